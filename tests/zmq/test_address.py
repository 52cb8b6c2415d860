"""One parser for a ZeroMQ address's host, shared by the store, the collective endpoint and the CLI."""

from __future__ import annotations

import pytest

from diloco.collective.endpoint import _host_of
from diloco.collective.store import bind_host
from diloco.transport.zmq.address import address_host, is_loopback_address


@pytest.mark.parametrize("address, host", [
    ("tcp://10.0.0.5:5555", "10.0.0.5"), ("tcp://[::1]:5555", "::1"), ("tcp://*:5555", "*"),
    ("tcp://node-3.cluster:7000", "node-3.cluster"), ("ipc:///tmp/diloco.sock", "127.0.0.1"),
    ("127.0.0.1:5555", "127.0.0.1"),
])
def test_the_host_of_an_address(address, host):
    assert address_host(address) == host == bind_host(address)


def test_the_store_is_dialled_on_the_coordinators_host_or_on_loopback_for_a_wildcard():
    assert _host_of("tcp://10.0.0.5:5555") == "10.0.0.5"
    assert _host_of("tcp://*:5555") == _host_of("tcp://0.0.0.0:1") == _host_of(None) == "127.0.0.1"
    assert _host_of("ipc:///tmp/x") == "127.0.0.1"


@pytest.mark.parametrize("address, loopback", [
    ("tcp://127.0.0.1:5555", True), ("tcp://127.8.0.1:5555", True), ("tcp://[::1]:1", True),
    ("tcp://localhost:1", True), ("ipc:///tmp/x", True), ("tcp://0.0.0.0:5555", False),
    ("tcp://*:5555", False), ("tcp://10.0.0.5:5555", False),
])
def test_loopback_addresses(address, loopback):
    assert is_loopback_address(address) is loopback
