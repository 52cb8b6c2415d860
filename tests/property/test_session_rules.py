"""One focused, time-exact example per worker-session rule (SPEC.md section 14, W1-W20).

Each test is named after the rule it checks and drives a ``WorkerSession`` by
hand with a fake clock (plain numbers: the session never reads a clock).
Actions are compared as the tuples of ``session_model.observe`` (log ``Note``
lines dropped); ``sent`` keeps only what goes on the wire.
"""

from __future__ import annotations

import dataclasses

import pytest

from diloco.wire.messages import (
    PROTOCOL_VERSION,
    Accepted,
    Command,
    Error,
    ErrorCode,
    HeartbeatReply,
    Join,
    Result,
    TensorSpec,
    Welcome,
)
from diloco.worker.actions import Send
from diloco.worker.session import SessionError, WorkerSession
from diloco.worker.states import WorkerState as S
from session_model import observe

WID = "w"
NAMES = ("a", "b", "c")
SPEC = tuple(TensorSpec(n, (2,), "float32") for n in NAMES)
ONE = (("a", "b", "c"),)
TWO = (("a",), ("b", "c"))
THREE = (("a",), ("b",), ("c",))
PARAMS = {n: f"p-{n}" for n in NAMES}


def welcome(rounds=(0,), layout=ONE, parked=(), mode="sync", below=False, hb=1.0) -> Welcome:
    return Welcome(WID, tuple(rounds), tuple(parked), mode, layout, 2, below, hb, PARAMS)


def reply(below=False, command=Command.CONTINUE) -> HeartbeatReply:
    return HeartbeatReply(below, 2, "running", command)


def result(f, r, outcome="applied", nxt=None) -> Result:
    return Result(f, r, outcome, r + 1 if nxt is None else nxt, {} if outcome == "stop" else {"x": "new"})


def err(code: str, to: str) -> Error:
    return Error(ErrorCode(code), "refused", to)


def sent(actions) -> list:
    """What goes on the wire: message type names, ("submit", f, r) and "join_with_params"."""
    out = []
    for t in observe(actions):
        if t[0] == "send":
            out.append(t[1])
        elif t[0] == "submit":
            out.append(t)
        elif t[0] == "join_with_params":
            out.append("JoinWithParams")
    return out


def kinds(actions, kind: str) -> list[tuple]:
    return [t for t in observe(actions) if t[0] == kind]


def joined(H=4, layout=ONE, rounds=None, mode="sync", hb=1.0, timeout=600.0, below=False, parked=(),
           T=0, alpha=0.5) -> WorkerSession:
    """A session started at t=0 and welcomed at t=0 (``T``: overlap_steps)."""
    s = WorkerSession(WID, H, SPEC, coordinator_timeout_s=timeout, overlap_steps=T, overlap_alpha=alpha)
    s.start(0.0)
    s.on_message(welcome(rounds or (0,) * len(layout), layout, parked, mode, below, hb), 0.0)
    return s


# --------------------------------------------------------------------------- W1


def test_w1_join_start_sends_the_spec_and_enters_joining():
    s = WorkerSession(WID, 4, SPEC)
    actions = s.start(0.0)
    assert observe(actions) == [("state", "joining", None), ("send", "Join")]
    join = actions[1].message
    assert join == Join(WID, PROTOCOL_VERSION, SPEC) and not join.params
    assert s.state is S.JOINING and not s.may_train
    with pytest.raises(SessionError):
        s.start(0.0)


@pytest.mark.parametrize("code", ["params_required", "start_params_required"])
def test_w1_join_params_required_is_answered_with_a_join_carrying_params(code):
    s = WorkerSession(WID, 4, SPEC)
    s.start(0.0)
    assert sent(s.on_message(err(code, "Join"), 0.1)) == ["JoinWithParams"]
    assert s.state is S.JOINING


def test_w1_join_already_member_leaves_and_joins_again_at_most_three_times():
    s = WorkerSession(WID, 4, SPEC)
    s.start(0.0)
    for i in range(3):
        assert sent(s.on_message(err("already_member", "Join"), 0.1 * i)) == ["Leave", "Join"]
    actions = s.on_message(err("already_member", "Join"), 1.0)
    assert kinds(actions, "fail") == [("fail", "already_member")] and s.state is S.STOPPED


@pytest.mark.parametrize("code", ["stopped", "shutting_down"])
def test_w1_join_refused_because_the_run_ended_stops_without_saving(code):
    s = WorkerSession(WID, 4, SPEC)
    s.start(0.0)
    actions = s.on_message(err(code, "Join"), 0.5)
    (stop,) = kinds(actions, "stop")
    assert stop[1].startswith(f"run {code} before join") and stop[2] is False
    assert s.state is S.STOPPING and sent(actions) == []


@pytest.mark.parametrize("code", ["model_mismatch", "protocol_version", "too_many_workers", "banned", "wrong_key",
                                  "invalid_worker_id", "non_finite"])
def test_w1_join_any_other_refusal_fails(code):
    s = WorkerSession(WID, 4, SPEC)
    s.start(0.0)
    assert kinds(s.on_message(err(code, "Join"), 0.5), "fail") == [("fail", code)]
    assert s.state is S.STOPPED


def test_w1_join_unanswered_is_sent_again_after_2_5_s_doubling_at_most_every_30_s():
    s = WorkerSession(WID, 4, SPEC, coordinator_timeout_s=600.0)
    s.start(0.0)
    resent = []
    t = 0.0
    while t <= 130.0:
        if "Join" in sent(s.tick(t)):
            resent.append(t)
        t += 0.25
    assert resent == [2.5, 7.5, 17.5, 37.5, 67.5, 97.5, 127.5]
    assert s.state is S.JOINING


# --------------------------------------------------------------------------- W2


def test_w2_welcome_installs_every_fragment_and_trains():
    s = WorkerSession(WID, 4, SPEC)
    s.start(0.0)
    actions = s.on_message(welcome((0, 0), TWO), 0.0)
    assert kinds(actions, "install") == [("install", 0, ("a",), False, "Welcome"),
                                         ("install", 1, ("b", "c"), False, "Welcome")]
    assert all(a.params is PARAMS for a in actions if type(a).__name__ == "InstallParams")
    assert s.state is S.TRAINING and s.may_train and s.waiting == {}


