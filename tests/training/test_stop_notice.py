"""Who has heard the stop (``diloco/coordinator/stop_notice.py``): a stopped server lets go once every
connected worker has been told, and at once when none is connected."""

from __future__ import annotations

import torch

from diloco.coordinator.stop_notice import StopNotice, tells_the_stop
from diloco.testing import join_message, make_coordinator
from diloco.wire.messages import (
    AdminRequest,
    Command,
    Error,
    ErrorCode,
    Heartbeat,
    HeartbeatReply,
    Leave,
    Result,
    Submit,
)

P0 = {"w": torch.zeros(4)}


def _stopped_with(*workers: str, kind: str = "abort"):
    c = make_coordinator(0.0, min_workers=len(workers))
    for i, wid in enumerate(workers):
        c.handle(f"peer-{wid}", join_message(wid, P0), 0.1 + i)
    assert not c.stop_notice.everyone_told  # running: nobody is to be told anything yet
    out = c.handle("admin", AdminRequest("shutdown", {"kind": kind}), 5.0)
    assert c.stopped
    c.stop_notice.sent(out)
    return c


def test_what_tells_a_worker_the_run_stopped():
    told = [Result(0, 1, "stop", 1), Result(0, 1, "applied_final", 2), HeartbeatReply(False, 1, "stopped", Command.STOP),
            HeartbeatReply(False, 1, "stopped", Command.SAVE_AND_STOP), Error(ErrorCode.STOPPED, "stopped", "Submit")]
    not_told = [Result(0, 1, "applied", 2), HeartbeatReply(False, 1, "running", Command.CONTINUE),
                HeartbeatReply(False, 1, "running", Command.REJOIN), Error(ErrorCode.BAD_MESSAGE, "no", "Submit")]
    assert all(tells_the_stop(m) for m in told) and not any(tells_the_stop(m) for m in not_told)


def test_with_no_worker_connected_everyone_is_told_at_the_stop():
    c = make_coordinator(0.0)
    c.stop_notice.sent(c.handle("admin", AdminRequest("shutdown", {"kind": "abort"}), 1.0))
    assert c.stopped and c.stop_notice.everyone_told


def test_each_worker_is_told_by_its_heartbeat_reply_or_needs_no_telling_once_gone():
    c = _stopped_with("a", "b", "c")
    assert c.stop_notice.untold == ["a", "b", "c"]
    c.stop_notice.sent(c.handle("peer-a", Heartbeat("a"), 6.0))
    assert c.stop_notice.untold == ["b", "c"]
    c.stop_notice.sent(c.handle("peer-b", Leave("b"), 6.5))  # left: nobody there to tell
    assert c.stop_notice.untold == ["c"] and not c.stop_notice.everyone_told
    c.stop_notice.sent(c.peer_lost("peer-c", 7.0))  # its connection dropped
    assert c.stop_notice.everyone_told


def test_a_refusal_saying_the_run_stopped_tells_and_a_stranger_does_not_count():
    c = _stopped_with("a")
    c.stop_notice.sent(c.handle("peer-x", Heartbeat("x"), 6.0))  # no worker of the run on that connection
    assert c.stop_notice.untold == ["a"]
    c.stop_notice.sent(c.handle("peer-a", Submit("a", 0, 0, {"w": torch.zeros(4)}), 6.5))
    assert c.stop_notice.everyone_told


def test_a_worker_waiting_on_its_round_is_told_by_the_stop_result():
    c = make_coordinator(0.0, min_workers=2)
    c.handle("peer-a", join_message("a", P0), 0.1)
    c.handle("peer-b", join_message("b", P0), 0.2)
    c.handle("peer-a", Submit("a", 0, 0, {"w": torch.ones(4)}), 1.0)  # a waits for its round's Result
    out = c.handle("admin", AdminRequest("shutdown", {"kind": "abort"}), 2.0)
    assert any(p == "peer-a" and isinstance(m, Result) and m.outcome == "stop" for p, m in out)
    c.stop_notice.sent(out)
    assert c.stop_notice.untold == ["b"]


def test_the_notice_counts_nothing_before_the_stop():
    notice = StopNotice()
    notice.sent([("p", HeartbeatReply(False, 1, "stopped", Command.STOP))])
    notice.gone("p")
    assert not notice.everyone_told and notice.untold == []
    notice.stopped({"w": "p"})
    assert notice.untold == ["w"]
    notice.stopped({})  # a second stop changes nothing
    assert notice.untold == ["w"]
