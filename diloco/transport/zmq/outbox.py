"""The sender's side of parts: what waits to be handed to libzmq, and how big each part may be.

``Outbox`` holds a sender's messages not yet handed to libzmq and gives them
out one part at a time, asides first (``framing``). A message's frames are
cut into parts only as each part is handed over, at the size its
``PartSizer`` allows *then*: a frame no bigger goes whole (a ``tags.tag``
part), a bigger one in pieces (``tags.piece_tag``), zero-copy slices of the
frame's memory.

``PartSizer`` sizes parts to what the link moves in ``part_time_s``
(default 1 s), measured from what arrived, not from what was handed over:
the receiver acks each big message as its bytes come in (``tags.ack_tag``,
at most every ``ACK_INTERVAL_S``, and once it is whole), and the sizer takes
``received / (now - the message's first hand-over)`` as the link's rate.
That is a lower bound whatever the buffers between the two ends hold (the
kernel's, a proxy's: they swallow megabytes at once, so hand-overs alone
would say a 50 KB/s link is fast), and so the parts err small. Until an ack
says otherwise a part is ``min_part_bytes`` (64 KiB): about a second at
50 KB/s; on loopback the first ack comes back within milliseconds and parts
are ``max_part_bytes`` (the codec's 16 MiB chunks) from then on.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Sequence

from diloco.transport.limits import CHUNK_BYTES
from diloco.transport.zmq import tags

#: Smallest part a frame is cut into (SPEC.md section 11, "Parts on thin links").
MIN_PART_BYTES = 64 << 10
#: What one part should take on the link: well within every limit on silence (the ZMTP link
#: timeout, 30 s; the incomplete-message limit, 120 s; the heartbeat timeout, 30 s).
PART_TIME_S = 1.0
#: A receiver acks a message of at least this many bytes, at most this often while it arrives, and
#: once it is whole.
ACK_MIN_BYTES = MIN_PART_BYTES
ACK_INTERVAL_S = 0.05


class PartSizer:
    """How big the next part to one peer may be: what the link moved in ``part_time_s``, from acks.

    ``started(seq, now)`` when a message's first part is handed over; ``acked(seq, received, now)``
    for each ack. The rate is the latest ack's ``received / (now - started)``: a message that
    waited on the sender, or a receiver busy elsewhere, only makes it lower (smaller parts).
    """

    #: Messages whose start is remembered (acks for older ones are ignored).
    REMEMBERED = 16

    def __init__(self, min_part_bytes: int = MIN_PART_BYTES, max_part_bytes: int = CHUNK_BYTES,
                 part_time_s: float = PART_TIME_S) -> None:
        if not (min_part_bytes > 0 and max_part_bytes > 0 and part_time_s > 0):
            raise ValueError(f"part sizes and time must be > 0: min_part_bytes={min_part_bytes}, "
                             f"max_part_bytes={max_part_bytes}, part_time_s={part_time_s}")
        self.min_part_bytes = min(min_part_bytes, max_part_bytes)
        self.max_part_bytes = max_part_bytes
        self.part_time_s = part_time_s
        #: Bytes per second the link delivered, at least (None until the first ack).
        self.rate: float | None = None
        self._started: OrderedDict[int, float] = OrderedDict()

    def part_bytes(self) -> int:
        if self.rate is None:
            return self.min_part_bytes
        return max(self.min_part_bytes, min(self.max_part_bytes, int(self.rate * self.part_time_s)))

    def started(self, seq: int, now_s: float) -> None:
        self._started[seq & 0xFFFFFFFF] = now_s
        while len(self._started) > self.REMEMBERED:
            self._started.popitem(last=False)

    def acked(self, seq: int, received: int, now_s: float) -> None:
        start = self._started.get(seq)
        if start is None or received <= 0:
            return
        self.rate = received / max(now_s - start, 1e-6)


@dataclass(slots=True)
class Queued:
    """One message in an ``Outbox``: parts made ahead (``parts``: asides, acks, legacy messages) or
    frames cut into parts as they are handed over (``frames``), and how far it went out."""

    parts: list | None
    nbytes: int
    what: str = ""
    frames: list | None = None
    seq: int = 0
    #: What goes before the tag in every part (the router's routing id).
    prefix: tuple = ()
    #: Parts handed over (``parts``), or the frame being cut and the bytes of it handed over (``frames``).
    sent: int = 0
    offset: int = 0
    #: The part ``peek`` named, its payload's bytes and whether it ends its frame, until ``advance``.
    pending: tuple | None = field(default=None)

    @property
    def count(self) -> int:
        return len(self.parts) if self.parts is not None else len(self.frames)


def _byte_view(frame: Any) -> memoryview:
    buf = memoryview(getattr(frame, "buffer", frame))
    return buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf


class Outbox:
    """A sender's messages not yet handed to libzmq, given out one part at a time: asides first.

    The owner hands libzmq the part ``peek`` names while its queue has room and
    calls ``advance`` for each one it took, so that libzmq never holds more than
    its send limit and what waits here can still be reordered: an aside put here
    goes out before the next part of the message in progress. Everything else
    keeps its order. ``parts`` counts frames waiting (a frame cut in pieces is one).
    """

    def __init__(self, sizer: PartSizer | None = None) -> None:
        self.sizer = sizer
        self._asides: deque[Queued] = deque()
        self._messages: deque[Queued] = deque()
        #: Frames (or parts made ahead) waiting here.
        self.parts = 0

    def __bool__(self) -> bool:
        return self.parts > 0

    def put(self, parts: Sequence[list], nbytes: int, what: str = "", *, aside: bool = False) -> None:
        """A message as parts made ahead (an aside, an ack, an old peer's reply): handed over as they are."""
        queued = Queued(list(parts), nbytes, what)
        if not queued.parts:
            return
        (self._asides if aside else self._messages).append(queued)
        self.parts += len(queued.parts)

    def put_frames(self, seq: int, frames: Sequence[Any], nbytes: int, what: str = "", *,
                   prefix: tuple = ()) -> None:
        """A codec message's ``frames``, cut into parts as they are handed over (module docstring)."""
        if not frames:
            return
        self._messages.append(Queued(None, nbytes, what, list(frames), seq, prefix))
        self.parts += len(frames)

    def peek(self) -> list | None:
        """The next part to hand over (an aside's whole, or the current message's next part), or None."""
        if self._asides:
            return self._asides[0].parts[0]
        if not self._messages:
            return None
        head = self._messages[0]
        if head.parts is not None:
            return head.parts[head.sent]
        if head.pending is None:
            head.pending = self._cut(head)
        return head.pending[0]

    def _cut(self, head: Queued) -> tuple[list, int, bool]:
        frame = head.frames[head.sent]
        buf = _byte_view(frame)
        size = buf.nbytes
        limit = self.sizer.part_bytes() if self.sizer is not None else size
        if head.offset == 0 and size <= limit:
            return [*head.prefix, tags.tag(head.seq, head.sent, len(head.frames)), frame], size, True
        n = min(limit, size - head.offset)
        piece = buf[head.offset:head.offset + n]
        return ([*head.prefix, tags.piece_tag(head.seq, head.sent, len(head.frames), size, head.offset), piece], n,
                head.offset + n == size)

    def advance(self, now_s: float = 0.0) -> Queued | None:
        """The part ``peek`` named went out (at ``now_s``): its message if that was the last of it, else None."""
        queue = self._asides if self._asides else self._messages
        head = queue[0]
        if head.parts is not None:
            head.parts[head.sent] = None  # libzmq holds it now: drop our reference
            head.sent += 1
            self.parts -= 1
        else:
            if head.sent == 0 and head.offset == 0 and self.sizer is not None:
                self.sizer.started(head.seq, now_s)
            _part, n, ends_frame = head.pending
            head.pending = None
            head.offset += n
            if ends_frame:
                head.frames[head.sent] = None
                head.sent += 1
                head.offset = 0
                self.parts -= 1
        if head.sent < head.count:
            return None
        queue.popleft()
        return head

    @property
    def parts_behind(self) -> int:
        """Frames waiting behind the first message's (what a sender's queue limit counts: one message of
        any size is taken, and a receiver that stopped reading is told by what piles up after it)."""
        if not self._messages:
            return self.parts
        head = self._messages[0]
        return self.parts - (head.count - head.sent)

    @property
    def mid_message(self) -> bool:
        """True while a message is partly handed over (the rest of it waits here)."""
        return bool(self._messages) and (self._messages[0].sent > 0 or self._messages[0].offset > 0)

    def clear(self) -> list[Queued]:
        """Forget everything waiting; returns the messages dropped."""
        dropped = [*self._asides, *self._messages]
        self._asides.clear()
        self._messages.clear()
        self.parts = 0
        return dropped


__all__ = ["ACK_INTERVAL_S", "ACK_MIN_BYTES", "MIN_PART_BYTES", "PART_TIME_S", "Outbox", "PartSizer", "Queued"]
