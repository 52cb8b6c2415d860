"""A TCP link with faults on demand, for partition tests on one machine: drop, black-hole, delay, cut one way.

    link = FaultLink(upstream=("127.0.0.1", 5555))    # listens on 127.0.0.1:<link.port>
    link.start()                                      # the worker connects to tcp://127.0.0.1:<link.port>
    link.set("blackhole")                             # packets vanish, connections stay open
    link.set("pass")                                  # heal: what was held goes through
    link.close()

Every connection a client (a worker) opens to the link's port is forwarded
to ``upstream`` (the coordinator) by one thread of this process, which
copies bytes both ways and can, at any moment:

``pass``
    forward everything (the healed state).
``drop``
    cut the link: every open connection is reset (RST) on both sides, and a
    new one is reset as soon as it is accepted; what was in flight is lost.
    Both ends see the connection fail and reconnect, and are refused until
    the heal, as when a router between them reboots or a firewall rejects.
``blackhole``
    packets vanish and connections stay open: nothing is forwarded either
    way (bytes are held, as TCP retransmission would deliver them after the
    heal), new connections are not accepted (their handshake waits in the
    listen queue) and a close is held too. Neither end learns anything but
    silence, unless its own timers give up (libzmq's link timeout, the
    heartbeat timeout).
``delay S``
    every byte and every close arrives S seconds late, each way.
``cut up`` / ``cut down``
    one direction black-holed: ``up`` what the client sends (the worker's
    heartbeats and Submits), ``down`` what it receives (the coordinator's
    replies). The other direction flows: a half-open link.

``pass`` releases what was held, in order, immediately; bytes already read
keep their release time when the delay changes. Each direction holds at most
``HOLD_BYTES`` (beyond it the link stops reading, and the sender's kernel
buffers fill: TCP back-pressure, as on a real link). No data is invented,
reordered or corrupted: a fault delays or loses whole connections' streams,
never a few bytes from the middle of one.

``python scripts/faultlink.py --listen PORT --upstream HOST:PORT`` runs one by
hand and reads modes from stdin (``drop``, ``blackhole``, ``delay 2``,
``cut up``, ``pass``).
"""

from __future__ import annotations

import argparse
import collections
import selectors
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass, field

HOLD_BYTES = 32 << 20
READ_BYTES = 1 << 16
TICK_S = 0.02
MODES = ("pass", "drop", "blackhole", "delay", "cut")
DIRECTIONS = ("up", "down")
EOF = b""  # a held close


@dataclass(frozen=True)
class Mode:
    kind: str = "pass"
    delay_s: float = 0.0
    cut: str = ""  # "up" or "down" with kind "cut"

    @classmethod
    def parse(cls, text: str) -> Mode:
        """``pass``, ``drop``, ``blackhole``, ``delay S``, ``cut up|down`` -> a Mode (ValueError otherwise)."""
        words = text.split()
        if not words or words[0] not in MODES:
            raise ValueError(f"unknown link mode {text!r}: expected one of pass, drop, blackhole, delay S, cut up|down")
        kind, rest = words[0], words[1:]
        if kind == "delay":
            if len(rest) != 1:
                raise ValueError(f"{text!r}: delay takes the seconds, e.g. 'delay 1.5'")
            delay = float(rest[0])
            if not 0 <= delay < 3600:
                raise ValueError(f"{text!r}: the delay must be within [0, 3600) s")
            return cls("delay", delay_s=delay)
        if kind == "cut":
            if rest not in (["up"], ["down"]):
                raise ValueError(f"{text!r}: cut takes a direction, 'cut up' (client to upstream) or 'cut down'")
            return cls("cut", cut=rest[0])
        if rest:
            raise ValueError(f"{text!r}: {kind} takes no argument")
        return cls(kind)

    def held(self, direction: str) -> bool:
        """True when this direction forwards nothing."""
        return self.kind == "blackhole" or (self.kind == "cut" and self.cut == direction)

    def __str__(self) -> str:
        if self.kind == "delay":
            return f"delay {self.delay_s:g}"
        if self.kind == "cut":
            return f"cut {self.cut}"
        return self.kind


@dataclass
class _Flow:
    """One direction of one connection: bytes read from ``src``, waiting to be written to ``dst``."""

    src: socket.socket
    dst: socket.socket
    direction: str
    queue: collections.deque = field(default_factory=collections.deque)  # (release monotonic, bytes | EOF)
    queued: int = 0
    read_eof: bool = False
    done: bool = False  # the held close was delivered


@dataclass
class _Pipe:
    client: socket.socket
    upstream: socket.socket
    up: _Flow = field(init=False)
    down: _Flow = field(init=False)

    def __post_init__(self) -> None:
        self.up = _Flow(self.client, self.upstream, "up")
        self.down = _Flow(self.upstream, self.client, "down")

    def flows(self) -> tuple[_Flow, _Flow]:
        return self.up, self.down


def _reset(sock: socket.socket) -> None:
    """Close with RST (SO_LINGER 0): the peer sees ECONNRESET, not an orderly end."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


class FaultLink:
    """A forwarding TCP port on 127.0.0.1 whose faults are set with ``set`` from any thread."""

    def __init__(self, upstream: tuple[str, int], port: int = 0, name: str = "link") -> None:
        self.upstream = upstream
        self.name = name
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", port))
        self._listener.listen(64)
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._mode = Mode()
        self._lock = threading.Lock()
        self._pipes: list[_Pipe] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"faultlink-{name}", daemon=True)
        #: Counters: connections forwarded, reset by ``drop``, refused while dropped; bytes forwarded per direction.
        self.stats = {"connections": 0, "reset": 0, "refused": 0, "up_bytes": 0, "down_bytes": 0}

    @property
    def address(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def mode(self) -> Mode:
        with self._lock:
            return self._mode

    def set(self, mode: str | Mode) -> Mode:
        """Change the fault now; returns the new mode."""
        new = Mode.parse(mode) if isinstance(mode, str) else mode
        with self._lock:
            self._mode = new
        return new

    def start(self) -> FaultLink:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        for pipe in self._pipes:
            pipe.client.close()
            pipe.upstream.close()
        self._pipes.clear()
        self._listener.close()

    def __enter__(self) -> FaultLink:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ the forwarding thread

    def _loop(self) -> None:
        sel = selectors.DefaultSelector()
        try:
            while not self._stop.is_set():
                mode = self.mode
                if mode.kind == "drop":
                    self._reset_all()
                self._accept()
                now = time.monotonic()
                for pipe in self._pipes:
                    for flow in pipe.flows():
                        self._write(flow, mode, now)
                self._pipes = [p for p in self._pipes if not self._finished(p)]
                self._wait_readable(sel)
        finally:
            sel.close()

    def _accept(self) -> None:
        while True:
            mode = self.mode  # read now: a connection made after a heal is never treated as before it
            if mode.kind == "blackhole":
                return  # the handshake waits in the listen queue, unanswered
            try:
                client, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            if mode.kind == "drop":
                self.stats["refused"] += 1
                _reset(client)
                continue
            try:
                upstream = socket.create_connection(self.upstream, timeout=2)
            except OSError:
                _reset(client)  # upstream down: the client sees its connection fail, as it would directly
                continue
            for s in (client, upstream):
                s.setblocking(False)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.stats["connections"] += 1
            self._pipes.append(_Pipe(client, upstream))

    def _reset_all(self) -> None:
        for pipe in self._pipes:
            _reset(pipe.client)
            _reset(pipe.upstream)
            self.stats["reset"] += 1
        self._pipes.clear()

    def _wait_readable(self, sel: selectors.BaseSelector) -> None:
        """Read whatever is ready within one tick from every flow with room to hold it."""
        for key in list(sel.get_map().values()):
            sel.unregister(key.fileobj)
        for pipe in self._pipes:
            for flow in pipe.flows():
                if not flow.read_eof and flow.queued < HOLD_BYTES:
                    sel.register(flow.src, selectors.EVENT_READ, flow)
        if not sel.get_map():
            time.sleep(TICK_S)
            return
        for key, _ in sel.select(TICK_S):
            flow: _Flow = key.data
            try:
                data = flow.src.recv(READ_BYTES)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                data = EOF  # reset by the peer: pass on a close
            current = self.mode  # as of this read: bytes read after a change take the new delay
            release = time.monotonic() + (current.delay_s if current.kind == "delay" else 0.0)
            flow.queue.append((release, data))
            flow.queued += len(data)
            if data == EOF:
                flow.read_eof = True

    def _write(self, flow: _Flow, mode: Mode, now: float) -> None:
        if flow.done or mode.held(flow.direction):
            return
        while flow.queue:
            release, data = flow.queue[0]
            if release > now:
                return
            if data == EOF:
                flow.queue.popleft()
                flow.done = True
                try:
                    flow.dst.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                return
            try:
                sent = flow.dst.send(data)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                flow.queue.clear()
                flow.queued = 0
                flow.done = True
                return
            self.stats[f"{flow.direction}_bytes"] += sent
            flow.queued -= sent
            if sent < len(data):
                flow.queue[0] = (release, data[sent:])
                return
            flow.queue.popleft()

    @staticmethod
    def _finished(pipe: _Pipe) -> bool:
        """Both directions closed and delivered, or one side gone with nothing left to deliver."""
        if pipe.up.done and pipe.down.done:
            pipe.client.close()
            pipe.upstream.close()
            return True
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--listen", type=int, default=0, help="port on 127.0.0.1 (default: any free one, printed)")
    ap.add_argument("--upstream", required=True, help="HOST:PORT to forward to (the coordinator)")
    args = ap.parse_args(argv)
    host, _, port = args.upstream.rpartition(":")
    if not host or not port.isdigit():
        ap.error(f"--upstream {args.upstream!r}: expected HOST:PORT")
    with FaultLink((host, int(port)), port=args.listen) as link:
        print(f"forwarding {link.address} -> {args.upstream}; modes on stdin: pass, drop, blackhole, "
              f"delay S, cut up|down", flush=True)
        for line in sys.stdin:
            if not line.strip():
                continue
            try:
                print(f"mode: {link.set(line.strip())}  stats: {link.stats}", flush=True)
            except ValueError as e:
                print(f"error: {e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