def test_w2_welcome_onto_the_same_layout_keeps_a_bit_identical_local_model():
    s = joined(layout=TWO)
    s.on_message(reply(command=Command.REJOIN), 0.5)
    assert s.state is S.JOINING
    assert [t[3] for t in kinds(s.on_message(welcome((0, 0), TWO), 1.0), "install")] == [True, True]
    s.on_message(reply(command=Command.REJOIN), 1.5)
    assert [t[3] for t in kinds(s.on_message(welcome((0,), ONE), 2.0), "install")] == [False]
    # A worker restored from its checkpoint keeps its model on the first Welcome too.
    r = WorkerSession(WID, 4, SPEC)
    r.restore(fragments=ONE, round_ids=[3], next_close=[16], sched_step=13, inner_step=13, rounds_synced=3,
              mode="sync")
    r.start(0.0)
    assert [t[3] for t in kinds(r.on_message(welcome((3,), ONE), 0.1), "install")] == [True]
    assert (r.next_close, r.sched_step) == ([16], 13)   # the run's rounds agree: its own schedule is kept


def test_w2_welcome_sync_places_the_worker_at_the_last_close_already_past():
    s = joined(H=4, layout=TWO, rounds=(3, 2))     # offsets 2 and 4: closes 3*4+2 = 14 and 2*4+4 = 12
    assert (s.next_close, s.sched_step, s.round_ids) == ([14, 12], 10, [3, 2])
    assert sent(s.step_done(1.0)) == []
    assert sent(s.step_done(2.0)) == [("submit", 1, 2), "Heartbeat"]


def test_w2_welcome_async_counts_the_schedule_from_the_workers_own_start():
    s = joined(H=4, layout=TWO, rounds=(7, 9), mode="async")
    assert (s.next_close, s.sched_step) == ([2, 4], 0)


def test_w2_welcome_parked_contributions_are_waited_for():
    s = joined(layout=TWO, parked=((1, 0),))
    assert s.state is S.WAITING and s.waiting == {1: 0} and not s.may_train
    assert sent(s.on_message(result(1, 0), 0.5)) == []
    assert s.state is S.TRAINING


def test_w2_welcome_with_a_fragment_already_due_submits_it_at_once():
    s = WorkerSession(WID, 4, SPEC)
    s.start(0.0)
    actions = s.on_message(welcome((2, 0), TWO), 0.0)   # closes 10 and 4, placed at step 6
    assert sent(actions) == [("submit", 1, 0), "Heartbeat"] and s.state is S.WAITING


def test_w2_welcome_that_does_not_cover_the_model_fails():
    s = WorkerSession(WID, 4, SPEC)
    s.start(0.0)
    assert kinds(s.on_message(welcome((0,), (("a", "b"),)), 0.0), "fail") == [("fail", "bad_welcome")]
    assert s.state is S.STOPPED


# --------------------------------------------------------------------------- W3


def test_w3_heartbeats_every_interval_while_training_waiting_or_paused_and_after_each_submit():
    s = WorkerSession(WID, 2, SPEC)
    s.start(0.0)
    assert all("Heartbeat" not in sent(s.tick(t)) for t in (0.5, 1.0, 1.5, 2.0))   # joining: none
    s.on_message(welcome(hb=1.0), 2.0)
    beats = [t for t in (2.5, 2.99, 3.0, 3.5, 4.0) if "Heartbeat" in sent(s.tick(t))]
    assert beats == [3.0, 4.0]
    s.step_done(4.1)
    assert sent(s.step_done(4.2)) == [("submit", 0, 0), "Heartbeat"]               # one right after the Submit
    assert s.state is S.WAITING
    assert sent(s.tick(5.1)) == [] and sent(s.tick(5.2)) == ["Heartbeat"]            # then every interval
    for _ in range(3):                               # the replies to 3.0 and 4.0, then the Submit's: paused
        s.on_message(reply(below=True), 5.3)
    assert s.state is S.PAUSED
    assert sent(s.tick(6.2)) == ["Heartbeat"]
    s.on_message(reply(command=Command.STOP), 6.3)
    assert s.state is S.STOPPING and sent(s.tick(7.2)) == [] and sent(s.tick(60.0)) == []


# --------------------------------------------------------------------------- W4


def test_w4_schedule_each_fragment_is_submitted_at_its_close_and_the_worker_waits():
    s = joined(H=4, layout=TWO)                      # closes at steps 2 and 4
    assert sent(s.step_done(1.0)) == [] and s.state is S.TRAINING
    assert sent(s.step_done(1.0)) == [("submit", 0, 0), "Heartbeat"] and s.state is S.WAITING
    s.on_message(result(0, 0), 1.5)
    assert s.state is S.TRAINING and s.next_close == [6, 4]
    s.step_done(2.0)
    assert sent(s.step_done(2.0)) == [("submit", 1, 0), "Heartbeat"]
    assert (s.inner_step, s.sched_step) == (4, 4)


def test_w4_schedule_fragments_closing_together_are_submitted_together():
    s = joined(H=2, layout=THREE)                    # offsets 1, 1, 2
    assert sent(s.step_done(1.0)) == [("submit", 0, 0), "Heartbeat", ("submit", 1, 0), "Heartbeat"]
    assert s.waiting == {0: 0, 1: 0}


def test_w4_schedule_a_step_finished_outside_training_is_counted_but_moves_nothing():
    s = joined(H=1)
    s.step_done(1.0)                                 # submits round 0: WAITING
    assert (s.inner_step, s.sched_step, s.state) == (1, 1, S.WAITING)
    assert sent(s.step_done(1.1)) == [] and (s.inner_step, s.sched_step) == (2, 1)
    s.on_message(reply(command=Command.REJOIN), 1.2)
    assert sent(s.step_done(1.3)) == [] and (s.inner_step, s.sched_step, s.state) == (3, 1, S.JOINING)
    s.request_stop(1.4)
    s.stopped_done(1.4)
    assert s.step_done(1.5) == [] and s.inner_step == 3                  # STOPPED: ignored


def test_w4_schedule_a_step_that_ran_while_a_stop_arrived_from_training_still_counts():
    s = joined(H=4)
    s.step_done(0.5)
    s.on_message(reply(command=Command.STOP), 0.6)
    assert s.state is S.STOPPING
    assert s.step_done(0.7) == [] and (s.inner_step, s.sched_step) == (2, 2)


# --------------------------------------------------------------------------- W5


