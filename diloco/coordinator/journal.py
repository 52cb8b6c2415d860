"""The hub coordinator's write-ahead journal: a durable round costs what the round changed.

A full checkpoint (``checkpoint.py``) holds the params and the outer optimizers'
state: two model copies, 800 MB at 100M parameters, too much to write before
every round's Results (SPEC.md section 5: persist before announce). What a
round changes is fully determined by its outer step's *input*
(``HubRounds.outer_step`` is deterministic), so the journal records that, and
a full checkpoint is written every few rounds in the background
(``persist.py``). The input is recorded in one of two forms:

- the contributions, as they came (encoded in the run's wire dtype: one byte per
  parameter at int8), each appended *as it is accepted*, so that only the last
  one of a round is written after the round closes; a replay decodes them and
  sums them in the same order (``ParamStore.accumulate``, ``take_mean``);
- the mean pseudo-gradient itself (fp32 runs: k fp32 contributions would be k
  times the bytes), written while the outer step runs.

Resuming reads the newest valid full checkpoint and replays the journal's steps
after it through the same code: the params and the momentum come back bit for
bit.

Files, next to the full checkpoints::

    journal-<first seq, 12 digits>.log

A segment starts after each full checkpoint (``journal_seq`` in the checkpoint's
metadata is the last step it holds) and after each resume. A segment is a
sequence of chunks::

    b"DLJ1" kind(1 byte) header_len(u64 LE) payload_len(u64 LE) header payload crc32(u32 LE)

- ``K`` (a contribution): header ``{"incarnation", "fragment", "round", "worker", "wire",
  "tensors": [[name, dtype, shape], ...], "scales": [...]}``, payload the values' then
  the scales' bytes.
- ``S`` (a mean pseudo-gradient): header ``{"fragment", "tensors": [...]}``, payload the
  tensors' bytes.
- ``C`` (commit): header ``{"seq": n, "steps": [...], "meta": {...}}``, no payload. Each
  step is ``{"fragment": f, "mean": true}`` (the next ``S`` chunk since the last
  commit) or ``{"fragment": f, "inputs": [[round, worker], ...]}`` (``K`` chunks of this
  incarnation: summed in that order, or in async mode the one held contribution).
  ``meta`` is the coordinator's small state after step ``n`` (the machine's snapshot,
  counters, access list: what a checkpoint's metadata holds). Step ``n`` is durable
  once its commit is fsync'd.

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

from diloco.ckptio import _raw, fsync_dir, numbered_files, write_all
from diloco.ckptio import CheckpointError

MAGIC = b"DLJ1"
CONTRIBUTION = b"K"
MEAN = b"S"
COMMIT = b"C"
KINDS = (CONTRIBUTION, MEAN, COMMIT)
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
    return numbered_files(directory, _NAME_RX)


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

    def append_mean(self, fragment_id: int, tensors: dict[str, torch.Tensor]) -> int:
        """Append a mean pseudo-gradient; its size in bytes. See ``append_contribution`` on the fdatasync."""
        size = self._append(MEAN, {"fragment": fragment_id, "tensors": _listing(tensors)}, list(tensors.values()))
        os.fdatasync(self._fd)
        return size

    def append_contribution(self, incarnation: int, fragment_id: int, round_id: int, worker_id: str,
                            wire_dtype: str, values: dict[str, torch.Tensor], scales: dict[str, torch.Tensor],
                            tokens: int | None = None) -> int:
        """Append an accepted contribution as it came; its size in bytes.

        fdatasync'd here already (this runs on the journal thread, while the round goes on),
        so that the commit's own fdatasync, which the Results wait for, finds little left to
        write: a round's contributions are hundreds of MB of dirty pages otherwise.
        """
        header = {"incarnation": incarnation, "fragment": fragment_id, "round": round_id, "worker": worker_id,
                  "wire": wire_dtype, "tensors": _listing(values), "scales": _listing(scales)}
        if tokens is not None:
            header["tokens"] = tokens  # a token-weighted merge replays with the same weights
        size = self._append(CONTRIBUTION, header, list(values.values()) + list(scales.values()))
        os.fdatasync(self._fd)
        return size

    def append_commit(self, seq: int, steps: list[dict], meta: dict) -> None:
        """Append a commit and fsync the segment: step ``seq`` is durable when this returns."""
        self._append(COMMIT, {"seq": seq, "steps": steps, "meta": meta}, [])
        os.fdatasync(self._fd)

    def _append(self, kind: bytes, header: dict, tensors: list[torch.Tensor]) -> int:
        raw_header = json.dumps(header, separators=(",", ":")).encode()
        views = [_raw(t) for t in tensors if t.numel()]
        payload_len = sum(len(v) for v in views)
        head = _HEAD.pack(MAGIC, kind, len(raw_header), payload_len) + raw_header
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

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _listing(tensors: dict[str, torch.Tensor]) -> list:
    return [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in tensors.items()]


# --------------------------------------------------------------------- reading


@dataclass
class Chunk:
    """Where a chunk's tensors lie in a segment (read only if its step is replayed)."""

    path: pathlib.Path
    header: dict
    offset: int
    length: int

    def load(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(tensors, scales): a mean's tensors, or a contribution's encoded values and scales."""
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            buf = bytearray(self.length)
            if f.readinto(buf) != self.length:
                raise CheckpointError(f"{self.path}: a journal chunk ends early")
        pos = 0
        out = []
        for listing in (self.header["tensors"], self.header.get("scales", [])):
            tensors: dict[str, torch.Tensor] = {}
            for name, dtype, shape in listing:
                torch_dtype = _DTYPES[dtype]
                numel = 1
                for d in shape:
                    numel *= int(d)
                t = (torch.frombuffer(buf, dtype=torch_dtype, offset=pos, count=numel) if numel
                     else torch.empty(0, dtype=torch_dtype))
                tensors[name] = t.reshape([int(d) for d in shape])
                pos += numel * t.element_size()
            out.append(tensors)
        if pos != self.length:
            raise CheckpointError(f"{self.path}: a journal chunk's tensors do not fill its {self.length} bytes")
        return out[0], out[1]


@dataclass
class StepInput:
    """One outer step of a committed journal step: the mean itself, or the contributions that made it."""

    fragment_id: int
    mean: Chunk | None = None
    #: The contributions in the order they were summed (async: the one held contribution).
    contributions: list[Chunk] = field(default_factory=list)


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
    #: Means and contributions no commit used (the open rounds at a crash).
    unused_chunks: int = 0


def _chunks(path: pathlib.Path, reading: Reading) -> Iterator[tuple[bytes, dict, int, int]]:
    """(kind, header, payload offset, payload length) of each whole, crc-checked chunk of a segment."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return  # deleted since it was listed: a rotation (every kept checkpoint holds its steps)
    with f:
        size = os.fstat(f.fileno()).st_size
        pos = 0
        while pos < size:
            raw = f.read(_HEAD.size)
            if len(raw) < _HEAD.size:
                reading.torn.append((path, pos, "a chunk header ends early"))
                return
            magic, kind, hlen, plen = _HEAD.unpack(raw)
            if magic != MAGIC or kind not in KINDS or pos + _HEAD.size + hlen + plen + _CRC.size > size:
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
            if not isinstance(header, dict):
                reading.torn.append((path, pos, "a chunk header is not an object"))
                return
            yield kind, header, payload_at, plen
            pos = payload_at + plen + _CRC.size


def read_steps(directory: str | os.PathLike, after_seq: int) -> Reading:
    """The committed steps with a sequence number above ``after_seq``, in order.

    Raises ``CheckpointError`` when they do not follow on from ``after_seq`` one by
    one, or a commit names a contribution the journal does not hold (a segment is
    missing or corrupt in the middle: steps that were announced cannot be
    recovered, and resuming would silently lose them).
    """
    reading = Reading()
    expected = after_seq + 1
    #: (incarnation, fragment, round, worker) -> the contribution's chunk, until a commit uses it.
    contributions: dict[tuple[int, int, int, str], Chunk] = {}
    for _, path in list_segments(directory):
        means: list[Chunk] = []
        for kind, header, offset, length in _chunks(path, reading):
            chunk = Chunk(path, header, offset, length)
            try:
                if kind == CONTRIBUTION:
                    key = (int(header["incarnation"]), int(header["fragment"]), int(header["round"]),
                           str(header["worker"]))
                    contributions[key] = chunk
                    continue
                if kind == MEAN:
                    means.append(chunk)
                    continue
                seq, meta = int(header["seq"]), header["meta"]
                incarnation = int(meta["incarnation"])
                inputs = []
                for step in header["steps"]:
                    fid = int(step["fragment"])
                    if step.get("mean"):
                        if not means:
                            raise CheckpointError(f"{path}: the commit of step {seq} has no mean before it")
                        inputs.append(StepInput(fid, mean=means.pop(0)))
                        continue
                    used = []
                    for round_id, worker in step["inputs"]:
                        key = (incarnation, fid, int(round_id), str(worker))
                        if key not in contributions:
                            if seq < expected:
                                break  # already in the checkpoint: its contributions may be gone
                            raise CheckpointError(
                                f"{path}: step {seq} sums worker {worker!r}'s contribution to fragment {fid} "
                                f"round {round_id}, which the journal does not hold (a segment is missing)")
                        used.append(contributions.pop(key))
                    inputs.append(StepInput(fid, contributions=used))
            except (KeyError, TypeError, ValueError) as exc:
                if isinstance(exc, CheckpointError):
                    raise
                raise CheckpointError(f"{path}: a journal chunk at byte {offset} is malformed ({exc!r})") from None
            if seq < expected:
                continue  # already in the checkpoint
            if seq != expected:
                raise CheckpointError(
                    f"{path}: the journal jumps from step {expected - 1} to step {seq}: the steps between are "
                    f"missing or corrupt, so rounds the workers were told of cannot be recovered")
            reading.steps.append(Step(seq, inputs, meta))
            expected += 1
        reading.unused_chunks += len(means)
    reading.unused_chunks += len(contributions)
    return reading


def rotate(directory: str | os.PathLike, oldest_kept_seq: int, pinned: set[int] = frozenset()) -> list[pathlib.Path]:
    """Delete the segments every kept full checkpoint already holds (all their steps <= ``oldest_kept_seq``),
    but not those ``pinned`` (by first seq: they hold contributions to rounds still open)."""
    segments = list_segments(directory)
    removed = []
    for (first, path), (next_first, _) in zip(segments, segments[1:]):
        if next_first - 1 <= oldest_kept_seq and first not in pinned:
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed
