"""The tracking model the property tests share: follow a RoundFSM from the outside.

A ``Tracker`` knows only what a driver can know -- the events it fed and the
effects it got back -- and from those alone it rebuilds who is live, what is
pending, which round each fragment is on, and the phase. After every step it
checks the effect list against the rules (``observe``) and the machine's
visible state against its own (``check_state``). Every assertion message
starts with the SPEC.md number it enforces, so a failure names the rule.

It is deliberately not a second implementation of the core: it does not
decide *what* should happen next (``test_reference_model`` does that), only
that what did happen is allowed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from diloco.core import (
    AcceptContribution,
    AcceptJoin,
    ApplyRound,
    ContributionSubmitted,
    DeclareDead,
    DiscardContribution,
    DiscardReason,
    FSMConfig,
    HeartbeatSeen,
    MinWorkersChanged,
    Mode,
    Phase,
    PhaseChanged,
    QuorumChanged,
    Reject,
    RejectReason,
    ReleaseOutcome,
    ReleaseWorker,
    RoundFSM,
    ShutdownKind,
    ShutdownRequested,
    StopRun,
    Ticked,
    WorkerJoined,
    WorkerLeft,
)

#: (worker_id, fragment_id, round_id) -- the round id is the sync round, or the async base version.
Key = tuple[str, int, int]

#: The phase graph as SPEC.md section 6 draws it, written out by hand (not read from the code).
ALLOWED_PHASE_MOVES: frozenset[tuple[Phase, Phase]] = frozenset({
    (Phase.FORMING, Phase.RUNNING),
    (Phase.PAUSED, Phase.RUNNING),
    (Phase.RUNNING, Phase.PAUSED),
    (Phase.RUNNING, Phase.DRAINING),
    (Phase.FORMING, Phase.STOPPED),
    (Phase.RUNNING, Phase.STOPPED),
    (Phase.PAUSED, Phase.STOPPED),
    (Phase.DRAINING, Phase.STOPPED),
})


def snapshot_key(fsm: RoundFSM) -> str:
    """A canonical string for a machine's state (used to deduplicate states)."""
    return json.dumps(fsm.snapshot(), sort_keys=True)


def parked_keys(snap: dict) -> dict[Key, None]:
    """Every accepted-but-unresolved contribution a snapshot shows, in fragment then arrival order."""
    keys: dict[Key, None] = {}
    for fid, frag in enumerate(snap["fragments"]):
        if "contributed" in frag:
            for wid in frag["contributed"]:
                keys[(wid, fid, frag["round_id"])] = None
        else:
            for wid, base in frag["held"]:
                keys[(wid, fid, base)] = None
    return keys


def is_valid_worker_id(wid: object, config: FSMConfig) -> bool:
    return isinstance(wid, str) and 0 < len(wid) <= config.max_worker_id_len


def is_valid_min_workers(value: object, config: FSMConfig) -> bool:
    return type(value) is int and 1 <= value <= config.max_workers


