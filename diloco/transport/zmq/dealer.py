"""A worker's (or an admin client's) DEALER: frames to the coordinator, frames back.

libzmq reconnects on its own when the coordinator goes away and comes back
(a restart on the same address); messages sent meanwhile wait in the queue
(at most ``dealer_sndhwm`` parts). ``silence_s()`` reports how long the
coordinator has said nothing, for a worker that wants to act on silence.
``wake()`` ends a ``recv`` blocked in another thread at once.

Big messages do not hold small ones up. libzmq sends a connection's
messages in order, so a heartbeat handed to it behind a 1 GB Submit would
wait for the whole of it -- minutes on a slow link, long past the
coordinator's heartbeat timeout. Instead the messages wait in an
``framing.Outbox`` and libzmq gets at most ``dealer_pipe_parts`` parts at a
time; a message sent with ``aside=True`` (heartbeats) goes out before the
next part of the one in progress, as an *aside* the coordinator delivers
without dropping the interrupted message (``framing``). So a heartbeat waits
behind at most the part on the wire and ``dealer_pipe_parts`` more. Parts
are handed over by whichever thread holds the socket: ``send``, ``recv``
(polled for room while parts wait), or, when neither runs, a short-lived
background thread that does the same until the outbox is empty. ``sending()`` and ``receiving()`` tell whether a message is still
going out or coming in part by part.

With ``auth`` the socket is a CURVE client. A coordinator that refuses the
key sends nothing back through ZeroMQ itself: the socket's monitor sees the
failed handshake, and ``send``/``recv`` raise ``AuthRefused`` with a line
saying so instead of timing out.

This layer never decodes a frame: ``diloco.wire.zmq`` does.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter, deque
from typing import Any

import zmq

from diloco.transport.base import AuthRefused, TransportClosed, TransportError
from diloco.transport.zmq import framing, tags
from diloco.transport.zmq.auth import ClientAuth
from diloco.transport.zmq.outbox import Outbox, PartSizer
from diloco.transport.zmq.options import ZmqOptions, close_socket, make_routing_id, peer_name, set_option

log = logging.getLogger("diloco.transport.zmq")


class FrameDealer:
    """A DEALER connected to the coordinator. Thread-safe (one lock around the socket)."""

    #: recv polls in slices this long so that a concurrent ``send`` waits at most this much for the lock.
    _SLICE_S = 0.01

    def __init__(self, connect: str, *, routing_id: bytes | None = None, label: str = "worker",
                 options: ZmqOptions | None = None, clock=time.monotonic, auth: ClientAuth | None = None,
                 coalescer: framing.Coalescer | None = None) -> None:
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
        # libzmq's own queue stays short: the rest waits in the outbox, where an aside can pass it.
        set_option(self._sock, zmq.SNDHWM, o.dealer_pipe_parts)
        set_option(self._sock, zmq.RCVHWM, o.dealer_rcvhwm)
        set_option(self._sock, zmq.MAXMSGSIZE, o.max_frame_bytes)
        set_option(self._sock, zmq.RECONNECT_IVL, o.reconnect_ivl_ms)
        set_option(self._sock, zmq.RECONNECT_IVL_MAX, o.reconnect_ivl_max_ms)
        set_option(self._sock, zmq.HEARTBEAT_IVL, o.zmtp_heartbeat_ivl_ms)
        set_option(self._sock, zmq.HEARTBEAT_TIMEOUT, o.zmtp_heartbeat_timeout_ms)
        self._monitor = None
        self._refused: str | None = None
        self._failed_handshakes = 0  # in a row, since the last one that succeeded
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
        self._assembler = framing.Assembler(o.max_message_bytes, max_partials=1,
                                            partial_timeout_s=o.partial_timeout_s, coalescer=coalescer,
                                            track_progress=False)  # only the coordinator acts on progress
        #: How big a part may be: what the link to the coordinator moves in ``part_time_s`` (``outbox``).
        self.sizer = PartSizer(o.min_part_bytes, o.chunk_bytes, o.part_time_s)
        self._outbox = Outbox(self.sizer)
        #: Whole messages the background sender read while it waited for room (``recv`` hands them out).
        self._inbox: deque[list] = deque()
        self._pumper: threading.Thread | None = None
        self._last_heard = clock()
        self.counters: Counter[str] = Counter()

    @property
    def peer(self) -> str:
        return peer_name(self.routing_id)

    def silence_s(self) -> float:
        """Seconds since the last message from the coordinator (or since connecting)."""
        return self._clock() - self._last_heard

    def sending(self) -> bool:
        """True while parts of a message sent still wait to be handed to libzmq (a big one on a slow link)."""
        return bool(self._outbox)

    def receiving(self) -> bool:
        """True while a message from the coordinator has arrived in part, its other parts still coming."""
        return self._assembler.arriving("coordinator", time.monotonic())

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
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                # The connection broke during the handshake (reset or closed: the value is an errno). That is
                # what a network fault, a proxy resetting connections or a coordinator going down look like,
                # so it is no refusal: libzmq reconnects and the worker's --coordinator-timeout bounds the
                # wait. A CURVE client with the wrong --server-key sees the same (the server just closes),
                # which the warning names.
                self._failed_handshakes += 1
                self.counters["handshake_failures"] += 1
                if self._failed_handshakes in (3, 30, 300, 3000):
                    log.warning("the handshake with %s failed %d times in a row (%s)%s", self.address,
                                self._failed_handshakes, os.strerror(event.get("value") or 0) or "closed",
                                ": a network fault, or a --server-key that is not the coordinator's public key"
                                if self.auth is not None else ": a network fault; retrying")
            elif kind in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_AUTH):
                self._refused = (
                    f"the CURVE handshake with {self.address} failed: is --server-key the coordinator's public "
                    f"key, and does the coordinator run with --auth?" if self.auth is not None else
                    f"the handshake with {self.address} failed: the coordinator requires authentication "
                    f"(pass --key and --server-key, or set DILOCO_KEY and DILOCO_SERVER_KEY)")
            elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.counters["handshakes"] += 1
                self._failed_handshakes = 0
        if self._refused is not None:
            raise AuthRefused(self._refused)

    def send(self, frames: list[Any], *, what: str = "a message", aside: bool = False) -> bool:
        """Queue one message's ``frames`` for the coordinator; False if dropped. Never raises because it is away.

        While the coordinator is down the message waits in the queue and goes
        out on reconnect. When the queue is full (``dealer_sndhwm`` parts
        waiting behind the message in progress: the coordinator has been gone
        a long while, or stopped reading) it waits up to ``send_timeout_s``
        for room, then drops the message and counts it
        (``counters["dropped_queue_full"]``), like a datagram to a dead host:
        the worker notices the silence (no replies) and acts on it. A message
        is taken whole or not at all, whatever its size. ``aside``: a
        one-frame message (a heartbeat) that may go out between the parts of
        one sent before it. ``what`` names the message in that warning.
        Raises ``AuthRefused`` if the coordinator refused this endpoint's key.
        """
        if self._closed:
            raise TransportClosed(f"endpoint to {self.address} is closed")
        deadline = time.monotonic() + self.options.send_timeout_s
        with self._lock:
            self._check_handshake()
            while self._outbox.parts_behind >= self.options.dealer_sndhwm:
                self._pump()
                if self._outbox.parts_behind < self.options.dealer_sndhwm:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self.counters["dropped_queue_full"] += 1
                    log.warning("dropped %s to %s: the send queue stayed full for %g s", what,
                                self.address, self.options.send_timeout_s)
                    return False
                self._sock.poll(int(min(remaining, self._SLICE_S) * 1000) + 1, zmq.POLLOUT)
            self._seq += 1
            if aside and len(frames) == 1:
                self._outbox.put([[tags.aside_tag(self._seq), frames[0]]], framing.total_nbytes(frames), what,
                                 aside=True)
            else:
                self._outbox.put_frames(self._seq, frames, framing.total_nbytes(frames), what)
            self._pump()
            self._ensure_pumper()
        return True

    def _ensure_pumper(self) -> None:
        """Parts still waiting and nobody to hand them over: start the background sender. Call with the lock."""
        if self._outbox and self._pumper is None:
            self._pumper = threading.Thread(target=self._pump_in_background, daemon=True,
                                            name=f"diloco-send-{self.peer[:40]}")
            self._pumper.start()

    def _pump(self) -> None:
        """Hand libzmq the outbox's next parts until its queue is full. Call with the lock."""
        while (part := self._outbox.peek()) is not None:
            between = self._outbox.mid_message
            try:
                self._sock.send_multipart(part, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            done = self._outbox.advance(time.monotonic())
            if done is not None and done.what != "ack":
                self.counters["messages_out"] += 1
                if between and done.parts is not None:
                    self.counters["asides_between_parts"] += 1

    def _pump_in_background(self) -> None:
        """Keep handing parts over while nobody calls ``send`` or ``recv``; ends once the outbox is empty."""
        while True:
            with self._lock:
                if self._closed or not self._outbox:
                    self._pumper = None
                    return
                try:
                    self._pump()
                    if self._outbox:
                        # Room in libzmq's queue wakes this at once; the slice bounds how long a
                        # send or recv in another thread waits for the lock. What arrives meanwhile
                        # is read too: the coordinator's acks size the parts still to go.
                        if self._sock.poll(int(self._SLICE_S * 1000), zmq.POLLOUT | zmq.POLLIN) & zmq.POLLIN:
                            frames = self._take(self._sock.recv_multipart(zmq.NOBLOCK, copy=False))
                            if frames is not None:
                                self._inbox.append(frames)
                        self._pump()
                except zmq.ZMQError as exc:  # the socket is unusable: the owner's next call will say so
                    log.warning("sending to %s stopped: %s", self.address, exc)
                    self._pumper = None
                    return
            time.sleep(0)  # a thread waiting for the lock takes it now

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
                if self._inbox:
                    return self._inbox.popleft()
                if self._outbox:
                    self._pump()
                # Parts still waiting: wake for room in libzmq's queue too, to hand the next one over.
                self._poller.register(self._sock, zmq.POLLIN | (zmq.POLLOUT if self._outbox else 0))
                remaining = deadline - time.monotonic()
                wait_ms = max(0, int(min(remaining, self._SLICE_S) * 1000 + 0.999)) if remaining > 0 else 0
                ready = dict(self._poller.poll(wait_ms))
                if ready.get(self._sock, 0) & zmq.POLLOUT:
                    self._pump()
                if self._wake_rx in ready:
                    while True:
                        try:
                            self._wake_rx.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                    return None  # woken: the caller has something to do (see ``wake``)
                if ready.get(self._sock, 0) & zmq.POLLIN:
                    frames = self._take(self._sock.recv_multipart(zmq.NOBLOCK, copy=False))
                    if frames is not None:
                        return frames
                    continue
            if time.monotonic() >= deadline:
                return None

    def _take(self, zmq_frames: list) -> list | None:
        """One ZeroMQ message from the coordinator: a whole message's frames, or None (a part, an ack, a
        probe, a refusal). Acks what is arriving. Call with the lock."""
        self._last_heard = self._clock()
        if len(zmq_frames) == 1 and len(zmq_frames[0].buffer) == 0:
            return None  # the coordinator's liveness probe (``lost_peers``): nothing to read
        now = time.monotonic()
        got = self._assembler.add("coordinator", zmq_frames, now)
        ack = self._assembler.take_ack()
        if ack is not None:
            self._outbox.put([[tags.ack_tag(*ack), b""]], 0, "ack", aside=True)
            self._pump()
            self._ensure_pumper()
        if isinstance(got, framing.Acked):
            self.sizer.acked(got.seq, got.received, now)
        elif isinstance(got, framing.Complete):
            self.counters["messages_in"] += 1
            return got.frames
        elif isinstance(got, framing.Refused):
            self.counters["malformed"] += 1
            log.warning("refused a message from the coordinator at %s: %s", self.address, got.detail)
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
                self._outbox.clear()  # linger 0: what was not sent is dropped, as libzmq drops its queue
                self._close_sockets()

    def _close_sockets(self) -> None:
        for wake in (getattr(self, "_wake_tx", None), getattr(self, "_wake_rx", None)):
            if wake is not None:
                wake.close(0)
        close_socket(self._sock, self._monitor, self._ctx)
