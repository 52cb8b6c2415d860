"""Membership end to end: a death pauses the survivor, a replacement resumes the run,
a shutdown or a local stop releases a paused worker at once."""

from __future__ import annotations

import time

import pytest
import torch

from diloco.testing import params_of
from diloco.worker import DilocoWorker
from training_harness import Run, batch_at, batches, linear, wait_for


class Killed(Exception):
    """The simulated crash of a worker process."""


def dying_batches(worker_endpoint, seed: int, die_before_step: int):
    """Yield batches, then crash: the endpoint goes silent (no Leave) and the loop dies."""
    for step in range(die_before_step):
        yield batch_at(seed, step)
    worker_endpoint.close()
    raise Killed(f"killed before step {die_before_step + 1}")


def test_death_pauses_the_survivor_and_a_replacement_resumes_the_run():
    H, steps = 5, 30
    states: list[tuple[str, str, float]] = []
    replacement_start: dict[str, dict[str, torch.Tensor]] = {}
    with Run(min_workers=2, heartbeat_timeout_s=0.5) as run:
        survivor = run.worker("survivor", linear(1), sync_every=H, on_state=lambda *a: states.append(a))
        doomed = run.worker("doomed", linear(2), sync_every=H)
        run.start(survivor, batches(seed=1), max_steps=steps)
        # Dies in the middle of round 1 (after inner step 7), without a Leave.
        run.start(doomed, dying_batches(doomed.endpoint, seed=2, die_before_step=7))

        # The survivor reaches step 10, submits round 1 and waits; the coordinator declares
        # the doomed worker dead after 0.5 s of silence; below quorum, the survivor pauses.
        # (It may also have paused at round 0 if it submitted before the doomed one joined:
        # FORMING is below quorum too.)
        wait_for(lambda: survivor.state == "paused" and survivor.inner_step == 2 * H, 10.0,
                 "the survivor to pause at round 1")
        assert run.coordinator.fsm.open_round_ids() == (1,)
        time.sleep(0.4)
        assert survivor.state == "paused" and survivor.inner_step == 2 * H, "trained ahead while paused"
        assert run.handles["doomed"].join(5.0, expect_error=True) is None
        assert isinstance(run.handles["doomed"].error, Killed)

        def on_replacement_state(wid, state, t):
            if state == "training" and wid not in replacement_start:
                replacement_start[wid] = params_of(replacement.model)

        replacement = run.worker("replacement", linear(3), sync_every=H, on_state=on_replacement_state)
        # Placed on the schedule from the Welcome's round ids (round 1 open): 5 steps to
        # round 1's close, then rounds 2..5 with the survivor.
        run.start(replacement, batches(seed=3), max_steps=steps - H)
        reports = {wid: run.handles[wid].join(30.0) for wid in ("survivor", "replacement")}

    kinds = [k for k, _ in run.events]
    dead = kinds.index("dead")
    assert run.events[dead][1]["worker_id"] == "doomed"
    # Round 0 applied before the death; nothing applied while paused; rounds 1..5 after.
    assert [r for _, r, _ in run.applied] == list(range(6))
    apply_1 = next(i for i, (k, info) in enumerate(run.events) if k == "apply" and info["round_id"] == 1)
    assert apply_1 > dead
    assert run.events[apply_1][1]["contributors"] == ["survivor", "replacement"]
    # The replacement started from the global params of the moment (round 1's base = after round 0).
    _, _, after_round_0 = run.applied[0]
    assert all(torch.equal(replacement_start["replacement"][n], t) for n, t in after_round_0.items())
    # The survivor's timeline: training, syncing, paused, syncing (quorum back), training.
    seq = [s for wid, s, _ in states]
    # After the pause: waiting (a heartbeat reply said the quorum is back) or straight to
    # training (the round's Result came first: the replacement's 5 steps beat the next reply).
    assert "paused" in seq and seq[seq.index("paused") + 1] in ("waiting", "training")
    assert reports["survivor"].rounds_synced == 6 and reports["survivor"].inner_steps == steps
    assert reports["survivor"].seconds_paused > 0.3
    assert reports["replacement"].rounds_synced == 5
    final = run.coordinator.store.params
    assert all(torch.equal(survivor.global_params[n], final[n]) for n in final)
    assert all(torch.equal(replacement.global_params[n], final[n]) for n in final)


@pytest.mark.parametrize("kind", ["abort", "drain", "save_and_stop"])
def test_shutdown_releases_a_paused_worker_promptly(kind, tmp_path):
    stopped_at: list[float] = []
    with Run(min_workers=2, checkpoint_dir=tmp_path / "coordinator") as run:
        w = run.worker("lonely", linear(1), sync_every=3, checkpoint_dir=tmp_path / "workers",
                       on_state=lambda wid, s, t: stopped_at.append(time.monotonic()) if s == "stopped" else None)
        run.start(w, batches(seed=1), max_steps=100)
        wait_for(lambda: w.state == "paused", 10.0, "the worker to pause below quorum")
        t0 = time.monotonic()
        assert run.admin("shutdown", kind=kind).ok
        report = run.handles["lonely"].join(5.0)
        assert stopped_at and stopped_at[0] - t0 < 2.0, "a paused worker must stop at once"
    assert report.inner_steps == 3
    if kind == "save_and_stop":
        assert report.stop_reason == "save_and_stop"
        assert w.checkpoint_path.exists()
        assert list((tmp_path / "coordinator").glob("coordinator-*.safetensors"))
    else:
        assert report.stop_reason == "stop"
        assert not w.checkpoint_path.exists()


