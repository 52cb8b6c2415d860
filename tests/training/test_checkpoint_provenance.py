"""A worker's checkpoint names, for each fragment, the round whose state it holds (SPEC.md M10).

Three ways a file could offer one round's label with another round's state, each closed:

* the hub: the communication thread advances the session's round ids when a Result arrives and
  queues its params for the training thread; a checkpoint read in between would pair the new
  label with the old params. The params are queued in the same critical section that changes the
  session, and a checkpoint installs the queue before it reads both under the lock;
* overlap: a Result held for its window has advanced the label, not yet the params: no
  checkpoint is written then;
* the collective plane: a worker restored from an older checkpoint that starts the run holds the
  run's round ids with its own older state until a commit confirms it: no checkpoint meanwhile.
"""

from __future__ import annotations

import threading

import torch

from diloco.collective.member import HeldState
from diloco.transport.inproc import InprocNetwork
from diloco.worker import DilocoWorker
from diloco.worker.actions import InstallParams
from diloco.worker.checkpoint import load_worker_checkpoint

from training_harness import mlp


def _worker(tmp_path) -> DilocoWorker:
    model = mlp(0)
    w = DilocoWorker(model, torch.optim.SGD(model.parameters(), lr=0.1), InprocNetwork().connect("w1"),
                     worker_id="w1", sync_every=2, checkpoint_dir=tmp_path)
    w._training_thread = threading.get_ident()  # this test plays the training thread
    w._keeper.global_ = {n: p.detach().clone() for n, p in model.named_parameters()}
    w.session.fragments = (tuple(w._keeper.global_),)
    w.session.round_ids = [0]
    w.session.next_close = [2]
    return w


def test_a_checkpoint_installs_the_params_of_the_round_it_names_first(tmp_path):
    w = _worker(tmp_path)
    new = {n: t + 1.0 for n, t in w._keeper.global_.items()}
    # As the communication thread leaves it: the session already at round 1, its params queued.
    w.session.round_ids = [1]
    w._model_queue.append(InstallParams(0, tuple(new), new, False, "Result"))
    w.save_checkpoint()
    ckpt = load_worker_checkpoint(w.checkpoint_path)
    assert ckpt.round_ids == [1]
    assert all(torch.equal(ckpt.global_params[n], new[n]) for n in new)


def test_the_communication_thread_queues_a_results_params_with_the_session_change(tmp_path):
    w = _worker(tmp_path)
    actions = [InstallParams(0, tuple(w._keeper.global_), w._keeper.global_, False, "Result")]
    with w._lock:  # as ``_pump`` holds it while the session takes the message
        assert w._queue_model_actions(actions) == actions  # on the training thread: nothing to queue
    done = []

    def comm_thread():
        with w._lock:
            done.append(w._queue_model_actions(actions))

    t = threading.Thread(target=comm_thread)
    t.start()
    t.join(10)
    assert done == [[]] and list(w._model_queue) == actions


def test_no_checkpoint_while_a_result_is_held_for_its_overlap_window(tmp_path):
    w = _worker(tmp_path)
    w.session.held[0] = dict(w._keeper.global_)
    w.save_checkpoint()
    assert not w.checkpoint_path.exists()
    del w.session.held[0]
    w.save_checkpoint()
    assert w.checkpoint_path.exists()


def test_no_checkpoint_of_a_collective_start_state_no_commit_has_confirmed(tmp_path):
    w = _worker(tmp_path)
    machine = w.data_plane.machine
    machine.collective = True
    machine.held = HeldState(w.session.fragments, (226,), ("old",))
    machine._confirmed = [False]  # a start from round 219's state, relabelled to the run's 226
    w.save_checkpoint()
    assert not w.checkpoint_path.exists()
    machine._confirmed = [True]   # a commit of the run made it
    w.save_checkpoint()
    assert w.checkpoint_path.exists()
