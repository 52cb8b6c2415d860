"""An oracle test: RoundFSM against a tiny, obviously-correct reference implementation.

``Reference`` restates SPEC.md sections 4-8 in the dumbest way that works:
plain lists and dicts, no counters kept in sync, no ordered-dict tricks, and
after every accepted event it recomputes from scratch what may apply (it does
not trust that only the submitted fragment can have become ready). Hypothesis
feeds both the same random event sequences, over random configs, and every
step's effect lists must be equal, in order, after normalising away only the
human-readable text (``Reject.detail`` and ``QuorumChanged.reason``).

The reference is written from the spec, not from round_fsm.py; where the spec
fixes an order (section 5) it follows it, otherwise it uses fragment order and
acceptance order, which is what the spec's "dicts, not sets" determinism
promise (R1) implies.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from diloco.core import (
    EVENT_TYPES,
    AcceptContribution,
    AcceptJoin,
    ApplyRound,
    ClockWentBackwardsError,
    InvalidEventError,
    ContributionSubmitted,
    DeclareDead,
    DiscardContribution,
    DiscardReason,
    DriverError,
    FSMConfig,
    HeartbeatSeen,
    LeaveCause,
    MachineStoppedError,
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
    UnknownEventError,
    WorkerJoined,
    WorkerLeft,
)


class Reference:
    """SPEC.md, executed literally."""

    def __init__(self, cfg: FSMConfig) -> None:
        self.cfg = cfg
        self.sync = cfg.mode is Mode.SYNC
        self.phase = Phase.FORMING
        self.min_workers = cfg.min_workers
        self.now = 0.0
        #: member -> (last_seen, touch number); the touch number orders members by last seen.
        self.members: dict[str, tuple[float, int]] = {}
        self.touches = 0
        #: sync: open round per fragment; async: version per fragment.
        self.open = [0] * cfg.num_fragments
        #: sync: [worker, fragment] per accepted contribution to an open round, in acceptance order.
        #: async: [worker, fragment, base] per held contribution, in arrival order.
        self.pending: list[list] = []
        #: async: (worker, fragment) -> base of its last accepted contribution (members only, P3).
        self.last_base: dict[tuple[str, int], int] = {}

    # --------------------------------------------------------------- facts

    def below(self) -> bool:
        return len(self.members) < self.min_workers

    def is_member(self, wid) -> bool:
        return isinstance(wid, str) and wid in self.members

    def touch(self, wid: str) -> None:
        self.touches += 1
        self.members[wid] = (self.now, self.touches)

    def pending_in(self, fid: int) -> list[list]:
        return [p for p in self.pending if p[1] == fid]

    def round_of(self, p: list) -> int:
        return self.open[p[1]] if self.sync else p[2]

    # ---------------------------------------------------------------- step

    def step(self, event) -> list:
        if type(event) not in EVENT_TYPES:
            raise UnknownEventError(type(event).__name__)
        if self.phase is Phase.STOPPED:
            raise MachineStoppedError("stopped")
        out: list = []
        was_below = self.below()
        handler = {
            WorkerJoined: self.on_join, HeartbeatSeen: self.on_heartbeat,
            ContributionSubmitted: self.on_submit, WorkerLeft: self.on_leave,
            Ticked: self.on_tick, MinWorkersChanged: self.on_min_workers,
            ShutdownRequested: self.on_shutdown,
        }[type(event)]
        handler(event, out, was_below)
        if not any(isinstance(e, Reject) for e in out):
            # Recompute from scratch: whatever is complete and may apply, applies now.
            self.settle(out)
        return out

    def on_join(self, ev, out, was_below):
        wid = ev.worker_id
        if not isinstance(wid, str) or len(wid) == 0 or len(wid) > self.cfg.max_worker_id_len:
            out.append(Reject(wid if isinstance(wid, str) else "", RejectReason.INVALID_WORKER_ID, ""))
        elif self.phase is Phase.DRAINING:
            out.append(Reject(wid, RejectReason.SHUTTING_DOWN, ""))
        elif wid in self.members:
            out.append(Reject(wid, RejectReason.ALREADY_MEMBER, ""))
        elif len(self.members) >= self.cfg.max_workers:
            out.append(Reject(wid, RejectReason.TOO_MANY_WORKERS, ""))
        else:
            self.touch(wid)
            # P1/P2: the id's still-pending contributions park the new member on them.
            parked = sorted((p[1], self.round_of(p)) for p in self.pending if p[0] == wid)
            if not self.sync:
                # P3: work older than the version the joiner is given is a previous incarnation's.
                for fid, version in enumerate(self.open):
                    self.last_base[(wid, fid)] = version - 1
                for fid, base in parked:
                    # Its held contribution's base may be newer than that (held at the
                    # current version): never lower the bar below either.
                    self.last_base[(wid, fid)] = max(base, self.open[fid] - 1)
            out.append(AcceptJoin(wid, tuple(self.open), tuple(parked)))
            self.membership_changed(out, was_below, announce=False)

    def on_heartbeat(self, ev, out, was_below):
        if self.is_member(ev.worker_id):
            self.touch(ev.worker_id)
        else:
            out.append(self.unknown(ev.worker_id))

    def on_leave(self, ev, out, was_below):
        if ev.cause not in {c.value for c in LeaveCause}:
            raise InvalidEventError(repr(ev.cause))
        if not self.is_member(ev.worker_id):
            out.append(self.unknown(ev.worker_id))
            return
        self.forget(ev.worker_id)
        self.membership_changed(out, was_below, announce=False)

    def on_tick(self, ev, out, was_below):
        now = ev.now_s
        if isinstance(now, bool) or not isinstance(now, (int, float)) or now != now or abs(now) == float("inf"):
            raise InvalidEventError(repr(now))
        if now < self.now:
            raise ClockWentBackwardsError(repr(now))
        self.now = float(now)
        # R9, literally: silence longer than the timeout means dead; in last-seen order.
        dead = [w for w, (last, _) in self.members.items() if self.now - last > self.cfg.heartbeat_timeout_s]
        dead.sort(key=lambda w: self.members[w][1])
        if not dead:
            return
        for wid in dead:
            out.append(DeclareDead(wid, self.members[wid][0]))
            self.forget(wid)
        self.membership_changed(out, was_below, announce=False)

    def on_min_workers(self, ev, out, was_below):
        n = ev.min_workers
        if type(n) is not int or not 1 <= n <= self.cfg.max_workers:
            out.append(Reject("", RejectReason.INVALID_MIN_WORKERS, ""))
            return
        self.min_workers = n
        self.membership_changed(out, was_below, announce=True)

    def on_shutdown(self, ev, out, was_below):
        try:
            kind = ShutdownKind(ev.kind)
        except ValueError:
            raise InvalidEventError(repr(ev.kind)) from None
        if kind is ShutdownKind.DRAIN and self.phase is Phase.DRAINING:
            out.append(Reject("", RejectReason.SHUTTING_DOWN, ""))
        elif kind is ShutdownKind.DRAIN and self.sync and not self.below():
            self.move(Phase.DRAINING, out)
        else:
            self.stop(kind, out)

    def on_submit(self, ev, out, was_below):
        wid, fid, rid = ev.worker_id, ev.fragment_id, ev.round_id
        reason = None
        if not self.is_member(wid):
            out.append(self.unknown(wid))
            return
        if type(fid) is not int or not 0 <= fid < self.cfg.num_fragments:
            reason = RejectReason.UNKNOWN_FRAGMENT
        elif type(rid) is not int or rid < 0:
            reason = RejectReason.INVALID_ROUND
        elif self.sync:
            if rid < self.open[fid]:
                reason = RejectReason.STALE_ROUND
            elif rid > self.open[fid]:
                reason = RejectReason.FUTURE_ROUND
            elif [wid, fid] in self.pending:
                reason = RejectReason.DUPLICATE
        else:
            if rid > self.open[fid]:
                reason = RejectReason.FUTURE_ROUND
            elif self.open[fid] - rid > self.cfg.max_staleness:
                reason = RejectReason.STALE_ROUND
            elif any(p[0] == wid for p in self.pending_in(fid)) or rid <= self.last_base.get((wid, fid), -1):
                reason = RejectReason.DUPLICATE
            elif self.below() and len(self.pending_in(fid)) >= self.cfg.max_held_per_fragment:
                reason = RejectReason.HELD_LIMIT
        if reason is not None:
            out.append(Reject(wid, reason, ""))
            return
        if self.sync:
            self.pending.append([wid, fid])
        else:
            self.pending.append([wid, fid, rid])
            self.last_base[(wid, fid)] = rid
        self.touch(wid)
        out.append(AcceptContribution(wid, fid, rid))

    # -------------------------------------------------------------- helpers

    def unknown(self, wid) -> Reject:
        return Reject(wid if isinstance(wid, str) else "", RejectReason.UNKNOWN_WORKER, "")

    def forget(self, wid: str) -> None:
        # R7/P1: the member goes; its pending contributions stay; its duplicate memory goes.
        del self.members[wid]
        self.last_base = {k: v for k, v in self.last_base.items() if k[0] != wid}

    def membership_changed(self, out, was_below, announce) -> None:
        below = self.below()
        if below != was_below or announce:
            out.append(QuorumChanged(below, len(self.members), self.min_workers, ""))
        if below and self.phase is Phase.RUNNING:
            self.move(Phase.PAUSED, out)
        elif below and self.phase is Phase.DRAINING:
            self.stop(ShutdownKind.DRAIN, out)
        elif not below and self.phase in (Phase.FORMING, Phase.PAUSED):
            self.move(Phase.RUNNING, out)

    def settle(self, out) -> None:
        """R5: apply every complete round / held contribution, if and only if quorum holds."""
        if self.phase is Phase.STOPPED or self.below():
            return
        outcome = ReleaseOutcome.APPLIED_FINAL if self.phase is Phase.DRAINING else ReleaseOutcome.APPLIED
        applied = False
        for fid in range(self.cfg.num_fragments):
            if self.sync:
                who = [p[0] for p in self.pending_in(fid)]
                if who and all(m in who for m in self.members):
                    out.append(ApplyRound(fid, self.open[fid], tuple(who)))
                    out.extend(ReleaseWorker(w, fid, self.open[fid], outcome) for w in who if w in self.members)
                    self.pending = [p for p in self.pending if p[1] != fid]
                    self.open[fid] += 1
                    applied = True
            else:
                for p in self.pending_in(fid):
                    out.append(ApplyRound(fid, self.open[fid], (p[0],)))
                    if p[0] in self.members:
                        out.append(ReleaseWorker(p[0], fid, p[2], outcome))
                    self.pending.remove(p)
                    self.open[fid] += 1
                    applied = True
        if applied and outcome is ReleaseOutcome.APPLIED_FINAL:
            self.stop(ShutdownKind.DRAIN, out)

    def stop(self, kind: ShutdownKind, out) -> None:
        for fid in range(self.cfg.num_fragments):
            for p in self.pending_in(fid):
                rid = self.round_of(p)
                out.append(DiscardContribution(p[0], fid, rid, DiscardReason.SHUTDOWN))
                if p[0] in self.members:
                    out.append(ReleaseWorker(p[0], fid, rid, ReleaseOutcome.STOP))
        self.pending = []
        self.move(Phase.STOPPED, out)
        out.append(StopRun(kind))

    def move(self, new: Phase, out) -> None:
        out.append(PhaseChanged(self.phase, new))
        self.phase = new


# ------------------------------------------------------------------ the test


def normalise(effects) -> list:
    """Drop only the human-readable text; everything else must match exactly."""
    out = []
    for e in effects:
        if isinstance(e, Reject):
            out.append(("Reject", e.worker_id, e.reason))
        elif isinstance(e, QuorumChanged):
            out.append(("QuorumChanged", e.below_min_workers, e.live_workers, e.min_workers))
        else:
            out.append(e)
    return out


WORKERS = ("A", "B", "C", "D")

configs = st.builds(
    FSMConfig,
    min_workers=st.integers(1, 3),
    mode=st.sampled_from(list(Mode)),
    num_fragments=st.integers(1, 3),
    heartbeat_timeout_s=st.sampled_from((0.3, 1.0, 10.0)),
    max_workers=st.integers(3, 5),
    max_staleness=st.integers(0, 2),
    max_held_per_fragment=st.integers(1, 3),
    max_worker_id_len=st.just(4),
)

# An action is (kind, a, b, c): a kind, weighted towards the events that make
# progress, and three small integers that ``resolve`` turns into a concrete
# event against the reference's state at the time, so "a member submits for
# the open round" stays meaningful as rounds advance and members change.
KINDS = (["join"] * 3 + ["submit"] * 6 + ["everyone"] * 2 + ["heartbeat"] * 2 + ["leave"] * 2
         + ["tick"] * 2 + ["deadline"] + ["min"] + ["garbage"] * 2 + ["shutdown"])
actions = st.tuples(st.sampled_from(KINDS), st.integers(0, 7), st.integers(0, 7), st.integers(0, 7))

TICKS = (0.0, 0.1, 0.2, 0.3, 0.7, 1.1, 2.5, 9.9, 10.0, 10.1, 25.0)
BAD_IDS = ("", "TOOLONG", 3, None, ("A",), ["A"])


def resolve(action, ref: Reference) -> list:
    """Turn an action into the concrete event(s) it means right now."""
    kind, a, b, c = action
    members = sorted(ref.members)
    # Mostly a live member; sometimes any id (maybe departed, maybe never joined).
    wid = members[a % len(members)] if members and b < 6 else WORKERS[a % len(WORKERS)]
    nfrag = len(ref.open)
    fid = a % nfrag
    if kind == "join":
        return [WorkerJoined(WORKERS[a % len(WORKERS)] if c else BAD_IDS[b % len(BAD_IDS)])]
    if kind == "heartbeat":
        return [HeartbeatSeen(wid if c else BAD_IDS[b % len(BAD_IDS)])]
    if kind == "submit":
        delta = (0, 0, 0, 0, -1, 1, -2, -3)[c]
        return [ContributionSubmitted(wid, fid, ref.open[fid] + delta)]
    if kind == "everyone":
        lag = 1 if (c == 0 and not ref.sync) else 0
        return [ContributionSubmitted(w, fid, max(ref.open[fid] - lag, 0)) for w in members]
    if kind == "leave":
        return [WorkerLeft(wid if c else BAD_IDS[b % len(BAD_IDS)], list(LeaveCause)[b % 3])]
    if kind == "tick":
        return [Ticked(ref.now + TICKS[(a + b) % len(TICKS)] + (-0.5 if c == 7 else 0.0))]
    if kind == "deadline":
        # Exactly at (or just past) a member's heartbeat deadline: the R9 boundary.
        if not ref.members:
            return [Ticked(ref.now)]
        last = sorted(last for last, _ in ref.members.values())[a % len(ref.members)]
        eps = (0.0, 0.0, 5e-324, 1e-9)[b % 4]
        return [Ticked(max(ref.now, last + ref.cfg.heartbeat_timeout_s + eps))]
    if kind == "min":
        return [MinWorkersChanged((1, 2, 3, 1, 2, 4, 0, "2")[b])]
    if kind == "garbage":
        bad_fid = (0, 1, -1, nfrag, True, "0", None, 0.0)[b]
        bad_rid = (0, 1, -1, 2.0, "1", None, False, 10**9)[c]
        return [ContributionSubmitted(wid if a < 6 else ["A"], bad_fid, bad_rid)]
    # shutdown: only one draw in four, so scripts get deep before they end.
    if c >= 2:
        return []
    return [ShutdownRequested((list(ShutdownKind) + ["bogus"])[b % 4])]


def run_both(fsm: RoundFSM, ref: Reference, event):
    results = []
    for machine in (ref, fsm):
        try:
            results.append(normalise(machine.step(event)))
        except DriverError as exc:
            results.append(type(exc))
    return results


def check_script(cfg: FSMConfig, script) -> None:
    fsm, ref = RoundFSM(cfg), Reference(cfg)
    for n, action in enumerate(script):
        for event in resolve(action, ref):
            want, got = run_both(fsm, ref, event)
            assert got == want, f"step {n} {event!r}:\n  RoundFSM  {got!r}\n  reference {want!r}"
        if ref.phase is Phase.STOPPED:
            # One more poke: both must refuse (R12), then the script is over.
            want, got = run_both(fsm, ref, HeartbeatSeen("A"))
            assert got == want == MachineStoppedError
            return


@settings(max_examples=max(settings().max_examples * 5, 100))
@given(cfg=configs, script=st.lists(actions, min_size=10, max_size=80))
def test_roundfsm_matches_reference(cfg, script):
    """Same events -> the same effects, step by step (R1-R12, P1-P4)."""
    check_script(cfg, script)


def test_reference_is_not_vacuous():
    """The oracle itself reaches the interesting places: a paused round that a replacement completes."""
    ref = Reference(FSMConfig(min_workers=2))
    for ev in (WorkerJoined("A"), WorkerJoined("B"), ContributionSubmitted("A", 0, 0), WorkerLeft("B")):
        ref.step(ev)
    assert ref.phase is Phase.PAUSED and ref.pending == [["A", 0]]
    ref.step(WorkerJoined("C"))
    out = ref.step(ContributionSubmitted("C", 0, 0))
    assert ApplyRound(0, 0, ("A", "C")) in out and ref.open == [1]
