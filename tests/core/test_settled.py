"""Corner cases SPEC.md settles in words, one test each (section 4 "Async round ids",
R3/R4 "Which reason wins", R7 "A leave's effects", P4 "Drain").
"""

from __future__ import annotations

from diloco.core import (
    AcceptContribution,
    AcceptJoin,
    ApplyRound,
    ContributionSubmitted,
    DeclareDead,
    DiscardContribution,
    DiscardReason,
    HeartbeatSeen,
    LeaveCause,
    MinWorkersChanged,
    Mode,
    Phase,
    PhaseChanged,
    QuorumChanged,
    Reject,
    RejectReason,
    ReleaseOutcome,
    ReleaseWorker,
    ShutdownKind,
    ShutdownRequested,
    StopRun,
    Ticked,
    WorkerJoined,
    WorkerLeft,
    quorum_decision,
)
from diloco.testing import fsm_after

J, S, L = WorkerJoined, ContributionSubmitted, WorkerLeft
R = RejectReason


machine = fsm_after


def reason(effects) -> RejectReason:
    (only,) = effects
    assert isinstance(only, Reject), effects
    return only.reason


def test_a_drain_while_draining_is_refused_shutting_down_and_changes_nothing():
    fsm = machine(J("A"), J("B"), S("A", 0, 0), ShutdownRequested(ShutdownKind.DRAIN))
    assert fsm.phase is Phase.DRAINING
    before = fsm.snapshot()
    assert reason(fsm.step(ShutdownRequested(ShutdownKind.DRAIN))) is R.SHUTTING_DOWN
    assert fsm.snapshot() == before


def test_one_death_completing_rounds_in_several_fragments_during_a_drain_releases_all_applied_final():
    """P4: the step that applies first applies every round it completes; all release applied_final."""
    fsm = machine(J("A"), J("B"), J("C"), S("A", 0, 0), S("B", 0, 0), S("A", 1, 0), S("B", 1, 0),
                  ShutdownRequested(ShutdownKind.DRAIN), min_workers=2, num_fragments=2)
    assert fsm.phase is Phase.DRAINING
    effects = fsm.step(L("C", LeaveCause.CRASHED))  # C was the last one awaited in both fragments
    applies = [e for e in effects if isinstance(e, ApplyRound)]
    assert applies == [ApplyRound(0, 0, ("A", "B")), ApplyRound(1, 0, ("A", "B"))]
    releases = [e for e in effects if isinstance(e, ReleaseWorker)]
    assert {(r.worker_id, r.fragment_id) for r in releases} == {("A", 0), ("B", 0), ("A", 1), ("B", 1)}
    assert all(r.outcome is ReleaseOutcome.APPLIED_FINAL for r in releases)
    assert effects[-1] == StopRun(ShutdownKind.DRAIN) and fsm.phase is Phase.STOPPED


def test_a_drain_goes_on_when_a_leave_completes_no_round_and_quorum_holds():
    """P4: min_workers=1; A, B, C; A submits; drain; B crashes: no round completes (C is
    awaited) and quorum holds, so the run keeps draining and A's work stays pending."""
    fsm = machine(J("A"), J("B"), J("C"), S("A", 0, 0), ShutdownRequested(ShutdownKind.DRAIN))
    effects = fsm.step(L("B", LeaveCause.CRASHED))
    assert effects == [] and fsm.phase is Phase.DRAINING
    assert fsm.status().fragments[0].contributed == ("A",)
    effects = fsm.step(S("C", 0, 0))
    assert ApplyRound(0, 0, ("A", "C")) in effects and fsm.phase is Phase.STOPPED


