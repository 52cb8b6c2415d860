"""Effects: what the driver must do, returned by ``RoundFSM.step`` (imperative, frozen, slotted).

Execute them in list order; SPEC.md section 5 says why the order matters
(an ``ApplyRound`` always precedes the ``ReleaseWorker`` of its contributors:
compute the new params before you tell anyone to fetch them).
"""

from __future__ import annotations

from dataclasses import dataclass

from diloco.core.phases import Phase
from diloco.core.reasons import AbortReason, DiscardReason, RejectReason, ReleaseOutcome, ShutdownKind


@dataclass(frozen=True, slots=True)
class AcceptJoin:
    """Admit ``worker_id``; send it the global params and each fragment's open round id."""

    worker_id: str
    #: Per fragment: the open round (sync) or the current version (async).
    round_ids: tuple[int, ...]
    #: (fragment_id, round_id) where a contribution under this worker_id, accepted
    #: before it left, is still pending: the new member waits on it (SPEC.md P2).
    parked: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True, slots=True)
class AcceptContribution:
    """Keep this pseudo-gradient (add it to the round's running sum, or hold it)."""

    worker_id: str
    fragment_id: int
    round_id: int


@dataclass(frozen=True, slots=True)
class Reject:
    """Refuse the event; tell the sender ``reason`` and ``detail``. Nothing changed."""

    #: The sender, or "" for an admin event.
    worker_id: str
    reason: RejectReason
    #: A human-readable sentence: which field, which value, what was expected.
    detail: str


@dataclass(frozen=True, slots=True)
class ApplyRound:
    """Apply one outer step to ``fragment_id`` from exactly these contributions.

    Sync: the mean of the contributors' pseudo-gradients for ``round_id``.
    Async: the single contributor's held or just-accepted pseudo-gradient;
    ``round_id`` is the version being replaced (the new version is ``round_id + 1``).
    """

    fragment_id: int
    round_id: int
    contributors: tuple[str, ...]
    #: Collective plane: the digest every contributor reported (the commit, SPEC.md C4); "" on the hub.
    digest: str = ""


@dataclass(frozen=True, slots=True)
class OrderReduce:
    """Collective plane: tell ``group`` (sorted ids; rank = index) to reduce (fragment, round).

    Each member all-reduces its pseudo-gradient with the others, computes the outer step
    on a copy and reports ``ReduceReported`` with the digest of the params it would adopt.
    Nobody adopts anything until the ``ApplyRound`` of this attempt (SPEC.md C3).
    """

    fragment_id: int
    round_id: int
    attempt: int
    group: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class AbortReduce:
    """Collective plane: the attempt ended without a commit; its members drop what it computed.

    Survivors keep their pseudo-gradients: they are still ready for the round (SPEC.md C5).
    """

    fragment_id: int
    round_id: int
    attempt: int
    group: tuple[str, ...]
    reason: AbortReason


@dataclass(frozen=True, slots=True)
class ReleaseWorker:
    """Wake ``worker_id``, waiting on its contribution to (fragment, round), with ``outcome``."""

    worker_id: str
    fragment_id: int
    round_id: int
    outcome: ReleaseOutcome


@dataclass(frozen=True, slots=True)
class DeclareDead:
    """``worker_id`` missed its heartbeat deadline; forget it and close its connection."""

    worker_id: str
    last_seen_s: float


@dataclass(frozen=True, slots=True)
class DiscardContribution:
    """Drop this accepted contribution (free its buffers); it will never apply."""

    worker_id: str
    fragment_id: int
    round_id: int
    reason: DiscardReason


@dataclass(frozen=True, slots=True)
class QuorumChanged:
    """``below_min_workers`` flipped or ``min_workers`` changed; tell the workers."""

    below_min_workers: bool
    live_workers: int
    min_workers: int
    reason: str


@dataclass(frozen=True, slots=True)
class PhaseChanged:
    """The run's phase moved along the graph in SPEC.md section 6."""

    old: Phase
    new: Phase


@dataclass(frozen=True, slots=True)
class StopRun:
    """The run is over: checkpoint if ``kind`` is SAVE_AND_STOP, tell every worker to stop."""

    kind: ShutdownKind


Effect = (
    AcceptJoin
    | AcceptContribution
    | Reject
    | ApplyRound
    | ReleaseWorker
    | DeclareDead
    | DiscardContribution
    | QuorumChanged
    | PhaseChanged
    | StopRun
    | OrderReduce
    | AbortReduce
)

EFFECT_TYPES: tuple[type, ...] = (
    AcceptJoin,
    AcceptContribution,
    Reject,
    ApplyRound,
    ReleaseWorker,
    DeclareDead,
    DiscardContribution,
    QuorumChanged,
    PhaseChanged,
    StopRun,
    OrderReduce,
    AbortReduce,
)
