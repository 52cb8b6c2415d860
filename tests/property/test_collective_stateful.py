"""Hypothesis drives random collective-plane runs through RoundFSM (SPEC.md C1-C7, I13-I15).

The world here can do everything the hub's stateful test does (joins, leaves,
crashes, silence, quorum changes, every shutdown) plus what a reducing group
does: members report success with a digest (mostly one, sometimes another),
report failure, report for old attempts or out of turn, or never report until
the reduce deadline passes. An independent oracle (``Oracle``) follows the
effects and checks, after every step:

* I13 -- every ``ApplyRound`` commits the open attempt of its fragment: its
  contributors are exactly that attempt's group, every one of them reported ok
  with the committed digest, all are live members, and there are at least
  ``min_workers`` of them;
* I14 -- every ``OrderReduce`` names every live member (all ready), at least
  ``min_workers`` of them, with quorum, and no other attempt open for the
  fragment; every ``AbortReduce`` ends the open one;
* I15 -- liveness: no fragment whose live members are all ready waits without
  an attempt while quorum holds, and no attempt whose reports are all in (one
  digest) is left open;
* plus I3 (rounds in order), I6 (below flag exact), I10 (rejects change
  nothing), and I8/I9 (replay and snapshot/restore equivalence) at teardown.
"""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from diloco.core import (
    AbortReduce,
    AcceptContribution,
    AcceptJoin,
    ApplyRound,
    ContributionSubmitted,
    DeclareDead,
    DriverError,
    FSMConfig,
    HeartbeatSeen,
    LeaveCause,
    MinWorkersChanged,
    OrderReduce,
    Phase,
    QuorumChanged,
    ReduceReported,
    Reject,
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
from test_fsm_stateful import FSMStateMachine, Resume, _msgpack_roundtrip

WORKERS = ("A", "B", "C", "D")
TIMEOUT_S = 10.0
REDUCE_TIMEOUT_S = 4.0


class Oracle:
    """What the effects say the run is; checks I13-I15 as they come."""

    def __init__(self, config: FSMConfig, now_s: float = 0.0) -> None:
        self.config = config
        self.min_workers = config.min_workers
        self.live: dict[str, None] = {}
        self.ready: list[dict[str, None]] = [{} for _ in range(config.num_fragments)]
        #: fid -> (attempt, group, {wid: digest})
        self.open: dict[int, tuple[int, tuple[str, ...], dict[str, str]]] = {}
        self.next_round = [0] * config.num_fragments
        self.now_s = now_s
        self.stopped = False
        self.commits = 0

    def observe(self, event, effects: list) -> None:
        if isinstance(event, Ticked):
            self.now_s = float(event.now_s)
        if isinstance(event, MinWorkersChanged) and not any(isinstance(e, Reject) for e in effects):
            self.min_workers = event.min_workers
        if isinstance(event, WorkerLeft) and not any(isinstance(e, Reject) for e in effects):
            self._forget(event.worker_id)
        for i, e in enumerate(effects):
            if isinstance(e, AcceptJoin):
                self.live[e.worker_id] = None
                assert e.parked == (), "C2: nothing is pending for a joiner in the collective plane"
            elif isinstance(e, DeclareDead):
                self._forget(e.worker_id)
            elif isinstance(e, AcceptContribution):
                assert e.fragment_id not in self.open, "C3: readiness accepted while the fragment reduces"
                assert e.round_id == self.next_round[e.fragment_id]
                self.ready[e.fragment_id][e.worker_id] = None
            elif isinstance(e, OrderReduce):
                fid = e.fragment_id
                assert fid not in self.open, "I14: a second attempt while one is open"
                assert set(e.group) == set(self.live) == set(self.ready[fid]), \
                    f"I14: group {e.group} is not every live, ready member ({sorted(self.live)})"
                assert list(e.group) == sorted(e.group), "I14: ranks are sorted ids"
                assert len(e.group) >= self.min_workers and len(self.live) >= self.min_workers, "I14: below quorum"
                assert e.round_id == self.next_round[fid]
                self.open[fid] = (e.attempt, e.group, {})
            elif isinstance(e, AbortReduce):
                attempt, group, _ = self.open.pop(e.fragment_id)
                assert (e.attempt, e.group) == (attempt, group), "I14: abort of an attempt that is not open"
            elif isinstance(e, ApplyRound):
                self._commit(e, effects[i + 1:])
            elif isinstance(e, QuorumChanged):
                assert e.min_workers == self.min_workers and e.live_workers == len(self.live)
            elif isinstance(e, StopRun):
                self.stopped = True
                assert not self.open, "R12: an attempt open after the stop"
                self.ready = [{} for _ in self.ready]
        if isinstance(event, ReduceReported) and not any(isinstance(e, (Reject, AbortReduce)) for e in effects):
            fid = event.fragment_id
            if fid in self.open:
                self.open[fid][2][event.worker_id] = event.digest
            else:  # the report completed the attempt, and it committed in this very step
                assert any(isinstance(e, ApplyRound) for e in effects)

    def _commit(self, e: ApplyRound, later: list) -> None:
        fid = e.fragment_id
        assert fid in self.open, "I13: a commit without an open attempt"
        attempt, group, reports = self.open.pop(fid)
        assert e.contributors == group, f"I13: committed {e.contributors}, the group was {group}"
        # The last report arrives in the committing step itself: count it as the event's.
        assert len(group) >= self.min_workers, "I13: a commit below min_workers"
        assert all(w in self.live for w in group), "I13: a commit naming a departed member"
        assert e.round_id == self.next_round[fid], "I3: rounds commit in order"
        self._pending_commit = (fid, e.digest, group, reports)
        releases = [x for x in later if isinstance(x, ReleaseWorker) and x.fragment_id == fid]
        assert {x.worker_id for x in releases} >= set(group)
        assert all(x.outcome in (ReleaseOutcome.APPLIED, ReleaseOutcome.APPLIED_FINAL) for x in releases)
        self.next_round[fid] += 1
        self.ready[fid] = {}
        self.commits += 1

    def check_commit_votes(self, event) -> None:
        """I13: every member of the committed group reported ok with the committed digest."""
        pending = getattr(self, "_pending_commit", None)
        if pending is None:
            return
        fid, digest, group, reports = pending
        self._pending_commit = None
        assert isinstance(event, ReduceReported) and event.ok and event.digest == digest, \
            "I13: a commit not caused by a member's ok report"
        reports = dict(reports)
        reports[event.worker_id] = event.digest
        assert set(reports) == set(group) and set(reports.values()) == {digest}, \
            f"I13: committed {digest!r} on reports {reports}"

    def _forget(self, wid: str) -> None:
        self.live.pop(wid, None)
        for ready in self.ready:
            ready.pop(wid, None)

    @property
    def below(self) -> bool:
        return len(self.live) < self.min_workers

    def check(self, fsm: RoundFSM) -> None:
        assert set(fsm.status().to_dict()["members"][i]["worker_id"] for i in range(fsm.live_workers)) == set(self.live)
        assert fsm.below_min_workers == self.below, "I6"
        assert fsm.open_round_ids() == tuple(self.next_round), "I3"
        if self.stopped:
            return
        for fid in range(self.config.num_fragments):
            attempt = self.open.get(fid)
            if attempt is None:
                complete = self.live and set(self.ready[fid]) == set(self.live)
                assert not (complete and not self.below), f"I15: fragment {fid} complete with quorum, no order"
            else:
                _, group, reports = attempt
                assert not (len(reports) == len(group) and len(set(reports.values())) == 1 and not self.below), \
                    f"I15: fragment {fid}: every report is in, nothing committed"


class CollectiveMachine(RuleBasedStateMachine):
    CONFIG: FSMConfig

    def __init__(self) -> None:
        super().__init__()
        self.fsm = RoundFSM(self.CONFIG)
        self.oracle = Oracle(self.CONFIG)
        self.log: list[object] = []
        self.results: list[object] = []
        self.snaps: list[dict] = []

    @property
    def running(self) -> bool:
        return self.fsm.phase is not Phase.STOPPED

    def step(self, event):
        before = self.fsm.snapshot()
        self.snaps.append(before)
        self.log.append(event)
        try:
            effects = self.fsm.step(event)
        except DriverError as exc:
            self.results.append(type(exc))
            assert self.fsm.snapshot() == before
            return
        self.results.append(effects)
        if any(isinstance(e, Reject) for e in effects):
            assert len(effects) == 1 and self.fsm.snapshot() == before, "I10"
        self.oracle.observe(event, effects)
        self.oracle.check_commit_votes(event)

    def pick(self, who: int) -> str:
        live = sorted(self.oracle.live)
        return live[who % len(live)] if who < 6 and live else WORKERS[who % len(WORKERS)]

    @precondition(lambda self: self.running)
    @rule(wid=st.sampled_from(WORKERS))
    def join(self, wid):
        self.step(WorkerJoined(wid))

    @precondition(lambda self: self.running and self.oracle.live)
    @rule(who=st.integers(0, 7))
    def heartbeat(self, who):
        self.step(HeartbeatSeen(self.pick(who)))

    @precondition(lambda self: self.running and self.oracle.live)
    @rule(fid=st.integers(0, 1), delta=st.sampled_from((0, 0, 0, 1, -1)))
    def everyone_ready(self, fid, delta):
        fid %= self.CONFIG.num_fragments
        for wid in sorted(self.oracle.live):
            if self.running and wid not in self.oracle.ready[fid]:
                self.step(ContributionSubmitted(wid, fid, max(0, self.oracle.next_round[fid] + delta)))

    @precondition(lambda self: self.running and self.oracle.live)
    @rule(who=st.integers(0, 7), fid=st.integers(0, 1))
    def one_ready(self, who, fid):
        fid %= self.CONFIG.num_fragments
        self.step(ContributionSubmitted(self.pick(who), fid, self.oracle.next_round[fid]))

    @precondition(lambda self: self.running and self.oracle.open)
    @rule(data=st.data(), digest=st.sampled_from(("x", "x", "x", "x", "y", "")),
          ok=st.sampled_from((True, True, True, True, True, False)), skew=st.sampled_from((0, 0, 0, 0, -1, 1)))
    def group_reports(self, data, digest, ok, skew):
        """Every member of an open attempt that has not reported does, mostly agreeing."""
        fid = data.draw(st.sampled_from(sorted(self.oracle.open)))
        attempt, group, reports = self.oracle.open[fid]
        for wid in group:
            if not self.running or self.oracle.open.get(fid, (None,))[0] != attempt:
                return
            if wid in self.oracle.open[fid][2]:
                continue
            one = data.draw(st.sampled_from((digest, "x")))
            self.step(ReduceReported(wid, fid, self.oracle.next_round[fid], attempt + skew, ok, one))

    @precondition(lambda self: self.running and self.oracle.live)
    @rule(who=st.integers(0, 7), fid=st.integers(0, 2), attempt=st.integers(-1, 3), ok=st.booleans(),
          digest=st.sampled_from(("x", "y", "", 5, None)))
    def stray_report(self, who, fid, attempt, ok, digest):
        self.step(ReduceReported(self.pick(who), fid, self.oracle.next_round[fid % self.CONFIG.num_fragments],
                                 attempt, ok, digest))

    @precondition(lambda self: self.running and self.oracle.live)
    @rule(who=st.integers(0, 7), cause=st.sampled_from(list(LeaveCause)))
    def leave(self, who, cause):
        self.step(WorkerLeft(self.pick(who), cause))

    @precondition(lambda self: self.running)
    @rule(dt=st.sampled_from((0.5, 1.0, REDUCE_TIMEOUT_S, REDUCE_TIMEOUT_S + 0.5, TIMEOUT_S + 0.25)))
    def tick(self, dt):
        self.step(Ticked(self.oracle.now_s + dt))

    @precondition(lambda self: self.running)
    @rule(value=st.sampled_from((1, 2, 3, 4, 2, 0)))
    def set_min_workers(self, value):
        self.step(MinWorkersChanged(value))

    @precondition(lambda self: self.running)
    @rule(kind=st.sampled_from(list(ShutdownKind)), go=st.integers(0, 4))
    def shutdown(self, kind, go):
        if go == 0:
            self.step(ShutdownRequested(kind))

    @precondition(lambda self: not self.running)
    @rule()
    def resume(self):
        old = self.oracle
        self.snaps.append(self.fsm.snapshot())
        self.log.append(Resume(old.now_s))
        self.results.append(None)
        self.fsm = RoundFSM.resume(_msgpack_roundtrip(self.fsm.snapshot()), now_s=old.now_s)
        self.oracle = Oracle(self.CONFIG, old.now_s)
        self.oracle.min_workers = old.min_workers
        self.oracle.next_round = list(old.next_round)

    @invariant()
    def oracle_agrees(self):
        self.oracle.check(self.fsm)

    def teardown(self):
        if not self.log:
            return
        # I8 and I9, exactly as the hub machine checks them (same replay).
        final = FSMStateMachine._replay(self, RoundFSM(self.CONFIG), 0)
        assert final.snapshot() == self.fsm.snapshot()
        for idx in sorted(set(range(0, len(self.log), 5)) | {len(self.log) - 1}):
            restored = RoundFSM.restore(_msgpack_roundtrip(self.snaps[idx]))
            assert restored.snapshot() == self.snaps[idx], f"I9 at step {idx}"
            assert FSMStateMachine._replay(self, restored, idx).snapshot() == self.fsm.snapshot()


def _machine(name: str, **kw) -> type[CollectiveMachine]:
    config = FSMConfig(data_plane="collective", heartbeat_timeout_s=TIMEOUT_S,
                       reduce_timeout_s=REDUCE_TIMEOUT_S, **kw)
    return type(name, (CollectiveMachine,), {"CONFIG": config})


CollectiveQuorumTwo = _machine("CollectiveQuorumTwo", min_workers=2, max_workers=4)
CollectiveTwoFragments = _machine("CollectiveTwoFragments", min_workers=2, num_fragments=2, max_workers=3)

TestCollectiveQuorumTwo = CollectiveQuorumTwo.TestCase
TestCollectiveTwoFragments = CollectiveTwoFragments.TestCase
