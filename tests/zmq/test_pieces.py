"""Parts on thin links (SPEC.md section 11): frames cut into pieces sized to the link, acks, proof of life.

A frame bigger than the sender's part size goes as pieces (``outbox.Outbox`` cuts them as each is
handed over); the receiver puts them together, counts the frame's declared bytes from its first
piece, acks what arrived, and notes who is sending. The sender sizes its parts from those acks
(``outbox.PartSizer``). The coordinator counts a worker whose message keeps arriving as alive.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import zmq

from diloco.transport.zmq import tags
from diloco.transport.zmq.framing import Acked, Assembler, Complete, Refused, parts
from diloco.transport.zmq.outbox import ACK_INTERVAL_S, MIN_PART_BYTES, Outbox, PartSizer
from diloco.wire import codec
from diloco.wire.messages import Submit
from diloco.wire.zmq import _TENSOR_RUNS, ZmqOptions


class FixedSizer(PartSizer):
    """Parts of exactly ``n`` bytes (the real sizer never goes below 64 KiB)."""

    def __init__(self, n: int) -> None:
        super().__init__(n, n)


def _handed_over(box: Outbox) -> list[list]:
    out = []
    while (part := box.peek()) is not None:
        out.append(part)
        box.advance(0.0)
    return out


def _submit(tensors: dict, chunk_bytes: int = codec.CHUNK_BYTES) -> list:
    return codec.encode(Submit("w", 0, 3, tensors, "fp32", {}), chunk_bytes=chunk_bytes)


def _assemble(a: Assembler, zmq_parts: list, now: float = 0.0) -> list:
    return [a.add("p", [bytes(memoryview(f).cast("B")) if not isinstance(f, bytes) else f for f in part], now)
            for part in zmq_parts]


@pytest.mark.parametrize("coalescer", [None, _TENSOR_RUNS], ids=["plain", "coalescing"])
@pytest.mark.parametrize("piece", [7, 1000, 4096])
def test_frames_cut_into_pieces_arrive_as_the_same_message(coalescer, piece):
    tensors = {"big": torch.randn(3000), "chunked": torch.randn(5000), "small": torch.randn(3)}
    frames = _submit(tensors, chunk_bytes=8000)  # "chunked" is a run of three frames, each cut again
    box = Outbox(FixedSizer(piece))
    box.put_frames(1, frames, sum(memoryview(f).nbytes for f in frames))
    sent = _handed_over(box)
    assert any(tags.read(p[0]).magic == tags.PIECE_MAGIC for p in sent)
    assert all(memoryview(p[1]).nbytes <= piece for p in sent)
    got = _assemble(Assembler(1 << 20, coalescer=coalescer), sent)
    assert all(g is None for g in got[:-1]) and isinstance(got[-1], Complete)
    out = codec.decode(got[-1].frames)
    for name, t in tensors.items():
        assert torch.equal(out.tensors[name], t), name
    assert not box and box.parts == 0


def test_a_frame_that_fits_goes_whole_and_pieces_are_slices_of_the_senders_memory():
    t = torch.arange(10_000, dtype=torch.float32)
    frames = _submit({"t": t})
    box = Outbox(FixedSizer(4096))
    box.put_frames(5, frames, 0)
    sent = _handed_over(box)
    assert tags.read(sent[0][0]).magic == tags.MAGIC  # the header fits: whole
    pieces = sent[1:]
    assert len(pieces) == -(-t.numel() * 4 // 4096)
    first = memoryview(pieces[0][1])
    assert first.obj is memoryview(frames[1]).obj  # no copy: a view of the tensor's own bytes
    assert [tags.read(p[0]).offset for p in pieces] == [i * 4096 for i in range(len(pieces))]


def test_a_one_frame_message_in_pieces_and_a_header_in_pieces_are_assembled():
    box = Outbox(FixedSizer(10))
    box.put_frames(1, [b"x" * 95], 95)
    got = _assemble(Assembler(1000), _handed_over(box))
    assert isinstance(got[-1], Complete) and bytes(got[-1].frames[0]) == b"x" * 95
    many = {f"t{i}": torch.ones(2) for i in range(40)}  # a header of over a kilobyte
    frames = _submit(many)
    box.sizer = FixedSizer(100)
    box.put_frames(2, frames, 0)
    got = _assemble(Assembler(1 << 20, coalescer=_TENSOR_RUNS), _handed_over(box))
    assert isinstance(got[-1], Complete)
    assert sorted(codec.decode(got[-1].frames).tensors) == sorted(many)


def test_a_frame_in_pieces_counts_its_declared_bytes_from_the_first_piece():
    a = Assembler(max_message_bytes=10_000)
    header = tags.tag(1, 0, 2), b"h"
    assert a.add("p", list(header), 0.0) is None
    assert a.add("p", [tags.piece_tag(1, 1, 2, 6000, 0), b"a" * 100], 0.0) is None
    assert a.partial_bytes >= 6000  # the frame's buffer, held from its first piece
    r = a.add("p", [tags.piece_tag(2, 0, 1, 20_000, 0), b"b" * 100], 0.0)  # declares past the limit
    assert isinstance(r, Refused) and r.code == "too_large"
    assert a.partial_bytes == 0  # nothing held for it (the first message was dropped when it started)
    assert a.add("p", [tags.piece_tag(2, 0, 1, 20_000, 100), b"b" * 100], 0.0) is None  # its rest skipped
    assert a.add("p", [tags.piece_tag(2, 0, 1, 20_000, 19_900), b"b" * 100], 0.0) is None
    assert a.partial_count == 0  # its last piece ends the skipping


def test_pieces_that_overrun_their_frame_or_come_out_of_place_never_make_a_message():
    a = Assembler(1 << 20)
    r = a.add("p", [tags.piece_tag(1, 0, 1, 50, 40), b"z" * 20], 0.0)  # bytes 40..60 of 50
    assert isinstance(r, Refused) and r.code == "bad_message"
    assert isinstance(a.add("p", [tags.piece_tag(1, 0, 1, 50, 0), b""], 0.0), Refused)  # an empty piece
    assert a.add("p", [tags.piece_tag(2, 0, 1, 50, 0), b"a" * 20], 0.0) is None
    assert a.add("p", [tags.piece_tag(2, 0, 1, 50, 30), b"a" * 20], 0.0) is None  # a gap: 20..30 missing
    assert a.partial_count == 0 and a.incomplete_dropped == 1
    assert a.add("p", [tags.piece_tag(2, 0, 1, 50, 20), b"a" * 30], 0.0) is None  # too late: skipped


def test_the_receiver_acks_a_big_message_as_it_arrives_and_once_whole():
    a = Assembler(1 << 24)
    box = Outbox(FixedSizer(MIN_PART_BYTES))
    box.put_frames(9, [b"h", b"x" * (4 * MIN_PART_BYTES)], 0)
    sent = _handed_over(box)
    now = 0.0
    acks = []
    for part in sent:
        a.add("p", part, now)
        if (ack := a.take_ack()) is not None:
            acks.append(ack)
        now += ACK_INTERVAL_S / 2  # two pieces per ack interval
    received = [r for seq, r in acks if seq == 9]
    assert received == sorted(received) and received[-1] == 1 + 4 * MIN_PART_BYTES  # the last one: whole
    assert 2 <= len(acks) <= 4  # rate-limited, not one per piece
    assert a.take_ack() is None and a.take_progress() == ["p"]
    small = a.add("p", list(parts(10, [b"tiny", b"msg"]))[0], now)
    assert small is None and a.take_ack() is None  # small messages are not acked
    assert Assembler(1 << 20, track_progress=False).take_progress() == []
    got = a.add("q", [tags.ack_tag(77, 12345), b""], now)
    assert got == Acked(77, 12345)


def test_the_sizer_starts_small_and_sizes_parts_to_what_arrived_in_a_second():
    s = PartSizer(64 << 10, 16 << 20, part_time_s=1.0)
    assert s.part_bytes() == 64 << 10  # nothing known: the smallest
    s.acked(1, 10_000, 5.0)  # an ack for a message it never started: ignored
    assert s.rate is None
    s.started(1, 10.0)
    s.acked(1, 200_000, 14.0)  # 50 KB/s, at least
    assert s.rate == 50_000 and s.part_bytes() == 64 << 10
    s.acked(1, 4_400_000, 18.0)  # 550 KB/s
    assert s.part_bytes() == 550_000
    s.started(2, 20.0)
    s.acked(2, 1 << 30, 20.5)  # 2 GB/s: capped at the codec's chunk
    assert s.part_bytes() == 16 << 20
    for seq in range(3, 3 + PartSizer.REMEMBERED):
        s.started(seq, 30.0)
    s.acked(2, 1, 31.0)  # forgotten: ignored
    assert s.part_bytes() == 16 << 20


def test_on_loopback_the_first_ack_makes_parts_big():
    """A real DEALER and ROUTER: the first message goes in small parts, then the acks size them up."""
    from diloco.transport.zmq.dealer import FrameDealer
    from diloco.transport.zmq.router import FrameRouter

    opts = ZmqOptions(max_message_bytes=1 << 28)
    router = FrameRouter("tcp://127.0.0.1:0", options=opts, monitor=False)
    dealer = FrameDealer(router.address, options=opts)
    try:
        payload = bytes(8 << 20)
        for seq in range(3):
            dealer.send([b"header", payload], what="big")
            deadline = time.monotonic() + 20
            while (got := router.recv(0.1)) is None:
                dealer.recv(0.0)  # reads the router's acks
                assert time.monotonic() < deadline, "nothing arrived"
            assert isinstance(got.got, Complete) and bytes(got.got.frames[1]) == payload
            largest = got.got.largest_part
            if seq == 0:
                assert largest >= MIN_PART_BYTES
        dealer.recv(0.2)
        assert dealer.sizer.rate is not None and dealer.sizer.part_bytes() > 1 << 20
        assert largest == 8 << 20  # by the third message, the frame goes whole
        assert router.stats()["part_bytes_in"] == 8 << 20
    finally:
        dealer.close()
        router.close()


def test_a_worker_whose_submit_outlasts_the_heartbeat_timeout_stays_a_member_while_its_bytes_arrive():
    """No heartbeat for 3 s, a 1 s heartbeat timeout: the Submit's pieces alone keep the worker a member."""
    from diloco.coordinator import Coordinator, CoordinatorConfig
    from diloco.coordinator.runner import serve
    from diloco.core import FSMConfig
    from diloco.wire.messages import PROTOCOL_VERSION, Join, Result, Welcome, spec_of
    from diloco.wire.zmq import ZmqCoordinatorEndpoint

    # The first optimizer a process makes imports torch._dynamo (about a second): made here, so that the
    # coordinator's first Join does not take longer than the heartbeat timeout under test.
    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1, momentum=0.9, nesterov=True)
    params = {"w": torch.zeros(20_000)}
    coordinator = Coordinator(CoordinatorConfig(fsm=FSMConfig(min_workers=1, heartbeat_timeout_s=1.0)),
                              time.monotonic())
    endpoint = ZmqCoordinatorEndpoint("tcp://127.0.0.1:0")
    stop = threading.Event()
    server = threading.Thread(target=serve, args=(endpoint, coordinator),
                              kwargs=dict(stop_event=stop, tick_interval_s=0.02), daemon=True)
    server.start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, b"slow-uploader")
    sock.connect(endpoint.address)
    inbox = Assembler(1 << 28)

    def send(seq, message, pause_s=0.0, piece=4096):
        box = Outbox(FixedSizer(piece))
        box.put_frames(seq, codec.encode(message), 0)
        while (part := box.peek()) is not None:
            sock.send_multipart(part)
            box.advance(time.monotonic())
            time.sleep(pause_s)

    def receive(kind, timeout_s=20.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if sock.poll(100):
                got = inbox.add("coordinator", sock.recv_multipart(), time.monotonic())
                if isinstance(got, Complete):
                    message = codec.decode(got.frames)
                    if isinstance(message, kind):
                        return message
        raise AssertionError(f"no {kind.__name__}")

    try:
        send(1, Join("w1", PROTOCOL_VERSION, spec_of(params), params))
        receive(Welcome)
        grad = {"w": torch.randn(20_000)}  # 80 KB in 4 KB pieces, one every 0.15 s: 3 s, no heartbeat
        started = time.monotonic()
        send(2, Submit("w1", 0, 0, grad, "fp32", {}), pause_s=0.15)
        assert time.monotonic() - started > 2.5
        result = receive(Result)
        assert result.outcome == "applied"
        assert coordinator.fsm.is_member("w1") and coordinator.fsm.rounds_applied == 1
    finally:
        sock.close(0)
        ctx.term()
        stop.set()
        server.join(10)
        endpoint.close()


def test_diloco_status_shows_the_part_sizes_people_read():
    from diloco.deploy.admin import render_status

    page = render_status({"transport": {"messages_in": 3, "part_bytes_in": 65536, "part_bytes_out": 16 << 20}})
    assert "parts (median over workers): in 64 KiB, out 16 MiB" in page
    assert "parts" not in render_status({"transport": {"messages_in": 3}})  # nothing measured yet: no line
