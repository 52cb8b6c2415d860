"""ZeroMQ socket limits and timings, routing ids, and the two socket chores both ends share."""

from __future__ import annotations

import logging
import math
import os
import socket as _socket
import uuid
from dataclasses import dataclass, field

import zmq

from diloco.transport.limits import CHUNK_BYTES, MAX_HEADER_BYTES, MAX_MESSAGE_BYTES
from diloco.transport.zmq.outbox import MIN_PART_BYTES, PART_TIME_S

log = logging.getLogger("diloco.transport.zmq")

#: ``zmtp_heartbeat_timeout_ms`` by default (``diloco server|worker --link-timeout``, in seconds).
DEFAULT_LINK_TIMEOUT_MS = 30_000
#: ``partial_timeout_s`` by default: an incomplete message silent this long is dropped.
DEFAULT_PARTIAL_TIMEOUT_S = 120.0
#: Environment variable that sets ``partial_timeout_s`` (seconds) for every endpoint of the process:
#: a test can shorten the limit without waiting minutes (tests/zmq/test_slow_link.py).
PARTIAL_TIMEOUT_ENV = "DILOCO_PARTIAL_TIMEOUT_S"


#: Environment variable that sets ``max_partial_bytes`` (MiB) for every endpoint of the process.
MAX_PARTIAL_ENV = "DILOCO_MAX_PARTIAL_MB"


def memory_bytes() -> int:
    """The memory this process may use: the machine's, or its cgroup's limit when lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < total:
            total = int(text)
    return total


def _max_partial_bytes_from_env() -> int:
    text = os.environ.get(MAX_PARTIAL_ENV)
    if text is None or not text.strip():
        return memory_bytes() // 2
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise ValueError(f"{MAX_PARTIAL_ENV}={text!r} is invalid: expected MiB > 0")
    return int(value * (1 << 20))


def _partial_timeout_from_env() -> float:
    text = os.environ.get(PARTIAL_TIMEOUT_ENV)
    if text is None or not text.strip():
        return DEFAULT_PARTIAL_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise ValueError(f"{PARTIAL_TIMEOUT_ENV}={text!r} is invalid: expected seconds > 0")
    return value


@dataclass(frozen=True)
class ZmqOptions:
    """Socket limits and timings shared by both ends."""

    #: Largest message (and, at the libzmq level, largest frame) accepted.
    max_message_bytes: int = MAX_MESSAGE_BYTES
    #: Tensors larger than this are sent as several frames (SPEC.md section 11); also the largest part.
    chunk_bytes: int = CHUNK_BYTES
    #: Smallest part a frame is cut into on a thin link, and the part size until the receiver's first
    #: ack tells the link's speed (``outbox.PartSizer``; SPEC.md section 11, "Parts on thin links").
    min_part_bytes: int = MIN_PART_BYTES
    #: What one part should take on the link: parts are sized to what it delivered in this long.
    part_time_s: float = PART_TIME_S
    #: Coordinator: parts handed to libzmq per peer; beyond them a message's rest waits in the endpoint
    #: (a message of more parts, or one for a slow reader), and a message for a peer that has this
    #: many parts waiting behind the one going out (it stopped reading) is dropped.
    router_sndhwm: int = 256
    #: Worker: parts queued towards the coordinator behind the message going out, not yet handed to
    #: libzmq (while it is away, they wait here); a message is taken whole while fewer wait, however
    #: many parts it has.
    dealer_sndhwm: int = 1000
    #: Worker: parts handed to libzmq at a time. The rest wait in the endpoint, where a heartbeat can
    #: pass them, so it waits behind at most the part on the wire and these.
    dealer_pipe_parts: int = 1
    dealer_rcvhwm: int = 1024
    #: Worker: how long ``send`` waits for room in a full queue before dropping the message.
    send_timeout_s: float = 0.5
    #: Reconnect back-off of a DEALER whose coordinator went away.
    reconnect_ivl_ms: int = 100
    reconnect_ivl_max_ms: int = 1000
    #: ZMTP-level pings: a TCP peer that delivers no whole frame for ``zmtp_heartbeat_timeout_ms``
    #: after a ping is disconnected (and a DEALER reconnects). libzmq counts a frame only once it
    #: has fully arrived, and a peer's pong queues behind the frame it is sending: the timeout must
    #: outlast one frame (``chunk_bytes``, 16 MiB) on the slowest link, shared by every stream on it.
    #: 30 s needs about 4.5 Mbit/s per stream; ``--link-timeout`` raises it for slower links.
    zmtp_heartbeat_ivl_ms: int = 1000
    zmtp_heartbeat_timeout_ms: int = DEFAULT_LINK_TIMEOUT_MS
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
    #: An incomplete message none of whose parts came for this many seconds is dropped: a limit on
    #: silence, not on the transfer's age (``framing.Assembler``). Default 120 s, or
    #: ``$DILOCO_PARTIAL_TIMEOUT_S``.
    partial_timeout_s: float = field(default_factory=_partial_timeout_from_env)
    #: Coordinator: most bytes all incomplete messages together may hold (each part counted at
    #: ``framing.part_cost``), never less than ``max_message_bytes``; beyond it the ones silent
    #: longest are dropped (``framing.Assembler``). Default half of the memory this process may
    #: use (the machine's, or its cgroup's limit), or ``$DILOCO_MAX_PARTIAL_MB``.
    max_partial_bytes: int = field(default_factory=_max_partial_bytes_from_env)
    #: Coordinator: most incomplete messages at once, all peers together (each peer has at most
    #: one). ``max_partial_bytes`` is the bound on memory; this one bounds the bookkeeping, and is
    #: high enough that a flood of connections that start messages displaces nobody else's: 1,100
    #: such peers pushed every worker's Submit out of a limit of 1,024 until the flood ended.
    max_partials: int = 65_536
    #: Coordinator, with keys: incomplete messages one key may hold at once, per worker id it may
    #: hold (``workers/NAME.max_ids``). One worker has one at a time; two cover a restarted
    #: worker whose old connection is not yet found gone.
    partials_per_key_id: int = 2

    @property
    def max_frame_bytes(self) -> int:
        """The largest single frame (``ZMQ_MAXMSGSIZE``): a tensor chunk or a header, and never above the message limit."""
        return min(self.max_message_bytes, max(self.chunk_bytes, MAX_HEADER_BYTES) + 64)

    def __post_init__(self) -> None:
        for name in ("max_message_bytes", "chunk_bytes", "min_part_bytes", "router_sndhwm", "dealer_sndhwm",
                     "dealer_pipe_parts", "dealer_rcvhwm", "reconnect_ivl_ms", "reconnect_ivl_max_ms", "zmtp_heartbeat_ivl_ms",
                     "zmtp_heartbeat_timeout_ms", "io_threads", "max_partial_bytes", "max_partials",
                     "partials_per_key_id"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ZmqOptions.{name}={v!r} is invalid: expected an integer >= 1")
        for name in ("send_timeout_s", "disconnect_grace_s", "partial_timeout_s", "part_time_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not (isinstance(v, (int, float)) and 0 < v < float("inf")):
                raise ValueError(f"ZmqOptions.{name}={v!r} is invalid: expected seconds > 0")


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


def set_option(sock: zmq.Socket, option: int, value: int) -> None:
    try:
        sock.setsockopt(option, value)
    except (zmq.ZMQError, AttributeError):  # an option this libzmq lacks: keep its default
        log.debug("socket option %r not supported", option)


def close_socket(sock: zmq.Socket, monitor: zmq.Socket | None, ctx: zmq.Context, authenticator=None) -> None:
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
