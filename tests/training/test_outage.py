"""A coordinator outage, in every phase of a worker: scripted, single-threaded, fake clock.

One rule (SPEC.md section 13): after ``coordinator_timeout_s`` without a word from
the coordinator the worker writes its checkpoint and stops with
``coordinator_unreachable``; while it waits it reports every 10 s (first after 5 s)
what it waits for; a coordinator back within the limit (a restart) is re-joined
and the run goes on. The process tests (exit code 3, real kill -9) are in
``tests/zmq/test_outage_processes.py``.
"""

from __future__ import annotations

import pytest
import torch

from diloco.testing import join_message, make_coordinator
from diloco.wire.messages import Heartbeat, Join, Submit
from diloco.worker import DilocoWorker
from diloco.worker.session import OUTAGE_NOTICE_S, OUTAGE_REPORT_EVERY_S
from test_scripted import FakeClock, Script, ScriptEndpoint, pseudo_gradient, train_step
from training_harness import linear

TIMEOUT_S = 30.0
T0 = 100.0


class CountingEndpoint(ScriptEndpoint):
    def __init__(self, script: Script) -> None:
        super().__init__(script)
        self.sent: list = []

    def send(self, message) -> None:
        self.sent.append(message)
        super().send(message)


def make(tmp_path, *, sync_every: int = 2, **fsm):
    clock = FakeClock(T0)
    c = make_coordinator(clock(), **fsm)
    script = Script(c, clock)
    model = linear(0)
    states: list[str] = []
    outages: list[tuple[str, float, str, float]] = []
    ep = CountingEndpoint(script)
    w = DilocoWorker(model, torch.optim.SGD(model.parameters(), lr=0.05), ep, worker_id="a",
                     sync_every=sync_every, clock=clock, on_state=lambda wid, s, t: states.append(s),
                     checkpoint_dir=tmp_path, coordinator_timeout_s=TIMEOUT_S,
                     on_outage=lambda *a: outages.append(a))
    return clock, c, script, ep, w, states, outages


def forever(clock: FakeClock, dt: float = 0.1):
    while True:
        clock.advance(dt)
        yield


def check_gave_up(w, outages, what: str, started: float, clock: FakeClock, *, checkpoint: bool = True) -> None:
    waiting = [o for o in outages if o[0] == "waiting"]
    assert [o[0] for o in outages] == ["waiting"] * len(waiting) + ["gave_up"], outages
    # A report after 5 s of silence, then every 10 s: 5, 15, 25 for a 30 s limit.
    expected = [OUTAGE_NOTICE_S + k * OUTAGE_REPORT_EVERY_S for k in range(3)]
    # (Reported at the first check after each due time: within one step of the clock, 0.5 s here.)
    assert [o[1] for o in waiting] == pytest.approx(expected, abs=0.6), waiting
    assert all(o[2] == what and o[3] == TIMEOUT_S for o in outages), outages
    assert outages[-1][1] == pytest.approx(TIMEOUT_S, abs=1.0)
    assert clock.t - started == pytest.approx(TIMEOUT_S, abs=1.5)
    assert w.stopped and w.stop_reason == "coordinator_unreachable"
    assert w.checkpoint_path.exists() is checkpoint


def test_joining_a_silent_coordinator_resends_the_join_then_gives_up(tmp_path):
    clock, c, script, ep, w, states, outages = make(tmp_path)
    script.partitioned = True
    script.scenario = forever(clock)
    w.join()
    check_gave_up(w, outages, "a Welcome (joining)", T0, clock, checkpoint=False)  # nothing to save yet
    joins = [m for m in ep.sent if isinstance(m, Join)]
    assert 4 <= len(joins) <= 6  # at 0, 2.5, 7.5, 17.5 s (backing off), not one per poll


def test_a_join_lost_in_an_outage_is_sent_again_when_the_coordinator_is_back(tmp_path):
    clock, c, script, ep, w, states, outages = make(tmp_path)
    script.partitioned = True

    def scenario():
        while clock.t < T0 + 12:
            clock.advance(0.1)
            yield
        script.partitioned = False  # the coordinator is back; the Joins sent so far were lost
        yield from forever(clock)

    script.scenario = scenario()
    w.join()
    assert w.state == "training" and not w.stopped
    # Joins went out at 0, 2.5 and 7.5 s (lost); the one at 17.5 s is answered.
    assert [o[0] for o in outages] == ["waiting", "waiting", "back"]
    assert 17.5 <= clock.t - T0 < 19


def test_training_with_heartbeats_unanswered_gives_up_with_its_checkpoint(tmp_path):
    clock, c, script, ep, w, states, outages = make(tmp_path, sync_every=1000, min_workers=1)
    w.join()
    assert train_step(w, 0)
    script.partitioned = True
    started = None
    for step in range(1, 200):
        clock.advance(0.5)
        if not train_step(w, step):
            break
        if started is None and w.session._unanswered_since is not None:
            started = w.session._unanswered_since
    check_gave_up(w, outages, "heartbeat replies", started, clock)
    assert states[-1] == "stopped" and states.count("joining") == 1