def test_async_round_ids_name_the_base_except_apply_round_which_names_the_version_replaced():
    fsm = machine(J("A"), J("B"), min_workers=2, mode=Mode.ASYNC, max_staleness=4)
    assert fsm.step(S("A", 0, 0)) == [AcceptContribution("A", 0, 0), ApplyRound(0, 0, ("A",)),
                                      ReleaseWorker("A", 0, 0, ReleaseOutcome.APPLIED)]
    assert fsm.step(S("B", 0, 0)) == [AcceptContribution("B", 0, 0), ApplyRound(0, 1, ("B",)),
                                      ReleaseWorker("B", 0, 0, ReleaseOutcome.APPLIED)]  # base 0 replaces v1
    fsm.step(L("B", LeaveCause.CRASHED))
    fsm.step(S("A", 0, 1))                             # held below quorum, from base 1 (version is 2)
    fsm.step(L("A", LeaveCause.LEFT))
    assert fsm.step(J("A"))[0] == AcceptJoin("A", (2,), ((0, 1),))       # parked on its base, 1
    effects = fsm.step(ShutdownRequested(ShutdownKind.ABORT))
    assert DiscardContribution("A", 0, 1, DiscardReason.SHUTDOWN) in effects
    assert ReleaseWorker("A", 0, 1, ReleaseOutcome.STOP) in effects


def test_which_reject_reason_wins_on_a_submission():
    """R3/R4: unknown_worker, then unknown_fragment, then invalid_round, then the round checks."""
    fsm = machine(J("A"), J("B"), S("A", 0, 0), min_workers=2, num_fragments=1)
    assert reason(fsm.step(S("Z", 7, -1))) is R.UNKNOWN_WORKER
    assert reason(fsm.step(S("A", 7, -1))) is R.UNKNOWN_FRAGMENT
    assert reason(fsm.step(S("A", 0, -1))) is R.INVALID_ROUND
    assert reason(fsm.step(S("A", 0, 5))) is R.FUTURE_ROUND
    assert reason(fsm.step(S("A", 0, 0))) is R.DUPLICATE


def test_which_reject_reason_wins_on_an_async_submission():
    """P3: future_round, then stale_round, then duplicate (held, or a base at or below the
    last base), then held_limit."""
    fsm = machine(J("A"), J("B"), J("C"), min_workers=3, mode=Mode.ASYNC, max_staleness=2,
                  max_held_per_fragment=1)
    for base in (0, 1, 2):
        fsm.step(S("B", 0, base))                      # version 3
    assert reason(fsm.step(S("A", 0, 4))) is R.FUTURE_ROUND
    assert reason(fsm.step(S("A", 0, 0))) is R.STALE_ROUND   # 3 versions old > max_staleness 2
    fsm.step(S("A", 0, 2))                             # accepted, applies (version 4): A's last base is 2
    assert reason(fsm.step(S("A", 0, 2))) is R.DUPLICATE     # at its last base, though fresh enough
    fsm.step(L("C", LeaveCause.CRASHED))               # below quorum
    assert fsm.step(S("A", 0, 3)) == [AcceptContribution("A", 0, 3)]   # held
    assert reason(fsm.step(S("A", 0, 4))) is R.DUPLICATE     # A has one held there
    assert reason(fsm.step(S("B", 0, 1))) is R.STALE_ROUND   # stale wins over a full lane
    assert reason(fsm.step(S("B", 0, 4))) is R.HELD_LIMIT    # the fragment's one slot is taken


def test_which_reject_reason_wins_on_a_join():
    """R3/R6: invalid_worker_id, then shutting_down, then already_member, then too_many_workers."""
    fsm = machine(J("A"), J("B"), S("A", 0, 0), ShutdownRequested(ShutdownKind.DRAIN), max_workers=2)
    assert reason(fsm.step(J(""))) is R.INVALID_WORKER_ID
    assert reason(fsm.step(J("A"))) is R.SHUTTING_DOWN
    full = machine(J("A"), J("B"), max_workers=2)
    assert reason(full.step(J("A"))) is R.ALREADY_MEMBER
    assert reason(full.step(J("C"))) is R.TOO_MANY_WORKERS


