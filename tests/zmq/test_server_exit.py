"""A stopped server lets go at once: it stays only until every connected worker has heard the stop
(``diloco/coordinator/stop_notice.py``), at most its linger (3 heartbeat intervals), and a server
started right after on the same address binds."""

from __future__ import annotations

import time

import torch

from diloco.testing import join_message
from diloco.wire.messages import AdminRequest, Command, Heartbeat, HeartbeatReply, Welcome
from diloco.wire.zmq import ZmqWorkerEndpoint, admin_request

#: 30 s: workers beat every 7.5 s, and a stopped server lingers at most 22.5 s for a silent one.
HEARTBEAT_TIMEOUT_S = 30.0
LINGER_S = 3 * HEARTBEAT_TIMEOUT_S / 4


def _shutdown(address: str, kind: str = "abort") -> None:
    reply = admin_request(address, AdminRequest("shutdown", {"kind": kind}), timeout_s=10.0)
    assert reply.ok, reply


def test_with_no_worker_the_server_exits_at_once_and_its_address_is_free_again(cluster):
    server = cluster.server(heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
    address = cluster.address
    t = time.monotonic()
    _shutdown(address)
    assert server.wait_exit(LINGER_S - 5) == 0
    assert time.monotonic() - t < LINGER_S - 5  # well before its linger: nobody was to be told
    again = cluster.server(bind=address, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
    assert cluster.address == address
    _shutdown(address)
    assert again.wait_exit(LINGER_S - 5) == 0


def test_the_server_stays_until_its_worker_heard_the_stop_then_exits(cluster):
    server = cluster.server(heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
    with ZmqWorkerEndpoint(cluster.address, label="w1") as worker:
        worker.send(join_message("w1", {"w": torch.zeros(8)}))
        assert isinstance(worker.recv(30.0), Welcome)
        _shutdown(cluster.address)
        time.sleep(2.0)
        assert server.alive()  # w1 has not heard the stop: the server waits for its heartbeat
        worker.send(Heartbeat("w1"))
        reply = worker.recv(10.0)
        assert isinstance(reply, HeartbeatReply) and reply.command is Command.STOP
        t = time.monotonic()
        assert server.wait_exit(LINGER_S - 5) == 0
        assert time.monotonic() - t < LINGER_S - 5
