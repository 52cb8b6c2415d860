"""Big messages do not hold small ones up, are never cut for their size in parts, nor lost for their age.

Unit and loopback tests of what ``tests/zmq/test_slow_link.py`` shows end to end over a slow
link (SPEC.md section 11, "Frames" and "Limits"; section 14, W3 and W9):

* an *aside* (a heartbeat) goes between another message's parts and the receiver keeps
  that message (``framing.Assembler``); the sender's ``framing.Outbox`` hands libzmq a part at
  a time, asides first, everything else in order;
* a worker's heartbeat reaches the coordinator before the rest of a big Submit already queued;
* the coordinator sends a message of more parts than libzmq's queue holds (a Result for a
  model of many tensors), and still drops for a peer that stopped reading;
* ``DILOCO_PARTIAL_TIMEOUT_S`` sets the limit on an incomplete message's silence;
* the worker session heartbeats while joining only while a message moves, and does not
  resync (W9) while its Submit or its Result is still crossing.
"""

from __future__ import annotations

import time

import pytest
import torch

from diloco.transport.zmq import framing, tags
from diloco.transport.zmq.framing import Assembler, Complete, Outbox, Refused, aside_tag, parts
from diloco.transport.zmq.options import PARTIAL_TIMEOUT_ENV
from diloco.wire import codec
from diloco.wire.messages import (
    Accepted,
    Command,
    Heartbeat,
    HeartbeatReply,
    Leave,
    Result,
    Submit,
    TensorSpec,
    Welcome,
)
from diloco.wire.zmq import ZmqCoordinatorEndpoint, ZmqOptions, ZmqWorkerEndpoint
from diloco.worker.actions import Send
from diloco.worker.session import WorkerSession
from diloco.worker.states import WorkerState as S

LOOPBACK = "tcp://127.0.0.1:0"


def _parts(message, seq=1, chunk_bytes=codec.CHUNK_BYTES):
    return list(parts(seq, codec.encode(message, chunk_bytes=chunk_bytes)))


def _aside(message, seq):
    (frame,) = codec.encode(message)
    return [aside_tag(seq), frame]


# --------------------------------------------------------------------------- the receiver


def test_an_aside_between_parts_is_delivered_and_the_message_it_interrupts_completes():
    big = Submit("w", 0, 0, {"t": torch.arange(64.0)})
    a = Assembler(1 << 20)
    pieces = _parts(big, chunk_bytes=32)
    assert len(pieces) > 4
    got = [a.add("p", p, 0.0) for p in pieces[:3]]
    hb = a.add("p", _aside(Heartbeat("w"), 2), 1.0)
    assert isinstance(hb, Complete) and codec.decode(hb.frames) == Heartbeat("w")
    assert a.partial_count == 1 and a.incomplete_dropped == 0 and a.arriving("p", 1.0)
    got += [a.add("p", p, 2.0) for p in pieces[3:]]
    assert got[:-1] == [None] * (len(pieces) - 1) and isinstance(got[-1], Complete)
    assert torch.equal(codec.decode(got[-1].frames).tensors["t"], torch.arange(64.0))
    assert not a.arriving("p", 2.0)
    # Any other message that starts still drops an incomplete one (a sender that gave up on it).
    a.add("p", pieces[0], 3.0)
    assert isinstance(a.add("p", _parts(Heartbeat("w"), seq=3)[0], 3.0), Complete)
    assert a.incomplete_dropped == 1


def test_an_aside_lets_go_of_an_interrupted_message_only_once_that_one_went_silent():
    a = Assembler(1 << 20, partial_timeout_s=10.0)
    pieces = _parts(Submit("w", 0, 0, {"t": torch.zeros(8)}), chunk_bytes=8)
    a.add("p", pieces[0], 0.0)
    a.add("p", pieces[1], 5.0)
    assert isinstance(a.add("p", _aside(Heartbeat("w"), 2), 14.0), Complete)   # 9 s of silence: kept
    assert a.partial_count == 1 and a.arriving("p", 14.0)
    assert not a.arriving("p", 15.5)                                            # past the limit
    assert isinstance(a.add("p", _aside(Heartbeat("w"), 3), 15.5), Complete)   # dropped now
    assert a.partial_count == 0 and a.incomplete_dropped == 1
    assert a.add("p", pieces[2], 16.0) is None                                  # its rest is skipped


