"""Hypothesis drives random runs through RoundFSM and checks every invariant after every event.

Rules model what the world can do to a run: workers join (and re-join), send
heartbeats, submit valid and invalid contributions, leave, get kicked, crash,
go silent until a tick declares them dead; operators change ``min_workers``
(to valid and invalid values) and shut the run down in each of the three ways;
the driver ticks the clock (and sometimes misuses it). Each machine is
parametrised by a config: sync, async, and fragment modes.

Per-step checks live in ``model.Tracker.observe`` (I1, I2, I3, I4, I5, I11,
P1, P2, P4, R2, R9, R10); state invariants are Hypothesis ``@invariant``s
(I3, I4, I5, I6, I7, I12); determinism (I8) and snapshot/restore equivalence
(I9) are checked in ``teardown`` by replaying the recorded events into a
fresh machine and into machines restored from msgpack round-tripped
snapshots taken along the way. Rejections (I10) and driver errors must leave
``snapshot()`` unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from diloco.core import (
    ClockWentBackwardsError,
    InvalidEventError,
    ContributionSubmitted,
    DriverError,
    FSMConfig,
    HeartbeatSeen,
    LeaveCause,
    MachineStoppedError,
    MinWorkersChanged,
    Mode,
    Phase,
    Reject,
    RoundFSM,
    ShutdownKind,
    ShutdownRequested,
    Ticked,
    UnknownEventError,
    WorkerJoined,
    WorkerLeft,
)
from model import Tracker

WORKERS = ("A", "B", "C", "D")
#: Ids a confused or hostile peer might send: empty, too long, not a string, unhashable.
BAD_IDS = ("", "W" * 9, 7, None, b"A", ("A",), ["A"], {"id": "A"})
TIMEOUT_S = 10.0


def _config(**kw) -> FSMConfig:
    base = dict(heartbeat_timeout_s=TIMEOUT_S, max_worker_id_len=8)
    base.update(kw)
    return FSMConfig(**base)


@dataclass(frozen=True)
class Resume:
    """A log entry: the run was resumed from its own snapshot (``RoundFSM.resume``)."""

    now_s: float


def _msgpack_roundtrip(snap: dict) -> dict:
    return msgpack.unpackb(msgpack.packb(snap, use_bin_type=True), raw=False)


class FSMStateMachine(RuleBasedStateMachine):
    """Base machine; subclasses pick the config."""

    CONFIG: FSMConfig

    def __init__(self) -> None:
        super().__init__()
        self.fsm = RoundFSM(self.CONFIG)
        self.tracker = Tracker.fresh(self.CONFIG)
        #: Every event stepped (or Resume), the result (effects or the DriverError type),
        #: and the snapshot taken just before it.
        self.log: list[object] = []
        self.results: list[object] = []
        self.snaps: list[dict] = []

    # ------------------------------------------------------------ helpers

    @property
    def cfg(self) -> FSMConfig:
        return self.CONFIG

    @property
    def running(self) -> bool:
        return self.fsm.phase is not Phase.STOPPED

    def step(self, event: object):
        before = self.fsm.snapshot()
        self.snaps.append(before)
        self.log.append(event)
        try:
            effects = self.fsm.step(event)
        except DriverError as exc:
            self.results.append(type(exc))
            assert self.fsm.snapshot() == before, f"{type(exc).__name__} changed the state"
            return exc
        self.results.append(effects)
        if any(isinstance(e, Reject) for e in effects):
            # I10: a rejected step changes nothing.
            assert self.fsm.snapshot() == before, f"I10: {event!r} was rejected but the snapshot changed"
        self.tracker.observe(event, effects)
        return effects

    def expect_raise(self, event: object, error: type) -> None:
        got = self.step(event)
        assert isinstance(got, error), f"{event!r} should raise {error.__name__}, got {got!r}"

    # --------------------------------------------------------------- rules
    # Valid-looking actions get most rules (Hypothesis picks rules uniformly), so
    # runs get deep; each kind of garbage still shows up in every few runs.

    def pick(self, who: int) -> str:
        """Mostly a live member (who < 6), sometimes any id, member or not."""
        live = sorted(self.tracker.live)
        if who < 6 and live:
            return live[who % len(live)]
        return WORKERS[who % len(WORKERS)]

    @precondition(lambda self: self.running)
    @rule(wid=st.sampled_from(WORKERS))
    def join(self, wid):
        self.step(WorkerJoined(wid))

    @precondition(lambda self: self.running and self.tracker.live)
    @rule(who=st.integers(0, 7))
    def heartbeat(self, who):
        self.step(HeartbeatSeen(self.pick(who)))

    @precondition(lambda self: self.running and self.tracker.live)
    @rule(who=st.integers(0, 7), fid=st.integers(0, 2), delta=st.sampled_from((0, 0, 0, 0, -1, 1, -2, -3)))
    def submit(self, who, fid, delta):
        """Mostly the open round; sometimes stale, future, or (if repeated) duplicate."""
        fid %= self.cfg.num_fragments
        self.step(ContributionSubmitted(self.pick(who), fid, self.tracker.next_round[fid] + delta))

    @precondition(lambda self: self.running and self.tracker.live)
    @rule(fid=st.integers(0, 2), lag=st.integers(0, 1))
    def everyone_submits(self, fid, lag):
        """Every live member that has not contributed yet submits (base lagging by ``lag``, async)."""
        fid %= self.cfg.num_fragments
        for wid in sorted(self.tracker.live):
            if not self.running:
                return
            if any(k[0] == wid and k[1] == fid for k in self.tracker.pending):
                continue
            rid = self.tracker.next_round[fid] - (0 if self.cfg.mode is Mode.SYNC else lag)
            self.step(ContributionSubmitted(wid, fid, max(rid, 0)))

    @precondition(lambda self: self.running and self.tracker.live)
    @rule(who=st.integers(0, 7), cause=st.sampled_from(list(LeaveCause)))
    def leave(self, who, cause):
        self.step(WorkerLeft(self.pick(who), cause))

    @precondition(lambda self: self.running)
    @rule(dt=st.sampled_from((0.0, 0.5, 1.0, 3.0, TIMEOUT_S / 2, TIMEOUT_S, TIMEOUT_S + 0.25, 3 * TIMEOUT_S)))
    def tick(self, dt):
        self.step(Ticked(self.tracker.now_s + dt))

    @precondition(lambda self: self.running)
    @rule(value=st.sampled_from((1, 2, 3, 4, 1, 2, 3, 0, 10**7, True, "2", 2.0)))
    def set_min_workers(self, value):
        self.step(MinWorkersChanged(value))

    @precondition(lambda self: self.running)
    @rule(kind=st.sampled_from(list(ShutdownKind)), go=st.integers(0, 3), finish=st.booleans())
    def shutdown(self, kind, go, finish):
        # Only one draw in four shuts down, so runs get deep before they end.
        if go == 0:
            self.step(ShutdownRequested(kind))
            if self.fsm.phase is Phase.DRAINING and finish:
                # P4: the round in flight completes during the drain (APPLIED_FINAL).
                self.everyone_submits(fid=0, lag=0)

    @precondition(lambda self: self.running)
    @rule(
        kind=st.sampled_from(("join", "heartbeat", "leave", "submit")),
        wid=st.sampled_from(WORKERS + BAD_IDS),
        fid=st.sampled_from((0, 1, -1, 3, 1024, True, "0", 0.0, None)),
        rid=st.sampled_from((0, 1, -1, 10**9, False, "0", 0.5, None)),
    )
    def garbage(self, kind, wid, fid, rid):
        """A confused or hostile peer: bad ids and types everywhere (R3); answered by Reject."""
        event = {
            "join": lambda: WorkerJoined(wid),
            "heartbeat": lambda: HeartbeatSeen(wid),
            "leave": lambda: WorkerLeft(wid),
            "submit": lambda: ContributionSubmitted(wid, fid, rid),
        }[kind]()
        self.step(event)

    @precondition(lambda self: self.running)
    @rule(
        misuse=st.sampled_from(("backwards", "nan", "str", "bool", "inf", "object", "tuple", "none", "kind")),
        back=st.sampled_from((1e-6, 1.0, 1e9)),
    )
    def driver_misuse(self, misuse, back):
        """The driver's own bugs raise the documented DriverError and change nothing (R9, R12)."""
        if misuse == "backwards":
            if self.tracker.now_s == 0:
                return
            self.expect_raise(Ticked(self.tracker.now_s - back), ClockWentBackwardsError)
        elif misuse in ("nan", "str", "bool", "inf"):
            value = {"nan": float("nan"), "str": "5", "bool": True, "inf": float("inf")}[misuse]
            self.expect_raise(Ticked(value), InvalidEventError)
        else:
            event = {"object": object(), "tuple": ("join", "A"), "none": None,
                     "kind": ShutdownRequested("bogus")}[misuse]
            self.expect_raise(event, UnknownEventError)

    @precondition(lambda self: not self.running)
    @rule(event=st.sampled_from((WorkerJoined("A"), HeartbeatSeen("A"), ContributionSubmitted("A", 0, 0),
                                 WorkerLeft("A"), Ticked(1e9), MinWorkersChanged(1),
                                 ShutdownRequested(ShutdownKind.ABORT))))
    def poke_stopped(self, event):
        # R12: a stopped machine refuses everything, loudly.
        self.expect_raise(event, MachineStoppedError)

    @precondition(lambda self: not self.running)
    @rule()
    def resume(self):
        """A new incarnation from the stopped run's checkpoint keeps counters and quorum, nothing else."""
        old = self.tracker
        self.snaps.append(self.fsm.snapshot())
        self.log.append(Resume(old.now_s))
        self.results.append(None)
        self.fsm = RoundFSM.resume(_msgpack_roundtrip(self.fsm.snapshot()), now_s=old.now_s)
        assert self.fsm.phase is Phase.FORMING and self.fsm.live_workers == 0
        assert self.fsm.open_round_ids() == tuple(old.next_round), "resume must keep every fragment's counter"
        assert self.fsm.min_workers == old.min_workers
        assert not self.fsm.status().parked_workers
        self.tracker = Tracker.fresh(self.cfg, now_s=old.now_s)
        self.tracker.min_workers = old.min_workers
        self.tracker.next_round = list(old.next_round)

    # ---------------------------------------------------------- invariants

    @invariant()
    def membership_matches(self):
        self.tracker.check_membership(self.fsm)

    @invariant()
    def i3_rounds_in_order(self):
        self.tracker.check_i3_round_counters(self.fsm)

    @invariant()
    def i4_conservation(self):
        self.tracker.check_i4_conservation(self.fsm)

    @invariant()
    def i5_nothing_parked_after_stop(self):
        self.tracker.check_i5_nothing_parked_after_stop(self.fsm)

    @invariant()
    def i6_below_flag_exact(self):
        self.tracker.check_i6_below_flag(self.fsm)

    @invariant()
    def i7_liveness(self):
        self.tracker.check_i7_liveness(self.fsm)

    @invariant()
    def i12_phase_consistent(self):
        self.tracker.check_i12_phase(self.fsm)

    def teardown(self):
        if not self.log:
            return
        # I8: a fresh machine fed the same events returns the same effects.
        final = self._replay(RoundFSM(self.CONFIG), 0)
        assert final.snapshot() == self.fsm.snapshot(), "I8: same events, different final state"
        # I9: a machine restored from a msgpack round-trip of any snapshot continues identically.
        for idx in sorted(set(range(0, len(self.log), 4)) | {len(self.log) - 1}):
            snap = _msgpack_roundtrip(self.snaps[idx])
            restored = RoundFSM.restore(snap)
            assert restored.snapshot() == self.snaps[idx], f"I9: restore(snapshot) != snapshot at step {idx}"
            end = self._replay(restored, idx)
            assert end.snapshot() == self.fsm.snapshot(), f"I9: restored at step {idx}, diverged by the end"

    def _replay(self, fsm: RoundFSM, start: int) -> RoundFSM:
        for idx in range(start, len(self.log)):
            entry = self.log[idx]
            if isinstance(entry, Resume):
                fsm = RoundFSM.resume(fsm.snapshot(), now_s=entry.now_s)
                continue
            try:
                got: object = fsm.step(entry)
            except DriverError as exc:
                got = type(exc)
            assert got == self.results[idx], (
                f"I8/I9: replaying step {idx} {entry!r} from step {start} gave {got!r}, "
                f"originally {self.results[idx]!r}")
        return fsm


