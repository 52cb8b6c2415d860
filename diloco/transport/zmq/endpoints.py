"""ZeroMQ endpoints: the coordinator binds a ROUTER, each worker connects a DEALER.

Frames on the wire are ``diloco.transport.codec``'s (SPEC.md section 11); a
ROUTER prepends the sender's routing id, which is how the coordinator names
peers. Every worker process picks a unique routing id (worker id, host, pid,
random suffix), so a restarted worker is a new peer and the coordinator can
tell it from a duplicated message (SPEC.md R6).

Limits (a limit on everything that grows):

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

import zmq

from diloco.transport import codec
from diloco.transport.base import AuthRefused, TransportClosed, TransportError
from diloco.transport.messages import (
    AdminReply,
    AdminRequest,
    Error,
    ErrorCode,
    Heartbeat,
    Join,
    Leave,
    Message,
    Submit,
)
from diloco.transport.zmq import framing
from diloco.transport.zmq.auth import ClientAuth, KeyIdentity, Role, ServerAuth

log = logging.getLogger("diloco.transport.zmq")


@dataclass(frozen=True)
class ZmqOptions:
    """Socket limits and timings shared by both ends."""

    #: Largest message (and, at the libzmq level, largest frame) accepted.
    max_message_bytes: int = codec.MAX_MESSAGE_BYTES
    #: Tensors larger than this are sent as several frames (SPEC.md section 11).
    chunk_bytes: int = codec.CHUNK_BYTES
    #: Coordinator: messages queued per peer before further ones are dropped.
    router_sndhwm: int = 256
    #: Coordinator: parts queued per peer before libzmq stops reading that peer's connection.
    #: With parts of at most ``max_frame_bytes``, this bounds what libzmq holds for one peer.
    router_rcvhwm: int = 16
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
    #: libzmq's I/O threads (``zmq.Context(io_threads=...)``); CURVE encrypts and decrypts on them.
    io_threads: int = 1
    #: Coordinator: a peer whose connection closed and did not come back within this many
    #: seconds is reported lost (``lost_peers``); a reconnect inside the window is a blip.
    disconnect_grace_s: float = 1.0

    @property
    def max_frame_bytes(self) -> int:
        """The largest single frame (``ZMQ_MAXMSGSIZE``): a tensor chunk or a header, and never above the message limit."""
        return min(self.max_message_bytes, max(self.chunk_bytes, codec.MAX_HEADER_BYTES) + 64)

    def __post_init__(self) -> None:
        for name in ("max_message_bytes", "chunk_bytes", "router_sndhwm", "router_rcvhwm", "dealer_sndhwm",
                     "dealer_rcvhwm", "reconnect_ivl_ms", "reconnect_ivl_max_ms", "zmtp_heartbeat_ivl_ms",
                     "zmtp_heartbeat_timeout_ms", "io_threads"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ZmqOptions.{name}={v!r} is invalid: expected an integer >= 1")
        for name in ("send_timeout_s", "disconnect_grace_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not (isinstance(v, (int, float)) and 0 < v < float("inf")):
                raise ValueError(f"ZmqOptions.{name}={v!r} is invalid: expected seconds > 0")


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

    def __call__(self, t) -> memoryview:
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


def _close(sock: zmq.Socket, monitor: zmq.Socket | None, ctx: zmq.Context, authenticator=None) -> None:
    """Close an endpoint's socket, its monitor and authenticator, then its context (linger 0: never blocks)."""
    if monitor is not None:
        try:
            sock.disable_monitor()
        except zmq.ZMQError:
            pass
        monitor.close(0)
    sock.close(0)
    if authenticator is not None:
        authenticator.stop()
    ctx.term()


# ------------------------------------------------------------------ who may send what

#: Message types a worker key may send. Admin keys send ``AdminRequest`` only.
_WORKER_MESSAGES = (Join, Heartbeat, Submit, Leave)
#: Admin commands a worker key may run (read-only).
_WORKER_ADMIN_COMMANDS = frozenset({"status"})


def forbidden_reason(identity: KeyIdentity, message: Message) -> str | None:
    """Why ``identity``'s role may not send ``message`` (SPEC.md section 11, "Auth"), or None if it may."""
    if isinstance(message, AdminRequest):
        if identity.role is Role.ADMIN or message.command in _WORKER_ADMIN_COMMANDS:
            return None
        return (f"admin command {message.command!r} needs an admin key; {identity.describe()} may run only "
                f"{sorted(_WORKER_ADMIN_COMMANDS)}")
    if isinstance(message, _WORKER_MESSAGES) and identity.role is not Role.WORKER:
        return f"{type(message).__name__} needs a worker key; {identity.describe()} may send admin commands only"
    return None