@dataclass
class Tracker:
    """What a driver can know about a run, rebuilt from events and effects only."""

    config: FSMConfig
    min_workers: int
    now_s: float = 0.0
    phase: Phase = Phase.FORMING
    #: live member -> last seen; dict order is last-seen order (R9).
    live: dict[str, float] = field(default_factory=dict)
    #: per fragment: the open round (sync) or current version (async).
    next_round: list[int] = field(default_factory=list)
    #: accepted, not yet applied or discarded (I4), in acceptance order.
    pending: dict[Key, None] = field(default_factory=dict)
    #: async: (worker, fragment) -> base of its last accepted contribution, this incarnation (P3).
    last_base: dict[tuple[str, int], int] = field(default_factory=dict)
    #: (worker, fragment, round) of every contribution ever applied (sync round / async version), I2.
    applied: set[tuple[str, int, int]] = field(default_factory=set)
    #: async grace window (P5): fragment -> the clock at which its open window closes (the first
    #: pending contribution's acceptance + the window, moved to a departure's clock); absent: none open.
    deadline: dict[int, float] = field(default_factory=dict)
    accepted_count: int = 0
    applied_count: int = 0
    discarded_count: int = 0
    steps: int = 0

    # ----------------------------------------------------------- builders

    @classmethod
    def fresh(cls, config: FSMConfig, now_s: float = 0.0) -> "Tracker":
        return cls(config=config, min_workers=config.min_workers, now_s=float(now_s),
                   next_round=[0] * config.num_fragments)

    @classmethod
    def from_fsm(cls, fsm: RoundFSM) -> "Tracker":
        """Start tracking an existing machine mid-run (exhaustive and product tests)."""
        snap = fsm.snapshot()
        t = cls(config=fsm.config, min_workers=snap["min_workers"], now_s=snap["now_s"],
                phase=Phase(snap["phase"]))
        t.live = {w: last for w, last in snap["members"]}
        for fid, frag in enumerate(snap["fragments"]):
            t.next_round.append(frag.get("round_id", frag.get("version")))
            for wid, base in frag.get("last_base", ()):
                t.last_base[(wid, fid)] = base
        t.pending = parked_keys(snap)
        t.accepted_count = len(t.pending)
        for fid, frag in enumerate(snap["fragments"]):
            if frag.get("deadline_s") is not None:
                t.deadline[fid] = frag["deadline_s"]
        return t

    # ------------------------------------------------------------ queries

    @property
    def sync(self) -> bool:
        return self.config.mode is Mode.SYNC

    @property
    def below(self) -> bool:
        return len(self.live) < self.min_workers

    @property
    def stopped(self) -> bool:
        return self.phase is Phase.STOPPED

    def pending_of(self, wid: str) -> list[Key]:
        return [k for k in self.pending if k[0] == wid]

    def held_count(self, fid: int) -> int:
        return sum(1 for k in self.pending if k[1] == fid)

    @property
    def window(self) -> float:
        """The async grace window in seconds (P5); 0: none."""
        return self.config.grace_window_s

    def window_due(self, fid: int) -> bool:
        """P5: fragment ``fid``'s open window must close now (if the quorum allows): its deadline
        passed (or a departure or a drain moved it to now), or every live member is in it."""
        if not self.window or fid not in self.deadline:
            return False
        inside = {k[0] for k in self.pending if k[1] == fid}
        return self.now_s >= self.deadline[fid] or set(self.live) <= inside

    def expected_reject(self, event: object) -> RejectReason | None:
        """The reason code an event must be rejected with, or None if it must be accepted.

        Only remote mistakes and admin typos are here; driver misuse raises instead.
        The checks run in the order SPEC.md section 4 lists them.
        """
        cfg = self.config
        if isinstance(event, WorkerJoined):
            wid = event.worker_id
            if not is_valid_worker_id(wid, cfg):
                return RejectReason.INVALID_WORKER_ID
            if self.phase is Phase.DRAINING:
                return RejectReason.SHUTTING_DOWN
            if wid in self.live:
                return RejectReason.ALREADY_MEMBER
            if len(self.live) >= cfg.max_workers:
                return RejectReason.TOO_MANY_WORKERS
            return None
        if isinstance(event, (HeartbeatSeen, WorkerLeft)):
            return None if self._is_live(event.worker_id) else RejectReason.UNKNOWN_WORKER
        if isinstance(event, MinWorkersChanged):
            return None if is_valid_min_workers(event.min_workers, cfg) else RejectReason.INVALID_MIN_WORKERS
        if isinstance(event, ShutdownRequested):
            if ShutdownKind(event.kind) is ShutdownKind.DRAIN and self.phase is Phase.DRAINING:
                return RejectReason.SHUTTING_DOWN
            return None
        if isinstance(event, ContributionSubmitted):
            return self._submit_reject(event.worker_id, event.fragment_id, event.round_id)
        return None

    def _is_live(self, wid: object) -> bool:
        return isinstance(wid, str) and wid in self.live

    def _submit_reject(self, wid: object, fid: object, rid: object) -> RejectReason | None:
        cfg = self.config
        if not self._is_live(wid):
            return RejectReason.UNKNOWN_WORKER
        if type(fid) is not int or not 0 <= fid < cfg.num_fragments:
            return RejectReason.UNKNOWN_FRAGMENT
        if type(rid) is not int or rid < 0:
            return RejectReason.INVALID_ROUND
        open_id = self.next_round[fid]
        if self.sync:
            if rid < open_id:
                return RejectReason.STALE_ROUND
            if rid > open_id:
                return RejectReason.FUTURE_ROUND
            if (wid, fid, rid) in self.pending:
                return RejectReason.DUPLICATE
            return None
        if rid > open_id:
            return RejectReason.FUTURE_ROUND
        if open_id - rid > cfg.max_staleness:
            return RejectReason.STALE_ROUND
        if any(k[0] == wid and k[1] == fid for k in self.pending):
            return RejectReason.DUPLICATE
        if rid <= self.last_base.get((wid, fid), -1):
            return RejectReason.DUPLICATE
        # Held below quorum, or (P5) in an open window above it: max_held_per_fragment bounds both.
        if (self.below or self.held_count(fid)) and self.held_count(fid) >= cfg.max_held_per_fragment:
            return RejectReason.HELD_LIMIT
        return None

    # ------------------------------------------------------------ observe

    def observe(self, event: object, effects: list) -> None:
        """Check one step's effect list against the rules and update the model.

        Raises AssertionError whose message starts with the rule number.
        """
        assert not self.stopped, "R12: a STOPPED machine returned effects instead of raising"
        self.steps += 1
        expected = self.expected_reject(event)
        rejects = [e for e in effects if isinstance(e, Reject)]
        if rejects or expected is not None:
            assert len(effects) == 1 and len(rejects) == 1, (
                f"R2: {event!r} must yield exactly one Reject({expected}), got {effects!r}")
            assert rejects[0].reason is expected, (
                f"R2: {event!r} rejected with {rejects[0].reason}, expected {expected}")
            assert isinstance(rejects[0].detail, str) and rejects[0].detail, "R2: a Reject explains itself"
            return

        old_below = self.below
        min_changed = False
        expected_dead: list[str] = []
        # Event-level facts that hold before the first effect executes.
        if isinstance(event, WorkerLeft):
            # R7: the member is gone before anything it was part of is settled.
            self._forget_member(event.worker_id)
        elif isinstance(event, ShutdownRequested):
            if (self.window and ShutdownKind(event.kind) is ShutdownKind.DRAIN and not self.below
                    and self.deadline):
                # P4/P5: an async drain closes the open windows now, as its final steps.
                for fid in self.deadline:
                    self.deadline[fid] = self.now_s
        elif isinstance(event, MinWorkersChanged):
            self.min_workers = event.min_workers
            min_changed = True
        elif isinstance(event, HeartbeatSeen):
            self._touch(event.worker_id)
        elif isinstance(event, Ticked):
            self.now_s = float(event.now_s)
            # R9, as written: silent for more than the timeout.
            timeout = self.config.heartbeat_timeout_s
            expected_dead = [w for w, last in self.live.items() if self.now_s - last > timeout]
            # P5: windows whose deadline this tick reaches close on it (with quorum).
            windows_due = [fid for fid in self.deadline if self.now_s >= self.deadline[fid]]

        seen_dead: list[str] = []
        joins = accepts = qcs = 0
        stop_kind: ShutdownKind | None = None
        i = 0
        n = len(effects)
        while i < n:
            e = effects[i]
            assert stop_kind is None, f"I5: {e!r} came after StopRun in {effects!r}"
            if isinstance(e, AcceptJoin):
                assert isinstance(event, WorkerJoined) and e.worker_id == event.worker_id, (
                    f"R6: AcceptJoin {e!r} does not answer {event!r}")
                # P2: the joiner is enlisted in every fragment's open round.
                assert e.round_ids == tuple(self.next_round), (
                    f"P2: AcceptJoin round_ids {e.round_ids} != open rounds {tuple(self.next_round)}")
                # P1/P2: an id with a contribution still pending comes back parked on it.
                mine = tuple(sorted((k[1], k[2]) for k in self.pending_of(e.worker_id)))
                assert e.parked == mine, f"P1: {e!r} but {e.worker_id} has {mine} pending"
                if not self.sync:
                    # P3: a joiner's work starts at the version it was given, so
                    # anything older is a previous incarnation's and cannot count.
                    for fid in range(len(self.next_round)):
                        self.last_base[(e.worker_id, fid)] = self.next_round[fid] - 1
                    for fid, base in mine:
                        self.last_base[(e.worker_id, fid)] = base
                self.live[e.worker_id] = self.now_s
                joins += 1
            elif isinstance(e, AcceptContribution):
                assert isinstance(event, ContributionSubmitted) and (
                    e.worker_id, e.fragment_id, e.round_id) == (event.worker_id, event.fragment_id, event.round_id), (
                    f"R3: {e!r} does not answer {event!r}")
                key = (e.worker_id, e.fragment_id, e.round_id)
                assert e.worker_id in self.live, f"R3: accepted a contribution from non-member {e.worker_id}"
                assert key not in self.pending, f"I2: {key} accepted twice while pending"
                if self.sync:
                    assert e.round_id == self.next_round[e.fragment_id], f"R3: {key} is not the open round"
                else:
                    lag = self.next_round[e.fragment_id] - e.round_id
                    assert 0 <= lag <= self.config.max_staleness, f"R10: {key} accepted with staleness {lag}"
                    assert not [k for k in self.pending if k[:2] == key[:2]], f"I2/R10: {key} second held"
                    self.last_base[(e.worker_id, e.fragment_id)] = e.round_id
                    if self.window and e.fragment_id not in self.deadline:
                        # P5: the first pending contribution opens the fragment's window.
                        self.deadline[e.fragment_id] = self.now_s + self.window
                self.pending[key] = None
                self._touch(e.worker_id)
                self.accepted_count += 1
                accepts += 1
            elif isinstance(e, ApplyRound):
                i = self._observe_apply(e, effects, i)
                continue
            elif isinstance(e, ReleaseWorker):
                raise AssertionError(
                    f"I11: {e!r} is neither right after its ApplyRound nor right after its "
                    f"DiscardContribution(SHUTDOWN) in {effects!r}")
            elif isinstance(e, DiscardContribution):
                key = (e.worker_id, e.fragment_id, e.round_id)
                assert key in self.pending, f"I4: {e!r} discards a contribution that was not pending"
                del self.pending[key]
                self.discarded_count += 1
                # P1: a contributor leaving is not a reason; only a stop discards.
                assert e.reason is DiscardReason.SHUTDOWN, f"P1: {e!r} outside a stop"
                if not any(k[1] == e.fragment_id for k in self.pending):
                    self.deadline.pop(e.fragment_id, None)
                assert any(isinstance(x, StopRun) for x in effects[i:]), (
                    f"I5: discarded with SHUTDOWN but the run does not stop: {effects!r}")
                if e.worker_id in self.live:
                    # I5: every member parked at the stop is woken with STOP.
                    nxt = effects[i + 1] if i + 1 < n else None
                    assert nxt == ReleaseWorker(e.worker_id, e.fragment_id, e.round_id, ReleaseOutcome.STOP), (
                        f"I5: {e!r} is not followed by its ReleaseWorker(STOP); got {nxt!r}")
                    i += 2
                    continue
            elif isinstance(e, DeclareDead):
                assert isinstance(event, Ticked), f"R9: {e!r} outside a Ticked"
                assert e.worker_id in self.live, f"R9: {e!r} declares a non-member dead"
                assert e.worker_id in expected_dead, (
                    f"R9: {e!r} at now={self.now_s} but timeout is {self.config.heartbeat_timeout_s}")
                assert e.last_seen_s == self.live[e.worker_id], (
                    f"R9: {e!r} but the worker was last seen at {self.live[e.worker_id]}")
                self._forget_member(e.worker_id)
                seen_dead.append(e.worker_id)
            elif isinstance(e, QuorumChanged):
                assert e.below_min_workers == self.below, f"I6: {e!r} but model says below={self.below}"
                assert e.live_workers == len(self.live), f"I6: {e!r} but {len(self.live)} live"
                assert e.min_workers == self.min_workers, f"I6: {e!r} but min_workers={self.min_workers}"
                qcs += 1
            elif isinstance(e, PhaseChanged):
                assert e.old is self.phase, f"I12: {e!r} but the phase was {self.phase}"
                assert (e.old, e.new) in ALLOWED_PHASE_MOVES, f"I12: illegal phase move {e!r}"
                if e.new in (Phase.RUNNING, Phase.DRAINING):
                    assert not self.below, f"I12: {e!r} while below quorum"
                if e.new is Phase.PAUSED:
                    assert self.below, f"I12: {e!r} while quorum holds"
                if e.new is Phase.STOPPED:
                    assert i + 1 < n and isinstance(effects[i + 1], StopRun), (
                        f"P4: PhaseChanged(->STOPPED) must be followed by StopRun: {effects!r}")
                self.phase = e.new
            elif isinstance(e, StopRun):
                assert self.phase is Phase.STOPPED, f"P4: {e!r} but phase is {self.phase}"
                assert not self.pending, f"I5: stopped with {list(self.pending)} still pending"
                stop_kind = e.kind
            elif isinstance(e, Reject):
                raise AssertionError(f"R2: unexpected {e!r}")
            else:
                raise AssertionError(f"unknown effect {e!r}")
            i += 1

        # ---- whole-step expectations
        if isinstance(event, Ticked):
            assert seen_dead == expected_dead, (
                f"R9: at now={self.now_s} expected {expected_dead} declared dead (last-seen order), got {seen_dead}")
            if not expected_dead and not (windows_due and not self.below):
                assert effects == [], f"R9: a tick with no deaths must do nothing, got {effects!r}"
        if isinstance(event, HeartbeatSeen):
            assert effects == [], f"R9: a heartbeat has no effects, got {effects!r}"
        if isinstance(event, WorkerJoined):
            assert joins == 1, f"R6: join of {event.worker_id} produced {joins} AcceptJoin"
        elif isinstance(event, ContributionSubmitted):
            assert accepts == 1, f"R3: valid submission {event!r} produced {accepts} AcceptContribution"
        else:
            assert joins == accepts == 0, f"an AcceptJoin/AcceptContribution answered {event!r}"
        new_below = self.below
        want_qc = 1 if (old_below != new_below or min_changed) else 0
        assert qcs == want_qc, (
            f"I6: {qcs} QuorumChanged for {event!r} (below {old_below}->{new_below}, min changed {min_changed})")
        if isinstance(event, ShutdownRequested):
            kind = ShutdownKind(event.kind)
            if kind is ShutdownKind.DRAIN and self.window and not old_below and effects[0] == PhaseChanged(
                    Phase.RUNNING, Phase.DRAINING):
                # P4/P5: an async drain with open windows applies them (applied_final), then stops.
                assert any(isinstance(x, ApplyRound) for x in effects) and stop_kind is kind, (
                    f"P5: an async drain with open windows gave {effects!r}")
            elif kind is ShutdownKind.DRAIN and self.sync and not old_below:
                # P4: a sync drain with quorum lets the round in flight finish first.
                assert effects == [PhaseChanged(Phase.RUNNING, Phase.DRAINING)], f"P4: drain gave {effects!r}"
            else:
                assert stop_kind is kind, f"P4: {event!r} must stop at once with StopRun({kind}), got {effects!r}"
        elif stop_kind is not None:
            # Only a drain ends without a ShutdownRequested in the same step.
            assert stop_kind is ShutdownKind.DRAIN, f"P4: {stop_kind} stop without a request"
        if self.phase is Phase.DRAINING:
            assert not self.below, "P4: a drain that lost quorum must stop at once"
        if self.window and not self.stopped and not self.below:
            # P5 liveness: no window that must close is left open while the quorum holds.
            due = [fid for fid in self.deadline if self.window_due(fid)]
            assert not due, (f"P5: fragment(s) {due} keep a window open past its close (deadline "
                             f"{[self.deadline[f] for f in due]}, now {self.now_s}, live {sorted(self.live)})")

    def _observe_apply(self, e: ApplyRound, effects: list, i: int) -> int:
        fid, rid, contributors = e.fragment_id, e.round_id, e.contributors
        assert 0 <= fid < self.config.num_fragments, f"I3: {e!r} names an unknown fragment"
        assert rid == self.next_round[fid], (
            f"I3: {e!r} but fragment {fid} is on round {self.next_round[fid]} (in order, at most once)")
        assert len(set(contributors)) == len(contributors), f"I2: {e!r} lists a worker twice"
        # I1: the quorum gate, on every path.
        assert not self.below, f"I1: {e!r} applied with {len(self.live)} live < min_workers {self.min_workers}"
        assert self.phase in (Phase.RUNNING, Phase.DRAINING), f"I1/I12: {e!r} applied in phase {self.phase}"
        if self.sync:
            # R5/I1: contributors include every member (P1: and may include departed ones).
            assert contributors and set(self.live) <= set(contributors), (
                f"I1/R5: {e!r} but live members are {sorted(self.live)}")
            assert len(contributors) >= self.min_workers, f"I1: {e!r} has < {self.min_workers} contributors"
            # I4: the round applies exactly what is pending for it, in acceptance order.
            want = tuple(k[0] for k in self.pending if k[1] == fid)
            assert contributors == want, f"I4: {e!r} but pending for fragment {fid} is {want}"
        elif self.window:
            # P5: a window closes with everything pending in it, in arrival order, and only when due.
            want = tuple(k[0] for k in self.pending if k[1] == fid)
            assert contributors == want, f"P5: {e!r} but the open window of fragment {fid} holds {want}"
            assert self.window_due(fid), (
                f"P5: {e!r} closed the window early: deadline {self.deadline.get(fid)}, now {self.now_s}, "
                f"live {sorted(self.live)}, in it {want}")
            del self.deadline[fid]
        else:
            assert len(contributors) == 1, f"I1/R5: async {e!r} must have exactly one contributor"
        final = self.phase is Phase.DRAINING
        want_outcome = ReleaseOutcome.APPLIED_FINAL if final else ReleaseOutcome.APPLIED
        j = i + 1
        for wid in contributors:
            if self.sync:
                key = (wid, fid, rid)
            else:
                mine = [x for x in self.pending if x[0] == wid and x[1] == fid]
                assert len(mine) == 1, f"I4: async {e!r} applies {wid} with {mine} pending"
                key = mine[0]
                oldest = next(x for x in self.pending if x[1] == fid)
                assert key == oldest, f"P3: async held contributions apply FIFO; {e!r} jumped {oldest}"
            assert key in self.pending, f"I4: {e!r} applies {key} which was not pending"
            applied_id = (wid, fid, rid)
            assert applied_id not in self.applied, f"I2: {applied_id} applied twice"
            self.applied.add(applied_id)
            del self.pending[key]
            self.applied_count += 1
            if wid in self.live:
                # I11: a member is released right after the ApplyRound that includes it.
                rel = effects[j] if j < len(effects) else None
                assert rel == ReleaseWorker(wid, fid, key[2], want_outcome), (
                    f"I11: {e!r} must be followed by ReleaseWorker({wid}, {fid}, {key[2]}, {want_outcome}); "
                    f"got {rel!r}")
                j += 1
            # P1: a departed contributor is nobody to wake.
        self.next_round[fid] += 1
        return j

    def observe_error(self) -> None:
        """A DriverError was raised: nothing happened (checked against the snapshot by the caller)."""

    def _forget_member(self, wid: str) -> None:
        """R7: the member is gone; what it contributed stays pending (P1); its duplicate memory goes (P3)."""
        del self.live[wid]
        for k in [k for k in self.last_base if k[0] == wid]:
            del self.last_base[k]
        for fid in self.deadline:
            # P5: a departure inside a window releases it.
            self.deadline[fid] = min(self.deadline[fid], self.now_s)

    def _touch(self, wid: str) -> None:
        self.live.pop(wid, None)
        self.live[wid] = self.now_s

    # ---------------------------------------------------------- state checks

    def check_state(self, fsm: RoundFSM) -> None:
        for check in (self.check_membership, self.check_i3_round_counters, self.check_i4_conservation,
                      self.check_i5_nothing_parked_after_stop, self.check_i6_below_flag,
                      self.check_i7_liveness, self.check_i12_phase):
            check(fsm)

    def check_membership(self, fsm: RoundFSM) -> None:
        st = fsm.status()
        got = {m.worker_id: m.last_seen_s for m in st.members}
        assert got == self.live, f"R7: machine members {got} != tracked {self.live}"
        assert [w for w, _ in fsm.snapshot()["members"]] == list(self.live), (
            f"R9: last-seen order {fsm.snapshot()['members']} != tracked {list(self.live)}")
        assert fsm.live_workers == len(self.live)
        assert fsm.min_workers == self.min_workers, f"R8: min_workers {fsm.min_workers} != {self.min_workers}"
        assert fsm.now_s == self.now_s, f"R9: clock {fsm.now_s} != {self.now_s}"

    def check_i3_round_counters(self, fsm: RoundFSM) -> None:
        assert fsm.open_round_ids() == tuple(self.next_round), (
            f"I3: open rounds {fsm.open_round_ids()} != applied-so-far {tuple(self.next_round)}")
        assert fsm.rounds_applied == sum(self.next_round)

    def check_i4_conservation(self, fsm: RoundFSM) -> None:
        shown = parked_keys(fsm.snapshot())
        assert set(shown) == set(self.pending), (
            f"I4: machine parks {sorted(shown)} but accepted-and-unresolved is {sorted(self.pending)}")
        st = fsm.status()
        for f in st.fragments:
            mine = [k[0] for k in self.pending if k[1] == f.fragment_id]
            assert sorted(f.contributed + f.held) == sorted(mine), (
                f"I4: status fragment {f.fragment_id} shows {f.contributed + f.held}, pending {mine}")
            if self.sync:
                assert set(f.awaited) == set(self.live) - set(f.contributed), (
                    f"P2: fragment {f.fragment_id} awaits {f.awaited}; members {sorted(self.live)}, "
                    f"contributed {f.contributed}")
        # Parked = a live member waiting on its accepted work; a departed contributor is not.
        assert set(st.parked_workers) == {k[0] for k in self.pending if k[0] in self.live}
        assert self.accepted_count == self.applied_count + self.discarded_count + len(self.pending), (
            f"I4: accepted {self.accepted_count} != applied {self.applied_count} + discarded "
            f"{self.discarded_count} + pending {len(self.pending)}")

    def check_i5_nothing_parked_after_stop(self, fsm: RoundFSM) -> None:
        if fsm.phase is Phase.STOPPED:
            assert not self.pending and not fsm.status().parked_workers, (
                f"I5: parked after shutdown: {fsm.status().parked_workers}")

    def check_i6_below_flag(self, fsm: RoundFSM) -> None:
        want = len(self.live) < self.min_workers
        assert fsm.below_min_workers == want, (
            f"I6: below_min_workers={fsm.below_min_workers} with {len(self.live)} live, min {self.min_workers}")
        assert fsm.status().below_min_workers == want
        assert fsm.quorum.below_min_workers == want

    def check_i7_liveness(self, fsm: RoundFSM) -> None:
        if fsm.phase is Phase.STOPPED or fsm.below_min_workers:
            return
        for f in fsm.status().fragments:
            if self.sync:
                assert not (f.contributed and set(self.live) <= set(f.contributed)), (
                    f"I7: fragment {f.fragment_id} round {f.round_id} has everyone in "
                    f"({f.contributed}) with quorum, but did not apply")
            elif self.window:
                assert not (f.held and self.window_due(f.fragment_id)), (
                    f"I7/P5: fragment {f.fragment_id} holds {f.held} in a window that is due")
            else:
                assert not f.held, f"I7: fragment {f.fragment_id} holds {f.held} although quorum holds"

    def check_i12_phase(self, fsm: RoundFSM) -> None:
        ph = fsm.phase
        assert ph is self.phase, f"I12: phase {ph} but PhaseChanged effects say {self.phase}"
        if ph in (Phase.RUNNING, Phase.DRAINING):
            assert not fsm.below_min_workers, f"I12: {ph} while below quorum"
        if ph in (Phase.FORMING, Phase.PAUSED):
            assert fsm.below_min_workers, f"I12: {ph} while quorum holds"
        if ph is Phase.DRAINING:
            assert self.sync, "P4: an async run never drains, it stops"
