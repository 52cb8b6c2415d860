"""Fast death detection (SPEC.md R7): a closed connection, not a heartbeat timeout, reports a worker gone.

A closed connection (the socket monitor) makes the endpoint probe, after
``disconnect_grace_s``, every peer it has heard from; a routing id with no
connection then is a lost peer.
"""

from __future__ import annotations

import re
import time

import pytest
import zmq

from diloco.wire import codec
from diloco.wire.messages import Heartbeat
from diloco.wire.zmq import ZmqCoordinatorEndpoint, ZmqOptions
from diloco.transport.zmq.framing import parts


def _dealer(ctx, address: str, rid: bytes) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.routing_id = rid
    sock.connect(address)
    return sock


def _send(sock, message) -> None:
    for p in parts(1, codec.encode(message)):
        sock.send_multipart(p)


def _wait_lost(ep, deadline_s: float) -> list[str]:
    deadline = time.monotonic() + deadline_s
    lost: list[str] = []
    while time.monotonic() < deadline and not lost:
        ep.recv(0.05)
        lost = ep.lost_peers()
    return lost


def test_a_closed_connection_is_a_lost_peer_after_the_grace_window():
    ctx = zmq.Context()
    with ZmqCoordinatorEndpoint("tcp://127.0.0.1:0", options=ZmqOptions(disconnect_grace_s=0.5)) as ep:
        sock = _dealer(ctx, ep.address, b"w1.test")
        _send(sock, Heartbeat("w1"))
        peer, msg, *_ = ep.recv(5.0)
        assert peer == "w1.test" and msg == Heartbeat("w1")
        closed_at = time.monotonic()
        sock.close(0)
        lost = _wait_lost(ep, 5.0)
        lost_after = time.monotonic() - closed_at
        assert lost == ["w1.test"]
        # Not inside the grace window: judged by when it came (a starved test thread only makes that
        # later), not by a poll of the first 0.3 s that a late wake-up could stretch past the window.
        assert 0.5 <= lost_after < 3.0, lost_after
        assert ep.lost_peers() == []  # reported once
        assert ep.stats()["peers_lost"] == 1
    ctx.term()


def test_a_reconnect_within_the_grace_window_is_not_a_death():
    ctx = zmq.Context()
    with ZmqCoordinatorEndpoint("tcp://127.0.0.1:0", options=ZmqOptions(disconnect_grace_s=1.0)) as ep:
        sock = _dealer(ctx, ep.address, b"w1.blip")
        _send(sock, Heartbeat("w1"))
        assert ep.recv(5.0) is not None
        sock.disconnect(ep.address)  # the connection drops ...
        time.sleep(0.1)
        sock.connect(ep.address)     # ... and the same socket (same routing id) comes back
        _send(sock, Heartbeat("w1"))
        assert ep.recv(5.0)[1] == Heartbeat("w1")
        assert _wait_lost(ep, 2.0) == []
        stats = ep.stats()
        assert stats["disconnects"] >= 1 and stats["peers_lost"] == 0
        # The probe reached the live socket as an empty message, which receivers ignore.
        assert sock.poll(1000) and sock.recv_multipart() == [b""]
        sock.close(0)
    ctx.term()


@pytest.mark.slow
def test_a_killed_worker_is_declared_gone_in_seconds_not_at_the_heartbeat_timeout(cluster):
    server = cluster.server("--min-workers", "1", heartbeat_timeout_s=120.0)
    cluster.worker("w1")
    w2 = cluster.worker("w2")
    cluster.wait_status(lambda s: len(s["members"]) == 2 and s["rounds_applied"] >= 2, 120, "two members")
    killed_at = time.monotonic()
    w2.kill9()
    st = cluster.wait_status(lambda s: {m["worker_id"] for m in s["members"]} == {"w1"}, 20, "w2 gone")
    took = time.monotonic() - killed_at
    assert took < 10.0, took  # the heartbeat timeout is 120 s
    assert re.search(r"left\s+w2 \(crashed\)", server.output())
    assert st["transport"]["peers_lost"] >= 1
    # The survivor goes on.
    cluster.wait_status(lambda s: s["rounds_applied"] >= st["rounds_applied"] + 2, 60, "more rounds")
