"""Enums the events and effects speak in: reason codes, outcomes, kinds.

Each code is part of the contract (SPEC.md section 4) and crosses the wire as
its string value, so values never change once released.
"""

from __future__ import annotations

import enum


class RejectReason(str, enum.Enum):
    """Why an event from a worker or an admin was refused. The state did not change (SPEC.md R2)."""

    #: The worker is not a live member (never joined, or was declared dead / left).
    UNKNOWN_WORKER = "unknown_worker"
    #: ``worker_id`` is not a non-empty string within ``max_worker_id_len``.
    INVALID_WORKER_ID = "invalid_worker_id"
    #: ``fragment_id`` is not an integer in ``0..num_fragments-1``.
    UNKNOWN_FRAGMENT = "unknown_fragment"
    #: ``round_id`` is not a non-negative integer.
    INVALID_ROUND = "invalid_round"
    #: Sync: the round already applied. Async: the base version is more than ``max_staleness`` old.
    STALE_ROUND = "stale_round"
    #: The round (sync) or base version (async) has not opened yet.
    FUTURE_ROUND = "future_round"
    #: This worker already contributed to this (fragment, round), or already has one held.
    DUPLICATE = "duplicate"
    #: The run is draining or stopping; no joins, and no contributions that could not apply.
    SHUTTING_DOWN = "shutting_down"
    #: ``max_workers`` live members already.
    TOO_MANY_WORKERS = "too_many_workers"
    #: Async: ``max_held_per_fragment`` contributions are already held below quorum.
    HELD_LIMIT = "held_limit"
    #: ``min_workers`` change to a value outside ``1..max_workers``.
    INVALID_MIN_WORKERS = "invalid_min_workers"
    #: A grace window change in a run without a window, or to a length outside (0, its ceiling].
    INVALID_GRACE_WINDOW = "invalid_grace_window"
    #: A live member with this id exists; the driver must report the old one gone first (R6).
    ALREADY_MEMBER = "already_member"
    #: Collective plane: no reduce attempt (fragment, round, attempt) is open with the sender in
    #: its group (an old attempt's late report, or a hub run), SPEC.md C4.
    STALE_ATTEMPT = "stale_attempt"
    #: Collective plane: a reduce report whose ``attempt``, ``ok`` or ``digest`` is malformed.
    INVALID_REPORT = "invalid_report"
    #: Collective plane: the fragment's open round is being reduced by a group without the sender;
    #: it is enlisted in what the attempt leaves open (SPEC.md C3).
    REDUCING = "reducing"


class DiscardReason(str, enum.Enum):
    """Why an accepted contribution will never be applied (SPEC.md I4: never silently dropped).

    A contributor leaving is *not* a reason: its accepted contribution stays in
    its round (SPEC.md P1). Only a stop discards.
    """

    #: The run stopped before the contribution could apply (SPEC.md R12).
    SHUTDOWN = "shutdown"


class AbortReason(str, enum.Enum):
    """Collective plane: why a reduce attempt ended without a commit (SPEC.md C5).

    The group's surviving members stay ready (their pseudo-gradients are still valid
    for the round), so the round is retried by a new attempt as soon as every live
    member is ready and the quorum holds.
    """

    #: A member of the group reported that its collective failed (an error, its own timeout).
    REDUCE_FAILED = "reduce_failed"
    #: Two members reported different digests of the params they would adopt.
    DIGEST_MISMATCH = "digest_mismatch"
    #: A member of the group left, was kicked or was declared dead.
    MEMBER_LOST = "member_lost"
    #: Not every member reported within ``reduce_timeout_s`` of the order.
    TIMEOUT = "timeout"
    #: ``min_workers`` rose above the group's size: its commit would be below quorum.
    GROUP_BELOW_QUORUM = "group_below_quorum"
    #: The run stopped.
    SHUTDOWN = "shutdown"


class ReleaseOutcome(str, enum.Enum):
    """What a worker waiting on a contribution is told when it is released."""

    #: The round applied: fetch the new global params and keep training.
    APPLIED = "applied"
    #: The round applied and the run is draining: fetch the new params, then stop.
    APPLIED_FINAL = "applied_final"
    #: Nothing applied for you and the run is stopping: stop now.
    STOP = "stop"


class ShutdownKind(str, enum.Enum):
    """How a run is asked to end (SPEC.md P4)."""

    #: Finish the round in flight if it can apply, then stop; stop at once if it cannot.
    DRAIN = "drain"
    #: Stop now; the driver checkpoints global state; parked contributions are discarded.
    SAVE_AND_STOP = "save_and_stop"
    #: Stop now, saving nothing.
    ABORT = "abort"


class LeaveCause(str, enum.Enum):
    """Why a member left (carried by ``WorkerLeft``; all causes follow the same rule, SPEC.md R7)."""

    #: The worker said goodbye.
    LEFT = "left"
    #: An operator removed it (``diloco kick``).
    KICKED = "kicked"
    #: The transport saw it die (connection lost, process gone).
    CRASHED = "crashed"
    #: Collective plane: the run starts again from a newer state another joiner holds; this
    #: member joins again and copies it (SPEC.md C6).
    RESEEDED = "reseeded"
    #: Collective plane: every member of an attempt's group found its contribution failing the
    #: run's checks, or it left its report out of attempt after attempt (SPEC.md section 7c).
    EVICTED = "evicted"