def test_w5_stale_base_may_train_only_in_training_and_training_means_nothing_outstanding():
    s = WorkerSession(WID, 1, SPEC)
    assert not s.may_train
    s.start(0.0)
    assert not s.may_train
    s.on_message(welcome(mode="async"), 0.0)
    assert s.may_train
    s.step_done(0.5)                                 # submit
    assert not s.may_train and s.waiting == {0: 0}
    s.on_message(err("held_limit", "Submit"), 0.6)    # nothing waits, but a retry is due: still not training
    assert s.waiting == {} and s.retry_at == {0: 1.6} and s.state is S.WAITING and not s.may_train
    s.tick(1.6)                                      # submitted again
    s.on_message(result(0, 0), 1.7)
    assert s.may_train and s.state is S.TRAINING and not s.waiting and not s.retry_at


# --------------------------------------------------------------------------- W6


def test_w6_pause_only_a_reply_to_a_heartbeat_sent_since_the_wait_began_pauses():
    s = joined(H=1)
    s.tick(1.0)                                      # heartbeat #1, before the wait
    s.step_done(1.5)                                 # Submit + heartbeat #2
    s.on_message(reply(below=True), 1.6)             # answers #1: says nothing about the sync point
    assert s.state is S.WAITING
    s.on_message(reply(below=True), 1.7)             # answers #2: fresh
    assert s.state is S.PAUSED and not s.may_train
    s.on_message(reply(below=False), 4.7)            # the quorum is back
    assert s.state is S.WAITING and s.seconds_paused == 3.0


def test_w6_pause_a_welcome_below_quorum_onto_a_parked_contribution_pauses_at_once():
    s = joined(parked=((0, 0),), below=True)
    assert s.state is S.PAUSED


def test_w6_pause_an_accepted_for_the_latest_submit_means_earlier_heartbeats_were_answered_or_lost():
    s = joined(H=1)
    s.tick(1.0)                                      # heartbeat #1: its reply is lost
    s.step_done(1.5)                                 # Submit + heartbeat #2
    s.on_message(Accepted(0, 0), 1.6)                # in order: #1's reply will never come
    s.on_message(reply(below=True), 1.7)             # so this one answers #2: fresh
    assert s.state is S.PAUSED


def test_w6_pause_ended_by_a_failure_is_counted():
    s = joined(H=1, parked=((0, 0),), below=True)
    assert s.state is S.PAUSED
    s.on_message(Result(0, 0, "exploded", 1, {}), 3.0)        # W14 while paused
    assert s.state is S.STOPPED and s.seconds_paused == 3.0
    s.leave(10.0)
    assert s.seconds_paused == 3.0


# --------------------------------------------------------------------------- W7


def test_w7_release_only_the_awaited_fragment_and_round_is_released():
    s = joined(H=4, layout=TWO)
    s.step_done(0.1)
    s.step_done(0.2)                                 # Submit(0, 0)
    for other in (result(0, 1), result(1, 0), result(2, 0)):
        assert observe(s.on_message(other, 0.3)) == [] and s.waiting == {0: 0}
    actions = s.on_message(result(0, 0, nxt=1), 0.4)
    assert kinds(actions, "install") == [("install", 0, ("a",), False, "Result")]
    assert actions[0].params == {"x": "new"}
    assert (s.round_ids, s.next_close, s.rounds_synced, s.state) == ([1, 0], [6, 4], 1, S.TRAINING)
    assert observe(s.on_message(result(0, 0), 0.5)) == []                 # a duplicate Result: ignored


def test_w7_release_the_worker_trains_again_only_when_nothing_waits():
    s = joined(H=2, layout=THREE)
    s.step_done(1.0)                                 # fragments 0 and 1
    s.on_message(result(1, 0), 1.1)
    assert s.state is S.WAITING and s.waiting == {0: 0}
    s.on_message(result(0, 0), 1.2)
    assert s.state is S.TRAINING


def test_w7_release_applied_final_installs_then_stops_to_drain():
    s = joined(H=1)
    s.step_done(1.0)
    actions = s.on_message(result(0, 0, "applied_final"), 1.1)
    assert [t[0] for t in observe(actions)] == ["install", "state", "stop"]
    assert kinds(actions, "stop") == [("stop", "drain", False)] and s.state is S.STOPPING
    assert observe(s.stopped_done(1.2)) == [("state", "stopped", "stopping")]


def test_w7_release_async_moves_the_close_one_period_on():
    s = joined(H=4, layout=TWO, mode="async")
    s.step_done(0.1)
    s.step_done(0.2)
    s.on_message(result(0, 0, nxt=5), 0.3)
    assert s.round_ids == [5, 0] and s.next_close == [6, 4]


# --------------------------------------------------------------------------- W8


@pytest.mark.parametrize("code, mode", [("held_limit", "async"), ("reducing", "sync")])
def test_w8_held_limit_submits_again_one_heartbeat_interval_later(code, mode):
    s = joined(H=1, mode=mode, hb=1.0)
    s.step_done(0.5)
    s.on_message(err(code, "Submit"), 0.75)
    assert s.retry_at == {0: 1.75} and s.state is S.WAITING
    assert ("submit", 0, 0) not in sent(s.tick(1.5))
    assert sent(s.tick(1.75)) == [("submit", 0, 0), "Heartbeat"]
    assert s.waiting == {0: 0} and s.retry_at == {}


def test_w8_held_limit_replies_are_paired_with_submits_in_order_and_a_result_answers_its_submit():
    s = joined(H=2, layout=TWO, mode="async")         # offsets 1 and 2
    s.step_done(0.1)                                  # Submit(0, 0) ...
    s.on_message(result(0, 0), 0.2)                   # ... released, its Accepted lost
    assert s.state is S.TRAINING
    s.step_done(0.3)                                  # Submit(1, 0)
    s.on_message(err("held_limit", "Submit"), 0.4)    # answers Submit(1, 0), not the released one
    assert s.waiting == {} and s.retry_at == {1: 1.4} and s.state is S.WAITING
    assert sent(s.tick(1.4)) == ["Heartbeat", ("submit", 1, 0), "Heartbeat"]


# --------------------------------------------------------------------------- W9


def _wait_answered(s: WorkerSession, start: float, until: float, step: float = 1.0, below=False) -> float | None:
    """Tick every ``step`` s, answering every heartbeat at once; the time of the resync, if any."""
    t = start
    while t <= until:
        actions = s.tick(t)
        if "Leave" in sent(actions):
            return t
        for a in actions:
            if isinstance(a, Send) and type(a.message).__name__ == "Heartbeat":
                s.on_message(reply(below=below), t)
        t += step
    return None


