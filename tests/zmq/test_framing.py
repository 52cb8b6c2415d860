"""Parts (SPEC.md section 11, "Frames"): a message's size is checked as its parts arrive, never after."""

from __future__ import annotations

import time

import torch
import zmq

from diloco.wire import codec
from diloco.wire.messages import Error, ErrorCode, Heartbeat, Submit
from diloco.wire.zmq import ZmqCoordinatorEndpoint, ZmqOptions
from diloco.transport.zmq.framing import Assembler, Complete, Refused, parts, read_tag, tag


def _parts_of(message, seq=1, chunk_bytes=codec.CHUNK_BYTES):
    return list(parts(seq, codec.encode(message, chunk_bytes=chunk_bytes)))


def test_tags_round_trip_and_anything_else_is_not_a_tag():
    assert read_tag(tag(7, 2, 5)) == (7, 2, 5)
    assert read_tag(b"DLC1" + bytes(12)) is None
    assert read_tag(b"short") is None


def test_parts_in_order_make_the_message():
    msg = Submit("w", 0, 3, {"a": torch.arange(10.0), "b": torch.ones(3, 3)})
    a = Assembler(1 << 20)
    got = [a.add("p", p, 0.0) for p in _parts_of(msg, chunk_bytes=16)]
    assert got[:-1] == [None] * (len(got) - 1)
    assert isinstance(got[-1], Complete)
    out = codec.decode(got[-1].frames)
    assert out.worker_id == "w" and torch.equal(out.tensors["b"], torch.ones(3, 3))
    assert a.partial_count == 0


def test_a_message_over_the_limit_is_refused_as_it_arrives_and_freed():
    big = Submit("w", 0, 0, {"t": torch.zeros(1000)})  # 4000 bytes in 16-byte chunks: 251 parts
    a = Assembler(max_message_bytes=1000)
    results = [a.add("p", p, 0.0) for p in _parts_of(big, chunk_bytes=16)]
    refused = [i for i, r in enumerate(results) if isinstance(r, Refused)]
    assert len(refused) == 1 and results[refused[0]].code == "too_large"
    # Refused long before the end: the size crossed 1000 bytes at about part 1000 / 16.
    assert refused[0] < 70 < len(results)
    assert a.partial_bytes == 0  # what was held is freed at once
    assert all(r is None for r in results[refused[0] + 1:])  # the rest is skipped
    assert a.partial_count == 0
    # The same peer's next message goes through.
    (last,) = [a.add("p", p, 0.0) for p in _parts_of(Heartbeat("w"), seq=2)]
    assert isinstance(last, Complete)


def test_an_incomplete_message_is_dropped_when_the_next_one_starts():
    a = Assembler(1 << 20)
    first = _parts_of(Submit("w", 0, 0, {"t": torch.zeros(8)}), seq=1, chunk_bytes=8)
    for p in first[:2]:
        assert a.add("p", p, 0.0) is None
    assert a.partial_count == 1
    assert isinstance(a.add("p", _parts_of(Heartbeat("w"), seq=2)[0], 0.0), Complete)
    assert a.incomplete_dropped == 1 and a.partial_count == 0
    # A stray later part of the dropped message is skipped.
    assert a.add("p", first[2], 0.0) is None


def test_partials_are_bounded_in_number_and_age():
    a = Assembler(1 << 20, max_partials=3, partial_timeout_s=10.0)
    start = _parts_of(Submit("w", 0, 0, {"t": torch.zeros(8)}), chunk_bytes=8)[0]
    for i in range(5):
        a.add(f"p{i}", start, 0.0)
    assert a.partial_count == 3 and a.incomplete_dropped == 2
    a.add("late", start, 100.0)  # the three older ones have timed out
    assert a.partial_count == 1


def test_a_message_that_keeps_arriving_is_kept_however_long_it_takes_and_a_silent_one_is_dropped():
    # A part every 9 s, a 10 s limit on silence: 60 s in all (older than the limit six times over).
    a = Assembler(1 << 20, partial_timeout_s=10.0)
    slow = _parts_of(Submit("w", 0, 0, {"t": torch.arange(8.0)}), chunk_bytes=4)
    assert len(slow) > 7
    got = None
    for i, part in enumerate(slow):
        other = a.add(f"other{i}", slow[0], 9.0 * i)  # other peers' messages start: expiry runs
        assert other is None
        got = a.add("slow", part, 9.0 * i)
    # The slow message completes; each other peer's lone first part went stale 18 s after it came.
    assert isinstance(got, Complete) and a.incomplete_dropped == len(slow) - 2 and a.partial_count == 2
    # Silence past the limit drops it: the next message start (anyone's) finds it stale.
    a = Assembler(1 << 20, partial_timeout_s=10.0)
    a.add("slow", slow[0], 0.0)
    a.add("slow", slow[1], 9.0)
    a.add("other", slow[0], 19.5)
    assert a.incomplete_dropped == 1 and a.add("slow", slow[2], 20.0) is None


def test_a_bad_part_count_is_refused():
    a = Assembler(1 << 20)
    assert isinstance(a.add("p", [tag(1, 0, 0), b"x"], 0.0), Refused)


def test_a_live_endpoint_refuses_an_oversized_message_part_by_part():
    options = ZmqOptions(max_message_bytes=1 << 20, chunk_bytes=64 << 10)
    with ZmqCoordinatorEndpoint("tcp://127.0.0.1:0", options=options) as ep:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(ep.address)
        try:
            # 4 MiB in 64 KiB parts against a 1 MiB limit.
            for p in _parts_of(Submit("w", 0, 0, {"t": torch.zeros(1 << 20)}), chunk_bytes=64 << 10):
                sock.send_multipart(p)
            for p in _parts_of(Heartbeat("after"), seq=2):
                sock.send_multipart(p)
            deadline = time.monotonic() + 10
            got = None
            while got is None and time.monotonic() < deadline:
                got = ep.recv(0.1)
            assert got is not None and got[1] == Heartbeat("after")
            assert sock.poll(3000)
            (tag_frame, payload) = sock.recv_multipart()
            reply = codec.decode([payload])
            assert isinstance(reply, Error) and reply.code is ErrorCode.TOO_LARGE
            assert "max_message_bytes=1048576" in reply.detail and "dropped as it arrived" in reply.detail
            stats = ep.stats()
            assert stats["malformed"] == {"too_large": 1} and stats["partial_messages"] == 0
        finally:
            sock.close(0)
            ctx.term()


def test_a_whole_multipart_message_of_this_version_is_refused():
    """Protocol 2 messages come as parts; one sent whole is bad_message, answered in the old framing."""
    with ZmqCoordinatorEndpoint("tcp://127.0.0.1:0") as ep:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(ep.address)
        try:
            sock.send_multipart(codec.encode(Heartbeat("w")))
            assert ep.recv(1.0) is None
            assert sock.poll(3000)
            reply = codec.decode(sock.recv_multipart())
            assert reply.code is ErrorCode.BAD_MESSAGE and "as a part" in reply.detail
        finally:
            sock.close(0)
            ctx.term()
