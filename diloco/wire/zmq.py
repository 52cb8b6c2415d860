"""Messages over ZeroMQ: the transport's frames through this package's codec.

``ZmqCoordinatorEndpoint`` and ``ZmqWorkerEndpoint`` are what the
coordinator and a worker hold (``diloco.wire.endpoints``'s interfaces). The
sockets, parts, limits and reconnects are the transport's
(``diloco.transport.zmq``: a ``FrameRouter`` and a ``FrameDealer``); what a
frame means is decided here: decoding (SPEC.md section 11), answering what
cannot be decoded with ``Error``, and who may send what when keys are in use.

Sending is zero-copy: libzmq reads the tensors' memory after ``send``
returns, so a sender must not change a tensor in place once sent (or set
``ZmqOptions.copy_on_send``). Receiving is zero-copy for a tensor that fits
one frame (the tensor keeps the libzmq message alive); a tensor of several
frames is copied into one buffer as its frames arrive (``framing.Coalescer``)
and handed out without a further copy.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import Counter
from typing import Any

from diloco.transport.arrival import Arrival
from diloco.transport.base import AuthRefused, TransportError
from diloco.transport.zmq import framing
from diloco.transport.zmq.auth import ClientAuth, KeyIdentity, Role, ServerAuth
from diloco.transport.zmq.dealer import FrameDealer
from diloco.transport.zmq.options import ZmqOptions, make_routing_id, peer_name
from diloco.transport.zmq.router import FrameRouter
from diloco.wire import codec, frame_plan
from diloco.wire.measure import SubmitSquares
from diloco.wire.messages import (
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

log = logging.getLogger("diloco.transport.zmq")


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


class _TensorRuns:
    """The transport's ``framing.Coalescer``: a tensor sent in several frames (chunks) is assembled into
    one buffer as its frames arrive, so that ``codec.decode`` hands it out without a copy; and a
    Submit's fp32 tensors are measured for the coordinator's checks as they arrive (``measure``)."""

    plan = staticmethod(frame_plan.plan_runs)
    watch = staticmethod(SubmitSquares.for_header)

    @staticmethod
    def allocate(nbytes: int):
        from diloco.wire import buffers  # torch and numpy: not for messages without tensors

        return buffers.empty_bytes(nbytes)


_TENSOR_RUNS = _TensorRuns()


def _tensor_bytes(options: ZmqOptions):
    return _SendSnapshots() if options.copy_on_send else codec.tensor_view


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

    With ``auth`` the socket is a CURVE server (see ``FrameRouter``): every
    message arrives with its sender's ``KeyIdentity`` (``recv``'s ``Arrival.identity``,
    None without auth) and each role may send only its own messages.
    """

    def __init__(self, bind: str, *, options: ZmqOptions | None = None, monitor: bool = True,
                 auth: ServerAuth | None = None) -> None:
        self.frames = FrameRouter(bind, options=options, monitor=monitor, auth=auth, coalescer=_TENSOR_RUNS)
        self.options = self.frames.options
        self.auth = auth
        #: The address actually bound (``tcp://127.0.0.1:0`` becomes the real port).
        self.address: str = self.frames.address
        self._tensor_bytes = _tensor_bytes(self.options)
        #: Undecodable messages by error code (answered with ``Error``, never seen by the coordinator).
        self.malformed: Counter[str] = Counter()
        #: Messages a key's role may not send (answered with ``Error(forbidden)``).
        self.forbidden = 0

    def stats(self) -> dict:
        """Counters for ``diloco status``: traffic, malformed input, drops, connections, refusals."""
        return {
            **self.frames.stats(),
            "forbidden": self.forbidden,
            "malformed_total": sum(self.malformed.values()),
            "malformed": dict(self.malformed),
        }

    def recv(self, timeout_s: float) -> Arrival | None:
        """The next ``Arrival`` (its ``identity`` is None without auth); None after ``timeout_s``."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            arrival = self.frames.recv(max(0.0, deadline - time.monotonic()))
            if arrival is None:
                return None
            received = self._accept(arrival)
            if received is not None:
                return received

    def _accept(self, arrival) -> Arrival | None:
        """Decode one peer's frames and check who sent it; answer and drop what cannot be accepted."""
        peer, got, identity = arrival.peer, arrival.got, arrival.identity
        if isinstance(got, framing.Refused):
            self.malformed[got.code] += 1
            log.warning("refused a message from %s as it arrived: %s", peer, got.detail)
            self.frames.send(peer, codec.encode(Error(ErrorCode(got.code), got.detail)))
            return None
        try:
            message = codec.decode(got.frames, max_message_bytes=self.options.max_message_bytes)
        except codec.CodecError as exc:
            self.malformed[exc.code.value] += 1
            log.warning("malformed message from %s: %s", peer, exc.detail)
            self.frames.send(peer, codec.encode(codec.error_for(exc), version=exc.reply_version), legacy=got.legacy)
            return None
        if got.legacy:
            # A message of this protocol version that did not come as parts: refused, so that
            # every message the coordinator accepts went through the size check as it arrived.
            detail = (f"{type(message).__name__} came as one multipart message; protocol version "
                      f"{codec.PROTOCOL_VERSION} sends each frame as a part [tag, frame] (SPEC.md section 11)")
            self.malformed[ErrorCode.BAD_MESSAGE.value] += 1
            self.frames.send(peer, codec.encode(Error(ErrorCode.BAD_MESSAGE, detail, type(message).__name__)),
                             legacy=True)
            return None
        if identity is None:
            return Arrival(peer, message, measured=got.watch)
        why = forbidden_reason(identity, message)
        if why is not None:
            self.forbidden += 1
            log.warning("refused %s from %s (%s): %s", type(message).__name__, peer, identity.name, why)
            self.frames.send(peer, codec.encode(Error(ErrorCode.FORBIDDEN, why, type(message).__name__)))
            return None
        return Arrival(peer, message, identity, got.watch)

    def lost_peers(self) -> list[str]:
        """Peers whose connection closed and did not come back (``FrameRouter.lost_peers``)."""
        return self.frames.lost_peers()

    def arriving_peers(self) -> list[str]:
        """Peers whose message is arriving part by part since the last call (``FrameRouter.arriving_peers``)."""
        return self.frames.arriving_peers()

    def send(self, peer: str, message: Message) -> None:
        frames = codec.encode(message, chunk_bytes=self.options.chunk_bytes, tensor_bytes=self._tensor_bytes)
        self.frames.send(peer, frames)

    def close(self) -> None:
        self.frames.close()

    def __enter__(self) -> "ZmqCoordinatorEndpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------ worker side

