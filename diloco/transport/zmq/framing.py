"""Parts: how one codec message travels as several ZeroMQ messages, and is bounded as it arrives.

libzmq delivers a multipart message only when its last frame has arrived,
so a peer could make the coordinator buffer any number of frames (each under
``ZMQ_MAXMSGSIZE``) before a single byte of it could be checked. Instead,
each of a message's codec frames (``diloco.wire.codec``: the msgpack
header, then the tensor frames) goes as its own two-frame ZeroMQ message,
a *part* ``[tag, payload]`` (``tags``: the tag carries the message's
``seq``, the frame's ``index`` and the message's ``count`` of frames), or,
when the frame is bigger than what the sender's link moves in about a
second, as several *pieces* in order (``outbox.PartSizer`` sizes them).

The receiver assembles a peer's parts in order (one ZeroMQ connection keeps
order) and checks the running size against ``max_message_bytes`` as each
part arrives: past it, the parts held are freed at once, the rest of that
message is skipped as it arrives, and the sender is answered ``too_large``.
A part counts its payload plus ``PART_COST_BYTES`` (what holding it costs:
empty parts are not free); a frame that comes in pieces counts its declared
bytes from its first piece, which go into one buffer as they arrive. So a
peer holds at most one message being assembled (at most
``max_message_bytes``). A sender that gives up half-way leaves an incomplete
message, which the receiver drops when that peer's next message starts, or
once no part of it has come for ``partial_timeout_s``. All incomplete
messages together are bounded in number (``max_partials``) and bytes
(``max_partial_bytes``), one *owner*'s (the sender's key, when known) in
number (``owner_limit``): to make room, the owner's own message silent
longest goes first, then, across owners, the one silent longest.

As a big message arrives the receiver *acks* it (``take_ack``: the bytes
held so far, at most every ``outbox.ACK_INTERVAL_S`` and once it is whole),
which is how the sender learns what its link moves; and it notes the peers
whose bytes are arriving (``take_progress``), which is how the coordinator
knows a worker is alive while its upload outlasts the heartbeat timeout.

An *aside* is a one-part message sent between another message's parts, so
that it does not wait behind the whole of that message (a worker's heartbeat
behind its 1 GB Submit on a slow link). It is delivered as it arrives and
leaves the message it interrupts being assembled; any other message that
starts still drops an incomplete one. ``outbox.Outbox`` is the sender's side:
the parts it has not yet handed to libzmq, asides first.

*Coalescing.* A frame of a message says nothing to this module, but the
receiver may pass a ``Coalescer`` (the wire layer's: it reads the codec's
header) that names runs of consecutive frames which together make one
contiguous buffer (a tensor sent in several chunks). The assembler then
copies each such frame into that buffer as it arrives and lets the part go
(its libzmq message freed at once), so that the message is delivered with
the run already contiguous: its first frame holds the run's bytes, the
others are empty. The copy is made while the rest of the message, and other
peers' messages, are still arriving, rather than after the whole message is
in; and a message being assembled holds one copy of its bytes, never its
parts plus a reassembled copy. The buffer is counted in full (its declared
bytes) from the run's first part, so the limits hold as before; frames that
do not fit what the run declared end the coalescing of that run and are
kept as they came, for the decoder to judge. The coalescer may also watch a
message (``FrameWatch``): it is told of each frame as that frame is whole, on
the receiving thread, and what it saw goes to the decoder with the message.

Anything that does not carry a tag is handed back whole as a *legacy*
message (protocol version 1 sent a message as one multipart message), so
that the decoder can answer an old peer with a ``protocol_version`` error it
can read.

Why one module of about 600 lines: the receiver's assembly, its limits and
its coalescing act on the same partial message at every part; split, each
would restate the others' bookkeeping.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol, Sequence

from diloco.transport.zmq import tags
from diloco.transport.zmq.outbox import ACK_INTERVAL_S, ACK_MIN_BYTES, Outbox, Queued
from diloco.transport.zmq.tags import ASIDE_MAGIC, MAGIC, TAG_BYTES, aside_tag, read_tag, tag

#: Most parts one message may have (a header plus tensor frames; the codec's own limit is far above real models).
MAX_PARTS = 1 << 20
#: What holding one part costs beyond its payload, counted against every limit: a part's
#: ``zmq.Frame``, its libzmq message and its list slot measured 270-280 bytes whatever the
#: payload (pyzmq 27.3, CPython 3.11, 200,000 parts held), so an empty part is not free.
#: Rounded up for the allocator's slack.
PART_COST_BYTES = 512


def parts(seq: int, frames: Sequence[Any]) -> Iterator[list]:
    """The ZeroMQ messages (each ``[tag, payload]``) that carry one codec message's ``frames``, each whole."""
    n = len(frames)
    for i, frame in enumerate(frames):
        yield [tag(seq, i, n), frame]


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
    """A run of frames being copied into one buffer, or one frame arriving in pieces (``end = first + 1``)."""

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
    #: The frames whole so far (a run's later frames as empty placeholders).
    frames: list = field(default_factory=list)
    #: What its parts held cost (``part_cost``); 0 once it is being skipped.
    size: int = 0
    #: True once the message went over the limit: its remaining parts are skipped.
    dropping: bool = False
    #: Runs to coalesce not yet started: first frame index -> (frames, bytes) (``Coalescer``).
    runs: dict = field(default_factory=dict)
    #: The run being coalesced, if any.
    run: _Run | None = None
    #: The frame arriving in pieces outside any run, if any (a run of one frame).
    piece: _Run | None = None
    #: Bytes of the frame being assembled that arrived so far (where its next piece starts).
    frame_at: int = 0
    #: Told of each frame as it is whole (``Coalescer.watch``), if any.
    watch: FrameWatch | None = None
    #: Payload bytes arrived, and when the sender was last told (``take_ack``).
    received: int = 0
    acked_s: float = -math.inf
    #: The biggest part's payload so far (how the sender cut its frames).
    largest: int = 0


