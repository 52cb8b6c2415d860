"""WorkerSession fixes found by the simulator (tests/sim owns them; see diloco/sim/checker.py).

Lost heartbeats made a worker ignore the quorum: the session counts heartbeats
without a reply, and at a submit treats that many replies as stale (they answer
heartbeats sent before the wait began, SPEC.md W6). A heartbeat lost with the
link never gets its reply, so the count stayed inflated until the next Welcome,
and in every later wait the worker ignored as many *fresh* replies: it kept
waiting while the run was below quorum instead of pausing. Found by the
simulator's check of rule W6 (22 of the 200 CI seeds; seed 55: one heartbeat
lost in a 6 s partition at t=12 s, a fresh reply ignored at t=67 s). Fixed in
``WorkerSession`` (commit 8f3774f): the ``Accepted`` of the latest Submit fences
the stale replies off (on the FIFO connection, every heartbeat sent before
that Submit is answered by then, or lost).
"""

from __future__ import annotations

from diloco.wire.messages import Accepted, Command, Heartbeat, HeartbeatReply, TensorSpec, Welcome
from diloco.worker.actions import Send, SubmitFragment
from diloco.worker.session import WorkerSession
from diloco.worker.states import WorkerState

SPEC = (TensorSpec("p", (2,), "float32"),)


def _member(hb_interval_s: float = 1.0) -> WorkerSession:
    s = WorkerSession("w", 1, SPEC)
    s.start(0.0)
    s.on_message(Welcome("w", (0,), (), "sync", (("p",),), 2, False, hb_interval_s, {"p": object()}), 0.1)
    assert s.state is WorkerState.TRAINING
    return s


def _heartbeats(actions) -> int:
    return sum(isinstance(a, Send) and isinstance(a.message, Heartbeat) for a in actions)


def test_a_fresh_below_quorum_reply_pauses_after_heartbeats_were_lost():
    s = _member()
    # Three heartbeats lost with the link while training (no reply ever comes).
    assert sum(_heartbeats(s.tick(t)) for t in (1.1, 2.1, 3.1)) == 3
    actions = s.step_done(3.5)
    assert any(isinstance(a, SubmitFragment) for a in actions) and _heartbeats(actions) == 1
    assert s.state is WorkerState.WAITING
    s.on_message(Accepted(0, 0), 3.55)
    # The reply to the heartbeat sent with the Submit: the run is below quorum now.
    s.on_message(HeartbeatReply(True, 3, "paused", Command.CONTINUE), 3.6)
    assert s.state is WorkerState.PAUSED


def test_a_reply_to_a_heartbeat_sent_before_the_submit_still_does_not_pause():
    s = _member()
    assert _heartbeats(s.tick(1.1)) == 1           # its reply is in flight
    s.step_done(1.2)                                # submit + heartbeat
    s.on_message(HeartbeatReply(True, 3, "paused", Command.CONTINUE), 1.25)  # answers the 1.1 one
    assert s.state is WorkerState.WAITING
    s.on_message(Accepted(0, 0), 1.3)
    s.on_message(HeartbeatReply(True, 3, "paused", Command.CONTINUE), 1.3)   # answers the 1.2 one
    assert s.state is WorkerState.PAUSED
