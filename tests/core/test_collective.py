"""The collective plane's commit protocol in the core (SPEC.md C1-C7), as readable transcripts.

Each test reads like a run: who joins, who says it is ready, what the machine
orders, what the group reports, and what the machine commits or aborts.
"""

from __future__ import annotations

import pytest

from diloco.core import (
    AbortReason,
    AbortReduce,
    ApplyRound,
    ConfigError,
    ContributionSubmitted,
    DiscardContribution,
    FSMConfig,
    HeartbeatSeen,
    MinWorkersChanged,
    Mode,
    OrderReduce,
    Phase,
    ReduceReported,
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
from diloco.testing import fsm_after

J, S, L = WorkerJoined, ContributionSubmitted, WorkerLeft
R = RejectReason


def rep(wid, rid, attempt, digest="d", fid=0, ok=True):
    return ReduceReported(wid, fid, rid, attempt, ok, digest)


def machine(*events, **config):
    config.setdefault("data_plane", "collective")
    config.setdefault("heartbeat_timeout_s", 10.0)
    config.setdefault("reduce_timeout_s", 4.0)
    return fsm_after(*events, **config)


def kinds(effects):
    return [type(e).__name__ for e in effects]


def reducing_ab() -> RoundFSM:
    """min 2; A and B ready for round 0 and ordered to reduce it (attempt 0)."""
    fsm = machine(J("A"), J("B"), S("A", 0, 0), min_workers=2, max_workers=3)
    assert kinds(fsm.step(S("B", 0, 0))) == ["AcceptContribution", "OrderReduce"]
    return fsm


def test_ready_group_is_ordered_then_committed_on_one_digest():
    fsm = reducing_ab()
    assert fsm.step(rep("B", 0, 0, "x")) == []            # one report: nothing yet
    effects = fsm.step(rep("A", 0, 0, "x"))
    assert effects == [ApplyRound(0, 0, ("A", "B"), "x"),
                       ReleaseWorker("A", 0, 0, ReleaseOutcome.APPLIED),
                       ReleaseWorker("B", 0, 0, ReleaseOutcome.APPLIED)]
    assert fsm.open_round_ids() == (1,)


def test_order_names_the_group_in_rank_order_and_counts_attempts():
    fsm = machine(J("C"), J("A"), J("B"), S("C", 0, 0), S("A", 0, 0), min_workers=1)
    (order,) = [e for e in fsm.step(S("B", 0, 0)) if isinstance(e, OrderReduce)]
    assert order == OrderReduce(0, 0, 0, ("A", "B", "C"))


@pytest.mark.parametrize("second, reason", [
    (rep("B", 0, 0, "y"), AbortReason.DIGEST_MISMATCH),
    (rep("B", 0, 0, ok=False, digest=""), AbortReason.REDUCE_FAILED),
    (L("B"), AbortReason.MEMBER_LOST),
    (MinWorkersChanged(3), AbortReason.GROUP_BELOW_QUORUM),
])
def test_an_attempt_that_cannot_commit_aborts_and_nothing_applies(second, reason):
    fsm = reducing_ab()
    fsm.step(rep("A", 0, 0, "x"))
    effects = fsm.step(second)
    assert not any(isinstance(e, ApplyRound) for e in effects)
    aborts = [e for e in effects if isinstance(e, AbortReduce)]
    assert aborts == [AbortReduce(0, 0, 0, ("A", "B"), reason)]
    assert fsm.open_round_ids() == (0,)


def test_survivors_stay_ready_and_retry_at_once_when_the_quorum_holds():
    fsm = reducing_ab()
    effects = fsm.step(rep("B", 0, 0, ok=False, digest=""))
    assert kinds(effects) == ["AbortReduce", "OrderReduce"]
    assert effects[1] == OrderReduce(0, 0, 1, ("A", "B"))
    # A late report of the aborted attempt is refused and changes nothing.
    before = fsm.snapshot()
    assert fsm.step(rep("A", 0, 0, "x"))[0].reason is R.STALE_ATTEMPT
    assert fsm.snapshot() == before


def test_a_death_in_the_group_below_quorum_pauses_and_a_replacement_resumes():
    fsm = reducing_ab()
    effects = fsm.step(L("B", "crashed"))
    assert kinds(effects) == ["QuorumChanged", "PhaseChanged", "AbortReduce"]
    assert fsm.phase is Phase.PAUSED
    # The replacement is enlisted in round 0; A is still ready (its pseudo-gradient is valid).
    fsm.step(J("C"))
    assert fsm.phase is Phase.RUNNING
    effects = fsm.step(S("C", 0, 0))
    assert effects[-1] == OrderReduce(0, 0, 1, ("A", "C"))
    fsm.step(rep("C", 0, 1, "z"))
    assert isinstance(fsm.step(rep("A", 0, 1, "z"))[0], ApplyRound)


def test_a_silent_group_times_out_on_the_clock():
    fsm = reducing_ab()
    fsm.step(HeartbeatSeen("A"))
    assert fsm.step(Ticked(4.0)) == []                  # deadline is order + 4 s, not yet past
    effects = fsm.step(Ticked(4.5))
    assert AbortReduce(0, 0, 0, ("A", "B"), AbortReason.TIMEOUT) in effects
    assert OrderReduce(0, 0, 1, ("A", "B")) in effects


def test_a_joiner_during_a_reduce_waits_for_the_verdict_and_is_in_the_next_group():
    fsm = reducing_ab()
    fsm.step(J("C"))
    rej = fsm.step(S("C", 0, 0))
    assert len(rej) == 1 and rej[0].reason is R.REDUCING
    fsm.step(rep("A", 0, 0, "x"))
    effects = fsm.step(rep("B", 0, 0, "x"))
    assert effects[0] == ApplyRound(0, 0, ("A", "B"), "x")   # committed without the joiner
    fsm.step(S("A", 0, 1))
    fsm.step(S("B", 0, 1))
    assert fsm.step(S("C", 0, 1))[-1] == OrderReduce(0, 1, 0, ("A", "B", "C"))


def test_a_departed_member_is_no_longer_ready():
    """C2: its pseudo-gradient left with it; the round waits for the live members only."""
    fsm = machine(J("A"), J("B"), J("C"), S("A", 0, 0), min_workers=1)
    fsm.step(L("A"))
    assert fsm.status().fragments[0].contributed == ()
    fsm.step(S("B", 0, 0))
    assert fsm.step(S("C", 0, 0))[-1] == OrderReduce(0, 0, 0, ("B", "C"))


def test_drain_commits_the_round_in_flight_with_applied_final_then_stops():
    fsm = reducing_ab()
    fsm.step(ShutdownRequested(ShutdownKind.DRAIN))
    fsm.step(rep("A", 0, 0, "x"))
    effects = fsm.step(rep("B", 0, 0, "x"))
    assert effects[1].outcome is ReleaseOutcome.APPLIED_FINAL
    assert isinstance(effects[-1], StopRun) and fsm.phase is Phase.STOPPED


def test_save_and_stop_aborts_the_attempt_and_discards_readiness():
    fsm = reducing_ab()
    effects = fsm.step(ShutdownRequested(ShutdownKind.SAVE_AND_STOP))
    assert effects[0] == AbortReduce(0, 0, 0, ("A", "B"), AbortReason.SHUTDOWN)
    assert sum(isinstance(e, DiscardContribution) for e in effects) == 2
    assert isinstance(effects[-1], StopRun)


def test_fragments_reduce_independently():
    fsm = machine(J("A"), J("B"), min_workers=2, num_fragments=2)
    fsm.step(S("A", 1, 0))
    assert fsm.step(S("B", 1, 0))[-1] == OrderReduce(1, 0, 0, ("A", "B"))
    fsm.step(S("A", 0, 0))
    assert fsm.step(S("B", 0, 0))[-1] == OrderReduce(0, 0, 0, ("A", "B"))
    fsm.step(rep("A", 0, 0, "p", fid=1))
    assert fsm.step(rep("B", 0, 0, "p", fid=1))[0] == ApplyRound(1, 0, ("A", "B"), "p")
    assert fsm.open_round_ids() == (0, 1)


COLLECTIVE_CASES = [
    # (event, reason, worker_id in the Reject), against ``reducing_ab`` after A reported "x".
    (rep("Z", 0, 0), R.UNKNOWN_WORKER, "Z"),
    (rep("B", 0, 0, fid=5), R.UNKNOWN_FRAGMENT, "B"),
    (rep("B", -1, 0), R.INVALID_ROUND, "B"),
    (rep("B", 0, -1), R.INVALID_REPORT, "B"),
    (rep("B", 0, "0"), R.INVALID_REPORT, "B"),
    (ReduceReported("B", 0, 0, 0, 1, "x"), R.INVALID_REPORT, "B"),
    (rep("B", 0, 0, ""), R.INVALID_REPORT, "B"),
    (rep("B", 0, 0, "x" * 129), R.INVALID_REPORT, "B"),
    (rep("B", 0, 0, 7), R.INVALID_REPORT, "B"),
    (rep("B", 0, 1), R.STALE_ATTEMPT, "B"),
    (rep("B", 1, 0), R.STALE_ATTEMPT, "B"),
    (rep("A", 0, 0, "x"), R.DUPLICATE, "A"),
    (S("A", 0, 0), R.DUPLICATE, "A"),
]


@pytest.mark.parametrize("event, reason, wid", COLLECTIVE_CASES, ids=lambda v: repr(v)[:40])
def test_bad_reports_are_one_reject_and_change_nothing(event, reason, wid):
    fsm = reducing_ab()
    fsm.step(rep("A", 0, 0, "x"))
    before = fsm.snapshot()
    effects = fsm.step(event)
    assert len(effects) == 1 and isinstance(effects[0], Reject), effects
    assert effects[0].reason is reason and effects[0].worker_id == wid
    assert isinstance(effects[0].detail, str) and len(effects[0].detail) > 20, "a refusal says what was wrong"
    assert fsm.snapshot() == before


def test_a_joiner_outside_the_group_cannot_report():
    fsm = reducing_ab()
    fsm.step(J("C"))
    assert fsm.step(rep("C", 0, 0))[0].reason is R.STALE_ATTEMPT


def test_a_report_in_a_hub_run_is_a_stale_attempt():
    fsm = fsm_after(J("A"), S("A", 0, 0), min_workers=2)
    assert fsm.step(rep("A", 0, 0))[0].reason is R.STALE_ATTEMPT


def test_collective_needs_sync_mode_and_a_sane_reduce_timeout():
    with pytest.raises(ConfigError, match="data_plane"):
        FSMConfig(mode=Mode.ASYNC, data_plane="collective")
    with pytest.raises(ConfigError, match="data_plane"):
        FSMConfig(data_plane="ring")
    for bad in (0, -1.0, float("inf"), float("nan"), True, "5"):
        with pytest.raises(ConfigError, match="reduce_timeout_s"):
            FSMConfig(data_plane="collective", reduce_timeout_s=bad)


def test_an_open_attempt_survives_snapshot_and_restore():
    fsm = reducing_ab()
    fsm.step(rep("A", 0, 0, "x"))
    twin = RoundFSM.restore(fsm.snapshot())
    assert twin.snapshot() == fsm.snapshot()
    assert twin.step(rep("B", 0, 0, "x")) == fsm.step(rep("B", 0, 0, "x"))
    # A resumed run forgets the attempt (it is in flight, like a pending contribution).
    resumed = RoundFSM.resume(fsm.snapshot(), 0.0)
    assert resumed.open_round_ids() == (1,)


def test_a_digest_of_exactly_the_longest_length_is_accepted():
    fsm = reducing_ab()
    assert fsm.step(rep("A", 0, 0, "d" * 128)) == []


def test_a_report_in_an_async_run_is_a_stale_attempt():
    fsm = fsm_after(J("A"), min_workers=1, mode=Mode.ASYNC)
    assert fsm.step(rep("A", 0, 0))[0].reason is R.STALE_ATTEMPT


def test_a_membership_change_exactly_at_the_deadline_does_not_abort():
    """The attempt's deadline is the order's clock plus reduce_timeout_s; only past it does it abort."""
    fsm = reducing_ab()                        # ordered at t=0, deadline 4.0, heartbeat timeout 10
    fsm.step(HeartbeatSeen("A")), fsm.step(HeartbeatSeen("B"))
    fsm.step(Ticked(3.0))
    fsm.step(J("C"))
    fsm.step(Ticked(4.0))                       # exactly the deadline: not past it
    effects = fsm.step(L("C"))                  # a membership change re-checks every attempt
    assert not any(isinstance(e, AbortReduce) for e in effects), effects
