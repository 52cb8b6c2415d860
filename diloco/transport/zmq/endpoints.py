"""ZeroMQ endpoints: the coordinator binds a ROUTER, each worker connects a DEALER.

Frames on the wire are ``diloco.transport.codec``'s (SPEC.md section 11); a
ROUTER prepends the sender's routing id, which is how the coordinator names
peers. Every worker process picks a unique routing id (worker id, host, pid,
random suffix), so a restarted worker is a new peer and the coordinator can
tell it from a duplicated message (SPEC.md R6).

Limits (DESIGN.md section 4, "a limit on everything that grows"):

* ``max_message_bytes``: libzmq drops any single frame larger than this
  (``zmq.MAXMSGSIZE``: it closes that connection, which the monitor counts);
  the codec refuses a whole message larger than it with ``too_large``.
* high-water marks: the coordinator queues at most ``router_sndhwm`` messages
  per peer and drops (and counts) what a peer that stopped reading would
  exceed; a worker queues at most ``dealer_sndhwm`` messages while the
  coordinator is away; beyond that ``send`` drops (and counts) after
  ``send_timeout_s``: the worker sees the silence and acts on it.
* every blocking call polls with a timeout; sockets close with linger 0.

Sending is zero-copy: libzmq reads the tensors' memory after ``send``
returns, so a sender must not change a tensor in place once sent (or set
``ZmqOptions.copy_on_send``). Receiving is zero-copy for a tensor that fits
one frame (the tensor keeps the libzmq message alive).

Nothing here blocks forever, pickles, or knows what a round is.
"""

from __future__ import annotations

import logging
import os
import socket as _socket
import threading
import time
import uuid
import weakref
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from diloco.transport import codec
from diloco.transport.base import TransportClosed, TransportError
from diloco.transport.messages import AdminReply, AdminRequest, Message

log = logging.getLogger("diloco.transport.zmq")


@dataclass(frozen=True)
class ZmqOptions:
    """Socket limits and timings shared by both ends."""

    #: Largest message (and, at the libzmq level, largest frame) accepted.
    max_message_bytes: int = codec.MAX_MESSAGE_BYTES
    #: Tensors larger than this are sent as several frames (DESIGN.md section 6).
    chunk_bytes: int = codec.CHUNK_BYTES
    #: Coordinator: messages queued per peer before further ones are dropped.
    router_sndhwm: int = 256
    #: Coordinator: messages queued from all peers before libzmq stops reading sockets.
    router_rcvhwm: int = 4096
    #: Worker: messages queued towards the coordinator (while it is away, they wait here).
    dealer_sndhwm: int = 1000
    dealer_rcvhwm: int = 1024
    #: Worker: how long ``send`` waits for room in a full queue before dropping the message.
    send_timeout_s: float = 0.5
    #: Reconnect back-off of a DEALER whose coordinator went away.
    reconnect_ivl_ms: int = 100
    reconnect_ivl_max_ms: int = 1000
    #: ZMTP-level pings: a TCP peer silent this long is disconnected (and a DEALER reconnects).
    zmtp_heartbeat_ivl_ms: int = 1000
    zmtp_heartbeat_timeout_ms: int = 5000
    #: Snapshot tensors on send (one copy per tensor version), so a tensor changed in place
    #: after ``send`` cannot tear a message still queued. Off by default: ``send`` is
    #: zero-copy and the sender must not modify a tensor it sent. The coordinator and
    #: ``DilocoWorker`` always send tensors nobody modifies afterwards (fresh
    #: pseudo-gradients, copies of the params), so they pay no copy.
    copy_on_send: bool = False

    def __post_init__(self) -> None:
        for name in ("max_message_bytes", "chunk_bytes", "router_sndhwm", "router_rcvhwm", "dealer_sndhwm",
                     "dealer_rcvhwm", "reconnect_ivl_ms", "reconnect_ivl_max_ms", "zmtp_heartbeat_ivl_ms",
                     "zmtp_heartbeat_timeout_ms"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ZmqOptions.{name}={v!r} is invalid: expected an integer >= 1")
        if not (isinstance(self.send_timeout_s, (int, float)) and self.send_timeout_s > 0):
            raise ValueError(f"ZmqOptions.send_timeout_s={self.send_timeout_s!r} is invalid: expected seconds > 0")


# ------------------------------------------------------------------ helpers

def make_routing_id(label: str = "peer") -> bytes:
    """A routing id unique to this process and call: ``label.host.pid.random``, ASCII, <= 255 bytes."""
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in label)[:96] or "peer"
    host = "".join(c if c.isalnum() or c in "-_" else "_" for c in _socket.gethostname())[:64]
    return f"{safe}.{host}.{os.getpid()}.{uuid.uuid4().hex[:8]}".encode("ascii")