def test_w9_resync_after_exactly_16_intervals_then_32():
    s = joined(H=1, hb=1.0)
    s.step_done(0.0)                                 # waits for round 0
    s.on_message(reply(), 0.0)
    s.on_message(Accepted(0, 0), 0.0)
    assert _wait_answered(s, 0.0, 15.0) is None      # the wait's clock starts at the first tick (t=0)
    actions = s.tick(16.0)
    assert sent(actions) == ["Heartbeat", "Leave", "Join"] and s.state is S.JOINING
    s.on_message(welcome(parked=((0, 0),)), 16.5)    # parked on it again: the Result was lost
    assert s.state is S.WAITING
    assert _wait_answered(s, 17.0, 48.0) is None     # the delay doubled: 32 intervals from 17
    assert _wait_answered(s, 49.0, 49.0) == 49.0


def test_w9_resync_delay_stops_doubling_at_256_intervals():
    s = joined(H=1, hb=1.0)
    s.step_done(0.0)
    s.on_message(reply(), 0.0)
    s.on_message(Accepted(0, 0), 0.0)
    t, resyncs = 0.0, []
    for delay in (16, 32, 64, 128, 256, 256, 256):   # the Result stays lost: resync after resync
        assert _wait_answered(s, t, t + delay - 1) is None
        assert _wait_answered(s, t + delay, t + delay) == t + delay
        resyncs.append(delay)
        s.on_message(welcome(parked=((0, 0),)), t + delay + 0.5)
        assert s.state is S.WAITING
        t += delay + 1
    assert resyncs[-3:] == [256, 256, 256]


def test_w9_resync_not_while_paused_nor_while_the_coordinator_is_silent():
    s = joined(H=1, hb=1.0)
    s.step_done(0.0)
    s.on_message(reply(below=True), 0.0)             # fresh (the submit's heartbeat): paused
    assert s.state is S.PAUSED
    assert _wait_answered(s, 0.0, 40.0, below=True) is None    # paused: no resync however long
    s.on_message(reply(below=False), 40.0)
    assert s.state is S.WAITING
    assert all("Leave" not in sent(s.tick(t)) for t in range(41, 120))   # silent: an outage, not a lost Result


def test_w9_a_wait_left_for_training_starts_its_clock_again():
    """Leaving WAITING ends the wait: here a retry submitted with overlap (W8, W15) trains on, and
    the wait at the end of its window is timed from its own first tick, not the earlier wait's."""
    s = joined(H=2, layout=TWO, T=1)
    s.step_done(0.0)                                 # fragment 0 submitted at step 1 (merged at 2) ...
    s.step_done(0.0)                                 # ... fragment 1 at step 2, fragment 0's window ended
    assert s.state is S.WAITING and s.waiting == {0: 0, 1: 0}
    assert _wait_answered(s, 1.0, 2.0) is None       # the wait's clock starts at t=1
    s.on_message(err("held_limit", "Submit"), 2.0)   # fragment 0's Submit: sent again an interval later
    s.on_message(reply(), 3.0)
    assert s.state is S.TRAINING and s.merge_at == {0: 3, 1: 3}
    assert _wait_answered(s, 4.0, 29.0) is None      # a slow inner step: no resync while training
    s.step_done(30.0)                                # both windows end: a new wait
    assert s.state is S.WAITING
    assert _wait_answered(s, 31.0, 46.0) is None     # 16 intervals from its first tick (t=31) ...
    assert _wait_answered(s, 47.0, 47.0) == 47.0     # ... not from t=1


# --------------------------------------------------------------------------- W10


def test_w10_rejoin_commanded_by_a_heartbeat_reply_joins_again_without_leave():
    s = joined()
    actions = s.on_message(reply(command=Command.REJOIN), 1.0)
    assert sent(actions) == ["Join"] and s.state is S.JOINING


@pytest.mark.parametrize("code", ["stale_round", "future_round", "unknown_worker", "evicted"])
def test_w10_rejoin_when_a_submit_is_refused_for_its_round_or_membership(code):
    s = joined(H=1)
    s.step_done(1.0)
    actions = s.on_message(err(code, "Submit"), 1.1)
    assert sent(actions) == ["Join"] and s.state is S.JOINING


# --------------------------------------------------------------------------- W11


def test_w11_outage_reports_at_5_15_25_s_then_gives_up_at_the_limit_saving():
    s = joined(H=1, hb=1.0, timeout=30.0)
    reports = []
    t = 0.0
    while s.state is not S.STOPPING:
        t += 0.25
        actions = s.tick(t)
        reports += [(t,) + o[1:] for o in kinds(actions, "outage") + kinds(actions, "stop")]
    # The first heartbeat (t=1) is the first message left unanswered.
    assert reports == [(6.0, "waiting", 5.0), (16.0, "waiting", 15.0), (26.0, "waiting", 25.0),
                       (31.0, "gave_up", 30.0), (31.0, "coordinator_unreachable", True)]
    assert s.stop_reason == "coordinator_unreachable"


def test_w11_outage_a_message_after_reports_says_back():
    s = joined(H=1, hb=1.0)
    for t in (1.0, 3.0, 6.0):
        s.tick(t)
    assert kinds(s.on_message(reply(), 8.0), "outage") == [("outage", "back", 7.0)]
    assert kinds(s.on_message(reply(), 8.5), "outage") == []


def test_w11_outage_joining_gives_up_without_saving_unless_restored():
    s = WorkerSession(WID, 1, SPEC, coordinator_timeout_s=20.0)
    s.start(0.0)
    assert kinds(s.tick(19.75), "stop") == []
    assert kinds(s.tick(20.0), "stop") == [("stop", "coordinator_unreachable", False)]
    r = WorkerSession(WID, 1, SPEC, coordinator_timeout_s=20.0)
    r.restore(fragments=ONE, round_ids=[0], next_close=[1], sched_step=0, inner_step=0, rounds_synced=0, mode="sync")
    r.start(0.0)
    assert kinds(r.tick(20.0), "stop") == [("stop", "coordinator_unreachable", True)]


def test_w11_outage_a_message_still_arriving_is_not_silence():
    s = joined(H=1, hb=1.0, timeout=30.0)
    s.tick(1.0)
    assert kinds(s.tick(40.0, transport_silence_s=0.5), "stop") == []
    assert s.silence(40.0, 0.5) == 0.5 and s.silence(40.0) == 39.0


# --------------------------------------------------------------------------- W12


@pytest.mark.parametrize("command, save", [(Command.STOP, False), (Command.SAVE_AND_STOP, True)])
def test_w12_stop_commanded_by_a_heartbeat_reply(command, save):
    s = joined()
    actions = s.on_message(reply(command=command), 1.0)
    assert kinds(actions, "stop") == [("stop", command.value, save)] and s.state is S.STOPPING
    assert kinds(s.on_message(reply(command=Command.SAVE_AND_STOP), 1.1), "stop") == []   # one Stop only
    s.stopped_done(1.3)
    assert s.state is S.STOPPED