# ------------------------------------------------------------------ coordinator side

class ZmqCoordinatorEndpoint:
    """The coordinator's ROUTER. ``recv`` answers undecodable or forbidden input itself (``Error``) and counts it.

    With ``auth`` the socket is a CURVE server: only the auth directory's keys
    connect (a ZAP authenticator on this endpoint's own context), every
    message arrives with its sender's ``KeyIdentity`` (the third element of
    ``recv``'s result), each role may send only its own messages, and routing
    ids cannot be taken over (no ``ROUTER_HANDOVER``: a second connection
    claiming a live peer's routing id is refused by libzmq).
    """

    def __init__(self, bind: str, *, options: ZmqOptions | None = None, monitor: bool = True,
                 auth: ServerAuth | None = None) -> None:
        self.options = options or ZmqOptions()
        self.auth = auth
        self._ctx = zmq.Context(io_threads=self.options.io_threads)
        self._authenticator = None
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._snap = _SendSnapshots() if self.options.copy_on_send else codec.tensor_view
        o = self.options
        _set(self._sock, zmq.LINGER, 0)
        _set(self._sock, zmq.ROUTER_MANDATORY, 1)  # an unknown peer raises instead of vanishing silently
        # Without auth a reconnecting worker takes its routing id back at once. With auth a
        # routing id must never move to another key's connection: the old connection has to
        # close first (libzmq notices within zmtp_heartbeat_timeout_ms) and the worker
        # reconnects on its own.
        _set(self._sock, zmq.ROUTER_HANDOVER, 0 if auth is not None else 1)
        _set(self._sock, zmq.SNDHWM, o.router_sndhwm)
        _set(self._sock, zmq.RCVHWM, o.router_rcvhwm)
        _set(self._sock, zmq.MAXMSGSIZE, o.max_frame_bytes)
        _set(self._sock, zmq.HEARTBEAT_IVL, o.zmtp_heartbeat_ivl_ms)
        _set(self._sock, zmq.HEARTBEAT_TIMEOUT, o.zmtp_heartbeat_timeout_ms)
        #: routing id -> when it last sent something: the peers a probe checks (``lost_peers``).
        self._heard: dict[bytes, float] = {}
        #: When to probe for peers whose connection closed (a disconnect seen, plus the grace).
        self._probe_at: float | None = None
        self._monitor = None
        try:
            if auth is not None:
                self._authenticator = auth.start_authenticator(self._ctx)
                auth.apply(self._sock)
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
        self._seq = 0
        self._assembler = framing.Assembler(self.options.max_message_bytes)
        self.counters: Counter[str] = Counter()
        #: Undecodable messages by error code (answered with ``Error``, never seen by the coordinator).
        self.malformed: Counter[str] = Counter()

    def stats(self) -> dict:
        """Counters for ``diloco status``: traffic, malformed input, drops, connections, refusals."""
        return {
            "address": self.address,
            "auth": self.auth is not None,
            **{k: self.counters[k] for k in (
                "messages_in", "messages_out", "bytes_in", "bytes_out", "dropped_unroutable", "dropped_queue_full",
                "connections_accepted", "disconnects", "handshake_failures", "auth_failures", "forbidden",
                "peers_lost")},
            "incomplete_dropped": self._assembler.incomplete_dropped,
            "partial_messages": self._assembler.partial_count,
            "malformed_total": sum(self.malformed.values()),
            "malformed": dict(self.malformed),
        }

    def recv(self, timeout_s: float) -> tuple[str, Message] | tuple[str, Message, KeyIdentity] | None:
        """The next (peer, message), or (peer, message, identity) with auth; None after ``timeout_s``."""
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

    def _recv_ready(self):
        """Assemble and decode queued parts until a message is whole and valid; answer the invalid ones."""
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return None
            rid = frames[0].bytes
            self._remember(rid)
            peer = peer_name(rid)
            self.counters["bytes_in"] += codec.message_nbytes(frames[1:])
            identity = None
            if self.auth is not None:
                user_id = frames[-1].get("User-Id") if len(frames) > 1 else None
                identity = self.auth.identity(user_id)
                if identity is None:  # the authenticator let it in, so this cannot happen; never trust it
                    self.counters["auth_failures"] += 1
                    continue
            got = self._assembler.add(peer, frames[1:], time.monotonic())
            if got is None:
                continue
            if isinstance(got, framing.Refused):
                self.malformed[got.code] += 1
                log.warning("refused a message from %s as it arrived: %s", peer, got.detail)
                self._send_frames(rid, codec.encode(Error(ErrorCode(got.code), got.detail)))
                continue
            self.counters["messages_in"] += 1
            try:
                message = codec.decode(got.frames, max_message_bytes=self.options.max_message_bytes)
            except codec.CodecError as exc:
                self.malformed[exc.code.value] += 1
                log.warning("malformed message from %s: %s", peer, exc.detail)
                self._send_frames(rid, codec.encode(codec.error_for(exc)), legacy=got.legacy)
                continue
            if got.legacy:
                # A message of this protocol version that did not come as parts: refused, so that
                # every message the coordinator accepts went through the size check as it arrived.
                detail = (f"{type(message).__name__} came as one multipart message; protocol version "
                          f"{codec.PROTOCOL_VERSION} sends each frame as a part [tag, frame] (SPEC.md section 11)")
                self.malformed[ErrorCode.BAD_MESSAGE.value] += 1
                self._send_frames(rid, codec.encode(Error(ErrorCode.BAD_MESSAGE, detail, type(message).__name__)),
                                  legacy=True)
                continue
            if identity is None:
                return peer, message
            why = forbidden_reason(identity, message)
            if why is not None:
                self.counters["forbidden"] += 1
                log.warning("refused %s from %s (%s): %s", type(message).__name__, peer, identity.name, why)
                self._send_frames(rid, codec.encode(Error(ErrorCode.FORBIDDEN, why, type(message).__name__)))
                continue
            return peer, message, identity

    #: Most peers remembered for probing; the longest silent are forgotten first.
    MAX_REMEMBERED_PEERS = 100_000

    def _remember(self, rid: bytes) -> None:
        heard = self._heard
        heard.pop(rid, None)
        heard[rid] = time.monotonic()  # insertion order = order of last message
        if len(heard) > self.MAX_REMEMBERED_PEERS:
            del heard[next(iter(heard))]

    def lost_peers(self) -> list[str]:
        """Peers whose connection closed and did not come back within ``disconnect_grace_s``.

        libzmq does not say *which* peer a closed connection was (the socket
        monitor names only a file descriptor), so a closed connection schedules
        a probe ``disconnect_grace_s`` later: an empty message to every peer
        heard from. With ``ROUTER_MANDATORY`` a send to a routing id that has no
        connection fails at once (``EHOSTUNREACH``): that peer is lost, reported
        once. A worker whose process dies (``kill -9`` closes its socket at once)
        is reported about a second after; one whose connection blips and comes
        back within the window (libzmq reconnects a DEALER after 100 ms) answers
        the probe's send and is not. Receivers ignore an empty message.
        """
        if self._probe_at is None or time.monotonic() < self._probe_at:
            return []
        self._probe_at = None
        lost = []
        for rid in list(self._heard):
            try:
                self._sock.send(rid, zmq.SNDMORE | zmq.NOBLOCK)
                self._sock.send(b"", zmq.NOBLOCK)
            except zmq.Again:
                continue  # connected, just slow: its queue is full
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EHOSTUNREACH:
                    raise TransportError(f"probe of {peer_name(rid)} failed: {exc}") from None
                del self._heard[rid]
                self._assembler.forget(peer_name(rid))
                lost.append(peer_name(rid))
        self.counters["peers_lost"] += len(lost)
        return lost

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
                if self._probe_at is None:
                    self._probe_at = time.monotonic() + self.options.disconnect_grace_s
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self.counters["auth_failures"] += 1
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

    def _send_frames(self, rid: bytes, frames: list, *, legacy: bool = False) -> None:
        """Send one message as parts (``framing``); ``legacy``: as one multipart message (an old peer's reply)."""
        self._seq += 1
        messages = [frames] if legacy else framing.parts(self._seq, frames)
        for part in messages:
            try:
                self._sock.send_multipart([rid, *part], zmq.NOBLOCK, copy=False)
            except zmq.Again:
                # The peer stopped reading and its queue is full: drop rather than stall every other
                # peer (the rest of a message cut here is dropped by the receiver as incomplete).
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
        _close(self._sock, self._monitor, self._ctx, self._authenticator)

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

    With ``auth`` the socket is a CURVE client. A coordinator that refuses
    the key sends nothing back through ZeroMQ itself: the socket's monitor
    sees the failed handshake, and ``send``/``recv`` raise ``AuthRefused``
    with a line saying so instead of timing out.
    """

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
        self._snap = _SendSnapshots() if o.copy_on_send else codec.tensor_view
        self._lock = threading.Lock()
        _set(self._sock, zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTING_ID, self.routing_id)
        _set(self._sock, zmq.SNDHWM, o.dealer_sndhwm)
        _set(self._sock, zmq.RCVHWM, o.dealer_rcvhwm)
        _set(self._sock, zmq.MAXMSGSIZE, o.max_frame_bytes)
        _set(self._sock, zmq.RECONNECT_IVL, o.reconnect_ivl_ms)
        _set(self._sock, zmq.RECONNECT_IVL_MAX, o.reconnect_ivl_max_ms)
        _set(self._sock, zmq.HEARTBEAT_IVL, o.zmtp_heartbeat_ivl_ms)
        _set(self._sock, zmq.HEARTBEAT_TIMEOUT, o.zmtp_heartbeat_timeout_ms)
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
        _set(self._wake_tx, zmq.SNDHWM, 1)
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

    def send(self, message: Message) -> None:
        """Queue ``message`` for the coordinator; never raises because the coordinator is away.

        While the coordinator is down the message waits in the queue and goes
        out on reconnect. When the queue is full (``dealer_sndhwm`` parts:
        the coordinator has been gone a long while, or stopped reading) it
        waits up to ``send_timeout_s`` for room, then drops the message and
        counts it (``counters["dropped_queue_full"]``), like a datagram to a
        dead host: the worker notices the silence (no replies) and acts on it.
        Raises ``AuthRefused`` if the coordinator refused this endpoint's key.
        """
        if self._closed:
            raise TransportClosed(f"endpoint to {self.address} is closed")
        frames = codec.encode(message, chunk_bytes=self.options.chunk_bytes, tensor_bytes=self._snap)
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
                        log.warning("dropped %s to %s: the send queue stayed full for %g s", type(message).__name__,
                                    self.address, self.options.send_timeout_s)
                        return
                    self._sock.poll(int(min(remaining, self._SLICE_S) * 1000) + 1, zmq.POLLOUT)
            self.counters["messages_out"] += 1

    def recv(self, timeout_s: float) -> Message | None:
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
                        try:
                            return codec.decode(got.frames, max_message_bytes=self.options.max_message_bytes)
                        except codec.CodecError as exc:
                            self.counters["malformed"] += 1
                            log.warning("undecodable message from the coordinator at %s: %s", self.address, exc)
                    elif isinstance(got, framing.Refused):
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
        _close(self._sock, self._monitor, self._ctx)

    def __enter__(self) -> "ZmqWorkerEndpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------ admin

class CoordinatorUnreachable(TransportError):
    """No reply from the coordinator within the timeout."""


def admin_request(address: str, request: AdminRequest, *, timeout_s: float = 5.0,
                  options: ZmqOptions | None = None, auth: ClientAuth | None = None) -> AdminReply:
    """Send one admin command from a short-lived DEALER and wait for its reply.

    Raises ``CoordinatorUnreachable`` when nothing answers within
    ``timeout_s`` (libzmq connects lazily, so a dead address looks exactly like
    a silent one), ``AuthRefused`` when the coordinator refuses the key, and
    ``TransportError`` for a reply that is neither an ``AdminReply`` nor an
    ``Error``. An ``Error`` reply (a forbidden command, a malformed request)
    comes back as ``AdminReply(ok=False, error="<code>: <detail>")``.
    """
    deadline = time.monotonic() + timeout_s
    opts = options or ZmqOptions()
    ep = ZmqWorkerEndpoint(address, label="admin", options=opts, auth=auth)
    try:
        ep.send(request)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CoordinatorUnreachable(f"no reply from the coordinator at {address} within {timeout_s:g} s")
            reply = ep.recv(min(remaining, 0.1))
            if reply is None:
                continue
            if isinstance(reply, AdminReply):
                return reply
            if isinstance(reply, Error):
                code = reply.code.value if isinstance(reply.code, ErrorCode) else str(reply.code)
                return AdminReply(False, {}, f"{code}: {reply.detail}")
            raise TransportError(f"the coordinator at {address} answered {type(reply).__name__}: {reply}")
    finally:
        ep.close()