def peer_name(routing_id: bytes) -> str:
    """Routing id -> peer string: readable ASCII as is, anything else as ``0x<hex>`` (reversible)."""
    if routing_id and all(0x21 <= b < 0x7F for b in routing_id) and not routing_id.startswith(b"0x"):
        return routing_id.decode("ascii")
    return "0x" + routing_id.hex()


def routing_id_of(peer: str) -> bytes:
    if peer.startswith("0x"):
        return bytes.fromhex(peer[2:])
    return peer.encode("ascii")


class _SendSnapshots:
    """Copy a tensor once per version (``Tensor._version``) and hand out views of the copy.

    libzmq sends from our memory after ``send`` returns (copy=False). The
    coordinator changes its params in place at the next outer step, possibly
    while a Result for a slow reader is still queued; sending a snapshot makes
    that impossible, at the cost of one copy per tensor version, not one per
    peer (the same params go to every worker of a round).
    """

    def __init__(self) -> None:
        self._entries: dict[int, tuple[Any, int, memoryview]] = {}

    def __call__(self, t: torch.Tensor) -> memoryview:
        key = id(t)
        entry = self._entries.get(key)
        version = t._version
        if entry is not None and entry[0]() is t and entry[1] == version:
            return entry[2]
        view = codec.tensor_view(t.detach().clone())
        try:
            ref = weakref.ref(t, lambda _r, k=key, d=self._entries: d.pop(k, None))
        except TypeError:  # not weak-referenceable: do not cache
            return view
        self._entries[key] = (ref, version, view)
        return view


def _set(sock: zmq.Socket, option: int, value: int) -> None:
    try:
        sock.setsockopt(option, value)
    except (zmq.ZMQError, AttributeError):  # an option this libzmq lacks: keep its default
        log.debug("socket option %r not supported", option)


# ------------------------------------------------------------------ coordinator side

