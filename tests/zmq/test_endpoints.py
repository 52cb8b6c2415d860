"""ZeroMQ endpoints in one process, on loopback: delivery, limits, hostile frames, reconnects, admin timeouts."""

from __future__ import annotations

import threading
import time

import msgpack
import pytest
import torch
import zmq

from diloco.wire import codec
from diloco.transport.base import TransportClosed
from diloco.wire.messages import (
    PROTOCOL_VERSION,
    AdminReply,
    AdminRequest,
    Error,
    ErrorCode,
    Heartbeat,
    HeartbeatReply,
    Result,
    Submit,
)
from diloco.wire.zmq import (
    CoordinatorUnreachable,
    ZmqCoordinatorEndpoint,
    ZmqOptions,
    ZmqWorkerEndpoint,
    admin_request,
    peer_name,
)
from diloco.transport.zmq.options import routing_id_of

LOOPBACK = "tcp://127.0.0.1:0"


@pytest.fixture
def coordinator():
    ep = ZmqCoordinatorEndpoint(LOOPBACK)
    yield ep
    ep.close()


@pytest.fixture
def raw():
    """A raw DEALER factory for sending arbitrary frames."""
    ctx = zmq.Context()
    socks = []

    def make(address: str) -> zmq.Socket:
        s = ctx.socket(zmq.DEALER)
        s.linger = 0
        s.connect(address)
        socks.append(s)
        return s

    yield make
    for s in socks:
        s.close(0)
    ctx.term()


def send_parts(sock: zmq.Socket, frames, seq: int = 1) -> None:
    """Send codec frames the protocol-2 way: one [tag, frame] part each (SPEC.md section 11)."""
    from diloco.transport.zmq import framing

    for part in framing.parts(seq, list(frames)):
        sock.send_multipart(part)


def recv_reply(sock: zmq.Socket, timeout_s: float = 3.0):
    assert sock.poll(int(timeout_s * 1000)), "no reply"
    return codec.decode(sock.recv_multipart())


def test_bound_port_is_reported_and_messages_flow_both_ways(coordinator):
    assert coordinator.address.startswith("tcp://127.0.0.1:") and not coordinator.address.endswith(":0")
    with ZmqWorkerEndpoint(coordinator.address, label="w1") as w:
        w.send(Heartbeat("w1"))
        peer, msg, identity, *_ = coordinator.recv(3.0)
        assert msg == Heartbeat("w1") and peer == w.peer and peer.startswith("w1.")
        assert identity is None  # no keys, no identity
        params = {"a": torch.randn(1_500_000), "b": torch.tensor(3, dtype=torch.int64)}  # 6 MB: two frames
        coordinator.send(peer, Result(0, 4, "applied", 5, params))
        got = w.recv(5.0)
        assert isinstance(got, Result) and got.next_round_id == 5
        assert torch.equal(got.params["a"], params["a"]) and got.params["b"].item() == 3
        assert w.silence_s() < 1.0


def test_recv_times_out_and_never_blocks_past_the_timeout(coordinator):
    t = time.monotonic()
    assert coordinator.recv(0.2) is None
    assert 0.15 < time.monotonic() - t < 1.0
    with ZmqWorkerEndpoint(coordinator.address) as w:
        t = time.monotonic()
        assert w.recv(0.2) is None
        assert time.monotonic() - t < 1.0


def test_routing_ids_are_unique_and_peer_names_reversible():
    a, b = ZmqWorkerEndpoint("tcp://127.0.0.1:1", label="same"), ZmqWorkerEndpoint("tcp://127.0.0.1:1", label="same")
    try:
        assert a.routing_id != b.routing_id
    finally:
        a.close(), b.close()
    for rid in (b"w1.host.1.abc", b"\x00k\x8bEg", b"0xabc", b" spaced"):
        assert routing_id_of(peer_name(rid)) == rid


def test_hostile_frames_get_an_error_reply_and_are_counted(coordinator, raw):
    sock = raw(coordinator.address)
    cases = [
        ([b"\x00\x01garbage"], ErrorCode.BAD_MESSAGE),
        ([msgpack.packb({"v": PROTOCOL_VERSION + 1, "type": "Join"})], ErrorCode.PROTOCOL_VERSION),
        ([msgpack.packb({"v": PROTOCOL_VERSION, "type": "Heartbeat", "worker_id": 7})], ErrorCode.BAD_MESSAGE),
        ([msgpack.packb({"v": PROTOCOL_VERSION, "type": "Teleport"})], ErrorCode.BAD_MESSAGE),
        ([msgpack.packb({"v": PROTOCOL_VERSION, "type": "Submit", "worker_id": "w", "fragment_id": 0, "round_id": 0,
                         "wire_dtype": "fp32", "tensors": [["tensors", "t", "float32", [4], 1]]}), b"short"],
         ErrorCode.BAD_MESSAGE),
    ]
    for frames, code in cases:
        sock.send_multipart(frames)
        assert coordinator.recv(0.3) is None  # nothing reaches the coordinator's logic
        reply = recv_reply(sock)
        assert isinstance(reply, Error) and reply.code is code, reply
    # A valid message from the same socket still goes through.
    send_parts(sock, codec.encode(Heartbeat("ok")))
    peer, msg, *_ = coordinator.recv(2.0)
    assert msg == Heartbeat("ok")
    stats = coordinator.stats()
    assert stats["malformed_total"] == len(cases)
    assert stats["malformed"] == {"bad_message": 4, "protocol_version": 1}


