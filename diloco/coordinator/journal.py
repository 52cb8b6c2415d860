"""The hub coordinator's write-ahead journal: a durable round costs what the round changed.

A full checkpoint (``checkpoint.py``) holds the params and the outer optimizers'
state: two model copies, 800 MB at 100M parameters, too much to write before
every round's Results (SPEC.md section 5: persist before announce). What a
round changes is fully determined by its outer step's *input*, the mean
pseudo-gradient of the fragment (``Coordinator.outer_step`` is deterministic),
so the journal records that input, one model copy, and a full checkpoint is
written every few rounds in the background (``persist.py``). Resuming reads the
newest valid full checkpoint and replays the journal's steps after it through
the same ``outer_step``: the params and the momentum come back bit for bit.

Files, next to the full checkpoints::

    journal-<first seq, 12 digits>.log

A segment starts after each full checkpoint (``journal_seq`` in the checkpoint's
metadata is the last step it holds) and after each resume. A segment is a
sequence of chunks::

    b"DLJ1" kind(1 byte) header_len(u64 LE) payload_len(u64 LE) header payload crc32(u32 LE)

- ``S`` (step input): header ``{"fragment": fid, "tensors": [[name, dtype, shape], ...]}``,
  payload the tensors' bytes in that order. Written by a background thread while
  the step runs.
- ``C`` (commit): header ``{"seq": n, "inputs": k, "meta": {...}}``, no payload: the
  ``k`` step inputs before it are the step ``n``, and ``meta`` is the coordinator's
  small state after it (the machine's snapshot, counters, access list: what a
  checkpoint's metadata holds). The step is durable once its commit is fsync'd.

The crc32 covers the kind, the lengths, the header and the payload. Reading stops
at the first chunk that is short or fails its crc (a torn tail: the append a
crash interrupted); step inputs with no commit after them are the open round,
which no worker ever heard of, and are dropped.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import struct
import zlib
from dataclasses import dataclass, field
from typing import Iterator

import torch

from diloco.ckptio import _raw, fsync_dir, write_all
from diloco.tensorfile import CheckpointError

MAGIC = b"DLJ1"
STEP = b"S"
COMMIT = b"C"
_HEAD = struct.Struct("<4scQQ")
_CRC = struct.Struct("<I")
PREFIX = "journal-"
SUFFIX = ".log"
_NAME_RX = re.compile(rf"^{PREFIX}(\d+){re.escape(SUFFIX)}$")
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool)}
#: Bytes per write (and per crc update): the crc of one slice overlaps the write of the last one in
#: the kernel's page cache, and neither holds the interpreter lock.
_SLICE = 32 << 20


def segment_name(first_seq: int) -> str:
    return f"{PREFIX}{first_seq:012d}{SUFFIX}"


def list_segments(directory: str | os.PathLike) -> list[tuple[int, pathlib.Path]]:
    """(first seq, path) of the journal segments in ``directory``, oldest first."""
    directory = pathlib.Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for entry in directory.iterdir():
        m = _NAME_RX.match(entry.name)
        if m:
            found.append((int(m.group(1)), entry))
    return sorted(found)


# --------------------------------------------------------------------- writing


class Segment:
    """One journal segment open for appending. Not thread-safe: ``persist.py`` orders the calls."""

    def __init__(self, directory: pathlib.Path, first_seq: int) -> None:
        self.path = directory / segment_name(first_seq)
        self.first_seq = first_seq
        # Truncate: a segment of this name can only hold appends no commit made durable
        # (the replay that led here read every committed step; see the module doc).
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        os.fsync(self._fd)
        fsync_dir(directory)
        self.bytes_written = 0

    def append_step(self, fragment_id: int, tensors: dict[str, torch.Tensor]) -> int:
        """Append a step input chunk (not fsync'd: the commit's fsync covers it); its size in bytes."""
        listing = [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in tensors.items()]
        header = json.dumps({"fragment": fragment_id, "tensors": listing}, separators=(",", ":")).encode()
        views = [_raw(t) for t in tensors.values() if t.numel()]
        payload_len = sum(len(v) for v in views)
        head = _HEAD.pack(MAGIC, STEP, len(header), payload_len) + header
        crc = zlib.crc32(head[4:])
        write_all(self._fd, memoryview(head))
        for view in views:
            for start in range(0, len(view), _SLICE):
                piece = view[start:start + _SLICE]
                crc = zlib.crc32(piece, crc)
                write_all(self._fd, piece)
        write_all(self._fd, memoryview(_CRC.pack(crc)))
        size = len(head) + payload_len + _CRC.size
        self.bytes_written += size
        return size

    def append_commit(self, seq: int, inputs: int, meta: dict) -> None:
        """Append a commit chunk and fsync the segment: step ``seq`` is durable when this returns."""
        header = json.dumps({"seq": seq, "inputs": inputs, "meta": meta}, separators=(",", ":")).encode()
        head = _HEAD.pack(MAGIC, COMMIT, len(header), 0) + header
        write_all(self._fd, memoryview(head + _CRC.pack(zlib.crc32(head[4:]))))
        os.fdatasync(self._fd)
        self.bytes_written += len(head) + _CRC.size

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


# --------------------------------------------------------------------- reading


@dataclass
class StepInput:
    """Where one step input's tensors lie in a segment (read only if the step is replayed)."""

    path: pathlib.Path
    fragment_id: int
    listing: list
    offset: int
    length: int

    def load(self) -> dict[str, torch.Tensor]:
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            buf = bytearray(self.length)
            if f.readinto(buf) != self.length:
                raise CheckpointError(f"{self.path}: a step input ends early")
        out: dict[str, torch.Tensor] = {}
        pos = 0
        for name, dtype, shape in self.listing:
            torch_dtype = _DTYPES[dtype]
            numel = 1
            for d in shape:
                numel *= int(d)
            nbytes = numel * torch.empty((), dtype=torch_dtype).element_size()
            t = (torch.frombuffer(buf, dtype=torch_dtype, offset=pos, count=numel) if numel
                 else torch.empty(0, dtype=torch_dtype))
            out[name] = t.reshape([int(d) for d in shape])
            pos += nbytes
        return out


