"""A worker's (or an admin client's) DEALER: frames to the coordinator, frames back.

libzmq reconnects on its own when the coordinator goes away and comes back
(a restart on the same address); messages sent meanwhile wait in the queue
(at most ``dealer_sndhwm`` parts). ``silence_s()`` reports how long the
coordinator has said nothing, for a worker that wants to act on silence.
``wake()`` ends a ``recv`` blocked in another thread at once.

With ``auth`` the socket is a CURVE client. A coordinator that refuses the
key sends nothing back through ZeroMQ itself: the socket's monitor sees the
failed handshake, and ``send``/``recv`` raise ``AuthRefused`` with a line
saying so instead of timing out.

This layer never decodes a frame: ``diloco.wire.zmq`` does.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Any

import zmq

from diloco.transport.base import AuthRefused, TransportClosed, TransportError
from diloco.transport.zmq import framing
from diloco.transport.zmq.auth import ClientAuth
from diloco.transport.zmq.options import ZmqOptions, close_socket, make_routing_id, peer_name, set_option

log = logging.getLogger("diloco.transport.zmq")


class FrameDealer:
    """A DEALER connected to the coordinator. Thread-safe (one lock around the socket)."""

    #: recv polls in slices this long so that a concurrent ``send`` waits at most this much for the lock.
    _SLICE_S = 0.01

    def __init__(self, connect: str, *, routing_id: bytes | None = None, label: str = "worker",
                 options: ZmqOptions | None = None, clock=time.monotonic, auth: ClientAuth | None = None) -> None:
        self.options = o = options or ZmqOptions()
        self.address = connect
        self.auth = auth
        self.routing_id = routing_id or make_routing_id(label)
        self._clock = clock
        self._ctx = zmq.Context(io_threads=o.io_threads)
        self._sock = self._ctx.socket(zmq.DEALER)
        self._lock = threading.Lock()
        set_option(self._sock, zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTING_ID, self.routing_id)
        set_option(self._sock, zmq.SNDHWM, o.dealer_sndhwm)
        set_option(self._sock, zmq.RCVHWM, o.dealer_rcvhwm)
        set_option(self._sock, zmq.MAXMSGSIZE, o.max_frame_bytes)
        set_option(self._sock, zmq.RECONNECT_IVL, o.reconnect_ivl_ms)
        set_option(self._sock, zmq.RECONNECT_IVL_MAX, o.reconnect_ivl_max_ms)
        set_option(self._sock, zmq.HEARTBEAT_IVL, o.zmtp_heartbeat_ivl_ms)
        set_option(self._sock, zmq.HEARTBEAT_TIMEOUT, o.zmtp_heartbeat_timeout_ms)
        self._monitor = None
        self._refused: str | None = None
        try:
            if auth is not None:
                auth.apply(self._sock)
            # Handshake failures are the only sign of a refused key or a security mismatch.
            self._monitor = self._sock.get_monitor_socket(
                zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_SUCCEEDED)
            self._sock.connect(connect)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise TransportError(f"cannot connect to {connect}: {exc}") from None
        # A wake-up pipe polled with the DEALER: ``wake()`` (any thread) ends a blocking
        # ``recv`` at once, so a thread that owns the endpoint sends what another queued
        # without waiting out its poll.
        self._wake_lock = threading.Lock()
        self._wake_rx = self._ctx.socket(zmq.PAIR)
        self._wake_tx = self._ctx.socket(zmq.PAIR)
        wake_address = f"inproc://diloco-wake-{id(self)}"
        self._wake_rx.bind(wake_address)
        self._wake_tx.connect(wake_address)
        set_option(self._wake_tx, zmq.SNDHWM, 1)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._wake_rx, zmq.POLLIN)
        self._closed = False
        self._seq = 0
        self._assembler = framing.Assembler(o.max_message_bytes, max_partials=1)
        self._last_heard = clock()
        self.counters: Counter[str] = Counter()

    @property
    def peer(self) -> str:
        return peer_name(self.routing_id)

    def silence_s(self) -> float:
        """Seconds since the last message from the coordinator (or since connecting)."""
        return self._clock() - self._last_heard

    def _check_handshake(self) -> None:
        """Raise ``AuthRefused`` once the monitor has seen the coordinator refuse our key. Call with the lock."""
        from zmq.utils.monitor import recv_monitor_message
        while self._refused is None:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except (zmq.Again, zmq.ZMQError):
                break
            kind = event.get("event")
            if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH and self.auth is not None:
                self._refused = (f"the coordinator at {self.address} refused this key ({self.auth.key_file}): "
                                 f"its public key is not in the server's auth directory")
            elif kind in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
                          zmq.EVENT_HANDSHAKE_FAILED_AUTH):
                self._refused = (
                    f"the CURVE handshake with {self.address} failed: is --server-key the coordinator's public "
                    f"key, and does the coordinator run with --auth?" if self.auth is not None else
                    f"the handshake with {self.address} failed: the coordinator requires authentication "
                    f"(pass --key and --server-key, or set DILOCO_KEY and DILOCO_SERVER_KEY)")
            elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.counters["handshakes"] += 1
        if self._refused is not None:
            raise AuthRefused(self._refused)

    def send(self, frames: list[Any], *, what: str = "a message") -> bool:
        """Queue one message's ``frames`` for the coordinator; False if dropped. Never raises because it is away.

        While the coordinator is down the message waits in the queue and goes
        out on reconnect. When the queue is full (``dealer_sndhwm`` parts:
        the coordinator has been gone a long while, or stopped reading) it
        waits up to ``send_timeout_s`` for room, then drops the message and
        counts it (``counters["dropped_queue_full"]``), like a datagram to a
        dead host: the worker notices the silence (no replies) and acts on it.
        ``what`` names the message in that warning. Raises ``AuthRefused`` if
        the coordinator refused this endpoint's key.
        """
        if self._closed:
            raise TransportClosed(f"endpoint to {self.address} is closed")
        deadline = time.monotonic() + self.options.send_timeout_s
        with self._lock:
            self._check_handshake()
            self._seq += 1
            for part in framing.parts(self._seq, frames):
                while True:
                    try:
                        self._sock.send_multipart(part, zmq.NOBLOCK, copy=False)
                        break
                    except zmq.Again:
                        pass
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        # The rest of the message is dropped; the coordinator drops the part
                        # already sent as incomplete when our next message starts.
                        self.counters["dropped_queue_full"] += 1
                        log.warning("dropped %s to %s: the send queue stayed full for %g s", what,
                                    self.address, self.options.send_timeout_s)
                        return False
                    self._sock.poll(int(min(remaining, self._SLICE_S) * 1000) + 1, zmq.POLLOUT)
            self.counters["messages_out"] += 1
        return True

    def recv(self, timeout_s: float) -> list[Any] | None:
        """The next whole message's frames from the coordinator; None after ``timeout_s`` or when woken.

        A message refused as it arrived (over the size limit) is counted in
        ``counters["malformed"]``, logged and skipped.
        """
        if self._closed:
            raise TransportClosed(f"endpoint to {self.address} is closed")
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            with self._lock:
                self._check_handshake()
                remaining = deadline - time.monotonic()
                wait_ms = max(0, int(min(remaining, self._SLICE_S) * 1000 + 0.999)) if remaining > 0 else 0
                ready = dict(self._poller.poll(wait_ms))
                if self._wake_rx in ready:
                    while True:
                        try:
                            self._wake_rx.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                    return None  # woken: the caller has something to do (see ``wake``)
                if self._sock in ready:
                    frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    self._last_heard = self._clock()
                    if len(frames) == 1 and len(frames[0].buffer) == 0:
                        continue  # the coordinator's liveness probe (``lost_peers``): nothing to read
                    got = self._assembler.add("coordinator", frames, time.monotonic())
                    if isinstance(got, framing.Complete):
                        self.counters["messages_in"] += 1
                        return got.frames
                    if isinstance(got, framing.Refused):
                        self.counters["malformed"] += 1
                        log.warning("refused a message from the coordinator at %s: %s", self.address, got.detail)
                    continue
            if time.monotonic() >= deadline:
                return None

    def wake(self) -> None:
        """End a ``recv`` blocked in another thread now (it returns None). Thread-safe, never blocks."""
        with self._wake_lock:
            if self._closed:
                return
            try:
                self._wake_tx.send(b"", zmq.NOBLOCK)
            except zmq.Again:
                pass  # a wake-up is already pending

    def close(self) -> None:
        with self._lock, self._wake_lock:
            if not self._closed:
                self._closed = True
                self._close_sockets()

    def _close_sockets(self) -> None:
        for wake in (getattr(self, "_wake_tx", None), getattr(self, "_wake_rx", None)):
            if wake is not None:
                wake.close(0)
        close_socket(self._sock, self._monitor, self._ctx)
