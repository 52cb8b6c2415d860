"""Events: what happened, fed into ``RoundFSM.step`` (past tense, frozen, slotted).

Events carry ids and round numbers only: never bytes, tensors or wall-clock
reads. Time enters through ``Ticked`` alone (SPEC.md R9). Field types are
checked by the core where a remote peer could have chosen them (ids, round
numbers) and answered with a ``Reject``; see SPEC.md section 3.
"""

from __future__ import annotations

from dataclasses import dataclass

from diloco.core.reasons import LeaveCause, ShutdownKind


@dataclass(frozen=True, slots=True)
class WorkerJoined:
    """A worker asked to join the run (the id of a live member is refused, `already_member`, SPEC.md R6)."""

    worker_id: str


@dataclass(frozen=True, slots=True)
class HeartbeatSeen:
    """A member proved it is alive; its deadline moves to now + heartbeat_timeout_s."""

    worker_id: str


@dataclass(frozen=True, slots=True)
class ContributionSubmitted:
    """A worker submitted a pseudo-gradient for ``fragment_id``.

    Sync: ``round_id`` is the round it contributes to. Async: ``round_id`` is
    the fragment version its local training started from (its base).
    """

    worker_id: str
    fragment_id: int
    round_id: int


@dataclass(frozen=True, slots=True)
class ReduceReported:
    """Collective plane: a group member says how its reduce of (fragment, round, attempt) ended.

    ``ok`` with the ``digest`` of the params it would adopt, or not ok (its collective
    failed). The machine commits only on every member's ok with one digest (SPEC.md C4).
    """

    worker_id: str
    fragment_id: int
    round_id: int
    attempt: int
    ok: bool
    digest: str = ""


@dataclass(frozen=True, slots=True)
class WorkerLeft:
    """A member is gone: it said goodbye, was kicked, or the transport saw it die."""

    worker_id: str
    cause: LeaveCause = LeaveCause.LEFT


@dataclass(frozen=True, slots=True)
class Ticked:
    """The driver's clock reads ``now_s`` (monotonic seconds). The only source of time."""

    now_s: float


@dataclass(frozen=True, slots=True)
class MinWorkersChanged:
    """An operator set a new quorum."""

    min_workers: int


@dataclass(frozen=True, slots=True)
class GraceWindowChanged:
    """P5: windows opened from now on last ``seconds`` (``--grace-window auto``; the open ones keep theirs)."""

    seconds: float


@dataclass(frozen=True, slots=True)
class ShutdownRequested:
    """An operator asked the run to end in the given way."""

    kind: ShutdownKind = ShutdownKind.DRAIN


Event = (
    WorkerJoined
    | HeartbeatSeen
    | ContributionSubmitted
    | WorkerLeft
    | Ticked
    | MinWorkersChanged
    | ShutdownRequested
    | ReduceReported
    | GraceWindowChanged
)

#: Every event type, in the order SPEC.md lists them (tests iterate this).
EVENT_TYPES: tuple[type, ...] = (
    WorkerJoined,
    HeartbeatSeen,
    ContributionSubmitted,
    WorkerLeft,
    Ticked,
    MinWorkersChanged,
    ShutdownRequested,
    ReduceReported,
    GraceWindowChanged,
)