@pytest.mark.parametrize("trigger, reason", [
    (lambda: result(0, 0, "stop", 0), "stop"),
    (lambda: err("stopped", "Submit"), "stopped"),
    (lambda: err("shutting_down", "Heartbeat"), "shutting_down"),
])
@pytest.mark.parametrize("answer, save", [(Command.SAVE_AND_STOP, True), (Command.STOP, False)])
def test_w12_stop_of_unknown_kind_asks_with_one_heartbeat(trigger, reason, answer, save):
    s = joined(H=1)
    s.step_done(1.0)
    actions = s.on_message(trigger(), 1.1)
    assert sent(actions) == ["Heartbeat"] and s.state is S.STOPPING and kinds(actions, "stop") == []
    assert s.stopped_done(1.15) == [] and s.state is S.STOPPING    # not before the kind is known
    actions = s.on_message(reply(command=answer), 1.2)
    assert kinds(actions, "stop") == [("stop", "save_and_stop" if save else reason, save)]
    assert s.on_message(reply(command=Command.SAVE_AND_STOP), 1.3) == []   # the kind is settled


@pytest.mark.parametrize("hb, deadline", [(0.125, 0.5), (0.25, 1.0), (1.0, 1.0), (5.0, 1.0)])
def test_w12_stop_the_ask_waits_at_most_min_1_s_and_4_heartbeat_intervals(hb, deadline):
    s = joined(H=1, hb=hb)
    s.step_done(10.0)
    s.on_message(result(0, 0, "stop", 0), 10.0)
    assert kinds(s.tick(10.0 + deadline - 0.0625), "stop") == []
    assert kinds(s.tick(10.0 + deadline), "stop") == [("stop", "stop", False)]
    assert s.on_message(reply(command=Command.SAVE_AND_STOP), 10.0 + deadline) == []


def test_w12_stop_requested_locally_stops_at_once_from_any_state_breaking_a_pause():
    s = joined(H=1, parked=((0, 0),), below=True)
    assert s.state is S.PAUSED
    actions = s.request_stop(4.0, save=True)
    assert observe(actions) == [("state", "stopping", "paused"), ("stop", "stop_requested", True)]
    assert s.seconds_paused == 4.0
    assert s.request_stop(5.0) == []                 # once
    j = WorkerSession(WID, 1, SPEC)
    j.start(0.0)
    assert kinds(j.request_stop(1.0), "stop") == [("stop", "stop_requested", False)]
    a = joined(H=1)
    a.step_done(0.0)
    a.on_message(result(0, 0, "stop", 0), 0.1)       # asking ...
    assert kinds(a.request_stop(0.2, save=True), "stop") == [("stop", "stop_requested", True)]
    assert a.tick(5.0) == []                         # ... the ask is over
    b = WorkerSession(WID, 1, SPEC)                  # before start
    assert kinds(b.request_stop(0.0), "stop") == [("stop", "stop_requested", False)]


# --------------------------------------------------------------------------- W13


def test_w13_leave_sends_leave_unless_the_coordinator_ended_the_run():
    s = joined()
    s.request_stop(1.0)
    s.stopped_done(1.0)
    assert sent(s.leave(1.1)) == ["Leave"] and s.state is S.STOPPED
    assert s.leave(1.2) == []                        # once
    c = joined()
    c.on_message(reply(command=Command.STOP), 1.0)
    assert sent(c.leave(1.1)) == [] and c.state is S.STOPPED
    g = joined(timeout=10.0)
    g.tick(1.0)
    g.tick(11.0)                                     # gave up
    assert sent(g.leave(11.5)) == []
    n = WorkerSession(WID, 1, SPEC)                  # never welcomed: nothing to say
    n.start(0.0)
    assert sent(n.leave(0.5)) == [] and n.state is S.STOPPED


# --------------------------------------------------------------------------- W14


@pytest.mark.parametrize("code", ["tensor_mismatch", "non_finite", "update_too_large", "unknown_fragment",
                                  "invalid_round", "bad_message", "too_large", "forbidden", "wrong_key"])
def test_w14_errors_any_other_refused_submit_fails_naming_the_code(code):
    s = joined(H=1)
    s.step_done(1.0)
    actions = s.on_message(err(code, "Submit"), 1.1)
    assert kinds(actions, "fail") == [("fail", code)] and s.state is S.STOPPED
    assert [code in a.detail for a in actions if type(a).__name__ == "Fail"] == [True]
    _nothing_more(s)


def test_w14_errors_a_result_outcome_the_worker_does_not_know_fails():
    s = joined(H=1)
    s.step_done(1.0)
    assert kinds(s.on_message(Result(0, 0, "exploded", 1, {}), 1.1), "fail") == [("fail", "bad_message")]
    assert s.state is S.STOPPED
    _nothing_more(s)


def _nothing_more(s: WorkerSession) -> None:
    """STOPPED: every event is answered with nothing (but one Leave on leave(), W13)."""
    for t in (2.0, 50.0, 5000.0):
        assert s.tick(t) == [] and s.step_done(t) == [] and s.request_stop(t, True) == []
        assert s.on_message(reply(command=Command.REJOIN), t) == [] and s.on_message(welcome(), t) == []
        assert s.on_message(result(0, 0), t) == [] and s.stopped_done(t) == [] and s.fail("x", "y", t) == []
    assert sent(s.leave(6000.0)) == ["Leave"] and s.leave(6001.0) == []
    assert s.state is S.STOPPED


# --------------------------------------------------------------------------- W15


def states(actions) -> list[str]:
    return [t[1] for t in observe(actions) if t[0] == "state"]


def test_w15_overlap_a_submission_keeps_training_until_its_merge_step():
    s = joined(H=4, layout=TWO, T=2)                  # closes at steps 2 and 4
    s.step_done(1.0)
    actions = s.step_done(2.0)                        # step 2: fragment 0's sync point
    assert sent(actions) == [("submit", 0, 0), "Heartbeat"] and states(actions) == []
    assert s.state is S.TRAINING and s.may_train and s.waiting == {0: 0} and s.merge_at == {0: 4}
    s.step_done(3.0)
    actions = s.step_done(4.0)                        # step 4: fragment 1 submits; fragment 0's window ends
    assert sent(actions) == [("submit", 1, 0), "Heartbeat"] and s.state is S.WAITING
    assert s.merge_at == {0: 4, 1: 6}