class ZmqWorkerEndpoint:
    """A DEALER connected to the coordinator (``FrameDealer``), speaking messages. Thread-safe.

    The coordinator does not know a worker after its restart and answers its
    next heartbeat with ``Command.REJOIN`` (or a submission with
    ``unknown_worker``), which is how the worker re-joins. A message from the
    coordinator that cannot be decoded is counted (``counters["malformed"]``),
    logged and skipped.
    """

    def __init__(self, connect: str, *, routing_id: bytes | None = None, label: str = "worker",
                 options: ZmqOptions | None = None, clock=time.monotonic, auth: ClientAuth | None = None) -> None:
        self.frames = FrameDealer(connect, routing_id=routing_id, label=label, options=options, clock=clock,
                                  auth=auth, coalescer=_TENSOR_RUNS)
        self.options = self.frames.options
        self.address = connect
        self.auth = auth
        self.routing_id = self.frames.routing_id
        self.counters = self.frames.counters
        self._tensor_bytes = _tensor_bytes(self.options)

    @property
    def peer(self) -> str:
        return self.frames.peer

    def silence_s(self) -> float:
        """Seconds since the last message from the coordinator (or since connecting)."""
        return self.frames.silence_s()

    def sending(self) -> bool:
        """True while a message sent is still going out part by part (``FrameDealer.sending``)."""
        return self.frames.sending()

    def receiving(self) -> bool:
        """True while a message from the coordinator is arriving part by part (``FrameDealer.receiving``)."""
        return self.frames.receiving()

    def send(self, message: Message) -> None:
        """Queue ``message`` for the coordinator (``FrameDealer.send``: dropped and counted if the queue stays full).

        A ``Heartbeat`` goes as an aside: between the parts of a big message still going out,
        not behind all of it, so that the coordinator hears from this worker while its Submit
        crosses a slow link (SPEC.md section 11, "Frames"). Nothing else may pass: a Leave
        or a Join must not overtake a Submit sent before it.
        """
        frames = codec.encode(message, chunk_bytes=self.options.chunk_bytes, tensor_bytes=self._tensor_bytes)
        self.frames.send(frames, what=type(message).__name__, aside=type(message) is Heartbeat)

    def recv(self, timeout_s: float) -> Message | None:
        """The next message from the coordinator, or None after ``timeout_s`` (or when woken)."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            frames = self.frames.recv(max(0.0, deadline - time.monotonic()))
            if frames is None:
                return None
            try:
                return codec.decode(frames, max_message_bytes=self.options.max_message_bytes)
            except codec.CodecError as exc:
                self.counters["malformed"] += 1
                log.warning("undecodable message from the coordinator at %s: %s", self.address, exc)
            if time.monotonic() >= deadline:
                return None

    def wake(self) -> None:
        """End a ``recv`` blocked in another thread now (it returns None). Thread-safe, never blocks."""
        self.frames.wake()

    def close(self) -> None:
        self.frames.close()

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
    ep = ZmqWorkerEndpoint(address, label="admin", options=options or ZmqOptions(), auth=auth)
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


__all__ = [
    "AuthRefused",
    "CoordinatorUnreachable",
    "ZmqCoordinatorEndpoint",
    "ZmqOptions",
    "ZmqWorkerEndpoint",
    "admin_request",
    "forbidden_reason",
    "make_routing_id",
    "peer_name",
]