def test_a_leave_names_nobody_it_only_changes_what_follows_from_it():
    """R7: WorkerLeft has no effect of its own (the driver reported it, so it knows who left);
    the quorum change, phase change and any round it completes follow."""
    fsm = machine(J("A"), J("B"), J("C"), min_workers=2)
    assert fsm.step(L("C", LeaveCause.LEFT)) == []
    effects = fsm.step(L("B", LeaveCause.KICKED))
    assert [type(e) for e in effects] == [QuorumChanged, PhaseChanged]
    assert reason(fsm.step(L("B", LeaveCause.LEFT))) is R.UNKNOWN_WORKER


def test_a_heartbeat_from_a_non_member_is_unknown_worker_and_changes_nothing():
    fsm = machine(J("A"))
    before = fsm.snapshot()
    assert reason(fsm.step(HeartbeatSeen("Z"))) is R.UNKNOWN_WORKER
    assert fsm.snapshot() == before


def test_a_drain_goes_on_when_a_death_by_tick_completes_no_round_and_quorum_holds():
    """P4 with R9: min_workers=2; A, B, C; A submits; drain; B's heartbeat times out. C is
    still awaited and 2 live members keep the quorum: only DeclareDead, the drain goes on."""
    fsm = machine(J("A"), J("B"), J("C"), Ticked(5.0), HeartbeatSeen("C"), S("A", 0, 0),
                  ShutdownRequested(ShutdownKind.DRAIN), min_workers=2, heartbeat_timeout_s=10.0)
    assert fsm.phase is Phase.DRAINING
    effects = fsm.step(Ticked(12.0))
    assert effects == [DeclareDead("B", 0.0)]
    assert fsm.phase is Phase.DRAINING and not fsm.below_min_workers
    assert fsm.status().fragments[0].contributed == ("A",)
    effects = fsm.step(S("C", 0, 0))
    assert effects[:3] == [AcceptContribution("C", 0, 0), ApplyRound(0, 0, ("A", "C")),
                           ReleaseWorker("A", 0, 0, ReleaseOutcome.APPLIED_FINAL)]
    assert effects[-1] == StopRun(ShutdownKind.DRAIN) and fsm.phase is Phase.STOPPED


def test_a_drain_goes_on_when_min_workers_changes_but_completes_no_round_and_quorum_holds():
    """P4 with R8: raising min_workers to the live count, or lowering it, only announces the
    quorum (QuorumChanged is always emitted); the drain keeps waiting for B."""
    fsm = machine(J("A"), J("B"), J("C"), S("A", 0, 0), S("C", 0, 0),
                  ShutdownRequested(ShutdownKind.DRAIN), min_workers=2)
    for n in (3, 1):
        effects = fsm.step(MinWorkersChanged(n))
        assert effects == [QuorumChanged(False, 3, n, quorum_decision(3, n).reason)]
        assert fsm.phase is Phase.DRAINING and fsm.min_workers == n
        assert fsm.status().fragments[0].contributed == ("A", "C")
    effects = fsm.step(S("B", 0, 0))
    assert ApplyRound(0, 0, ("A", "C", "B")) in effects and fsm.phase is Phase.STOPPED
    assert [e.outcome for e in effects if isinstance(e, ReleaseWorker)] == [ReleaseOutcome.APPLIED_FINAL] * 3


def test_a_drain_stops_at_once_when_min_workers_rises_above_the_live_members():
    """P4: a drain that loses quorum stops now; the accepted work is discarded, its makers stopped."""
    fsm = machine(J("A"), J("B"), S("A", 0, 0), ShutdownRequested(ShutdownKind.DRAIN), min_workers=1)
    effects = fsm.step(MinWorkersChanged(3))
    assert effects == [
        QuorumChanged(True, 2, 3, quorum_decision(2, 3).reason),
        DiscardContribution("A", 0, 0, DiscardReason.SHUTDOWN),
        ReleaseWorker("A", 0, 0, ReleaseOutcome.STOP),
        PhaseChanged(Phase.DRAINING, Phase.STOPPED),
        StopRun(ShutdownKind.DRAIN),
    ]
