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
A part counts its payload plus ``PART_COST_BYTES`` (what holding it costs:
empty parts are not free). So a peer holds at most one message being
assembled (at most ``max_message_bytes``). A sender that gives up half-way
leaves an incomplete message, which the receiver drops when that peer's next
message starts, or once no part of it has come for ``partial_timeout_s``.
All incomplete messages together are bounded in number (``max_partials``)
and bytes (``max_partial_bytes``), one *owner*'s (the sender's key, when
known) in number (``owner_limit``): to make room, the owner's own message
silent longest goes first, then, across owners, the one silent longest.

An *aside* is a one-part message sent between another message's parts, so
that it does not wait behind the whole of that message (a worker's heartbeat
behind its 1 GB Submit on a slow link)::

    [aside_tag, payload]    aside_tag = b"DLCA" + seq (u32) + 0 (u32) + 1 (u32)

It is delivered as it arrives and leaves the message it interrupts being
assembled; any other message that starts still drops an incomplete one.
(A receiver older than asides takes one for the start of a new message and
drops the interrupted one: both ends must know them.) ``Outbox`` is the
sender's side: the parts it has not yet handed to libzmq, asides first.

*Coalescing.* A frame of a message says nothing to this module, but the
receiver may pass a ``Coalescer`` (the wire layer's: it reads the codec's
header) that names runs of consecutive parts which together make one
contiguous buffer (a tensor sent in several chunks). The assembler then
copies each such part into that buffer as it arrives and lets the part go
(its libzmq message freed at once), so that the message is delivered with
the run already contiguous: its first frame holds the run's bytes, the
others are empty. The copy is made while the rest of the message, and other
peers' messages, are still arriving, rather than after the whole message is
in; and a message being assembled holds one copy of its bytes, never its
parts plus a reassembled copy. The buffer is counted in full (its declared
bytes) from the run's first part, so the limits hold as before; parts that
do not fit what the run declared end the coalescing of that run and are
kept as they came, for the decoder to judge. The coalescer may also watch a
message (``FrameWatch``): it is told of each frame as that frame is whole, on
the receiving thread, and what it saw goes to the decoder with the message.

Anything that does not carry a tag is handed back whole as a *legacy*
message (protocol version 1 sent a message as one multipart message), so
that the decoder can answer an old peer with a ``protocol_version`` error it
can read.

Why one module of about 540 lines: the tag, the receiver's assembly with its
limits and coalescing, and the sender's outbox are the two ends of one
format; split, each half would restate the other's rules.
"""

from __future__ import annotations

import struct
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol, Sequence

MAGIC = b"DLC2"
#: The tag of an aside: a one-part message sent between another message's parts.
ASIDE_MAGIC = b"DLCA"
_TAG = struct.Struct("<4sIII")
TAG_BYTES = _TAG.size
#: Most parts one message may have (a header plus tensor frames; the codec's own limit is far above real models).
MAX_PARTS = 1 << 20
#: What holding one part costs beyond its payload, counted against every limit: a part's
#: ``zmq.Frame``, its libzmq message and its list slot measured 270-280 bytes whatever the
#: payload (pyzmq 27.3, CPython 3.11, 200,000 parts held), so an empty part is not free.
#: Rounded up for the allocator's slack.
PART_COST_BYTES = 512


def tag(seq: int, index: int, count: int) -> bytes:
    return _TAG.pack(MAGIC, seq & 0xFFFFFFFF, index, count)


def aside_tag(seq: int) -> bytes:
    return _TAG.pack(ASIDE_MAGIC, seq & 0xFFFFFFFF, 0, 1)


def parts(seq: int, frames: Sequence[Any]) -> Iterator[list]:
    """The ZeroMQ messages (each ``[tag, payload]``) that carry one codec message's ``frames``."""
    n = len(frames)
    for i, frame in enumerate(frames):
        yield [tag(seq, i, n), frame]


def _unpack(frame: Any) -> tuple[bytes, int, int, int] | None:
    try:
        buf = memoryview(getattr(frame, "buffer", frame))
    except TypeError:
        return None
    if buf.nbytes != TAG_BYTES:
        return None
    fields = _TAG.unpack(buf.cast("B") if buf.format != "B" else buf)
    return fields if fields[0] in (MAGIC, ASIDE_MAGIC) else None


def read_tag(frame: Any) -> tuple[int, int, int] | None:
    """(seq, index, count) of a part's tag, or None if ``frame`` is not one (an aside's tag is not)."""
    t = _unpack(frame)
    return None if t is None or t[0] != MAGIC else t[1:]