def test_request_stop_breaks_a_pause_and_leaves():
    with Run(min_workers=2) as run:
        w = run.worker("lonely", linear(1), sync_every=3)
        run.start(w, batches(seed=1), max_steps=100)
        wait_for(lambda: w.state == "paused", 10.0, "the worker to pause below quorum")
        t0 = time.monotonic()
        w.request_stop()
        report = run.handles["lonely"].join(5.0)
        assert time.monotonic() - t0 < 2.0
        assert report.stop_reason == "stop_requested" and w.state == "stopped"
        wait_for(lambda: run.coordinator.fsm.live_workers == 0, 5.0, "the Leave to reach the coordinator")
    # P1: its accepted contribution stays pending although it left.
    assert [k for k, _ in run.events].count("left") == 1


def test_a_worker_declared_dead_rejoins_on_its_own():
    """A partition longer than the heartbeat timeout: the coordinator declares the worker
    dead; when it heals, the heartbeat reply says rejoin, and the worker joins again."""
    H = 4
    with Run(min_workers=1, heartbeat_timeout_s=0.5) as run:
        w = run.worker("flaky", linear(1), sync_every=H)
        gate = {"slow": True}

        def slow_batches():
            for step in range(12):
                if step == 5 and gate["slow"]:
                    run.net.partition("flaky")
                    wait_for(lambda: "dead" in [k for k, _ in run.events], 10.0, "the death")
                    run.net.heal("flaky")
                yield batch_at(1, step)

        run.start(w, slow_batches(), max_steps=12)
        report = run.handles["flaky"].join(20.0)
    kinds = [k for k, _ in run.events]
    assert kinds.count("join") == 2 and "dead" in kinds
    assert report.inner_steps == 12 and report.stop_reason == "max_steps"
    # It re-joined between rounds and every later round applied.
    assert run.coordinator.fsm.open_round_ids()[0] >= 2
    final = run.coordinator.store.params
    assert all(torch.equal(w.global_params[n], final[n]) for n in final)


def test_step_done_before_join_is_an_error():
    from diloco.transport.inproc import InprocNetwork
    from diloco.worker import DilocoWorkerError
    model = linear(1)
    w = DilocoWorker(model, torch.optim.SGD(model.parameters(), lr=0.1), InprocNetwork().connect("x"),
                     worker_id="x", sync_every=2)
    with pytest.raises(DilocoWorkerError, match="call join"):
        w.step_done()
    w.leave()
    assert w.state == "stopped" and w.step_done() is False


def test_drain_finishes_the_round_in_flight_then_stops_everyone():
    import threading
    reached, go = threading.Event(), threading.Event()

    def gated(seed):
        for step in range(1000):
            if step == 7:
                reached.set()
                assert go.wait(20.0)
            yield batch_at(seed, step)

    with Run(min_workers=2) as run:
        a = run.worker("a", linear(1), sync_every=5)
        b = run.worker("b", linear(2), sync_every=5)
        run.start(a, gated(1))
        run.start(b, batches(seed=2))
        assert reached.wait(20.0)
        wait_for(lambda: b.state == "waiting" and b.inner_step == 10, 10.0, "B waiting at round 1")
        assert run.admin("shutdown", kind="drain").ok
        assert run.admin("status").data["phase"] == "draining"
        go.set()
        reports = run.join_workers(20.0)
    assert {r.stop_reason for r in reports.values()} == {"drain"}
    assert {r.inner_steps for r in reports.values()} == {10}
    assert run.coordinator.stopped and run.coordinator.fsm.open_round_ids() == (2,)
    final = run.coordinator.store.params
    for w in (a, b):
        assert w.sync_history[-1][1:] == (0, 1, "applied_final")
        assert all(torch.equal(p, final[n]) for n, p in w.model.named_parameters())


def test_on_state_reports_the_moves_in_order_when_the_training_thread_is_slow_to_report():
    """The demo hang: the training thread submits at its sync point (WAITING) but is
    descheduled before its ``on_state`` call; meanwhile the communication thread gets a
    fresh reply saying the run is below quorum and moves the session to PAUSED. The
    observer must still see WAITING then PAUSED, ending on the session's state; it used to
    see PAUSED then WAITING, and a demo waiting for "paused" waited forever."""
    import threading
    H = 3
    reported: list[str] = []
    with Run(min_workers=2, heartbeat_timeout_s=1.0) as run:
        w = run.worker("alone", linear(1), sync_every=H,
                       on_state=lambda wid, s, t: on_state(s))

        def on_state(state: str) -> None:
            if state == "waiting" and threading.current_thread().name == "worker-alone":
                # Descheduled here: the communication thread goes on, the session pauses.
                wait_for(lambda: w.session.state.value == "paused", 10.0, "the session to pause")
            reported.append(state)

        run.start(w, batches(seed=1), max_steps=100)
        wait_for(lambda: "paused" in reported and "waiting" in reported, 15.0, "both moves reported")
        time.sleep(0.3)  # a late report would land here
        assert w.state == "paused"
        assert reported[-2:] == ["waiting", "paused"], reported