def test_w15_overlap_a_welcome_with_a_fragment_due_submits_it_while_training():
    s = WorkerSession(WID, 4, SPEC, overlap_steps=1)
    s.restore(fragments=ONE, round_ids=[0], next_close=[4], sched_step=4, inner_step=4, rounds_synced=0,
              mode="sync")
    s.start(0.0)
    actions = s.on_message(welcome((0,)), 0.5)
    assert states(actions) == ["training"] and sent(actions) == [("submit", 0, 0), "Heartbeat"]
    assert s.state is S.TRAINING and s.merge_at == {0: 5}


@pytest.mark.parametrize("T,alpha,what", [(4, 0.5, "must be less than sync_every=4"), (-1, 0.5, ">= 0"),
                                          (True, 0.5, ">= 0"), (1.0, 0.5, ">= 0"), (1, 1.0, "0 <= alpha < 1"),
                                          (1, -0.1, "0 <= alpha < 1"), (1, float("nan"), "0 <= alpha < 1")])
def test_w15_overlap_steps_of_at_least_h_or_a_bad_alpha_are_refused(T, alpha, what):
    with pytest.raises(ValueError, match=what.replace("(", r"\(")):
        WorkerSession(WID, 4, SPEC, overlap_steps=T, overlap_alpha=alpha)
    assert WorkerSession(WID, 4, SPEC, overlap_steps=3, overlap_alpha=0.0).overlap_steps == 3


# --------------------------------------------------------------------------- W16


def test_w16_merge_a_result_within_the_window_is_held_then_merged_exactly_at_s_plus_t():
    s = joined(H=4, T=2, alpha=0.25)
    for t in (1.0, 2.0, 3.0):
        s.step_done(t)
    s.step_done(4.0)                                  # step 4: submit round 0, window until step 6
    actions = s.on_message(result(0, 0), 4.5)         # applied, within the window: held
    assert observe(actions) == [] and s.held == {0: {"x": "new"}} and s.waiting == {}
    assert s.round_ids == [1] and s.next_close == [8] and s.rounds_synced == 1   # released at arrival (W7)
    assert observe(s.step_done(5.0)) == [] and s.state is S.TRAINING
    actions = s.step_done(6.0)
    assert observe(actions) == [("merge", 0, ("a", "b", "c"), 0.25)]
    assert actions[0].params == {"x": "new"} and s.held == {} and s.merge_at == {} and s.state is S.TRAINING


def test_w16_merge_a_late_result_makes_the_worker_wait_at_s_plus_t_then_merges_at_once():
    s = joined(H=4, T=1)
    for t in (1.0, 2.0, 3.0, 4.0):
        s.step_done(t)                                # step 4: submit
    assert s.state is S.TRAINING
    actions = s.step_done(5.0)                        # step 5: window over, no Result: wait (W5)
    assert states(actions) == ["waiting"] and not s.may_train
    assert sent(s.step_done(5.5)) == [] and s.sched_step == 5              # W4: does not move the schedule
    actions = s.on_message(result(0, 0), 6.0)
    assert observe(actions) == [("merge", 0, ("a", "b", "c"), 0.5), ("state", "training", "waiting")]


def test_w16_merge_below_quorum_the_worker_still_pauses_at_the_end_of_the_window():
    s = joined(H=2, T=1)
    s.step_done(1.0)
    s.step_done(2.0)                                  # submit + heartbeat
    s.on_message(reply(below=True), 2.1)              # fresh: below quorum, but TRAINING is never paused (W6)
    assert s.state is S.TRAINING
    actions = s.step_done(3.0)                        # the window ends: wait, and pause at once
    assert states(actions) == ["waiting", "paused"] and s.state is S.PAUSED
    s.on_message(reply(below=False), 5.0)
    assert s.state is S.WAITING and s.seconds_paused == 2.0
    s.on_message(result(0, 0), 5.5)
    assert s.state is S.TRAINING


def test_w16_merge_never_before_the_round_applied():
    s = joined(H=2, T=1)
    s.step_done(1.0)
    s.step_done(2.0)
    for m in (result(0, 1), result(1, 0), Accepted(0, 0), reply()):      # anything but its applied Result
        assert kinds(s.on_message(m, 2.5), "merge") == []
    assert s.held == {} and s.waiting == {0: 0}
    assert kinds(s.step_done(3.0), "merge") == [] and s.state is S.WAITING
    actions = s.on_message(result(0, 0, "stop"), 3.5)                   # round ended without an apply
    assert kinds(actions, "merge") == [] and s.merge_at == {} and s.state is S.STOPPING


def test_w16_merge_comes_before_a_submission_of_the_same_step():
    s = joined(H=2, layout=TWO, T=1)                  # offsets 1 and 2
    s.step_done(1.0)                                  # step 1: submit fragment 0, merge at 2
    s.on_message(result(0, 0), 1.5)
    assert observe(s.step_done(2.0))[:3] == [("merge", 0, ("a",), 0.5), ("submit", 1, 0), ("send", "Heartbeat")]


# --------------------------------------------------------------------------- W17


def held_at_step_4(T=2, **kw) -> WorkerSession:
    s = joined(H=4, T=T, **kw)
    for t in (1.0, 2.0, 3.0, 4.0):
        s.step_done(t)
    s.on_message(result(0, 0), 4.5)
    assert s.held and s.state is S.TRAINING
    return s


@pytest.mark.parametrize("how", ["command_stop", "save_and_stop", "request_stop", "gave_up"])
def test_w17_stop_merges_every_held_result_before_the_stop(how):
    s = held_at_step_4(timeout=12.0)
    if how == "command_stop":
        actions = s.on_message(reply(command=Command.STOP), 5.0)
    elif how == "save_and_stop":
        actions = s.on_message(reply(command=Command.SAVE_AND_STOP), 5.0)
    elif how == "request_stop":
        actions = s.request_stop(5.0, save=True)
    else:
        s.tick(5.0)                                   # a heartbeat nobody answers
        actions = s.tick(17.5)
    got = [t[0] for t in observe(actions) if t[0] in ("merge", "stop")]
    assert got == ["merge", "stop"] and s.held == {}


def test_w17_stop_applied_final_within_the_window_merges_then_drains():
    s = held_at_step_4()
    s.step_done(5.0)
    s.step_done(6.0)                                  # merged at 6
    s.step_done(7.0)
    s.step_done(8.0)                                  # round 1 submitted
    actions = s.on_message(result(0, 1, "applied_final"), 8.5)
    assert [t[0] for t in observe(actions) if t[0] != "state"] == ["merge", "stop"]
    assert kinds(actions, "stop") == [("stop", "drain", False)]