def _machine(name: str, config: FSMConfig) -> type[FSMStateMachine]:
    return type(name, (FSMStateMachine,), {"CONFIG": config})


#: sync, one fragment; max_workers 3 of 4 ids so TOO_MANY_WORKERS happens.
SyncOneFragment = _machine("SyncOneFragment", _config(min_workers=2, max_workers=3))
#: sync, min_workers 3, all four ids may join.
SyncQuorumThree = _machine("SyncQuorumThree", _config(min_workers=3, max_workers=4))
#: Streaming DiLoCo: three fragments, each with its own counter and barrier.
SyncThreeFragments = _machine("SyncThreeFragments", _config(min_workers=2, num_fragments=3, max_workers=4))
#: async, one fragment, tight staleness and held limits so both bite.
AsyncOneFragment = _machine("AsyncOneFragment", _config(
    mode=Mode.ASYNC, min_workers=2, max_workers=4, max_staleness=2, max_held_per_fragment=1))
#: async with two fragments, staleness 0 (every base must be current).
AsyncTwoFragments = _machine("AsyncTwoFragments", _config(
    mode=Mode.ASYNC, min_workers=2, num_fragments=2, max_workers=3, max_staleness=0, max_held_per_fragment=3))

#: async with a grace window (SPEC.md P5): contributions within 2 s of the first pending one merge;
#: ticks of 0.5..30 s land before, at and past the deadline.
AsyncWindow = _machine("AsyncWindow", _config(
    mode=Mode.ASYNC, min_workers=2, max_workers=4, max_staleness=2, max_held_per_fragment=3, grace_window_s=2.0))
#: a short window on two fragments, quorum 1 (windows close on ticks, early closes and departures).
AsyncWindowTwoFragments = _machine("AsyncWindowTwoFragments", _config(
    mode=Mode.ASYNC, min_workers=1, num_fragments=2, max_workers=3, max_staleness=1, max_held_per_fragment=2,
    grace_window_s=0.5))

TestSyncOneFragment = SyncOneFragment.TestCase
TestSyncQuorumThree = SyncQuorumThree.TestCase
TestSyncThreeFragments = SyncThreeFragments.TestCase
TestAsyncOneFragment = AsyncOneFragment.TestCase
TestAsyncTwoFragments = AsyncTwoFragments.TestCase
TestAsyncWindow = AsyncWindow.TestCase
TestAsyncWindowTwoFragments = AsyncWindowTwoFragments.TestCase
# Modest example counts: the window machines add to the suite's budget (the core's window rule is
# also covered by the exhaustive search and tests/core/test_grace_window.py).
TestAsyncWindow.settings = settings(max_examples=max(settings().max_examples // 2, 20))
TestAsyncWindowTwoFragments.settings = settings(max_examples=max(settings().max_examples // 2, 20))
