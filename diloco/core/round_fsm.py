"""The round state machine: ``step(event) -> list[effect]``, pure and deterministic.

Theory of operation
-------------------
Everything that decides *whether a pseudo-gradient becomes an outer step*
lives in this file; nothing else in diloco makes that decision. This file
does not know about bytes, tensors, sockets or clocks: the driver (the
coordinator, the simulator, your orchestrator) turns what happened into an
event, calls ``step``, and executes the effects it gets back in order.

The state is small:

* ``_members``: live workers, ordered by last-seen time (oldest first), so a
  ``Ticked`` finds expired members by looking at the front only (R9, O(1)
  amortised per event instead of a scan of all members).
* per fragment, a ``SyncBarrier`` (sync) or ``AsyncLane`` (async).
* ``_min_workers``, ``_now_s`` and the phase (a ``transitions`` machine that
  is fired only when the phase changes, R13).

The policies (SPEC.md P1-P5) in one breath: a contribution, once accepted,
stays accepted even if its worker dies (P1); a joiner is enlisted in the
open round at once, which is how a replacement unblocks a paused run (P2);
async contributions may be ``max_staleness`` versions old (P3); drain
finishes the round in flight, save-and-stop and abort stop at once (P4);
async contributions within a grace window merge into one outer step (P5).

The one rule (SPEC.md R5): nothing applies while live members < min_workers.
Every path that can apply -- a submission, a death, a leave, a tick, a
change of ``min_workers``, a join in async mode -- ends in
``_apply_ready``, which asks ``quorum_decision`` first. There is no other
place that emits ``ApplyRound``.

Rule numbers (R1..R13, P1..P4) refer to SPEC.md.

The collective data plane (SPEC.md C1-C7) runs the same barrier with one more
step between "complete" and "applied": a complete round with quorum is
*ordered to reduce* (``OrderReduce``) by its ready group, and it applies
(``ApplyRound``, the commit) only when every member of that group reported
success with the same digest and the group has at least ``min_workers``
members. Both the order and the commit are emitted by ``_apply_ready``; a
failure, a mismatch, a timeout, a lost member or a quorum raised above the
group aborts the attempt (``AbortReduce``), and the survivors stay ready.

Why one file of about 800 lines: it is the decision, and SPEC.md's claim
that ``_apply_ready`` is the only place that applies is checkable only if
every path to it is in view. What is not decision lives beside it: the
quorum rule (``quorum.py``), the barriers and lanes (``fragments.py``), the
phases (``phases.py``), snapshots (``snapshot.py``) and status (``status.py``).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any, Callable, cast

from diloco.core.config import DataPlane, FSMConfig, Mode, validate_min_workers
from diloco.core.effects import (
    AbortReduce,
    AcceptContribution,
    AcceptJoin,
    ApplyRound,
    DeclareDead,
    DiscardContribution,
    Effect,
    OrderReduce,
    PhaseChanged,
    QuorumChanged,
    Reject,
    ReleaseWorker,
    StopRun,
)
from diloco.core.errors import (
    ClockWentBackwardsError,
    ConfigError,
    InvalidEventError,
    MachineStoppedError,
    UnknownEventError,
)
from diloco.core.events import (
    ContributionSubmitted,
    HeartbeatSeen,
    MinWorkersChanged,
    GraceWindowChanged,
    ReduceReported,
    ShutdownRequested,
    Ticked,
    WorkerJoined,
    WorkerLeft,
)
from diloco.core.fragments import AsyncLane, ReduceAttempt, SyncBarrier
from diloco.core.phases import Phase, PhaseModel
from diloco.core.quorum import QuorumDecision, quorum_decision
from diloco.core.reasons import (
    AbortReason,
    DiscardReason,
    LeaveCause,
    RejectReason,
    ReleaseOutcome,
    ShutdownKind,
)
from diloco.core import snapshot as _snapshot
from diloco.core.status import FragmentStatus, MemberStatus, StatusView


class RoundFSM:
    """The pure round state machine of one DiLoCo run. See SPEC.md."""

    def __init__(self, config: FSMConfig, now_s: float = 0.0) -> None:
        if not isinstance(config, FSMConfig):
            raise ConfigError("config", config, "an FSMConfig")
        if isinstance(now_s, bool) or not isinstance(now_s, (int, float)) or now_s != now_s:
            raise ConfigError("now_s", now_s, "a number of seconds")
        self.config = config
        self._sync = config.mode is Mode.SYNC
        #: Collective plane (SPEC.md C1): rounds are reduced by their group and committed on a vote.
        self._collective = config.data_plane is DataPlane.COLLECTIVE
        #: Async grace window (SPEC.md P5): contributions within it merge into one outer step.
        self._window_s = config.grace_window_s
        self._timeout_s = config.heartbeat_timeout_s
        self._min_workers = config.min_workers
        self._now_s = float(now_s)
        #: worker_id -> last seen (s); insertion order == last-seen order (R9).
        self._members: OrderedDict[str, float] = OrderedDict()
        self._barriers: list[SyncBarrier] = []
        self._lanes: list[AsyncLane] = []
        if self._sync:
            self._barriers = [SyncBarrier() for _ in range(config.num_fragments)]
        else:
            self._lanes = [AsyncLane() for _ in range(config.num_fragments)]
        self._phase = PhaseModel(Phase.FORMING)
        self._set_quorum(quorum_decision(0, self._min_workers))
        self._handlers: dict[type, Callable[[Any, list[Effect]], None]] = {
            HeartbeatSeen: self._on_heartbeat,
            ContributionSubmitted: self._on_submit_sync if self._sync else self._on_submit_async,
            Ticked: self._on_tick,
            WorkerJoined: self._on_join,
            WorkerLeft: self._on_leave,
            MinWorkersChanged: self._on_min_workers,
            GraceWindowChanged: self._on_grace_window,
            ShutdownRequested: self._on_shutdown,
            ReduceReported: self._on_report,
        }

    # ------------------------------------------------------------------ API

    def step(self, event: object) -> list[Effect]:
        """Feed one event; return the effects to execute, in order (SPEC.md section 5)."""
        handler = self._handlers.get(type(event))
        if handler is None:
            handler = self._handler_for_subclass(event)
        if handler is None:
            raise UnknownEventError(
                f"step() takes one of the events in diloco.core.events, got {type(event).__name__}"
            )
        if self._phase.state is Phase.STOPPED:
            raise MachineStoppedError(
                f"the run is STOPPED; {type(event).__name__} cannot be stepped (SPEC.md R12)"
            )
        effects: list[Effect] = []
        handler(event, effects)
        return effects

    def _handler_for_subclass(self, event: object):
        """An instance of a subclass of an event is that event (the exact-class lookup is the fast path)."""
        for cls in type(event).__mro__[1:]:
            handler = self._handlers.get(cls)
            if handler is not None:
                return handler
        return None

    @property
    def phase(self) -> Phase:
        return self._phase.state

    @property
    def below_min_workers(self) -> bool:
        """True while live members < min_workers (exact after every event, SPEC.md I6)."""
        return self._quorum.below_min_workers

    @property
    def quorum(self) -> QuorumDecision:
        return self._quorum

    @property
    def min_workers(self) -> int:
        return self._min_workers

    @property
    def now_s(self) -> float:
        return self._now_s

    @property
    def live_workers(self) -> int:
        return len(self._members)

    def is_member(self, worker_id: str) -> bool:
        return worker_id in self._members

    def open_round_ids(self) -> tuple[int, ...]:
        """Per fragment: the open round (sync) or the current version (async)."""
        if self._sync:
            return tuple(b.round_id for b in self._barriers)
        return tuple(lane.version for lane in self._lanes)

    @property
    def rounds_applied(self) -> int:
        """Outer steps applied so far, over all fragments."""
        return sum(self.open_round_ids())

    def status(self) -> StatusView:
        """A read-only view for status pages; O(members), never on the per-event path."""
        members = tuple(
            MemberStatus(wid, last, self._now_s - last) for wid, last in sorted(self._members.items())
        )
        fragments = []
        for fid in range(self.config.num_fragments):
            if self._sync:
                b = self._barriers[fid]
                contributed = tuple(b.contributed)
                awaited = tuple(w for w in sorted(self._members) if w not in b.contributed)
                fragments.append(FragmentStatus(fid, b.round_id, contributed, awaited, ()))
            else:
                lane = self._lanes[fid]
                fragments.append(FragmentStatus(fid, lane.version, (), (), tuple(lane.held)))
        return StatusView(
            phase=self.phase,
            mode=self.config.mode,
            min_workers=self._min_workers,
            below_min_workers=self.below_min_workers,
            quorum_reason=self._quorum.reason,
            now_s=self._now_s,
            members=members,
            fragments=tuple(fragments),
            rounds_applied=self.rounds_applied,
        )

    def snapshot(self) -> dict:
        """Plain msgpack-serialisable state with a format version (SPEC.md section 10)."""
        return _snapshot.dump(
            config=self.config.to_dict(),
            phase=self.phase,
            min_workers=self._min_workers,
            now_s=self._now_s,
            members=self._members,
            barriers=self._barriers,
            lanes=self._lanes,
            window_s=self._window_s,
        )

    @classmethod
    def restore(cls, snap: object) -> "RoundFSM":
        """Rebuild a machine that behaves exactly like the one that took ``snap`` (SPEC.md I9)."""
        parsed = _snapshot.load(snap)
        fsm = cls(parsed.config, now_s=parsed.now_s)
        fsm._min_workers = parsed.min_workers
        fsm._members = parsed.members
        if fsm._sync:
            fsm._barriers = parsed.barriers
        else:
            fsm._lanes = parsed.lanes
        fsm._window_s = parsed.window_s
        fsm._phase = PhaseModel(parsed.phase)
        fsm._set_quorum(quorum_decision(len(fsm._members), fsm._min_workers))
        return fsm

    @classmethod
    def resume(cls, snap: object, now_s: float = 0.0) -> "RoundFSM":
        """Start a new incarnation of a stopped or crashed run from ``snap``.

        Keeps the config, ``min_workers``, every fragment's round counter and the
        grace window's length (P5, as ``GraceWindowChanged`` set it); forgets members
        and anything in flight (they were discarded at the stop, SPEC.md P4): workers
        re-join and continue from the checkpointed params.
        """
        parsed = _snapshot.load(snap)
        fsm = cls(parsed.config, now_s=now_s)
        fsm._min_workers = parsed.min_workers
        fsm._window_s = parsed.window_s
        fsm._set_quorum(quorum_decision(0, fsm._min_workers))
        if fsm._sync:
            fsm._barriers = [SyncBarrier(round_id=b.round_id) for b in parsed.barriers]
        else:
            fsm._lanes = [AsyncLane(version=lane.version) for lane in parsed.lanes]
        return fsm

    # ------------------------------------------------------------ handlers

    def _on_heartbeat(self, event: HeartbeatSeen, effects: list[Effect]) -> None:
        if self._known(event.worker_id, effects):
            self._seen(event.worker_id)

    def _on_tick(self, event: Ticked, effects: list[Effect]) -> None:
        now = event.now_s
        if isinstance(now, bool) or not isinstance(now, (int, float)) or not -math.inf < now < math.inf:
            # Not a clock reading at all (NaN, infinity, a string): after Ticked(inf) no
            # deadline could ever pass again, so it is refused like any malformed event.
            raise InvalidEventError(f"Ticked.now_s must be a finite number of seconds, got {now!r}")
        if now < self._now_s:
            raise ClockWentBackwardsError(
                f"Ticked(now_s={now!r}) is earlier than the machine's clock {self._now_s!r} (SPEC.md R9)"
            )
        self._now_s = float(now)
        members = self._members
        now, timeout = self._now_s, self._timeout_s
        dead: list[str] = []
        # Members are ordered oldest-seen first, so expired ones are a prefix.
        # R9 says ``now_s - last_seen > heartbeat_timeout_s``; compute exactly that
        # (``last < now - timeout`` disagrees in the last bit, e.g. 0.7 vs 1.0 - 0.3).
        for wid, last in members.items():
            if not now - last > timeout:
                break
            dead.append(wid)
        if dead:
            for wid in dead:
                effects.append(DeclareDead(wid, members[wid]))
                self._remove_member(wid)
            self._after_membership_change(effects)
        if self._collective and self._phase.state is not Phase.STOPPED:
            # C5: an attempt past its deadline aborts; O(F) per tick, collective runs only.
            expired = [fid for fid, b in enumerate(self._barriers)
                       if b.reducing is not None and now > b.reducing.deadline_s]
            if expired:
                self._apply_ready(effects, expired)
        elif self._window_s and self._phase.state is not Phase.STOPPED:
            # P5: a window whose deadline passed closes (if the quorum holds); O(F) per tick.
            expired = [fid for fid, lane in enumerate(self._lanes)
                       if lane.held and now >= cast(float, lane.deadline_s)]  # set while held (P5)
            if expired:
                self._apply_ready(effects, expired)

    def _on_join(self, event: WorkerJoined, effects: list[Effect]) -> None:
        wid = event.worker_id
        if not isinstance(wid, str) or not 0 < len(wid) <= self.config.max_worker_id_len:
            effects.append(Reject(
                wid if isinstance(wid, str) else "", RejectReason.INVALID_WORKER_ID,
                f"worker_id={wid!r} is invalid: expected a non-empty string of at most "
                f"{self.config.max_worker_id_len} characters",
            ))
            return
        if self._phase.state is Phase.DRAINING:
            effects.append(Reject(wid, RejectReason.SHUTTING_DOWN,
                                  f"worker {wid!r} cannot join: the run is draining"))
            return
        if wid in self._members:
            # R6: only the driver can tell a restarted worker from a duplicate
            # message; it reports the old incarnation gone (WorkerLeft) first.
            effects.append(Reject(wid, RejectReason.ALREADY_MEMBER,
                                  f"worker {wid!r} is already a live member; a restarted worker "
                                  f"re-joins after its old incarnation is reported gone"))
            return
        if len(self._members) >= self.config.max_workers:
            effects.append(Reject(wid, RejectReason.TOO_MANY_WORKERS,
                                  f"worker {wid!r} cannot join: max_workers={self.config.max_workers} "
                                  f"live members already"))
            return
        self._members[wid] = self._now_s
        # P2: the joiner is enlisted in every fragment's *open* round at once; if
        # its id still has a contribution pending there (accepted before it left,
        # P1), it counts as contributed and waits on that contribution.
        parked: list[tuple[int, int]] = []
        if self._sync:
            for fid, barrier in enumerate(self._barriers):
                if wid in barrier.contributed:
                    barrier.live_contributed += 1
                    parked.append((fid, barrier.round_id))
        else:
            for fid, lane in enumerate(self._lanes):
                base = lane.held.get(wid)
                if base is not None:
                    # P3: it waits on its held contribution, and bases up to the version
                    # before the one it joined at belong to earlier incarnations.
                    lane.last_base[wid] = max(base, lane.version - 1)
                    if self._window_s:
                        lane.live_held += 1
                    parked.append((fid, base))
                else:
                    # P3/R4: the joiner was given version ``lane.version``; a base older
                    # than that is work of a previous incarnation and may have applied.
                    lane.last_base[wid] = lane.version - 1
        effects.append(AcceptJoin(wid, self.open_round_ids(), tuple(parked)))
        self._after_membership_change(effects)

    def _on_leave(self, event: WorkerLeft, effects: list[Effect]) -> None:
        try:
            LeaveCause(event.cause)
        except ValueError:
            raise InvalidEventError(f"WorkerLeft.cause={event.cause!r} is not a LeaveCause") from None
        wid = event.worker_id
        if not self._known(wid, effects):
            return
        self._remove_member(wid)
        self._after_membership_change(effects)

    def _on_submit_sync(self, event: ContributionSubmitted, effects: list[Effect]) -> None:
        wid = event.worker_id
        if not self._known(wid, effects):
            return
        fid, rid = event.fragment_id, event.round_id
        reject = self._check_ids(wid, fid, rid)
        if reject is not None:
            effects.append(reject)
            return
        barrier = self._barriers[fid]
        if rid != barrier.round_id:
            effects.append(_wrong_round(wid, fid, rid, barrier.round_id, "round"))
            return
        if wid in barrier.contributed:
            effects.append(Reject(wid, RejectReason.DUPLICATE,
                                  f"worker {wid!r} already contributed to fragment {fid} round {rid}"))
            return
        if barrier.reducing is not None:
            # C3: the group is fixed once ordered; a member that joined since waits for the verdict.
            effects.append(Reject(wid, RejectReason.REDUCING,
                                  f"fragment {fid} round {rid} is being reduced (attempt "
                                  f"{barrier.reducing.attempt}) by a group without {wid!r}; ready again "
                                  f"after its commit or abort"))
            return
        barrier.contributed[wid] = None
        barrier.live_contributed += 1
        self._seen(wid)  # a submission is proof of life (R9)
        effects.append(AcceptContribution(wid, fid, rid))
        if barrier.live_contributed == len(self._members):
            self._apply_ready(effects, (fid,))

    def _on_submit_async(self, event: ContributionSubmitted, effects: list[Effect]) -> None:
        wid = event.worker_id
        if not self._known(wid, effects):
            return
        fid, base = event.fragment_id, event.round_id
        reject = self._check_ids(wid, fid, base)
        if reject is not None:
            effects.append(reject)
            return
        lane = self._lanes[fid]
        if base > lane.version:
            effects.append(_wrong_round(wid, fid, base, lane.version, "version"))
            return
        if lane.version - base > self.config.max_staleness:
            effects.append(Reject(
                wid, RejectReason.STALE_ROUND,
                f"fragment {fid}: base version {base} is {lane.version - base} versions old; "
                f"max_staleness={self.config.max_staleness} (P3)",
            ))
            return
        if wid in lane.held or base <= lane.last_base.get(wid, -1):
            effects.append(Reject(
                wid, RejectReason.DUPLICATE,
                f"worker {wid!r} already contributed from fragment {fid} base version "
                f"{lane.last_base.get(wid)}; each base version counts once",
            ))
            return
        if (self._quorum.below_min_workers or lane.held) and len(lane.held) >= self.config.max_held_per_fragment:
            effects.append(Reject(
                wid, RejectReason.HELD_LIMIT,
                f"fragment {fid} already holds max_held_per_fragment="
                f"{self.config.max_held_per_fragment} contributions below quorum",
            ))
            return
        lane.last_base[wid] = base
        if self._window_s:
            if not lane.held:
                # P5: the first pending contribution opens the window.
                lane.deadline_s = self._now_s + self._window_s
            lane.live_held += 1
        lane.held[wid] = base
        self._seen(wid)  # a submission is proof of life (R9)
        effects.append(AcceptContribution(wid, fid, base))
        self._apply_ready(effects, (fid,))

    def _on_report(self, event: ReduceReported, effects: list[Effect]) -> None:
        """C4: a group member's outcome. Commits go through ``_apply_ready`` like every apply."""
        wid = event.worker_id
        if not self._known(wid, effects):
            return
        fid, rid, attempt, ok, digest = (event.fragment_id, event.round_id, event.attempt,
                                         event.ok, event.digest)
        reject = self._check_ids(wid, fid, rid)
        if reject is not None:
            effects.append(reject)
            return
        if type(attempt) is not int or attempt < 0 or type(ok) is not bool or (
                ok and not (isinstance(digest, str) and 0 < len(digest) <= MAX_DIGEST_LEN)):
            effects.append(Reject(wid, RejectReason.INVALID_REPORT,
                                  f"report attempt={attempt!r} ok={ok!r} digest={digest!r:.80}: expected an "
                                  f"integer attempt >= 0, a bool ok and, when ok, a digest of 1.."
                                  f"{MAX_DIGEST_LEN} characters"))
            return
        current = self._barriers[fid].reducing if self._collective else None
        if (current is None or rid != self._barriers[fid].round_id or attempt != current.attempt
                or wid not in current.reports):
            effects.append(Reject(wid, RejectReason.STALE_ATTEMPT,
                                  f"no reduce attempt {attempt} of fragment {fid} round {rid} is open with "
                                  f"{wid!r} in its group"))
            return
        if current.reports[wid]:
            effects.append(Reject(wid, RejectReason.DUPLICATE,
                                  f"worker {wid!r} already reported attempt {attempt} of fragment {fid} "
                                  f"round {rid}"))
            return
        self._seen(wid)  # a report is proof of life (R9)
        if not ok:
            self._abort(fid, AbortReason.REDUCE_FAILED, effects)
        elif current.reported and digest != next(d for d in current.reports.values() if d):
            # C4: replicas that would adopt different params must not commit.
            self._abort(fid, AbortReason.DIGEST_MISMATCH, effects)
        else:
            current.reports[wid] = digest
            current.reported += 1
            if current.reported < len(current.reports):
                return
        self._apply_ready(effects, (fid,))

    def _on_min_workers(self, event: MinWorkersChanged, effects: list[Effect]) -> None:
        try:
            value = validate_min_workers(event.min_workers, self.config.max_workers)
        except ConfigError as exc:
            effects.append(Reject("", RejectReason.INVALID_MIN_WORKERS, str(exc)))
            return
        self._min_workers = value
        self._after_membership_change(effects, announce=True)

    def _on_grace_window(self, event: GraceWindowChanged, effects: list[Effect]) -> None:
        """P5: the length of the windows opened from now on, within (0, the configured window]."""
        ceiling, s = self.config.grace_window_s, event.seconds
        if not ceiling or isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 < s <= ceiling:
            effects.append(Reject("", RejectReason.INVALID_GRACE_WINDOW,
                                  f"grace window {s!r}: expected seconds in (0, {ceiling:g}]" if ceiling else
                                  "this run has no grace window to change (grace_window_s=0)"))
            return
        self._window_s = float(s)

    @property
    def grace_window_s(self) -> float:
        """The length of the next window opened (P5; 0: no window)."""
        return self._window_s

    def _on_shutdown(self, event: ShutdownRequested, effects: list[Effect]) -> None:
        try:
            kind = ShutdownKind(event.kind)
        except ValueError:
            raise InvalidEventError(f"ShutdownRequested.kind={event.kind!r} is not a ShutdownKind") from None
        if kind is ShutdownKind.DRAIN:
            if self._phase.state is Phase.DRAINING:
                effects.append(Reject("", RejectReason.SHUTTING_DOWN, "the run is already draining"))
                return
            if self._sync and not self._quorum.below_min_workers:
                # P4: let the round in flight finish; _apply_ready stops the run after it.
                self._move_phase("drain_requested", effects)
                return
            if self._window_s and not self._quorum.below_min_workers and any(lane.held for lane in self._lanes):
                # P4/P5: the open windows are what is in flight: they close now, as the drain's
                # final steps (applied_final), and _apply_ready stops the run after them.
                self._move_phase("drain_requested", effects)
                for lane in self._lanes:
                    if lane.held:
                        lane.deadline_s = self._now_s
                self._apply_ready(effects, range(self.config.num_fragments))
                return
        # P4: async drain, a drain below quorum, save-and-stop and abort all stop now.
        self._stop(kind, effects)

    # ------------------------------------------------------------- helpers

    def _check_ids(self, wid: str, fid: object, rid: object) -> Reject | None:
        """R3: fragment and round ids a remote peer chose must be in range and the right type."""
        if type(fid) is not int or not 0 <= fid < self.config.num_fragments:
            return Reject(wid, RejectReason.UNKNOWN_FRAGMENT,
                          f"fragment_id={fid!r} is invalid: expected an integer in "
                          f"0..{self.config.num_fragments - 1}")
        if type(rid) is not int or rid < 0:
            return Reject(wid, RejectReason.INVALID_ROUND,
                          f"round_id={rid!r} is invalid: expected a non-negative integer")
        return None

    def _remove_member(self, wid: str) -> None:
        """R7 / P1: forget a member. O(fragments).

        What it already contributed stays accepted and will apply with its
        round: the pseudo-gradient is valid work from the round's base, and
        keeping it lets the driver aggregate with running sums (nothing to
        subtract). It no longer counts as a live member, so it cannot help
        meet the quorum on its own (R5).
        """
        del self._members[wid]
        if self._sync:
            for barrier in self._barriers:
                if wid in barrier.contributed:
                    barrier.live_contributed -= 1
                    if self._collective:
                        # C2: a ready member's pseudo-gradient lived on that worker and left with it.
                        del barrier.contributed[wid]
        else:
            now = self._now_s
            for lane in self._lanes:
                lane.last_base.pop(wid, None)
                if self._window_s and lane.held:
                    if wid in lane.held:
                        lane.live_held -= 1
                    if cast(float, lane.deadline_s) > now:  # set while held (P5)
                        # P5: a departure inside the window releases it (it closes with what it has,
                        # once the quorum allows).
                        lane.deadline_s = now

    def _set_quorum(self, decision) -> None:
        """The quorum decision, mirrored into the phase model (which gates its moves on it)."""
        self._quorum = decision
        self._phase.below_min_workers = decision.below_min_workers

    def _known(self, wid: object, effects: list[Effect]) -> bool:
        """True for a live member; else an ``unknown_worker`` Reject (R3: an id is untrusted, and a
        non-string, maybe unhashable, one is unknown, not a TypeError)."""
        if isinstance(wid, str) and wid in self._members:
            return True
        effects.append(_unknown_worker(wid))
        return False

    def _seen(self, wid: str) -> None:
        """Proof of life (R9): move ``wid`` to the back of the last-seen order, O(1)."""
        members = self._members
        members[wid] = self._now_s
        members.move_to_end(wid)

    def _after_membership_change(self, effects: list[Effect], announce: bool = False) -> None:
        """Recompute the quorum, move the phase, then apply whatever became ready.

        Called after every join, leave, death and min_workers change: those are
        the paths that can unblock *or* complete a round, so every one of them
        goes through the same gate (R5, R7, R8).
        """
        decision = quorum_decision(len(self._members), self._min_workers)
        flipped = decision.below_min_workers != self._quorum.below_min_workers
        self._set_quorum(decision)
        if flipped or announce:
            effects.append(QuorumChanged(decision.below_min_workers, len(self._members),
                                         self._min_workers, decision.reason))
        phase = self._phase.state
        if decision.below_min_workers:
            if phase is Phase.RUNNING:
                self._move_phase("quorum_lost", effects)
            elif phase is Phase.DRAINING:
                # P4: a drain that lost quorum cannot finish its round: stop now.
                self._stop(ShutdownKind.DRAIN, effects)
                return
        elif phase is Phase.FORMING or phase is Phase.PAUSED:
            self._move_phase("quorum_reached", effects)
        self._apply_ready(effects, range(self.config.num_fragments))

    def _apply_ready(self, effects: list[Effect], fragment_ids) -> None:
        """The only place that emits ``ApplyRound`` (R5). Applies what is complete, if quorum holds.

        Collective plane (C3-C5): also the only place that orders a reduce and that
        aborts a broken attempt; aborts come first and are not gated (an attempt whose
        member died must end whether or not the quorum still holds).
        """
        if self._collective:
            self._abort_broken(effects, fragment_ids)
        if self._quorum.below_min_workers:
            return
        outcome = ReleaseOutcome.APPLIED
        if self._phase.state is Phase.DRAINING:
            outcome = ReleaseOutcome.APPLIED_FINAL
        applied = False
        if self._sync:
            members = self._members
            live = len(members)
            for fid in fragment_ids:
                barrier = self._barriers[fid]
                # R5: complete = every live member contributed. Contributors that
                # left since count as contributors, never as live members (P1).
                if self._collective:
                    attempt = barrier.reducing
                    if attempt is None:
                        if barrier.contributed and barrier.live_contributed == live:
                            self._order_reduce(fid, effects)
                        continue
                    # C4: the commit. Every member reported ok with one digest (``_on_report``
                    # aborts on a mismatch), all are live and at least min_workers
                    # (``_abort_broken`` ended the attempt otherwise).
                    if attempt.reported != len(attempt.reports) or len(attempt.reports) < self._min_workers:
                        continue
                    rid = barrier.round_id
                    contributors = tuple(attempt.reports)
                    effects.append(ApplyRound(fid, rid, contributors, next(iter(attempt.reports.values()))))
                    for wid in contributors:
                        effects.append(ReleaseWorker(wid, fid, rid, outcome))
                    barrier.round_id = rid + 1
                    barrier.contributed = {}
                    barrier.live_contributed = 0
                    barrier.attempts = 0
                    barrier.reducing = None
                    applied = True
                    continue
                if not barrier.contributed or barrier.live_contributed != live:
                    continue
                rid = barrier.round_id
                contributors = tuple(barrier.contributed)
                effects.append(ApplyRound(fid, rid, contributors))
                for wid in contributors:
                    if wid in members:
                        effects.append(ReleaseWorker(wid, fid, rid, outcome))
                barrier.round_id = rid + 1
                barrier.contributed = {}
                barrier.live_contributed = 0
                applied = True
        elif self._window_s:
            members = self._members
            now, live = self._now_s, len(members)
            for fid in fragment_ids:
                lane = self._lanes[fid]
                # P5: the window closes -- everything held merges into one outer step -- when its
                # deadline passed (or a departure or a drain released it), or every live member
                # has a contribution in it.
                if not lane.held or (now < lane.deadline_s and lane.live_held != live):
                    continue
                contributors = tuple(lane.held)
                effects.append(ApplyRound(fid, lane.version, contributors))
                for wid in contributors:
                    if wid in members:
                        effects.append(ReleaseWorker(wid, fid, lane.held[wid], outcome))
                lane.version += 1
                lane.held = {}
                lane.live_held = 0
                lane.deadline_s = None
                applied = True
        else:
            for fid in fragment_ids:
                lane = self._lanes[fid]
                # P3: held contributions apply one by one, in arrival order.
                while lane.held:
                    wid = next(iter(lane.held))
                    base = lane.held.pop(wid)
                    effects.append(ApplyRound(fid, lane.version, (wid,)))
                    if wid in self._members:
                        effects.append(ReleaseWorker(wid, fid, base, outcome))
                    lane.version += 1
                    applied = True
        if applied and outcome is ReleaseOutcome.APPLIED_FINAL:
            # P4: the drain's round applied; nothing else will.
            self._stop(ShutdownKind.DRAIN, effects)

    def _order_reduce(self, fid: int, effects: list[Effect]) -> None:
        """C3: the ready group (every live member, at least min_workers) reduces the open round."""
        barrier = self._barriers[fid]
        group = tuple(sorted(barrier.contributed))
        barrier.reducing = ReduceAttempt(barrier.attempts, dict.fromkeys(group, ""),
                                         self._now_s + self.config.reduce_timeout_s)
        barrier.attempts += 1
        effects.append(OrderReduce(fid, barrier.round_id, barrier.reducing.attempt, group))

    def _abort_broken(self, effects: list[Effect], fragment_ids) -> None:
        """C5: end each open attempt that can no longer commit: a member gone, the quorum raised
        above the group, or the deadline passed. O(group) per fragment, on membership changes."""
        members = self._members
        for fid in fragment_ids:
            attempt = self._barriers[fid].reducing
            if attempt is None:
                continue
            if any(wid not in members for wid in attempt.reports):
                self._abort(fid, AbortReason.MEMBER_LOST, effects)
            elif len(attempt.reports) < self._min_workers:
                self._abort(fid, AbortReason.GROUP_BELOW_QUORUM, effects)
            elif self._now_s > attempt.deadline_s:
                self._abort(fid, AbortReason.TIMEOUT, effects)

    def _abort(self, fid: int, reason: AbortReason, effects: list[Effect]) -> None:
        """C5: drop the attempt; its live members stay ready (they are ``contributed`` still)."""
        barrier = self._barriers[fid]
        attempt = barrier.reducing
        assert attempt is not None
        barrier.reducing = None
        effects.append(AbortReduce(fid, barrier.round_id, attempt.attempt, tuple(attempt.reports), reason))

    def _stop(self, kind: ShutdownKind, effects: list[Effect]) -> None:
        """R12: discard everything pending, wake every parked member with STOP, then stop."""
        members = self._members
        if self._sync:
            for fid, barrier in enumerate(self._barriers):
                if barrier.reducing is not None:
                    self._abort(fid, AbortReason.SHUTDOWN, effects)
                for wid in barrier.contributed:
                    effects.append(DiscardContribution(wid, fid, barrier.round_id, DiscardReason.SHUTDOWN))
                    if wid in members:
                        effects.append(ReleaseWorker(wid, fid, barrier.round_id, ReleaseOutcome.STOP))
                barrier.contributed = {}
                barrier.live_contributed = 0
        else:
            for fid, lane in enumerate(self._lanes):
                for wid, base in lane.held.items():
                    effects.append(DiscardContribution(wid, fid, base, DiscardReason.SHUTDOWN))
                    if wid in members:
                        effects.append(ReleaseWorker(wid, fid, base, ReleaseOutcome.STOP))
                lane.held = {}
                lane.live_held = 0
                lane.deadline_s = None
        self._move_phase("stopped", effects)
        effects.append(StopRun(kind))

    def _move_phase(self, trigger: str, effects: list[Effect]) -> None:
        old = self._phase.state
        self._phase.fire(trigger)
        effects.append(PhaseChanged(old, self._phase.state))


#: Longest digest a reduce report may carry (a hex SHA-256 is 64 characters).
MAX_DIGEST_LEN = 128


def _unknown_worker(wid: object) -> Reject:
    return Reject(wid if isinstance(wid, str) else "", RejectReason.UNKNOWN_WORKER,
                  f"worker {wid!r} is not a live member of this run (join first)")


def _wrong_round(wid: str, fid: int, got: int, open_id: int, noun: str) -> Reject:
    if got < open_id:
        return Reject(wid, RejectReason.STALE_ROUND,
                      f"fragment {fid}: {noun} {got} already applied; the open {noun} is {open_id}")
    return Reject(wid, RejectReason.FUTURE_ROUND,
                  f"fragment {fid}: {noun} {got} has not opened; the open {noun} is {open_id}")
