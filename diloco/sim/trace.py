"""The trace: one JSON object per line, the only thing the checkers read.

Record kinds (every record has ``k``, the kind, and ``t``, simulated seconds):

``config``  first record: the format, the seed, the overrides and every derived knob.
``recv``    message ``m`` was delivered: ``src``, ``dst`` (peer names), ``type``. A
            worker's message delivered to the coordinator opens coordinator step ``s`` and
            carries the message's non-tensor fields and ``ts``, when it was sent; tensor
            payloads appear as ``h`` (a hash: sha256 over names and little-endian float32
            bytes, 16 hex digits) and, where a checker needs the numbers, ``v`` (name -> list
            of floats). A coordinator's message delivered to a worker refers to its ``send``.
``send``    a message the coordinator sent, in step ``s``: ``m`` (message id), ``src``,
            ``dst``, ``type`` and its fields (tensors as ``h``, as above).
``drop``    message ``m`` was lost (``why``: partition, closed, coordinator down); a
            worker's message carries its fields here instead of in a ``recv``.
``tick`` ``lost`` ``admin``   other coordinator steps: a clock tick that changed something,
            the transport reporting a peer gone, an operator command.
``obs``     an event from the coordinator's observer (``what``: join, dead, left, quorum,
            phase, apply, stop; collective: reduce, abort, reduce_failed), in the order it
            fired; ``apply`` carries the fragment's params after the step (``p``) and their
            hash (hub), or the committed ``digest`` (collective).
``worker``  a worker's state changed (``diloco.worker.states``: joining, training, waiting,
            paused, stopping, stopped; frozen and dead as observed); ``adopt``: a worker
            installed params for a fragment (``h``). Collective plane: ``adopt`` is a change
            of the worker's replica (``src``: ``commit`` with the digest ``d``, ``heal``
            ``from`` a member, or ``start``; ``r``, the round it is at after it; ``p``, the peer).
``fault``   a fault injected or healed, a snapshot, a coordinator crash or restart, a
            supervisor restarting a worker that exited (``why``, ``resume``). Collective
            plane: a reduce fault (``what`` one of ``REDUCE_FAULT_KINDS``, with ``w``, ``f``,
            ``r``, ``a``: worker, fragment, round, attempt), a heal that failed
            (``heal_failed``, ``why``); snapshots carry ``commits`` instead of ``hf``.
``phase``   the simulation moved on: heal (with the liveness bound), liveness_ok,
            shutdown, end.

Lines are ``json.dumps(record, separators=(",", ":"))``; the trace's sha256 is over
those lines, each followed by ``\\n``, so two runs agree byte for byte or not at all.
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import IO, Callable, Iterable, Iterator

import torch

TRACE_FORMAT = "diloco.sim.trace"
TRACE_VERSION = 2

_dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=True, check_circular=False,
                          allow_nan=False).encode


class ConsumerAbort(Exception):
    """Raised by a trace consumer to stop the run at once (``--replay``'s divergence)."""


def hash_values(items: Iterable[tuple[str, list[float]]]) -> str:
    """The trace's tensor hash: sha256 over each name and its little-endian float32 bytes.

    Checkers recompute it from the float lists they reconstruct, so it is defined
    on values, not on torch objects.
    """
    h = hashlib.sha256()
    for name, values in items:
        h.update(name.encode())
        h.update(b"\0")
        h.update(struct.pack(f"<{len(values)}f", *values))
    return h.hexdigest()[:16]


def tensors_to_lists(tensors: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    return {name: t.reshape(-1).tolist() for name, t in tensors.items()}


class TraceWriter:
    """Serialises records, hashes them, writes them to a file and feeds consumers.

    A consumer is a callable taking ``(record, line)``: the record (a dict of JSON
    types only) and its line. A record consumer takes the record alone (the checker,
    the timeline). Records are never kept in memory here, so a long run costs O(1)
    memory for its trace.
    """

    def __init__(self, path: str | None = None, consumers: Iterable[Callable[[dict, str], None]] = (),
                 record_consumers: Iterable[Callable[[dict], None]] = ()) -> None:
        self._sha = hashlib.sha256()
        self._file: IO[str] | None = open(path, "w", encoding="ascii") if path else None
        self._consumers = list(consumers)
        self._record_consumers = list(record_consumers)
        self._sha_update = self._sha.update
        self.count = 0

    def emit(self, record: dict, line: str | None = None) -> None:
        """Write ``record``. Hot paths pass ``line`` pre-formatted; it must equal ``json.dumps``'s."""
        if line is None:
            line = _dumps(record)
        self.count += 1
        data = line + "\n"
        self._sha_update(data.encode("ascii"))
        if self._file is not None:
            self._file.write(data)
        if self._consumers:
            for consumer in self._consumers:
                consumer(record, line)
        for consumer in self._record_consumers:
            consumer(record)

    def sha256(self) -> str:
        return self._sha.hexdigest()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_trace(path: str) -> Iterator[dict]:
    """Records of a JSONL trace file, in order."""
    with open(path, encoding="ascii") as f:
        for line in f:
            line = line.rstrip("\n")
            if line:
                yield json.loads(line)


def read_lines(path: str) -> Iterator[str]:
    with open(path, encoding="ascii") as f:
        for line in f:
            yield line.rstrip("\n")
