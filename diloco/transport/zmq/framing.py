"""Parts: how one codec message travels as several ZeroMQ messages, and is bounded as it arrives.

libzmq delivers a multipart message only when its last frame has arrived,
so a peer could make the coordinator buffer any number of frames (each under
``ZMQ_MAXMSGSIZE``) before a single byte of it could be checked. Instead,
each of a message's codec frames (``diloco.wire.codec``: the msgpack
header, then the tensor frames) goes as its own two-frame ZeroMQ message,
a *part*::

    [tag, payload]      tag = b"DLC2" + seq (u32) + index (u32) + count (u32), little-endian

``seq`` numbers the sender's messages, ``index`` is the part's place in
its message (0 is the header) and ``count`` the message's number of parts.
The receiver assembles a peer's parts in order (one ZeroMQ connection keeps
order) and checks the running size against ``max_message_bytes`` as each
part arrives: past it, the parts held are freed at once, the rest of that
message is skipped as it arrives, and the sender is answered ``too_large``.
So a peer holds at most one message being assembled (at most
``max_message_bytes``) plus what libzmq queues for it (``RCVHWM`` parts of
at most ``ZMQ_MAXMSGSIZE`` each). A sender that gives up half-way through a
message (a full queue) leaves an incomplete message, which the receiver
drops when that peer's next message starts.

Anything that does not carry a tag is handed back whole as a *legacy*
message (protocol version 1 sent a message as one multipart message), so
that the decoder can answer an old peer with a ``protocol_version`` error it
can read.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

MAGIC = b"DLC2"
_TAG = struct.Struct("<4sIII")
TAG_BYTES = _TAG.size
#: Most parts one message may have (a header plus tensor frames; the codec's own limit is far above real models).
MAX_PARTS = 1 << 20


def tag(seq: int, index: int, count: int) -> bytes:
    return _TAG.pack(MAGIC, seq & 0xFFFFFFFF, index, count)


def parts(seq: int, frames: Sequence[Any]) -> Iterator[list]:
    """The ZeroMQ messages (each ``[tag, payload]``) that carry one codec message's ``frames``."""
    n = len(frames)
    for i, frame in enumerate(frames):
        yield [tag(seq, i, n), frame]


def read_tag(frame: Any) -> tuple[int, int, int] | None:
    """(seq, index, count) of a tag frame, or None if ``frame`` is not a tag."""
    try:
        buf = memoryview(getattr(frame, "buffer", frame))
    except TypeError:
        return None
    if buf.nbytes != TAG_BYTES:
        return None
    magic, seq, index, count = _TAG.unpack(buf.cast("B") if buf.format != "B" else buf)
    if magic != MAGIC:
        return None
    return seq, index, count


def nbytes(frame: Any) -> int:
    buf = getattr(frame, "buffer", None)
    if buf is not None:
        return buf.nbytes
    return memoryview(frame).nbytes


def total_nbytes(frames: Iterator[Any] | Sequence[Any]) -> int:
    """Bytes in ``frames`` (``zmq.Frame`` objects or buffers)."""
    return sum(nbytes(f) for f in frames)


@dataclass
class _Partial:
    seq: int
    count: int
    #: When its latest part arrived: a message that keeps arriving is never dropped for its age.
    last_part_s: float
    frames: list = field(default_factory=list)
    size: int = 0
    #: True once the message went over the limit: its remaining parts are skipped.
    dropping: bool = False


@dataclass(frozen=True, slots=True)
class Complete:
    """A whole message's codec frames; ``legacy`` when they came as one multipart message, not as parts."""

    frames: list
    legacy: bool = False


@dataclass(frozen=True, slots=True)
class Refused:
    """A message refused while arriving. ``code`` is an ``ErrorCode`` value; answer it once."""

    code: str
    detail: str


class Assembler:
    """Per-peer assembly of parts, with a size limit checked as parts arrive.

    ``add(peer, zmq_frames, now_s)`` takes one received ZeroMQ message and
    returns ``Complete`` (a whole message), ``Refused`` (answer the peer) or
    None (more parts to come, or a part skipped). Memory: at most one partial
    message per peer, at most ``max_partials`` peers at once (the oldest is
    dropped beyond that), none whose last part came more than ``partial_timeout_s``
    ago: the limit is on silence, not on the transfer's total time, so a 1 GB message
    crossing a slow link for minutes is kept as long as its parts keep coming.
    """

    def __init__(self, max_message_bytes: int, *, max_partials: int = 1024, partial_timeout_s: float = 120.0) -> None:
        self.max_message_bytes = max_message_bytes
        self.max_partials = max_partials
        self.partial_timeout_s = partial_timeout_s
        self._partials: dict[str, _Partial] = {}
        #: Incomplete messages dropped (the sender gave up half-way, timed out, or too many at once).
        self.incomplete_dropped = 0

    @property
    def partial_count(self) -> int:
        return len(self._partials)

    @property
    def partial_bytes(self) -> int:
        return sum(p.size for p in self._partials.values())

    def add(self, peer: str, zmq_frames: Sequence[Any], now_s: float) -> Complete | Refused | None:
        if len(zmq_frames) != 2 or (t := read_tag(zmq_frames[0])) is None:
            # Not a part: an old peer's whole message (or garbage), for the decoder to judge.
            self._drop(peer)
            return Complete(list(zmq_frames), legacy=True)
        seq, index, count = t
        payload = zmq_frames[1]
        partial = self._partials.get(peer)
        if index == 0:
            if partial is not None:
                self._drop(peer)
            if not 1 <= count <= MAX_PARTS:
                return Refused("bad_message", f"part tag: a message of {count} parts; expected 1..{MAX_PARTS}")
            partial = _Partial(seq, count, now_s)
            if count > 1:
                self._make_room(now_s)
                self._partials[peer] = partial
        elif partial is None or partial.seq != seq or (index != len(partial.frames) and not partial.dropping):
            # A part of a message whose start we never kept (refused at its first part), or out of
            # order (impossible on one connection): skip it, and drop any other message it interrupts.
            if partial is not None:
                self._drop(peer)
            return None
        if partial.dropping:
            if index == partial.count - 1:
                del self._partials[peer]
            return None
        partial.last_part_s = now_s
        partial.size += nbytes(payload)
        if partial.size > self.max_message_bytes:
            partial.frames.clear()  # free what was held at once
            if index == partial.count - 1:
                self._partials.pop(peer, None)
            else:
                partial.dropping = True
            return Refused("too_large", f"message {seq} grew past max_message_bytes={self.max_message_bytes} at "
                                        f"part {index} of {partial.count}; it was dropped as it arrived")
        partial.frames.append(payload)
        if len(partial.frames) < partial.count:
            return None
        self._partials.pop(peer, None)
        return Complete(partial.frames)

    def forget(self, peer: str) -> None:
        self._partials.pop(peer, None)

    def _drop(self, peer: str) -> None:
        if self._partials.pop(peer, None) is not None:
            self.incomplete_dropped += 1

    def _make_room(self, now_s: float) -> None:
        stale = [p for p, part in self._partials.items() if now_s - part.last_part_s > self.partial_timeout_s]
        for p in stale:
            self._drop(p)
        while len(self._partials) >= self.max_partials:
            self._drop(next(iter(self._partials)))


__all__ = ["Assembler", "Complete", "Refused", "MAGIC", "TAG_BYTES", "MAX_PARTS", "parts", "read_tag", "tag"]