def test_protocol_version_reply_names_both_versions(coordinator, raw):
    sock = raw(coordinator.address)
    future = PROTOCOL_VERSION + 1
    sock.send_multipart([msgpack.packb({"v": future, "type": "Join", "worker_id": "x"})])
    coordinator.recv(0.3)
    reply = recv_reply(sock)
    assert reply.code is ErrorCode.PROTOCOL_VERSION
    assert f"version {future}" in reply.detail and f"version {PROTOCOL_VERSION}" in reply.detail


def test_a_worker_of_the_previous_version_gets_a_protocol_version_error_it_can_read(coordinator, raw, monkeypatch):
    old = PROTOCOL_VERSION - 1
    sock = raw(coordinator.address)
    send_parts(sock, [msgpack.packb({"v": old, "type": "Join", "worker_id": "x", "protocol_version": old,
                                     "spec": [], "tensors": []})])
    assert coordinator.recv(0.3) is None
    assert sock.poll(3000), "no reply"
    frames = sock.recv_multipart()  # one part: [tag, header]
    assert msgpack.unpackb(frames[-1])["v"] == old  # in the old peer's own version
    monkeypatch.setattr(codec, "PROTOCOL_VERSION", old)  # decoded as that peer decodes
    reply = codec.decode(frames[-1:])
    assert isinstance(reply, Error) and reply.code is ErrorCode.PROTOCOL_VERSION and reply.in_reply_to == "Join"
    assert f"version {old}" in reply.detail and f"version {PROTOCOL_VERSION}" in reply.detail


