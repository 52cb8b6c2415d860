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


@dataclass(slots=True)
class AsyncLane:
    """One fragment in async mode: a version counter and the contributions held below quorum."""

    #: Number of contributions applied to this fragment so far.
    version: int = 0
    #: worker_id -> base version, held while below quorum, in arrival order (FIFO on release).
    held: dict[str, int] = field(default_factory=dict)
    #: worker_id -> base version of its last accepted contribution (the duplicate check, SPEC.md R4).
    last_base: dict[str, int] = field(default_factory=dict)