def test_w17_stop_a_result_arriving_while_stopping_is_merged_at_once():
    s = joined(H=4, T=2)
    for t in (1.0, 2.0, 3.0, 4.0):
        s.step_done(t)
    s.on_message(err("stopped", "Heartbeat"), 4.2)   # a stop of unknown kind: asking
    assert s.state is S.STOPPING
    assert kinds(s.on_message(result(0, 0), 4.3), "merge") == [("merge", 0, ("a", "b", "c"), 0.5)]


def test_w17_leave_and_rejoin_merge_held_results_a_failure_drops_them():
    s = held_at_step_4()
    assert [t[0] for t in observe(s.leave(5.0))] == ["merge", "send", "state"]
    s = held_at_step_4()
    actions = s.on_message(reply(command=Command.REJOIN), 5.0)
    assert [t[0] for t in observe(actions)] == ["merge", "state", "send"] and s.state is S.JOINING
    s = held_at_step_4()
    assert kinds(s.fail("transport", "gone", 5.0), "merge") == [] and s.held == {}
    assert kinds(s.leave(5.1), "merge") == []
    s = held_at_step_4()
    actions = s.on_message(err("tensor_mismatch", "Submit"), 5.0)
    assert kinds(actions, "fail") == [("fail", "tensor_mismatch")] and kinds(actions, "merge") == []


# --------------------------------------------------------------------------- W18


def test_w18_welcome_a_parked_contribution_has_no_window_and_its_result_is_installed():
    s = joined(H=4, T=2)
    for t in (1.0, 2.0, 3.0, 4.0):
        s.step_done(t)                                # submitted round 0, window until step 6
    s.on_message(reply(command=Command.REJOIN), 4.5)
    actions = s.on_message(welcome((0,), parked=((0, 0),)), 5.0)
    assert s.merge_at == {} and s.state is S.WAITING and not s.may_train
    assert kinds(actions, "install") == [("install", 0, ("a", "b", "c"), True, "Welcome")]
    actions = s.on_message(result(0, 0), 5.5)
    assert kinds(actions, "install") == [("install", 0, ("a", "b", "c"), False, "Result")]
    assert kinds(actions, "merge") == [] and s.state is S.TRAINING


def test_w18_welcome_after_a_resync_keeps_the_merged_schedule():
    s = joined(H=4, T=1, hb=1.0)
    for t in (1.0, 2.0, 3.0, 4.0):
        s.step_done(t)
    s.step_done(5.0)                                  # window over: WAITING, Result lost
    t = 5.0
    while s.state is S.WAITING:
        t += 1.0
        s.tick(t)
        if s.awaiting_replies:
            s.on_message(reply(), t)
    assert s.state is S.JOINING and t == 22.0         # W9 as before: 16 intervals after the first tick
    s.on_message(welcome((1,)), 22.5)                 # the round applied meanwhile: the Welcome brings it
    assert s.state is S.TRAINING and s.merge_at == {} and s.waiting == {}


# --------------------------------------------------------------------------- misuse


def test_events_before_start():
    s = WorkerSession(WID, 1, SPEC)
    with pytest.raises(SessionError):
        s.step_done(0.0)
    assert s.tick(0.0) == [] and s.on_message(reply(), 0.0) == []
    s.start(0.0)
    with pytest.raises(SessionError):
        s.restore(fragments=ONE, round_ids=[0], next_close=[1], sched_step=0, inner_step=0, rounds_synced=0,
                  mode="sync")


# --------------------------------------------------------------------------- W19


def dylu_reply(h, below=False) -> HeartbeatReply:
    return HeartbeatReply(below, 2, "running", Command.CONTINUE, h)


def test_w19_dylu_a_welcome_naming_h_w_places_the_worker_with_it():
    s = WorkerSession(WID, 4, SPEC)
    s.start(0.0)
    s.on_message(dataclasses.replace(welcome((3,)), sync_every=2), 0.0)
    assert s.sync_every == 2 and s.own_sync_every == 4
    assert s.next_close == [8] and s.sched_step == 6            # round 3 closes at 3*2 + 2
    assert sent(s.step_done(1.0)) == [] and sent(s.step_done(2.0)) == [("submit", 0, 3), "Heartbeat"]


def test_w19_dylu_a_new_h_w_is_adopted_only_at_the_round_boundary():
    s = joined(H=4)
    s.step_done(1.0)
    s.on_message(dylu_reply(2), 1.1)                           # mid-round: noted, not adopted
    assert s.target_sync_every == 2 and s.sync_every == 4 and s.next_close == [4]
    assert sent(s.step_done(2.0)) == [] and sent(s.step_done(3.0)) == []
    assert sent(s.step_done(4.0)) == [("submit", 0, 0), "Heartbeat"]      # the round keeps its H
    s.on_message(dylu_reply(2), 4.1)
    assert s.sync_every == 4                                   # waiting: still mid-round
    s.on_message(result(0, 0), 4.5)                            # released: the boundary
    assert s.sync_every == 2 and s.round_ids == [1] and s.next_close == [4] and s.sched_step == 2
    assert s.state is S.TRAINING
    assert sent(s.step_done(5.0)) == [] and sent(s.step_done(6.0)) == [("submit", 0, 1), "Heartbeat"]
    s.on_message(dylu_reply(3), 6.1)
    s.on_message(result(0, 1), 6.5)
    assert s.sync_every == 3 and s.next_close == [9] and s.sched_step == 6


def test_w19_dylu_with_fragments_waits_for_the_period_s_last_close():
    s = joined(H=4, layout=TWO)                                # closes at 2 and 4
    s.step_done(1.0)
    s.on_message(dylu_reply(2), 1.5)
    s.step_done(2.0)                                           # fragment 0 submits
    s.on_message(result(0, 0), 2.5)
    assert s.sync_every == 4 and s.next_close == [6, 4]        # fragment 1's round is open: no change
    s.step_done(3.0)
    s.step_done(4.0)                                           # fragment 1 submits: the period's last close
    s.on_message(result(1, 0), 4.5)
    assert s.sync_every == 2 and s.next_close == [3, 4] and s.sched_step == 2   # (round, fragment) order kept
    assert sent(s.step_done(5.0)) == [("submit", 0, 1), "Heartbeat"]


