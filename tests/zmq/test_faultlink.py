"""The fault-injecting link the partition tests and the chaos soak put between workers and the coordinator.

Checked against a plain echo server: each mode does what the partition
tests rely on (``scripts/faultlink.py``), so a partition test that passes
does so because of the fault, not because the link never applied it.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from faultlink import FaultLink, Mode  # noqa: E402


@pytest.fixture
def echo():
    """An echo server on loopback: (host, port)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    stop = threading.Event()

    def serve(conn):
        with conn:
            while True:
                try:
                    data = conn.recv(65536)
                except OSError:
                    return
                if not data:
                    return
                conn.sendall(data)

    def accept():
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield server.getsockname()
    stop.set()
    t.join(2)
    server.close()


def connect(link: FaultLink, timeout: float = 2.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", link.port), timeout=timeout)


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            break
        out += chunk
    return out


def test_pass_forwards_both_ways(echo):
    with FaultLink(echo) as link, connect(link) as s:
        payload = bytes(range(256)) * 4096  # 1 MiB
        threading.Thread(target=s.sendall, args=(payload,), daemon=True).start()
        assert recv_exactly(s, len(payload)) == payload


def test_blackhole_holds_everything_and_the_heal_delivers_it_in_order(echo):
    with FaultLink(echo) as link, connect(link) as s:
        s.sendall(b"before")
        assert recv_exactly(s, 6) == b"before"
        link.set("blackhole")
        s.sendall(b"during")
        s.settimeout(0.5)
        with pytest.raises(socket.timeout):
            s.recv(10)
        # A new connection is not accepted upstream: nothing comes back on it either.
        with connect(link) as s2:
            s2.sendall(b"new")
            s2.settimeout(0.3)
            with pytest.raises(socket.timeout):
                s2.recv(10)
            link.set("pass")
            s2.settimeout(2)
            assert recv_exactly(s2, 3) == b"new"
        s.settimeout(2)
        assert recv_exactly(s, 6) == b"during"


def test_drop_resets_open_connections_and_refuses_new_ones_until_the_heal(echo):
    with FaultLink(echo) as link:
        s = connect(link)
        s.sendall(b"x")
        assert recv_exactly(s, 1) == b"x"
        link.set("drop")
        time.sleep(0.2)
        with pytest.raises((ConnectionResetError, BrokenPipeError)):
            s.sendall(b"y")
            s.recv(1) or (_ for _ in ()).throw(ConnectionResetError())
        s.close()
        s2 = connect(link)
        s2.settimeout(2)
        with pytest.raises((ConnectionResetError, BrokenPipeError)):
            s2.sendall(b"z")
            s2.recv(1) or (_ for _ in ()).throw(ConnectionResetError())
        s2.close()
        link.set("pass")
        with connect(link) as s3:
            s3.sendall(b"ok")
            assert recv_exactly(s3, 2) == b"ok"
        assert link.stats["reset"] >= 1 and link.stats["refused"] >= 1


def test_delay_holds_each_byte_for_the_delay(echo):
    with FaultLink(echo) as link, connect(link, timeout=5) as s:
        link.set("delay 0.4")
        t0 = time.monotonic()
        s.sendall(b"ping")
        assert recv_exactly(s, 4) == b"ping"
        assert time.monotonic() - t0 >= 0.75  # 0.4 s each way


@pytest.mark.parametrize("direction", ["up", "down"])
def test_cut_holds_one_direction_only(echo, direction):
    with FaultLink(echo) as link, connect(link) as s:
        link.set(f"cut {direction}")
        s.sendall(b"abc")
        s.settimeout(0.4)
        with pytest.raises(socket.timeout):
            s.recv(3)
        # Which side holds the bytes: upstream's counter moves only when "up" flows.
        assert (link.stats["up_bytes"] == 0) == (direction == "up")
        link.set("pass")
        s.settimeout(2)
        assert recv_exactly(s, 3) == b"abc"


def test_bad_modes_are_refused_precisely():
    for text, words in (("flood", "unknown link mode"), ("delay", "takes the seconds"), ("delay -1", "within"),
                        ("cut sideways", "takes a direction"), ("drop 3", "takes no argument")):
        with pytest.raises(ValueError, match=words):
            Mode.parse(text)
    assert str(Mode.parse("delay 1.5")) == "delay 1.5" and Mode.parse("cut down").held("down")
