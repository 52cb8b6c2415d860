"""Save-and-stop, then resume: the coordinator from its checkpoint, the workers from theirs.

The strongest check that nothing is lost: a run interrupted by save-and-stop
and resumed ends with *bit-identical* global params to the same run left
alone. Two workers, so the coordinator's running sum is order-independent
(a + b == b + a exactly in IEEE arithmetic); AdamW inner optimizers, so a
lost or reset optimizer state would show.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import pytest
import torch

from diloco.coordinator.checkpoint import load_coordinator
from diloco.testing import params_of
from diloco.worker import DilocoWorker
from training_harness import Run, batch_at, batches, mlp, wait_for

H, STEPS = 5, 20
SEEDS = {"a": 1, "b": 2}
#: The uninterrupted run's final params, computed once for both variants.
REFERENCE: dict[str, dict[str, torch.Tensor]] = {}


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.01)


def make_worker(run: Run, wid: str, model_seed: int, **kwargs) -> DilocoWorker:
    model = mlp(model_seed)
    return run.worker(wid, model, sync_every=H, optimizer=adamw(model), **kwargs)


def reference_run() -> dict[str, torch.Tensor]:
    with Run(min_workers=2) as run:
        for wid in SEEDS:
            run.start(make_worker(run, wid, model_seed=0), batches(SEEDS[wid]), max_steps=STEPS)
        run.join_workers()
    assert run.coordinator.fsm.open_round_ids() == (STEPS // H,)
    return {n: t.clone() for n, t in run.coordinator.store.params.items()}


def gated_batches(seed: int, gate_at: int, reached: threading.Event, go: threading.Event,
                  hold_until: Callable[[], bool] | None = None):
    """Batches of shard ``seed``; before batch ``gate_at`` signal ``reached`` and wait for ``go``,
    then, with ``hold_until``, hand out each later batch only once it holds (at most 20 s): what a
    heartbeat reply must have done by then, however late a loaded machine delivers it."""
    step = 0
    while True:
        if step == gate_at:
            reached.set()
            assert go.wait(20.0), "the test never released the gate"
        elif step > gate_at and hold_until is not None:
            deadline = time.monotonic() + 20.0
            while not hold_until():
                assert time.monotonic() < deadline, "what the batches wait for never happened"
                time.sleep(0.01)
        yield batch_at(seed, step)
        step += 1


def optimizer_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t for state in opt.state_dict()["state"].values() for t in state.values()
            if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("a_stops", ["at_the_sync_point", "mid_round"])
def test_save_and_stop_then_resume_loses_nothing(tmp_path, a_stops):
    """B is waiting at round 1's close when the run stops (its pending contribution is
    discarded, P4). A is either stalled until after the stop, reaches the close, submits,
    is refused (``stopped``) and learns save-and-stop from a heartbeat (``at_the_sync_point``),
    or hears save-and-stop from a heartbeat reply while still training (``mid_round``)."""
    expected = REFERENCE.get("params")
    if expected is None:
        expected = REFERENCE["params"] = reference_run()
    ckpt = tmp_path / "ckpt"

    # -- first half: A stalls mid-round 1 (after inner step 7); B reaches round 1's close
    # (step 10), submits and waits for A. Then the operator asks for save-and-stop.
    reached, go = threading.Event(), threading.Event()
    mid_round = a_stops == "mid_round"
    # mid_round: heartbeats every 0.5 s, and A's steps after the gate wait until one's reply told it to
    # stop: it hears the stop while still training (before its sync point), not as a matter of timing.
    with Run(min_workers=2, checkpoint_dir=ckpt, heartbeat_timeout_s=2.0 if mid_round else 10.0) as run:
        a = make_worker(run, "a", model_seed=0, checkpoint_dir=ckpt)
        b = make_worker(run, "b", model_seed=0, checkpoint_dir=ckpt)
        run.start(a, gated_batches(SEEDS["a"], 7, reached, go, (lambda: a.stopped) if mid_round else None),
                  max_steps=STEPS)
        run.start(b, batches(SEEDS["b"]), max_steps=STEPS)
        assert reached.wait(20.0)
        wait_for(lambda: b.state == "waiting" and b.inner_step == 10, 10.0, "B waiting at round 1")
        assert run.admin("shutdown", kind="save_and_stop").ok
        go.set()
        reports = run.join_workers(20.0)
    assert reports["a"].stop_reason == "save_and_stop" and reports["b"].stop_reason == "save_and_stop"
    assert run.coordinator.fsm.open_round_ids() == (1,)  # round 1's pending contribution was discarded
    saved = {wid: dict(inner_step=w.inner_step, params=params_of(w.model), round_ids=w.round_ids,
                       opt=[t.clone() for t in optimizer_tensors(w.inner_optimizer)])
             for wid, w in (("a", a), ("b", b))}
    assert saved["b"]["inner_step"] == 10
    assert saved["a"]["inner_step"] in ((8, 9) if mid_round else (10,))
    saved_global = {n: t.clone() for n, t in run.coordinator.store.params.items()}

    # -- resume: a new coordinator from its checkpoint; new worker objects with freshly
    # initialised models (another seed) and fresh optimizers, restored from their files.
    coordinator = load_coordinator(ckpt, time.monotonic())
    assert coordinator.fsm.open_round_ids() == (1,)
    assert all(torch.equal(coordinator.store.params[n], t) for n, t in saved_global.items())
    with Run(coordinator=coordinator, checkpoint_dir=ckpt) as run2:
        restored = {wid: make_worker(run2, wid, model_seed=99, checkpoint_dir=ckpt) for wid in SEEDS}
        for wid, w in restored.items():
            assert w.restored
            assert w.inner_step == saved[wid]["inner_step"]
            assert w.round_ids == saved[wid]["round_ids"] == (1,)
            assert all(torch.equal(p, saved[wid]["params"][n]) for n, p in w.model.named_parameters())
            got = optimizer_tensors(w.inner_optimizer)
            assert len(got) == len(saved[wid]["opt"]) > 0
            assert all(torch.equal(x, y) for x, y in zip(got, saved[wid]["opt"]))
            run2.start(w, batches(SEEDS[wid], start=w.inner_step), max_steps=STEPS)
        reports2 = run2.join_workers(20.0)
    # B re-submitted its discarded round-1 pseudo-gradient at join; A trained on from its step.
    assert run2.coordinator.fsm.open_round_ids() == (STEPS // H,)
    assert [r for _, r, _ in run2.applied] == [1, 2, 3]
    for wid, r in reports2.items():
        assert r.inner_steps == STEPS and r.stop_reason == "max_steps"
        assert r.steps_this_run == STEPS - saved[wid]["inner_step"]
    final = run2.coordinator.store.params
    for n, t in expected.items():
        assert torch.equal(final[n], t), f"{n}: the resumed run differs from the uninterrupted one"