def test_w19_dylu_a_reply_naming_no_h_returns_to_the_worker_s_own_at_the_next_boundary():
    s = WorkerSession(WID, 4, SPEC)
    s.start(0.0)
    s.on_message(dataclasses.replace(welcome(), sync_every=1), 0.0)
    assert s.sync_every == 1
    s.step_done(1.0)                                           # submit round 0
    s.on_message(reply(), 1.1)                                 # a coordinator without DyLU
    s.on_message(result(0, 0), 1.5)
    assert s.sync_every == 4 and s.target_sync_every is None and s.next_close == [8] and s.sched_step == 4


def test_w19_dylu_h_w_is_at_least_overlap_steps_plus_one():
    s = WorkerSession(WID, 4, SPEC, overlap_steps=2)
    s.start(0.0)
    s.on_message(dataclasses.replace(welcome(), sync_every=1), 0.0)
    assert s.sync_every == 3 and s.next_close == [3]


def test_w19_dylu_async_counts_the_new_h_from_the_boundary():
    s = joined(H=4, mode="async")
    s.on_message(dylu_reply(2), 0.0)                           # before any step: at the boundary, adopted
    assert s.sync_every == 2 and s.next_close == [2]
    s.step_done(1.0)
    s.on_message(dylu_reply(3), 1.5)                           # mid-round: waits
    s.step_done(2.0)
    s.on_message(result(0, 0, nxt=7), 2.5)
    assert s.sync_every == 3 and s.next_close == [5] and s.sched_step == 2


def test_w19_dylu_ignores_a_bad_h_w_and_a_run_without_dylu_changes_nothing():
    s = joined(H=4)
    s.on_message(dylu_reply(0), 0.5)
    assert s.target_sync_every is None
    for t in (1.0, 2.0, 3.0, 4.0):
        s.step_done(t)
    s.on_message(result(0, 0), 4.5)
    assert s.sync_every == 4 and s.next_close == [8] and s.sched_step == 4


# --------------------------------------------------------------------------- W20


def test_w20_plane_lost_track_joins_again_and_is_not_the_coordinator_speaking():
    from diloco.collective.member import PlaneEvent, PlaneEventKind

    s = joined(H=1, hb=1.0, timeout=30.0)
    s.step_done(1.0)
    actions = s.on_message(PlaneEvent(PlaneEventKind.LOST_TRACK, "fragment 0 round 0 committed without us"), 1.1)
    assert sent(actions) == ["Join"] and s.state is S.JOINING
    # While joining it changes nothing (the Welcome to come places the worker).
    assert sent(s.on_message(PlaneEvent(PlaneEventKind.LOST_TRACK, "again"), 1.2)) == []
    # Not a message from the coordinator: the outage clock runs on from the Join (W11).
    silent = joined(H=1, hb=1.0, timeout=30.0)
    t, stops = 0.0, []
    while silent.state is not S.STOPPING and t < 60.0:
        t += 0.25
        if t % 5.0 == 0.0:
            silent.on_message(PlaneEvent(PlaneEventKind.JOB_FAILED, "a job failed"), t)
        stops += [(t,) + o[1:] for o in kinds(silent.tick(t), "stop")]
    # As W11's test: the first heartbeat (t=1) is the first message left unanswered.
    assert stops == [(31.0, "coordinator_unreachable", True)]


@pytest.mark.parametrize("kind", ["heal_failed", "no_start_state"])
def test_w20_plane_failures_fail_with_their_kind(kind):
    from diloco.collective.member import PlaneEvent, PlaneEventKind

    s = WorkerSession(WID, 4, SPEC)
    s.start(0.0)
    actions = s.on_message(PlaneEvent(PlaneEventKind(kind), "no source could hand over the state"), 1.0)
    assert kinds(actions, "fail") == [("fail", kind)] and s.state is S.STOPPED


def test_w20_plane_job_failed_is_only_logged():
    from diloco.collective.member import PlaneEvent, PlaneEventKind

    s = joined(H=4)
    before = s.state
    actions = s.on_message(PlaneEvent(PlaneEventKind.JOB_FAILED, "ValueError: boom"), 1.0)
    assert sent(actions) == [] and kinds(actions, "fail") == [] and s.state is before


# --------------------------------------------------------------------------- the spec names these tests


def test_spec_section_14_names_only_tests_that_exist():
    """Every rule W1-W20 of SPEC.md section 14 names tests, and each name matches a test here."""
    import fnmatch
    import re
    from pathlib import Path

    spec = (Path(__file__).resolve().parents[2] / "SPEC.md").read_text(encoding="utf-8")
    section = spec[spec.index("## 14. The worker session"):]
    rules = re.findall(r"^- \*\*(W\d+) [^*]+\.\*\*(.*?)(?=^- \*\*W|\Z)", section, re.S | re.M)
    assert [r for r, _ in rules] == [f"W{i}" for i in range(1, 21)]
    tests = [name for name in globals() if name.startswith("test_")]
    for rule, text in rules:
        names = re.findall(r"`(test_\w+\*?)`", text)
        assert names, f"{rule} names no test"
        for name in names:
            assert fnmatch.filter(tests, name), f"{rule} names {name}, which matches no test"
            assert name.startswith(f"test_{rule.lower()}_"), f"{rule} names {name}"


# --------------------------------------------------------------------------- data work units (SPEC.md U1-U5)


def test_units_the_session_holds_the_unit_it_was_handed_and_names_it_when_it_joins_again():
    s = WorkerSession(WID, 2, SPEC)
    s.start(0.0)
    assert s.unit is None and s.units_per_epoch is None
    s.on_message(dataclasses.replace(welcome(), data_units=8, unit=11), 0.0)
    assert (s.units_per_epoch, s.unit) == (8, 11)  # epoch 1, unit 3
    s.step_done(0.1)
    s.step_done(0.2)
    s.on_message(dataclasses.replace(result(0, 0), unit=12), 0.3)
    assert s.unit == 12
    s.on_message(dataclasses.replace(result(0, 5), unit=13), 0.4)  # stale: the unit handed out still counts
    assert s.unit == 13
    joins = [a.message for a in s.on_message(reply(command=Command.REJOIN), 0.5)
             if isinstance(a, Send) and isinstance(a.message, Join)]
    assert joins and joins[0].unit == 13  # a re-join asks to keep its data


def test_units_a_run_without_units_joins_without_one():
    s = joined()
    assert s.unit is None and s.units_per_epoch is None
    joins = [a.message for a in s.on_message(reply(command=Command.REJOIN), 0.5)
             if isinstance(a, Send) and isinstance(a.message, Join)]
    assert joins and joins[0] == Join(WID, PROTOCOL_VERSION, SPEC)