class ZmqCoordinatorEndpoint:
    """The coordinator's ROUTER. ``recv`` answers undecodable frames itself (``Error``) and counts them."""

    def __init__(self, bind: str, *, options: ZmqOptions | None = None, monitor: bool = True) -> None:
        self.options = options or ZmqOptions()
        self._ctx = zmq.Context(io_threads=1)
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._snap = _SendSnapshots() if self.options.copy_on_send else codec.tensor_view
        o = self.options
        _set(self._sock, zmq.LINGER, 0)
        _set(self._sock, zmq.ROUTER_MANDATORY, 1)  # an unknown peer raises instead of vanishing silently
        _set(self._sock, zmq.ROUTER_HANDOVER, 1)   # a reconnecting worker takes its routing id back
        _set(self._sock, zmq.SNDHWM, o.router_sndhwm)
        _set(self._sock, zmq.RCVHWM, o.router_rcvhwm)
        _set(self._sock, zmq.MAXMSGSIZE, o.max_message_bytes)
        _set(self._sock, zmq.HEARTBEAT_IVL, o.zmtp_heartbeat_ivl_ms)
        _set(self._sock, zmq.HEARTBEAT_TIMEOUT, o.zmtp_heartbeat_timeout_ms)
        self._monitor = None
        try:
            if monitor:
                self._monitor = self._sock.get_monitor_socket(
                    zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
            self._sock.bind(bind)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise TransportError(f"cannot bind {bind}: {exc}") from None
        #: The address actually bound (``tcp://127.0.0.1:0`` becomes the real port).
        self.address: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        if self._monitor is not None:
            self._poller.register(self._monitor, zmq.POLLIN)
        self._closed = False
        self.counters: Counter[str] = Counter()
        #: Undecodable messages by error code (answered with ``Error``, never seen by the coordinator).
        self.malformed: Counter[str] = Counter()

    def stats(self) -> dict:
        """Counters for ``diloco status``: traffic, malformed input, drops, connections."""
        return {
            "address": self.address,
            **{k: self.counters[k] for k in (
                "messages_in", "messages_out", "bytes_in", "bytes_out", "dropped_unroutable", "dropped_queue_full",
                "connections_accepted", "disconnects", "handshake_failures")},
            "malformed_total": sum(self.malformed.values()),
            "malformed": dict(self.malformed),
        }

    def recv(self, timeout_s: float) -> tuple[str, Message] | None:
        if self._closed:
            raise TransportClosed("coordinator endpoint is closed")
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            msg = self._recv_ready()
            if msg is not None:
                return msg
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            events = dict(self._poller.poll(max(0, int(remaining * 1000 + 0.999))))
            if self._monitor is not None and self._monitor in events:
                self._drain_monitor()
            if self._sock not in events and time.monotonic() >= deadline:
                return None

    def _recv_ready(self) -> tuple[str, Message] | None:
        """Decode queued messages until one is valid; answer and count the invalid ones."""
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return None
            rid = frames[0].bytes
            body = frames[1:]
            self.counters["messages_in"] += 1
            self.counters["bytes_in"] += codec.message_nbytes(body)
            peer = peer_name(rid)
            try:
                return peer, codec.decode(body, max_message_bytes=self.options.max_message_bytes)
            except codec.CodecError as exc:
                self.malformed[exc.code.value] += 1
                log.warning("malformed message from %s: %s", peer, exc.detail)
                self._send_frames(rid, codec.encode(codec.error_for(exc)))

    def _drain_monitor(self) -> None:
        from zmq.utils.monitor import recv_monitor_message
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError:
                return
            kind = event.get("event")
            if kind == zmq.EVENT_ACCEPTED:
                self.counters["connections_accepted"] += 1
            elif kind == zmq.EVENT_DISCONNECTED:
                self.counters["disconnects"] += 1
            else:
                self.counters["handshake_failures"] += 1

    def send(self, peer: str, message: Message) -> None:
        if self._closed:
            raise TransportClosed("coordinator endpoint is closed")
        try:
            rid = routing_id_of(peer)
        except ValueError:
            self.counters["dropped_unroutable"] += 1
            return
        self._send_frames(rid, codec.encode(message, chunk_bytes=self.options.chunk_bytes, tensor_bytes=self._snap))

    def _send_frames(self, rid: bytes, frames: list) -> None:
        try:
            self._sock.send_multipart([rid, *frames], zmq.NOBLOCK, copy=False)
        except zmq.Again:
            # The peer stopped reading and its queue is full: drop rather than stall every other peer.
            self.counters["dropped_queue_full"] += 1
            log.warning("dropped a message to %s: its send queue is full", peer_name(rid))
            return
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:  # gone (a datagram to a dead host)
                self.counters["dropped_unroutable"] += 1
                return
            raise TransportError(f"send to {peer_name(rid)} failed: {exc}") from None
        self.counters["messages_out"] += 1
        self.counters["bytes_out"] += codec.message_nbytes(frames)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._close_sockets()

    def _close_sockets(self) -> None:
        if self._monitor is not None:
            try:
                self._sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self._monitor.close(0)
        self._sock.close(0)
        self._ctx.term()

    def __enter__(self) -> "ZmqCoordinatorEndpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------ worker side

class ZmqWorkerEndpoint:
    """A DEALER connected to the coordinator. Thread-safe (one lock around the socket).

    libzmq reconnects on its own when the coordinator goes away and comes
    back (a restart on the same address); messages sent meanwhile wait in
    the queue (at most ``dealer_sndhwm``). The coordinator does not know a
    worker after its restart and answers its next heartbeat with
    ``Command.REJOIN`` (or a submission with ``unknown_worker``), which is how
    the worker re-joins. ``silence_s()`` reports how long the coordinator has
    said nothing, for a worker that wants to act on silence itself.
    """

    #: recv polls in slices this long so that a concurrent ``send`` waits at most this much for the lock.
    _SLICE_S = 0.01

    def __init__(self, connect: str, *, routing_id: bytes | None = None, label: str = "worker",
                 options: ZmqOptions | None = None, clock=time.monotonic) -> None:
        self.options = o = options or ZmqOptions()
        self.address = connect
        self.routing_id = routing_id or make_routing_id(label)
        self._clock = clock
        self._ctx = zmq.Context(io_threads=1)
        self._sock = self._ctx.socket(zmq.DEALER)
        self._snap = _SendSnapshots() if o.copy_on_send else codec.tensor_view
        self._lock = threading.Lock()
        _set(self._sock, zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTING_ID, self.routing_id)
        _set(self._sock, zmq.SNDHWM, o.dealer_sndhwm)
        _set(self._sock, zmq.RCVHWM, o.dealer_rcvhwm)
        _set(self._sock, zmq.MAXMSGSIZE, o.max_message_bytes)
        _set(self._sock, zmq.RECONNECT_IVL, o.reconnect_ivl_ms)
        _set(self._sock, zmq.RECONNECT_IVL_MAX, o.reconnect_ivl_max_ms)
        _set(self._sock, zmq.HEARTBEAT_IVL, o.zmtp_heartbeat_ivl_ms)
        _set(self._sock, zmq.HEARTBEAT_TIMEOUT, o.zmtp_heartbeat_timeout_ms)
        try:
            self._sock.connect(connect)
        except zmq.ZMQError as exc:
            self._sock.close(0)
            self._ctx.term()
            raise TransportError(f"cannot connect to {connect}: {exc}") from None
        self._closed = False
        self._last_heard = clock()
        self.counters: Counter[str] = Counter()

    @property
    def peer(self) -> str:
        return peer_name(self.routing_id)

    def silence_s(self) -> float:
        """Seconds since the last message from the coordinator (or since connecting)."""
        return self._clock() - self._last_heard

    def send(self, message: Message) -> None:
        """Queue ``message`` for the coordinator; never raises because the coordinator is away.

        While the coordinator is down the message waits in the queue and goes
        out on reconnect. When the queue is full (``dealer_sndhwm`` messages:
        the coordinator has been gone a long while, or stopped reading) it
        waits up to ``send_timeout_s`` for room, then drops the message and
        counts it (``counters["dropped_queue_full"]``), like a datagram to a
        dead host: the worker notices the silence (no replies) and acts on it.
        """
        if self._closed:
            raise TransportClosed(f"endpoint to {self.address} is closed")
        frames = codec.encode(message, chunk_bytes=self.options.chunk_bytes, tensor_bytes=self._snap)
        deadline = time.monotonic() + self.options.send_timeout_s
        while True:
            with self._lock:
                try:
                    self._sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
                    self.counters["messages_out"] += 1
                    return
                except zmq.Again:
                    pass
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self.counters["dropped_queue_full"] += 1
                    log.warning("dropped %s to %s: the send queue stayed full for %g s", type(message).__name__,
                                self.address, self.options.send_timeout_s)
                    return
                self._sock.poll(int(min(remaining, self._SLICE_S) * 1000) + 1, zmq.POLLOUT)

    def recv(self, timeout_s: float) -> Message | None:
        if self._closed:
            raise TransportClosed(f"endpoint to {self.address} is closed")
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            with self._lock:
                remaining = deadline - time.monotonic()
                wait_ms = max(0, int(min(remaining, self._SLICE_S) * 1000 + 0.999)) if remaining > 0 else 0
                if self._sock.poll(wait_ms, zmq.POLLIN):
                    frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    self._last_heard = self._clock()
                    self.counters["messages_in"] += 1
                    try:
                        return codec.decode(frames, max_message_bytes=self.options.max_message_bytes)
                    except codec.CodecError as exc:
                        self.counters["malformed"] += 1
                        log.warning("undecodable message from the coordinator at %s: %s", self.address, exc)
                        continue
            if time.monotonic() >= deadline:
                return None

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._sock.close(0)
                self._ctx.term()

    def __enter__(self) -> "ZmqWorkerEndpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------ admin

class CoordinatorUnreachable(TransportError):
    """No reply from the coordinator within the timeout."""


def admin_request(address: str, request: AdminRequest, *, timeout_s: float = 5.0,
                  options: ZmqOptions | None = None) -> AdminReply:
    """Send one admin command from a short-lived DEALER and wait for its reply.

    Raises ``CoordinatorUnreachable`` when nothing answers within
    ``timeout_s`` (libzmq connects lazily, so a dead address looks exactly like
    a silent one), and ``TransportError`` for a reply that is not an ``AdminReply``.
    """
    deadline = time.monotonic() + timeout_s
    opts = options or ZmqOptions()
    ep = ZmqWorkerEndpoint(address, label="admin", options=opts)
    try:
        ep.send(request)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CoordinatorUnreachable(f"no reply from the coordinator at {address} within {timeout_s:g} s")
            reply = ep.recv(remaining)
            if reply is None:
                continue
            if isinstance(reply, AdminReply):
                return reply
            raise TransportError(f"the coordinator at {address} answered {type(reply).__name__}: {reply}")
    finally:
        ep.close()