@dataclass(frozen=True, slots=True)
class Complete:
    """A whole message's codec frames; ``legacy`` when they came as one multipart message, not as parts;
    ``watch``: what the coalescer's ``FrameWatch`` saw of them as they arrived (or None)."""

    frames: list
    legacy: bool = False
    watch: Any = None
    #: The biggest part's payload, for a message that came in several parts (else 0).
    largest_part: int = 0


@dataclass(frozen=True, slots=True)
class Refused:
    """A message refused while arriving. ``code`` is an ``ErrorCode`` value; answer it once."""

    code: str
    detail: str


@dataclass(frozen=True, slots=True)
class Acked:
    """The peer holds ``received`` bytes of our message ``seq`` (``tags.ack_tag``): for the sender's ``PartSizer``."""

    seq: int
    received: int


class Assembler:
    """Per-peer assembly of parts, with a size limit checked as parts arrive.

    ``add(peer, zmq_frames, now_s)`` takes one received ZeroMQ message and
    returns ``Complete`` (a whole message), ``Refused`` (answer the peer),
    ``Acked`` (the peer's ack of a message of ours) or None (more parts to
    come, or a part skipped). Memory: at most one partial message per peer (at
    most ``max_message_bytes``, each part counted at ``part_cost``, a frame in
    pieces at its declared bytes), none whose last part came more than
    ``partial_timeout_s`` ago: the limit is on silence, not on the transfer's
    total time, so a 1 GB message crossing a slow link for minutes is kept as
    long as its parts keep coming. All partial messages together: at most
    ``max_partials`` of them and ``max_partial_bytes`` (never less than one
    whole message), and at most ``owner_limit`` of one owner (``add``'s
    ``owner``, the sender's key).

    What goes to make room is what has been silent longest: a message start
    over its owner's limit displaces that owner's own partial message silent
    longest; one over ``max_partials``, and a part over ``max_partial_bytes``,
    the one silent longest of all. So a flood of message starts that then fall
    silent displaces only itself, and a message still arriving is never the
    first to go. Nobody is answered for a message dropped to make room
    (``evicted``); the rest of it is skipped. ``now_s`` must not go backwards.
    """

    def __init__(self, max_message_bytes: int, *, max_partials: int = 1024, max_partial_bytes: int | None = None,
                 partial_timeout_s: float = 120.0, coalescer: Coalescer | None = None,
                 track_progress: bool = True) -> None:
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
        #: The ack the last ``add`` made due, ``(seq, bytes received)`` (``take_ack``), or None.
        self._ack: tuple[int, int] | None = None
        #: Peers a part of whose message arrived since ``take_progress`` (kept with ``track_progress``).
        self._progress: dict[str, None] | None = {} if track_progress else None
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

    def take_ack(self) -> tuple[int, int] | None:
        """The ack the last ``add`` made due, ``(seq, bytes received)``, for the endpoint to send to that peer."""
        ack, self._ack = self._ack, None
        return ack

    def take_progress(self) -> list[str]:
        """The peers a part of whose message arrived since the last call (their bytes keep coming)."""
        if self._progress is None:
            return []
        peers = list(self._progress)
        self._progress.clear()
        return peers

    def add(self, peer: str, zmq_frames: Sequence[Any], now_s: float, *, owner: str | None = None,
            owner_limit: int = 1) -> Complete | Refused | Acked | None:
        """One received ZeroMQ message from ``peer``; ``owner`` (default: the peer) holds at most ``owner_limit``."""
        if len(zmq_frames) != 2 or (t := tags.read(zmq_frames[0])) is None:
            # Not a part: an old peer's whole message (or garbage), for the decoder to judge.
            self._drop(peer)
            return Complete(list(zmq_frames), legacy=True)
        magic, seq, index, count = t.magic, t.seq, t.index, t.count
        payload = zmq_frames[1]
        partial = self._partials.get(peer)
        if magic == tags.ACK_MAGIC:
            return Acked(seq, t.frame_bytes)
        if magic == ASIDE_MAGIC:
            return self._aside(peer, partial, index, count, payload, now_s)
        size = nbytes(payload)
        if magic == tags.PIECE_MAGIC:
            frame_bytes, offset = t.frame_bytes, t.offset
            if size == 0 or offset + size > frame_bytes:
                self._drop(peer)
                return Refused("bad_message", f"piece tag: bytes {offset}..{offset + size} of a frame of "
                                              f"{frame_bytes}; a piece is a non-empty part of its frame")
        else:
            frame_bytes, offset = size, 0
        ends_frame = offset + size == frame_bytes
        if index == 0 and offset == 0:
            if partial is not None:
                self._drop(peer)
            if not 1 <= count <= MAX_PARTS:
                return Refused("bad_message", f"part tag: a message of {count} parts; expected 1..{MAX_PARTS}")
            if count == 1 and ends_frame:
                if size + PART_COST_BYTES > self.max_message_bytes:
                    return self._too_large(seq, index, count)
                return Complete([payload])
            self._expire(now_s)
            partial = self._admit(peer, _Partial(seq, count, now_s, owner or peer), max(1, owner_limit))
        elif (partial is None or partial.seq != seq
              or ((index, offset) != (len(partial.frames), partial.frame_at) and not partial.dropping)):
            # A part of a message whose start we never kept (refused at its first part, or dropped to
            # make room), or out of order (impossible on one connection): skip it, and drop any other
            # message it interrupts.
            if partial is not None:
                self._drop(peer)
            return None
        if partial.dropping:
            if index == partial.count - 1 and ends_frame:
                self._remove(peer)
            return None
        partial.last_part_s = now_s
        self._touch(peer, partial)
        if self._progress is not None:
            self._progress[peer] = None
        cost, run_bytes, sink = self._cost(partial, index, offset, size, frame_bytes, ends_frame)
        if partial.size + cost > self.max_message_bytes:
            self._bytes -= partial.size
            partial.size = 0
            partial.frames.clear()  # free what was held at once
            partial.run = partial.piece = None
            if index == partial.count - 1 and ends_frame:
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
        partial.received += size
        partial.largest = max(partial.largest, size)
        if sink == "run-start":
            parts_in_run = partial.runs.pop(index)[0]
            partial.run = _Run(index, index + parts_in_run, self._allocate(run_bytes))
            sink = "run"
        elif sink == "piece-start":
            # Not from the coalescer's pool: a frame comes in pieces only until the sender's first ack, or on
            # a thin link; a pooled buffer of its size would be kept for a request that may never come again.
            partial.piece = _Run(index, index + 1, memoryview(bytearray(frame_bytes)))
            sink = "piece"
        if sink == "run":
            self._copy(partial.run, payload)
        elif sink == "piece":
            self._copy(partial.piece, payload)
        partial.frame_at = 0 if ends_frame else offset + size
        if ends_frame:
            self._frame_whole(partial, index, payload, sink)
        if len(partial.frames) < partial.count:
            if partial.received >= ACK_MIN_BYTES and now_s - partial.acked_s >= ACK_INTERVAL_S:
                partial.acked_s = now_s
                self._ack = (seq, partial.received)
            return None
        self._remove(peer)
        if partial.received >= ACK_MIN_BYTES:
            self._ack = (seq, partial.received)
        return Complete(partial.frames, watch=partial.watch, largest_part=partial.largest)

    def _cost(self, partial: _Partial, index: int, offset: int, size: int, frame_bytes: int,
              ends_frame: bool) -> tuple[int, int, str]:
        """What this part adds to the limits, the bytes of a run it starts, and where its bytes go:
        ``run`` / ``run-start`` (a coalesced run's buffer), ``piece`` / ``piece-start`` (the buffer of a
        frame arriving in pieces) or ``whole`` (the part is kept as it came)."""
        if offset > 0:  # a later piece of a frame: its buffer was counted at the frame's first piece
            return 0, 0, "run" if partial.run is not None else "piece"
        run = partial.run
        if run is not None:
            if run.filled + frame_bytes <= run.buffer.nbytes:
                return PART_COST_BYTES, 0, "run"  # its bytes were counted when the run started
            # More than the run declared: the run ends as far as it came, this frame is kept as it comes.
            partial.run = None
            partial.frames[run.first] = run.buffer[:run.filled]
        elif index in partial.runs:
            run_bytes = partial.runs[index][1]
            if run_bytes > frame_bytes:
                return run_bytes + PART_COST_BYTES, run_bytes, "run-start"  # the whole buffer, from now on
            del partial.runs[index]  # nothing to coalesce: the run is all in this frame, or declared too short
        if ends_frame:
            return size + PART_COST_BYTES, 0, "whole"
        return frame_bytes + PART_COST_BYTES, 0, "piece-start"

    @staticmethod
    def _copy(run: _Run, payload: Any) -> None:
        src = getattr(payload, "buffer", None)
        if src is None:
            src = memoryview(payload)
        if src.format != "B" or src.ndim != 1:
            src = src.cast("B")
        n = src.nbytes
        run.buffer[run.filled:run.filled + n] = src
        run.filled += n

    def _frame_whole(self, partial: _Partial, index: int, payload: Any, sink: str) -> None:
        """Frame ``index`` has all its bytes: take its place in the message, and tell who wants to know."""
        whole: Any = None
        if sink == "run":
            run = partial.run
            partial.frames.append(run.buffer if index == run.first else b"")
            if index == run.end - 1:
                partial.run = None
                whole = partial.frames[run.first] = run.buffer[:run.filled]
                index = run.first
        elif sink == "piece":
            whole = partial.piece.buffer
            partial.piece = None
            partial.frames.append(whole)
        else:
            whole = payload
            partial.frames.append(payload)
        if whole is None:
            return
        if index == 0 and self.coalescer is not None:
            partial.runs = self._plan(whole, partial.count)
            partial.watch = self._watch(whole)
        elif partial.watch is not None:
            self._tell(partial, index, whole)

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




__all__ = ["Acked", "Assembler", "Coalescer", "Complete", "FrameWatch", "Outbox", "Queued", "Refused", "ASIDE_MAGIC",
           "MAGIC", "TAG_BYTES", "MAX_PARTS", "PART_COST_BYTES", "aside_tag", "part_cost", "parts", "read_tag", "tag"]