def test_a_malformed_or_oversized_aside_is_refused():
    a = Assembler(100)
    (frame,) = codec.encode(Heartbeat("w"))
    bad = tags._PART.pack(tags.ASIDE_MAGIC, 1, 0, 2)
    assert isinstance(r := a.add("p", [bad, frame], 0.0), Refused) and r.code == "bad_message"
    assert isinstance(r := a.add("p", [aside_tag(2), b"x" * 101], 0.0), Refused) and r.code == "too_large"
    assert framing.read_tag(aside_tag(3)) is None  # an aside's tag is no part's


# --------------------------------------------------------------------------- the sender's outbox


def test_the_outbox_gives_asides_before_the_next_part_and_everything_else_in_order():
    box = Outbox()
    box.put([["m1", 0], ["m1", 1], ["m1", 2]], 30, "Submit")
    box.put([["leave"]], 1, "Leave")
    out = [box.peek()]
    assert box.advance() is None and box.mid_message
    box.put([["hb"]], 1, "Heartbeat", aside=True)
    assert box.parts_behind == 2  # the Leave and the heartbeat wait behind the Submit's rest
    done = []
    while (part := box.peek()) is not None:
        out.append(part)
        finished = box.advance()
        if finished is not None:
            done.append(finished.what)
    assert out == [["m1", 0], ["hb"], ["m1", 1], ["m1", 2], ["leave"]]
    assert done == ["Heartbeat", "Submit", "Leave"] and not box and box.parts == 0


# --------------------------------------------------------------------------- endpoints on loopback