def nbytes(frame: Any) -> int:
    buf = getattr(frame, "buffer", None)
    if buf is not None:
        return buf.nbytes
    return memoryview(frame).nbytes


def total_nbytes(frames: Iterator[Any] | Sequence[Any]) -> int:
    """Bytes in ``frames`` (``zmq.Frame`` objects or buffers)."""
    return sum(nbytes(f) for f in frames)


def part_cost(payload: Any) -> int:
    """What a part counts against the limits: its payload's bytes plus ``PART_COST_BYTES``."""
    return nbytes(payload) + PART_COST_BYTES


class Coalescer(Protocol):
    """Which parts of a message to assemble into one contiguous buffer as they arrive (module docstring)."""

    def plan(self, header: Any) -> Sequence[tuple[int, int, int]] | None:
        """From a message's first part: ``(first part index, number of parts, bytes)`` of each run to
        coalesce, or None. Only a hint: the decoder still checks every byte; may not raise."""

    def allocate(self, nbytes: int) -> Any:
        """A writable buffer of ``nbytes`` bytes (format ``B``), for one run."""

    def watch(self, header: Any) -> FrameWatch | None:
        """From a message's first part: an object to tell of each of its frames as that frame is whole,
        or None. Handed to the decoder with the message (``Complete.watch``). May not raise."""


class FrameWatch(Protocol):
    """Told of each frame of one message as it is whole, while the rest of the message arrives: the
    receiver's chance to look at bytes it will need anyway while they are fresh and its thread would
    otherwise wait (the wire layer measures a Submit's tensors for the coordinator's checks)."""

    def frame(self, index: int, buffer: Any) -> None:
        """Frame ``index`` is whole: a part's payload, or a coalesced run's buffer (at the run's first
        index). Called on the receiving thread; the buffer is not written again. An exception
        ends the watch (a hint only: it never changes what is assembled)."""


@dataclass(slots=True)
class _Run:
    """A run of parts being copied into one buffer."""

    first: int
    end: int
    buffer: memoryview
    filled: int = 0


@dataclass
class _Partial:
    seq: int
    count: int
    #: When its latest part arrived: a message that keeps arriving is never dropped for its age.
    last_part_s: float
    #: Whose it is: the sender's key when known, else the peer.
    owner: str = ""
    frames: list = field(default_factory=list)
    #: What its parts held cost (``part_cost``); 0 once it is being skipped.
    size: int = 0
    #: True once the message went over the limit: its remaining parts are skipped.
    dropping: bool = False
    #: Runs to coalesce not yet started: first part index -> (parts, bytes) (``Coalescer``).
    runs: dict = field(default_factory=dict)
    #: The run being coalesced, if any.
    run: _Run | None = None
    #: Told of each frame as it is whole (``Coalescer.watch``), if any.
    watch: FrameWatch | None = None


@dataclass(frozen=True, slots=True)
class Complete:
    """A whole message's codec frames; ``legacy`` when they came as one multipart message, not as parts;
    ``watch``: what the coalescer's ``FrameWatch`` saw of them as they arrived (or None)."""

    frames: list
    legacy: bool = False
    watch: Any = None


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
    message per peer (at most ``max_message_bytes``, each part counted at
    ``part_cost``), none whose last part came more than ``partial_timeout_s``
    ago: the limit is on silence, not on the transfer's total time, so a 1 GB
    message crossing a slow link for minutes is kept as long as its parts keep
    coming. All partial messages together: at most ``max_partials`` of them and
    ``max_partial_bytes`` (never less than one whole message), and at most
    ``owner_limit`` of one owner (``add``'s ``owner``, the sender's key).

    What goes to make room is what has been silent longest: a message start
    over its owner's limit displaces that owner's own partial message silent
    longest; one over ``max_partials``, and a part over ``max_partial_bytes``,
    the one silent longest of all. So a flood of message starts that then fall
    silent displaces only itself, and a message still arriving is never the
    first to go. Nobody is answered for a message dropped to make room
    (``evicted``); the rest of it is skipped. ``now_s`` must not go backwards.
    """

    def __init__(self, max_message_bytes: int, *, max_partials: int = 1024, max_partial_bytes: int | None = None,
                 partial_timeout_s: float = 120.0, coalescer: Coalescer | None = None) -> None:
        self.max_message_bytes = max_message_bytes
        self.coalescer = coalescer
        self.max_partials = max_partials
        self.max_partial_bytes = max(max_message_bytes, max_partials * max_message_bytes
                                     if max_partial_bytes is None else max_partial_bytes)
        self.partial_timeout_s = partial_timeout_s
        #: peer -> its partial message, the one silent longest first (moved to the end on every part).
        self._partials: dict[str, _Partial] = {}
        #: owner -> its peers with a partial message, in the same order.
        self._owned: dict[str, dict[str, None]] = {}
        self._bytes = 0
        #: Incomplete messages dropped (the sender gave up half-way, timed out, or to make room).
        self.incomplete_dropped = 0
        #: Of those, the ones dropped to keep within ``owner_limit``, ``max_partials`` or ``max_partial_bytes``.
        self.evicted = 0

    @property
    def partial_count(self) -> int:
        return len(self._partials)

    @property
    def partial_bytes(self) -> int:
        """What the partial messages held cost (``part_cost`` of each part held)."""
        return self._bytes

    def add(self, peer: str, zmq_frames: Sequence[Any], now_s: float, *, owner: str | None = None,
            owner_limit: int = 1) -> Complete | Refused | None:
        """One received ZeroMQ message from ``peer``; ``owner`` (default: the peer) holds at most ``owner_limit``."""
        if len(zmq_frames) != 2 or (t := _unpack(zmq_frames[0])) is None:
            # Not a part: an old peer's whole message (or garbage), for the decoder to judge.
            self._drop(peer)
            return Complete(list(zmq_frames), legacy=True)
        magic, seq, index, count = t
        payload = zmq_frames[1]
        partial = self._partials.get(peer)
        if magic == ASIDE_MAGIC:
            return self._aside(peer, partial, index, count, payload, now_s)
        cost = part_cost(payload)
        if index == 0:
            if partial is not None:
                self._drop(peer)
            if not 1 <= count <= MAX_PARTS:
                return Refused("bad_message", f"part tag: a message of {count} parts; expected 1..{MAX_PARTS}")
            if count == 1:
                if cost > self.max_message_bytes:
                    return self._too_large(seq, index, count)
                return Complete([payload])
            self._expire(now_s)
            partial = self._admit(peer, _Partial(seq, count, now_s, owner or peer), max(1, owner_limit))
            if self.coalescer is not None:
                partial.runs = self._plan(payload, count)
                partial.watch = self._watch(payload)
        elif partial is None or partial.seq != seq or (index != len(partial.frames) and not partial.dropping):
            # A part of a message whose start we never kept (refused at its first part, or dropped to
            # make room), or out of order (impossible on one connection): skip it, and drop any other
            # message it interrupts.
            if partial is not None:
                self._drop(peer)
            return None
        if partial.dropping:
            if index == partial.count - 1:
                self._remove(peer)
            return None
        partial.last_part_s = now_s
        self._touch(peer, partial)
        run = partial.run
        run_bytes = 0
        if run is not None:
            # A part of the run being coalesced: its bytes were counted when the run started.
            cost = PART_COST_BYTES
        elif index in partial.runs:
            parts_in_run, run_bytes = partial.runs.pop(index)
            if run_bytes > nbytes(payload):
                cost = run_bytes + PART_COST_BYTES  # the whole buffer, counted from now on
            else:
                run_bytes = 0  # nothing to coalesce: the run is all in this part, or declared too short
        if partial.size + cost > self.max_message_bytes:
            self._bytes -= partial.size
            partial.size = 0
            partial.frames.clear()  # free what was held at once
            if index == partial.count - 1:
                self._remove(peer)
            else:
                partial.dropping = True
            return self._too_large(seq, index, partial.count)
        if self._bytes + cost > self.max_partial_bytes:
            self._make_room_for(cost, keep=peer)
            if self._bytes + cost > self.max_partial_bytes:  # nothing else left to drop
                self._evict(peer)
                return None
        partial.size += cost
        self._bytes += cost
        if run_bytes:  # a run starts here
            run = partial.run = _Run(index, index + parts_in_run, self._allocate(run_bytes))
            partial.frames.append(run.buffer)
        if run is None:
            partial.frames.append(payload)
            if partial.watch is not None:
                self._tell(partial, index, payload)
        else:
            whole = self._coalesce(partial, run, index, payload)
            if whole is not None and partial.watch is not None:
                self._tell(partial, run.first, whole)
        if len(partial.frames) < partial.count:
            return None
        self._remove(peer)
        return Complete(partial.frames, watch=partial.watch)

    def _plan(self, header: Any, count: int) -> dict:
        """The runs the coalescer names in a message of ``count`` parts (sane ones only)."""
        try:
            plan = self.coalescer.plan(header)
        except Exception:  # a hint only: the decoder judges the message
            plan = None
        runs = {}
        end = 1
        for first, parts_in_run, run_bytes in plan or ():
            if not (type(first) is int and type(parts_in_run) is int and type(run_bytes) is int):
                return {}
            if first < end or parts_in_run < 2 or first + parts_in_run > count or run_bytes < 1:
                return {}
            runs[first] = (parts_in_run, run_bytes)
            end = first + parts_in_run
        return runs

    def _watch(self, header: Any) -> FrameWatch | None:
        try:
            return self.coalescer.watch(header)
        except Exception:  # a hint only
            return None

    @staticmethod
    def _tell(partial: _Partial, index: int, buffer: Any) -> None:
        try:
            partial.watch.frame(index, buffer)
        except Exception:  # a hint only: the watch ends, the message is assembled as ever
            partial.watch = None

    def _allocate(self, nbytes: int) -> memoryview:
        buf = memoryview(self.coalescer.allocate(nbytes))
        if buf.format != "B" or buf.ndim != 1:
            buf = buf.cast("B")
        if buf.nbytes != nbytes or buf.readonly:
            raise ValueError(f"the coalescer allocated {buf.nbytes} bytes (read-only: {buf.readonly}); "
                             f"asked for {nbytes}, writable")
        return buf

    @staticmethod
    def _coalesce(partial: _Partial, run: _Run, index: int, payload: Any) -> memoryview | None:
        """Copy a run's part into its buffer (then the part is let go), or end the run when it does not fit;
        the run's buffer once its last part is in."""
        src = getattr(payload, "buffer", None)
        if src is None:
            src = memoryview(payload)
        if src.format != "B" or src.ndim != 1:
            src = src.cast("B")
        n = src.nbytes
        if run.filled + n <= run.buffer.nbytes:
            run.buffer[run.filled:run.filled + n] = src
            run.filled += n
            if index > run.first:
                partial.frames.append(b"")
        else:
            # More than the run declared: keep what came as it came, for the decoder to judge.
            partial.run = None
            partial.frames[run.first] = run.buffer[:run.filled]
            partial.frames.append(payload)
            return None
        if index == run.end - 1:
            partial.run = None
            whole = partial.frames[run.first] = run.buffer[:run.filled]
            return whole
        return None

    def _too_large(self, seq: int, index: int, count: int) -> Refused:
        return Refused("too_large", f"message {seq} grew past max_message_bytes={self.max_message_bytes} at "
                                    f"part {index} of {count} (each part counts {PART_COST_BYTES} bytes more than "
                                    f"its payload); it was dropped as it arrived")

    def _aside(self, peer: str, partial: _Partial | None, index: int, count: int, payload: Any,
               now_s: float) -> Complete | Refused:
        """A one-part message between another's parts: delivered, and the interrupted message kept.

        Kept unless it has itself gone silent: asides (heartbeats) keep coming from a sender
        that gave up on a message, and must not keep that message's parts held forever.
        """
        if partial is not None and now_s - partial.last_part_s > self.partial_timeout_s:
            self._drop(peer)
        if index != 0 or count != 1:
            return Refused("bad_message", f"aside tag: part {index} of {count}; an aside is one part (0 of 1)")
        if part_cost(payload) > self.max_message_bytes:
            return Refused("too_large", f"an aside of {nbytes(payload)} bytes (+{PART_COST_BYTES}) is over "
                                        f"max_message_bytes={self.max_message_bytes}")
        return Complete([payload])

    def forget(self, peer: str) -> None:
        self._remove(peer)

    def arriving(self, peer: str, now_s: float) -> bool:
        """True while ``peer`` has a message partly arrived whose latest part came within ``partial_timeout_s``."""
        partial = self._partials.get(peer)
        return partial is not None and not partial.dropping and now_s - partial.last_part_s <= self.partial_timeout_s

    # ------------------------------------------------------------------ bookkeeping

    def _admit(self, peer: str, partial: _Partial, owner_limit: int) -> _Partial:
        """Keep a new partial message, dropping what must go to keep within the owner's limit and ``max_partials``."""
        mine = self._owned.get(partial.owner)
        while mine and len(mine) >= owner_limit:
            self._evict(next(iter(mine)))
        while self._partials and len(self._partials) >= self.max_partials:
            self._evict(next(iter(self._partials)))
        self._partials[peer] = partial
        self._owned.setdefault(partial.owner, {})[peer] = None
        return partial

    def _make_room_for(self, cost: int, keep: str) -> None:
        """Drop the partial messages silent longest (never ``keep``'s) until ``cost`` more bytes fit."""
        while self._bytes + cost > self.max_partial_bytes:
            victim = next(iter(self._partials))
            if victim == keep:
                return
            self._evict(victim)

    def _touch(self, peer: str, partial: _Partial) -> None:
        """``peer``'s partial message just got a part: it is now the one silent shortest."""
        self._partials[peer] = self._partials.pop(peer)
        mine = self._owned[partial.owner]
        mine[peer] = mine.pop(peer)

    def _expire(self, now_s: float) -> None:
        """Drop the partial messages silent for more than ``partial_timeout_s`` (they come first)."""
        while self._partials:
            peer, partial = next(iter(self._partials.items()))
            if now_s - partial.last_part_s <= self.partial_timeout_s:
                return
            self._drop(peer)

    def _remove(self, peer: str) -> _Partial | None:
        partial = self._partials.pop(peer, None)
        if partial is not None:
            self._bytes -= partial.size
            mine = self._owned[partial.owner]
            del mine[peer]
            if not mine:
                del self._owned[partial.owner]
        return partial

    def _drop(self, peer: str) -> None:
        if self._remove(peer) is not None:
            self.incomplete_dropped += 1

    def _evict(self, peer: str) -> None:
        if self._remove(peer) is not None:
            self.incomplete_dropped += 1
            self.evicted += 1


