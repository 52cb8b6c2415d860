"""The tags that open every ZeroMQ message diloco sends: what the other end reads before the payload.

One codec message travels as several ZeroMQ messages (``framing``), each
``[tag, payload]``. The tag says what the payload is; all integers are
little-endian::

    part    b"DLC2" seq u32, index u32, count u32                  a whole frame: frame ``index`` of ``count``
    piece   b"DLCP" seq u32, index u32, count u32, bytes u64, at u64
                                                                   bytes ``at`` .. ``at + len(payload)`` of frame
                                                                   ``index``, which is ``bytes`` long
    aside   b"DLCA" seq u32, 0 u32, 1 u32                          a one-part message between another's parts
    ack     b"DLCK" seq u32, received u64                          "of your message ``seq`` I hold ``received``
                                                                   payload bytes" (the payload is empty)

``seq`` numbers the sender's messages. A frame goes whole as one part or,
when it is bigger than what the sender's link moves in about a second
(``outbox.PartSizer``), cut into pieces in order, so that the receiver sees
bytes arrive while a big tensor crosses a thin link: libzmq hands a message
over only once it is whole, so one 16 MiB part at 50 KB/s would be 5 minutes
of silence. Acks go back the other way, so the sender learns its link's
speed from what actually arrived.
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

MAGIC = b"DLC2"
PIECE_MAGIC = b"DLCP"
ASIDE_MAGIC = b"DLCA"
ACK_MAGIC = b"DLCK"

_PART = struct.Struct("<4sIII")
_PIECE = struct.Struct("<4sIIIQQ")
_ACK = struct.Struct("<4sIQ")
TAG_BYTES = _PART.size
PIECE_TAG_BYTES = _PIECE.size
assert _ACK.size == TAG_BYTES


class Tag(NamedTuple):
    """A parsed tag. ``magic`` says which kind; the other fields as in the module docstring (an ack's
    ``received`` is in ``frame_bytes``; a part's ``frame_bytes`` is -1: its payload is the whole frame)."""

    magic: bytes
    seq: int
    index: int = 0
    count: int = 1
    frame_bytes: int = -1
    offset: int = 0


def tag(seq: int, index: int, count: int) -> bytes:
    return _PART.pack(MAGIC, seq & 0xFFFFFFFF, index, count)


def piece_tag(seq: int, index: int, count: int, frame_bytes: int, offset: int) -> bytes:
    return _PIECE.pack(PIECE_MAGIC, seq & 0xFFFFFFFF, index, count, frame_bytes, offset)


def aside_tag(seq: int) -> bytes:
    return _PART.pack(ASIDE_MAGIC, seq & 0xFFFFFFFF, 0, 1)


def ack_tag(seq: int, received: int) -> bytes:
    return _ACK.pack(ACK_MAGIC, seq & 0xFFFFFFFF, received)


def _buffer(frame: Any) -> memoryview | None:
    try:
        buf = memoryview(getattr(frame, "buffer", frame))
    except TypeError:
        return None
    return buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf


def read(frame: Any) -> Tag | None:
    """The tag ``frame`` holds, or None if it holds none (an old peer's frame, or garbage)."""
    buf = _buffer(frame)
    if buf is None:
        return None
    if buf.nbytes == TAG_BYTES:
        magic = bytes(buf[:4])
        if magic == ACK_MAGIC:
            _m, seq, received = _ACK.unpack(buf)
            return Tag(magic, seq, frame_bytes=received)
        if magic in (MAGIC, ASIDE_MAGIC):
            return Tag(*_PART.unpack(buf))
        return None
    if buf.nbytes == PIECE_TAG_BYTES and bytes(buf[:4]) == PIECE_MAGIC:
        return Tag(*_PIECE.unpack(buf))
    return None


def read_tag(frame: Any) -> tuple[int, int, int] | None:
    """(seq, index, count) of a whole part's tag, or None if ``frame`` is not one."""
    t = read(frame)
    return None if t is None or t.magic != MAGIC else (t.seq, t.index, t.count)


__all__ = ["ACK_MAGIC", "ASIDE_MAGIC", "MAGIC", "PIECE_MAGIC", "PIECE_TAG_BYTES", "TAG_BYTES", "Tag", "ack_tag",
           "aside_tag", "piece_tag", "read", "read_tag", "tag"]
