"""What the checks share: tolerances, the workers' vocabulary, ``Violation``, and the model
the checker rebuilds from the trace (``_Model``: rounds, params, optimizer state) with the
coordinator step being read (``_Step``).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from typing import Iterable

RTOL = 1e-4
ATOL = 1e-5

#: The states a ``worker`` record may name: ``diloco.worker.states.WorkerState``'s values (the
#: checker imports nothing from diloco; tests/sim/test_trace.py keeps the two equal).
WORKER_STATES = ("joining", "training", "waiting", "paused", "stopping", "stopped", "frozen", "dead")
#: States in which a worker has left whatever it was waiting for (a held_limit retry is off).
_LEFT_THE_WAIT = frozenset({"joining", "stopping", "stopped", "frozen", "dead"})
#: Seconds a worker's retry may take beyond its due time to show in the trace: the tick that
#: sends it (at most one heartbeat interval later) is counted separately; this covers link
#: delays (capped at 0.25 s) with room to spare.
_RETRY_SLACK_S = 1.0
#: A worker's message shows in the trace (delivered or dropped) within this of its sending:
#: the simulator caps link delays at 0.25 s.
_LINK_S = 0.3

ALLOWED_PHASE_MOVES = {
    ("forming", "running"), ("paused", "running"), ("running", "paused"), ("running", "draining"),
    ("forming", "stopped"), ("running", "stopped"), ("paused", "stopped"), ("draining", "stopped"),
}


def values_hash(items: Iterable[tuple[str, list[float]]]) -> str:
    """sha256 over each name, a NUL and its little-endian float32 bytes; 16 hex digits."""
    h = hashlib.sha256()
    for name, values in items:
        h.update(name.encode())
        h.update(b"\0")
        h.update(struct.pack(f"<{len(values)}f", *values))
    return h.hexdigest()[:16]


@dataclass
class Violation:
    t: float
    rule: str
    detail: str
    record: int

    def __str__(self) -> str:
        return f"[{self.rule}] t={self.t:.3f}s record #{self.record}: {self.detail}"


@dataclass
class _Model:
    """What the trace implies the coordinator holds: rounds, params, optimizer state, quorum."""

    fragments: list[list[str]]
    rounds: list[int]
    params: list[dict]
    hist: list[dict]
    opt: list[dict]
    delay: int

    def fhash(self, f: int) -> str:
        p = self.params[f]
        return values_hash((n, p[n]) for n in self.fragments[f])


@dataclass(slots=True)
class _Step:
    header: dict
    msg: dict | None
    recs: list = field(default_factory=list)
    #: (worker_id, fragment_id, round_id) -> (allowed outcomes of the Result it must get,
    #: the round its apply opened, or None for a stop).
    expect: dict = field(default_factory=dict)
    joins: dict = field(default_factory=dict)
    accept: tuple | None = None
    quorum_min: list = field(default_factory=list)
    #: (fragment_id, round_id) of the applies this step reported ``step_refused``.
    refused: set = field(default_factory=set)