def test_waiting_for_a_result_gives_up_without_resyncing(tmp_path):
    clock, c, script, ep, w, states, outages = make(tmp_path, min_workers=2, heartbeat_timeout_s=1.0)
    w.join()
    script.handle("b", join_message("b", w.session.spec))

    def scenario():
        assert w.state == "waiting"
        script.partitioned = True  # B has not submitted: A waits for round 0's Result
        yield from forever(clock)

    script.scenario = scenario()
    assert train_step(w, 0)
    assert not train_step(w, 1)
    # Silence counts from the first message the coordinator left unanswered (a heartbeat
    # right after the Submit, both at the sync point), so the worker stops 30 s after it.
    check_gave_up(w, outages, "the Result for fragment 0 round 0", T0, clock)
    assert states.count("joining") == 1, "no resync (leave and join again) while the coordinator is silent"


def test_paused_below_quorum_gives_up_the_same_way(tmp_path):
    clock, c, script, ep, w, states, outages = make(tmp_path, min_workers=2, heartbeat_timeout_s=1.0)
    w.join()

    def scenario():
        while w.state != "paused":
            yield
        paused_at.append(clock.t)
        script.partitioned = True
        yield from forever(clock)

    paused_at: list[float] = []
    script.scenario = scenario()
    assert train_step(w, 0)
    assert not train_step(w, 1)
    assert "paused" in states
    check_gave_up(w, outages, "the Result for fragment 0 round 0 (paused: the run was below quorum)",
                  paused_at[0], clock)


def test_a_coordinator_restarted_within_the_timeout_is_rejoined_and_the_run_goes_on(tmp_path):
    """Killed while the worker trains; it reaches its sync point and waits there (its Submit
    lost); 20 s later a new coordinator (no params, knows nobody) answers its heartbeat
    ``rejoin``: the worker joins it, supplies the params, and rounds apply again."""
    clock, c, script, ep, w, states, outages = make(tmp_path, sync_every=4, min_workers=1)
    w.join()
    step = 0
    while w.rounds_synced < 1:
        assert train_step(w, step)
        step += 1
    killed_at = clock.t

    def scenario():
        while clock.t < killed_at + 20:
            clock.advance(0.1)
            yield
        script.c = make_coordinator(clock(), min_workers=1)
        script.partitioned = False
        yield from forever(clock)

    script.partitioned = True  # kill -9
    script.scenario = scenario()
    rounds = w.rounds_synced
    for _ in range(12):
        clock.advance(0.2)
        assert train_step(w, step)
        step += 1
    assert [o[0] for o in outages] == ["waiting", "waiting", "back"] and 15 <= outages[-1][1] < 25
    assert not w.stopped and states.count("joining") == 2, "the worker re-joined the new coordinator"
    assert script.c.fsm.is_member("a")
    assert w.rounds_synced > rounds, "rounds apply again"
    assert not w.checkpoint_path.exists()


def test_a_second_worker_contributing_after_the_outage_releases_the_waiting_one(tmp_path):
    """An outage shorter than the timeout, at the barrier: nothing is lost, the round applies."""
    clock, c, script, ep, w, states, outages = make(tmp_path, min_workers=2, heartbeat_timeout_s=4.0)
    w.join()
    script.handle("b", join_message("b", w.session.spec))

    def scenario():
        script.partitioned = True  # between A and the coordinator only: B stays a member
        while clock.t < T0 + 8:
            clock.advance(0.1)
            script.handle("b", Heartbeat("b"))
            yield
        script.partitioned = False
        while not outages or outages[-1][0] != "back":
            clock.advance(0.1)
            script.handle("b", Heartbeat("b"))
            yield
        script.handle("b", Submit("b", 0, 0, pseudo_gradient(0.1)))
        yield from forever(clock)

    script.scenario = scenario()
    assert train_step(w, 0)
    assert train_step(w, 1)
    assert w.rounds_synced == 1 and w.round_ids == (1,) and w.state == "training"
    assert [o[0] for o in outages] == ["waiting", "back"]


def test_an_endpoint_still_receiving_parts_is_not_silent(tmp_path):
    """ZeroMQ's ``silence_s()`` counts every part: a large Result still arriving is no outage."""
    clock, c, script, ep, w, states, outages = make(tmp_path, sync_every=1000, min_workers=1)
    ep.silence_s = lambda: 1.0  # parts keep arriving
    w.join()
    script.partitioned = True
    for step in range(60):  # 30 s without a whole message
        clock.advance(0.5)
        assert train_step(w, step)
    assert outages == [] and not w.stopped