def test_oversized_messages_are_refused_and_oversized_frames_dropped_by_libzmq(raw):
    limit = 64 * 1024
    with ZmqCoordinatorEndpoint(LOOPBACK, options=ZmqOptions(max_message_bytes=limit)) as c:
        sock = raw(c.address)
        # Frames each under the limit, together over it: the codec answers too_large.
        hdr = msgpack.packb({"v": PROTOCOL_VERSION, "type": "Submit", "worker_id": "w", "fragment_id": 0,
                             "round_id": 0, "tensors": [["tensors", "t", "uint8", [limit], 2]]})
        sock.send_multipart([hdr, bytes(limit // 2), bytes(limit // 2)])
        assert c.recv(0.3) is None
        reply = recv_reply(sock)
        assert reply.code is ErrorCode.TOO_LARGE and str(limit) in reply.detail
        # One frame over the limit: libzmq drops it and closes that connection (no reply possible).
        sock2 = raw(c.address)
        sock2.send_multipart([bytes(limit + 1)])
        assert c.recv(0.5) is None
        assert not sock2.poll(300)
        # The coordinator is unharmed.
        sock3 = raw(c.address)
        send_parts(sock3, codec.encode(Heartbeat("fine")))
        assert c.recv(2.0)[1] == Heartbeat("fine")
        deadline = time.monotonic() + 3
        while c.stats()["disconnects"] < 1 and time.monotonic() < deadline:
            c.recv(0.05)
        assert c.stats()["disconnects"] >= 1
        assert c.stats()["malformed"] == {"too_large": 1}


def test_raw_tcp_garbage_is_refused_and_counted(coordinator):
    """Not ZMTP at all: libzmq fails the handshake or (legacy ZMTP/1.0 framing) delivers junk the codec refuses."""
    import socket

    host, port = coordinator.address.removeprefix("tcp://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=2) as s:
        s.sendall(b"GET / HTTP/1.0\r\n\r\n" + bytes(range(256)))
        deadline = time.monotonic() + 3
        while True:
            st = coordinator.stats()
            if st["handshake_failures"] + st["disconnects"] + st["malformed_total"] >= 1:
                break
            assert time.monotonic() < deadline, st
            assert coordinator.recv(0.05) is None


def test_send_to_an_unknown_peer_is_dropped_and_counted(coordinator):
    coordinator.send("nobody.here.1.x", HeartbeatReply(False, 1, "running"))
    coordinator.send("0xzz-not-hex", HeartbeatReply(False, 1, "running"))
    assert coordinator.stats()["dropped_unroutable"] == 2


def test_a_worker_reconnects_to_a_restarted_coordinator_on_the_same_address():
    c1 = ZmqCoordinatorEndpoint(LOOPBACK)
    address = c1.address
    w = ZmqWorkerEndpoint(address, label="w", options=ZmqOptions(reconnect_ivl_ms=50, reconnect_ivl_max_ms=200))
    try:
        w.send(Heartbeat("w"))
        assert c1.recv(3.0)[1] == Heartbeat("w")
        c1.close()
        # While the coordinator is away the worker's messages wait; silence grows.
        w.send(Heartbeat("w"))
        assert w.recv(0.3) is None and w.silence_s() >= 0.3
        c2 = ZmqCoordinatorEndpoint(address)
        try:
            peer, msg, *_ = c2.recv(5.0)
            assert msg == Heartbeat("w") and peer == w.peer  # same routing id after the reconnect
            c2.send(peer, HeartbeatReply(True, 2, "forming", command="rejoin"))
            reply = w.recv(3.0)
            assert reply.command.value == "rejoin"
        finally:
            c2.close()
    finally:
        w.close()


def test_worker_send_never_blocks_when_its_queue_is_full():
    # Nothing listens: the queue (hwm 2) fills; further sends wait send_timeout_s, then drop and count.
    opts = ZmqOptions(dealer_sndhwm=2, send_timeout_s=0.05)
    with ZmqWorkerEndpoint("tcp://127.0.0.1:9", options=opts) as w:
        t = time.monotonic()
        for _ in range(20):
            w.send(Heartbeat("w"))
        assert time.monotonic() - t < 5.0
        assert w.counters["dropped_queue_full"] >= 10


def test_closed_endpoints_raise_transport_closed(coordinator):
    w = ZmqWorkerEndpoint(coordinator.address)
    w.close()
    w.close()  # idempotent
    with pytest.raises(TransportClosed):
        w.send(Heartbeat("w"))
    with pytest.raises(TransportClosed):
        w.recv(0.1)


def test_admin_request_to_nothing_is_unreachable_within_the_timeout():
    t = time.monotonic()
    with pytest.raises(CoordinatorUnreachable, match="within 0.5 s"):
        admin_request("tcp://127.0.0.1:9", AdminRequest("status"), timeout_s=0.5)
    assert time.monotonic() - t < 2.0


def test_admin_request_round_trip(coordinator):
    def serve_one():
        item = coordinator.recv(3.0)
        if item is not None:
            coordinator.send(item[0], AdminReply(True, {"echo": item[1].command}))

    th = threading.Thread(target=serve_one)
    th.start()
    try:
        reply = admin_request(coordinator.address, AdminRequest("status"), timeout_s=3.0)
    finally:
        th.join(5)
    assert reply == AdminReply(True, {"echo": "status"})


def test_copy_on_send_snapshots_tensors_changed_after_send(coordinator):
    opts = ZmqOptions(copy_on_send=True)
    with ZmqWorkerEndpoint(coordinator.address, options=opts) as w:
        t = torch.zeros(1000)
        w.send(Submit("w", 0, 0, {"t": t}))
        t.add_(1.0)  # in place, right after send
        w.send(Submit("w", 0, 1, {"t": t}))
        first = coordinator.recv(3.0)[1]
        second = coordinator.recv(3.0)[1]
        assert first.tensors["t"].sum().item() == 0.0
        assert second.tensors["t"].sum().item() == 1000.0


def test_worker_endpoint_is_safe_to_share_between_threads(coordinator):
    with ZmqWorkerEndpoint(coordinator.address) as w:
        stop = threading.Event()
        got = []

        def reader():
            while not stop.is_set():
                m = w.recv(0.05)
                if m is not None:
                    got.append(m)

        th = threading.Thread(target=reader)
        th.start()
        try:
            for i in range(50):
                w.send(Heartbeat(f"w{i}"))
            seen = 0
            while seen < 50:
                item = coordinator.recv(3.0)
                assert item is not None
                coordinator.send(item[0], HeartbeatReply(False, 1, "running"))
                seen += 1
            deadline = time.monotonic() + 3
            while len(got) < 50 and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            stop.set()
            th.join(3)
        assert len(got) == 50


@pytest.mark.parametrize("transport", ["zmq", "inproc"])
def test_wake_ends_a_blocked_recv_at_once_and_messages_still_flow(coordinator, transport):
    """What the worker's communication thread relies on to send a queued Submit without
    waiting out its poll: ``wake()`` from another thread returns a blocked ``recv`` (None)."""
    from diloco.transport.inproc import InprocNetwork

    if transport == "zmq":
        ep = ZmqWorkerEndpoint(coordinator.address)
    else:
        ep = InprocNetwork().connect("w")
    try:
        got: list = []
        started = time.monotonic()
        t = threading.Thread(target=lambda: got.append((ep.recv(5.0), time.monotonic() - started)))
        t.start()
        time.sleep(0.1)
        ep.wake()
        t.join(2.0)
        assert not t.is_alive() and got[0][0] is None and got[0][1] < 1.0, got
        ep.wake()
        ep.wake()  # extra wake-ups only make a recv return None early, never a message
        assert ep.recv(0.0) is None
        if transport == "zmq":
            ep.send(Heartbeat("w"))
            peer, msg, *_ = coordinator.recv(2.0)
            coordinator.send(peer, HeartbeatReply(False, 1, "running"))
            deadline = time.monotonic() + 2.0
            reply = None
            while reply is None and time.monotonic() < deadline:
                reply = ep.recv(0.5)
            assert isinstance(reply, HeartbeatReply)
    finally:
        ep.close()
    ep.wake()  # after close: a no-op, never an error
