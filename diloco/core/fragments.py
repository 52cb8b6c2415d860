"""Per-fragment round state: a sync barrier or an async lane.

Each fragment of the model has its own round counter and its own barrier
(Streaming DiLoCo, SPEC.md R11). These classes only hold state; the rules
that read and change it live in ``round_fsm.py``.

Dicts with ``None`` values stand in for sets throughout the core: they iterate
in insertion order, so effects come out in the same order on every run and in
every process (a ``set`` of strings would not: hash randomisation).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class ReduceAttempt:
    """Collective plane: the group a fragment's open round was ordered to reduce (SPEC.md C3-C5)."""

    #: Which attempt at this round (0, 1, ...): a late report names an old one and is refused.
    attempt: int
    #: Group member -> the digest it reported ("" until it reports ok), in rank order (sorted ids).
    reports: dict[str, str]
    #: The clock after which an attempt still missing reports aborts (``reduce_timeout_s``).
    deadline_s: float
    #: How many members have reported ok (the commit waits for all: a counter, not a scan).
    reported: int = 0


@dataclass(slots=True)
class SyncBarrier:
    """The open round of one fragment in sync mode.

    Every live member is expected in the open round (joiners are enlisted at
    once, SPEC.md P2). A member that leaves after contributing stays in
    ``contributed`` (SPEC.md P1) but no longer in ``live_contributed``, so the
    round is complete exactly when ``live_contributed == live members`` -- a
    counter, not a scan (R13).
    """

    round_id: int = 0
    #: Accepted contributors of ``round_id`` (live or departed), in acceptance order.
    contributed: dict[str, None] = field(default_factory=dict)
    #: How many of ``contributed`` are live members right now.
    live_contributed: int = 0
    #: Collective plane: reduce attempts ordered for ``round_id`` so far (the next one's number).
    attempts: int = 0
    #: Collective plane: the open attempt, while the ready group reduces (None while collecting).
    reducing: ReduceAttempt | None = None


@dataclass(slots=True)
class AsyncLane:
    """One fragment in async mode: a version counter and the contributions held below quorum
    (or, with a grace window, in the open window: SPEC.md P5)."""

    #: Number of outer steps applied to this fragment so far (one per contribution without a window).
    version: int = 0
    #: worker_id -> base version, held while below quorum or in the open window, in arrival order
    #: (FIFO on release).
    held: dict[str, int] = field(default_factory=dict)
    #: worker_id -> base version of its last accepted contribution (the duplicate check, SPEC.md R4).
    last_base: dict[str, int] = field(default_factory=dict)
    #: Grace window (P5): the clock at which the open window closes (the first held contribution's
    #: acceptance plus ``grace_window_s``; moved to the clock of a member's departure, which releases
    #: it); None while nothing is held. Unused without a window.
    deadline_s: float | None = None
    #: Grace window (P5): how many of ``held`` are live members (the early close compares it with the
    #: live members: a counter, not a scan, R13).
    live_held: int = 0