@dataclass(slots=True)
class Queued:
    """One message in an ``Outbox``: its parts and how many of them went out."""

    parts: list
    nbytes: int
    what: str = ""
    sent: int = 0


class Outbox:
    """A sender's messages not yet handed to libzmq, given out one part at a time: asides first.

    The owner hands libzmq the part ``peek`` names while its queue has room and
    calls ``advance`` for each one it took, so that libzmq never holds more than
    its send limit and what waits here can still be reordered: an aside put here
    goes out before the next part of the message in progress. Everything else
    keeps its order.
    """

    def __init__(self) -> None:
        self._asides: deque[Queued] = deque()
        self._messages: deque[Queued] = deque()
        #: Parts waiting here.
        self.parts = 0

    def __bool__(self) -> bool:
        return self.parts > 0

    def put(self, parts: Sequence[list], nbytes: int, what: str = "", *, aside: bool = False) -> None:
        queued = Queued(list(parts), nbytes, what)
        if not queued.parts:
            return
        (self._asides if aside else self._messages).append(queued)
        self.parts += len(queued.parts)

    def peek(self) -> list | None:
        """The next part to hand over (an aside's whole, or the current message's next part), or None."""
        if self._asides:
            return self._asides[0].parts[0]
        if self._messages:
            head = self._messages[0]
            return head.parts[head.sent]
        return None

    def advance(self) -> Queued | None:
        """The part ``peek`` named went out: its message if that was the last of it, else None."""
        queue = self._asides if self._asides else self._messages
        head = queue[0]
        head.parts[head.sent] = None  # libzmq holds it now: drop our reference
        head.sent += 1
        self.parts -= 1
        if head.sent < len(head.parts):
            return None
        queue.popleft()
        return head

    @property
    def parts_behind(self) -> int:
        """Parts waiting behind the first message's (what a sender's queue limit counts: one message of
        any size is taken, and a receiver that stopped reading is told by what piles up after it)."""
        if not self._messages:
            return self.parts
        head = self._messages[0]
        return self.parts - (len(head.parts) - head.sent)

    @property
    def mid_message(self) -> bool:
        """True while a message is partly handed over (the rest of it waits here)."""
        return bool(self._messages) and self._messages[0].sent > 0

    def clear(self) -> list[Queued]:
        """Forget everything waiting; returns the messages dropped."""
        dropped = [*self._asides, *self._messages]
        self._asides.clear()
        self._messages.clear()
        self.parts = 0
        return dropped


__all__ = ["Assembler", "Coalescer", "Complete", "Outbox", "Queued", "Refused", "ASIDE_MAGIC", "MAGIC", "TAG_BYTES", "MAX_PARTS",
           "PART_COST_BYTES", "aside_tag", "part_cost", "parts", "read_tag", "tag"]