def _recv(ep, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = ep.recv(0.1)
        if got is not None:
            return got
    raise AssertionError("nothing arrived")


def test_a_heartbeat_passes_a_big_submit_queued_before_it_and_a_leave_does_not():
    # 64 MiB in 1 MiB parts: the worker hands libzmq one part at a time, so most of it still
    # waits in the worker's outbox when the heartbeat is sent as soon as the first part went
    # (the coordinator's libzmq reads as fast as the link delivers, so on loopback the outbox
    # empties within tens of milliseconds; on a slow link it is the link that holds the rest
    # back). The Leave sent after the heartbeat must stay behind the Submit.
    opts = ZmqOptions(chunk_bytes=1 << 20, max_message_bytes=1 << 28)
    tensor = torch.arange(16 << 20, dtype=torch.float32)
    with ZmqCoordinatorEndpoint(LOOPBACK, options=opts) as server, \
            ZmqWorkerEndpoint(server.address, label="w", options=opts) as worker:
        worker.send(Heartbeat("w"))
        assert _recv(server)[1] == Heartbeat("w")
        worker.send(Submit("w", 0, 0, {"x": tensor}))
        box = worker.frames._outbox
        deadline = time.monotonic() + 10
        while not box.mid_message and time.monotonic() < deadline:
            time.sleep(0.0002)
        assert box.mid_message and worker.sending()
        worker.send(Heartbeat("w"))
        worker.send(Leave("w"))
        order = [type(_recv(server)[1]).__name__ for _ in range(3)]
        assert order == ["Heartbeat", "Submit", "Leave"], order
        assert worker.counters["asides_between_parts"] == 1 and not worker.sending()
        assert server.stats()["incomplete_dropped"] == 0


def test_a_result_of_more_parts_than_the_routers_queue_arrives_whole_then_what_follows_it():
    # 600 tensors: 601 parts, over twice the 256 parts libzmq takes per peer (such a Result was
    # dropped whole, and the reply after it too). 64 KiB each, 39 MB in all: more than the loopback's
    # socket buffers hold while the worker reads nothing, so libzmq's queue cannot drain into them and
    # the rest must wait in the endpoint's backlog (with 256-byte tensors a fast machine drained it all).
    tensors = {f"t{i}": torch.full((16384,), float(i)) for i in range(600)}
    with ZmqCoordinatorEndpoint(LOOPBACK) as server, ZmqWorkerEndpoint(server.address, label="w") as worker:
        worker.send(Heartbeat("w"))
        peer = _recv(server).peer
        server.send(peer, Result(0, 0, "applied", 1, tensors))
        server.send(peer, HeartbeatReply(False, 1, "running"))
        assert server.stats()["send_backlog_parts"] > 0
        got = []
        deadline = time.monotonic() + 10
        while len(got) < 2 and time.monotonic() < deadline:
            server.recv(0.01)  # the coordinator's loop hands over what waits
            m = worker.recv(0.01)
            if m is not None:
                got.append(m)
        assert [type(m).__name__ for m in got] == ["Result", "HeartbeatReply"]
        assert all(torch.equal(got[0].params[f"t{i}"], tensors[f"t{i}"]) for i in (0, 299, 599))
        stats = server.stats()
        assert stats["dropped_queue_full"] == 0 and stats["send_backlog_parts"] == 0 and stats["messages_out"] == 2


def test_messages_for_a_peer_that_stopped_reading_are_dropped_once_parts_pile_up_behind():
    opts = ZmqOptions(router_sndhwm=4, dealer_rcvhwm=4, chunk_bytes=1 << 20)
    payload = {"x": torch.zeros(1 << 18)}  # 1 MiB: one part of its own
    with ZmqCoordinatorEndpoint(LOOPBACK, options=opts) as server, \
            ZmqWorkerEndpoint(server.address, label="w", options=opts) as worker:
        worker.send(Heartbeat("w"))
        peer = _recv(server).peer
        for i in range(200):  # the worker never reads: 200 MiB will not fit anywhere
            server.send(peer, Result(0, i, "applied", i + 1, payload))
            server.recv(0.001)
        stats = server.stats()
        assert stats["dropped_queue_full"] > 0
        # At most the message going out plus router_sndhwm parts behind it wait in the endpoint.
        assert stats["send_backlog_parts"] <= 2 + 4


def test_the_partial_limit_comes_from_the_environment(monkeypatch):
    assert ZmqOptions().partial_timeout_s == 120.0
    monkeypatch.setenv(PARTIAL_TIMEOUT_ENV, "3.5")
    assert ZmqOptions().partial_timeout_s == 3.5
    with ZmqCoordinatorEndpoint(LOOPBACK) as server:
        assert server.frames._assembler.partial_timeout_s == 3.5
    for bad in ("0", "-1", "soon", "inf"):
        monkeypatch.setenv(PARTIAL_TIMEOUT_ENV, bad)
        with pytest.raises(ValueError, match=PARTIAL_TIMEOUT_ENV):
            ZmqOptions()


# --------------------------------------------------------------------------- the worker session

SPEC = (TensorSpec("a", (2,), "float32"),)


def _sent(actions) -> list[str]:
    return [type(a.message).__name__ for a in actions if isinstance(a, Send)]


def _welcome(hb=1.0, parked=()) -> Welcome:
    return Welcome("w", (0,), tuple(parked), "sync", (("a",),), 2, False, hb, {"a": "p"})


def test_a_joining_worker_heartbeats_while_a_message_moves_and_not_otherwise():
    s = WorkerSession("w", 4, SPEC)
    assert _sent(s.start(0.0)) == ["Join"]
    assert _sent(s.tick(1.0)) == []                                # nothing moves: only the Join (resent later)
    assert _sent(s.tick(1.5, 0.1, receiving=True)) == ["Heartbeat"]  # the Welcome's parts arrive
    assert _sent(s.tick(2.0, 0.1, receiving=True)) == []            # one per heartbeat interval (1 s here)
    assert _sent(s.tick(2.6, 0.1, receiving=True)) == ["Heartbeat"]
    assert _sent(s.tick(3.7, 0.1, sending=True)) == ["Heartbeat"]   # our own Join with params going out
    # A reply before the Welcome (the coordinator did not count us yet: rejoin) is ignored.
    s.on_message(HeartbeatReply(False, 2, "forming", Command.REJOIN), 3.8)
    assert s.state is S.JOINING
    s.on_message(_welcome(), 4.0)
    assert s.state is S.TRAINING


def test_no_resync_while_the_submit_or_the_result_is_still_moving():
    s = WorkerSession("w", 1, SPEC)
    s.start(0.0)
    s.on_message(_welcome(), 0.0)
    s.step_done(0.0)                        # due: submits round 0 and waits for its Result
    assert s.state is S.WAITING

    def run(start, until, **busy):
        t = start
        while t <= until:
            actions = s.tick(t, 0.5, **busy)
            if "Leave" in _sent(actions):
                return t
            for name in _sent(actions):
                if name == "Heartbeat":
                    s.on_message(HeartbeatReply(False, 2, "running"), t)  # the coordinator answers at once
            t += 1.0
        return None

    s.on_message(Accepted(0, 0), 0.0)
    assert run(0.0, 60.0, sending=True) is None      # the Submit crosses for a minute: no resync (W9: 16 s)
    assert run(61.0, 120.0, receiving=True) is None  # then the Result does
    assert run(121.0, 200.0) == 121.0 + 16           # nothing moves and no Result: resync after 16 intervals