@dataclass
class Step:
    """A committed step: its sequence number, inputs (in the order they were applied) and meta."""

    seq: int
    inputs: list[StepInput]
    meta: dict


@dataclass
class Reading:
    """What ``read_steps`` found: committed steps after a sequence number, and what it dropped."""

    steps: list[Step] = field(default_factory=list)
    #: Torn or corrupt tails, as (segment, byte offset, why); an interrupted append leaves one.
    torn: list[tuple[pathlib.Path, int, str]] = field(default_factory=list)
    #: Step inputs with no commit after them (the open round at a crash).
    uncommitted_inputs: int = 0


def _chunks(path: pathlib.Path, reading: Reading) -> Iterator[tuple[bytes, dict, int, int]]:
    """(kind, header, payload offset, payload length) of each whole, crc-checked chunk of a segment."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        pos = 0
        while pos < size:
            raw = f.read(_HEAD.size)
            if len(raw) < _HEAD.size:
                reading.torn.append((path, pos, "a chunk header ends early"))
                return
            magic, kind, hlen, plen = _HEAD.unpack(raw)
            if magic != MAGIC or kind not in (STEP, COMMIT) or pos + _HEAD.size + hlen + plen + _CRC.size > size:
                reading.torn.append((path, pos, "a chunk is torn or not a journal chunk"))
                return
            header_raw = f.read(hlen)
            crc = zlib.crc32(raw[4:])
            crc = zlib.crc32(header_raw, crc)
            payload_at = pos + _HEAD.size + hlen
            left = plen
            while left:
                piece = f.read(min(left, _SLICE))
                crc = zlib.crc32(piece, crc)
                left -= len(piece)
            (want,) = _CRC.unpack(f.read(_CRC.size))
            if crc != want:
                reading.torn.append((path, pos, "a chunk fails its checksum"))
                return
            try:
                header = json.loads(header_raw)
            except ValueError:
                reading.torn.append((path, pos, "a chunk header is not JSON"))
                return
            yield kind, header, payload_at, plen
            pos = payload_at + plen + _CRC.size


def read_steps(directory: str | os.PathLike, after_seq: int) -> Reading:
    """The committed steps with a sequence number above ``after_seq``, in order.

    Raises ``CheckpointError`` when they do not follow on from ``after_seq`` one by
    one (a segment is missing or corrupt in the middle: steps that were announced
    cannot be recovered, and resuming would silently lose them).
    """
    reading = Reading()
    expected = after_seq + 1
    for _, path in list_segments(directory):
        pending: list[StepInput] = []
        for kind, header, offset, length in _chunks(path, reading):
            try:
                if kind == STEP:
                    pending.append(StepInput(path, int(header["fragment"]), list(header["tensors"]), offset, length))
                    continue
                seq, inputs, meta = int(header["seq"]), int(header["inputs"]), header["meta"]
            except (KeyError, TypeError, ValueError) as exc:
                raise CheckpointError(f"{path}: a journal chunk at byte {offset} is malformed ({exc!r})") from None
            mine, pending = pending[len(pending) - inputs:] if inputs else [], []
            if len(mine) != inputs or not isinstance(meta, dict):
                raise CheckpointError(f"{path}: the commit of step {seq} lists {inputs} inputs; "
                                      f"{len(mine)} precede it")
            if seq < expected:
                continue  # already in the checkpoint
            if seq != expected:
                raise CheckpointError(
                    f"{path}: the journal jumps from step {expected - 1} to step {seq}: the steps between are "
                    f"missing or corrupt, so rounds the workers were told of cannot be recovered")
            reading.steps.append(Step(seq, mine, meta))
            expected += 1
        reading.uncommitted_inputs += len(pending)
    return reading


def rotate(directory: str | os.PathLike, oldest_kept_seq: int) -> list[pathlib.Path]:
    """Delete the segments every kept full checkpoint already holds (all their steps <= ``oldest_kept_seq``)."""
    segments = list_segments(directory)
    removed = []
    for (first, path), (next_first, _) in zip(segments, segments[1:]):
        if next_first - 1 <= oldest_kept_seq:
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed
