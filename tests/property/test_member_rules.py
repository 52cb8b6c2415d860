"""One focused example per rule of the collective member's machine (SPEC.md section 7c, M1-M13).

The machine is driven message by message; its jobs are answered by hand, as a driver would
answer them, so every decision is visible: what goes to the coordinator, what the session
hears, which job runs next.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from diloco.collective.member import (
    MAX_HEAL_ATTEMPTS,
    CommitJob,
    Committed,
    HealFailed,
    Healed,
    HealJob,
    HealServed,
    JobFailed,
    MemberMachine,
    NewStore,
    PlaneEvent,
    PlaneEventKind,
    Reduced,
    ReduceJob,
    RestoredState,
    RollbackJob,
    RolledBack,
    RunJob,
    ServeHealJob,
    Started,
    StartJob,
    ToCoordinator,
    ToSession,
    CancelJob,
    NORM_SLACK,
    HeldState,
    judge_contributions,
    judge_mean,
    judge_reduce,
    mean_bound,
)
from diloco.wire.messages import (
    PROTOCOL_VERSION,
    Error,
    ErrorCode,
    HealOrder,
    Join,
    Leave,
    ReduceAbort,
    ReduceOrder,
    ReduceReport,
    Result,
    Submit,
    TensorSpec,
    Welcome,
)

WID = "w1"
FRAGMENTS = (("a",), ("b",))
SPEC = (TensorSpec("a", (2,), "float32"), TensorSpec("b", (2,), "float32"))
PARAMS = {"a": "tensor-a", "b": "tensor-b"}  # opaque to the machine (M1)


def welcome(source: str = "", rounds=(0, 0), committed=((-1, ""), (-1, "")), plane: str = "collective") -> Welcome:
    return Welcome(WID, rounds, (), "sync", FRAGMENTS, 2, False, 1.0, {}, data_plane=plane, store_port=7,
                   heal_source=source, heal_prefix="heal1" if source else "", collective_timeout_s=2.0,
                   committed=committed)


def order(fid=0, rid=0, attempt=0, group=(WID, "w2")) -> ReduceOrder:
    return ReduceOrder(fid, rid, attempt, group, "g0")


def commit(fid=0, rid=0, digest="D") -> Result:
    return Result(fid, rid, "applied", rid + 1, digest=digest)


def submit(fid=0, rid=0) -> Submit:
    return Submit(WID, fid, rid, {"a": f"pg-{fid}-{rid}"})


def jobs(actions) -> list:
    return [a.job for a in actions if isinstance(a, RunJob)]


def to_coordinator(actions) -> list:
    return [a.message for a in actions if isinstance(a, ToCoordinator)]


def to_session(actions) -> list:
    return [a.item for a in actions if isinstance(a, ToSession)]


def started(m: MemberMachine, rounds=(0, 0)) -> MemberMachine:
    """A member that started the run from its own params, and is ready for round 0 of fragment 0."""
    m.received(Error(ErrorCode.START_PARAMS_REQUIRED, "start it", "Join"))
    m.session_sends(Join(WID, PROTOCOL_VERSION, SPEC, dict(PARAMS)))
    (job,) = jobs(m.received(welcome(rounds=rounds)))
    assert isinstance(job, StartJob) and not job.keep and job.params == PARAMS
    m.completed(Started(("d0", "d1"), {"a": "p", "b": "p"}))
    m.session_sends(submit())
    return m


def reported(m: MemberMachine, digest="D", **kw) -> MemberMachine:
    (job,) = jobs(m.received(order(**kw)))
    assert isinstance(job, ReduceJob)
    (report,) = to_coordinator(m.completed(Reduced(digest)))
    assert isinstance(report, ReduceReport) and report.ok and report.digest == digest
    return m


# --------------------------------------------------------------------------- M1


def test_m1_pure_the_same_events_give_the_same_actions():
    def script():
        m = started(MemberMachine(WID))
        out = m.received(order())
        out += m.completed(Reduced("D"))
        out += m.received(commit())
        out += m.completed(Committed({"a": "new"}))
        return out, m.held

    assert script() == script()


def test_m1_pure_a_welcome_renews_the_store_client():
    m = MemberMachine(WID)
    m.received(Error(ErrorCode.START_PARAMS_REQUIRED, "start it", "Join"))
    m.session_sends(Join(WID, PROTOCOL_VERSION, SPEC, dict(PARAMS)))
    actions = m.received(welcome())
    assert actions[0] == NewStore(7, 2.0)


# --------------------------------------------------------------------------- M2


def test_m2_one_job_at_a_time_and_the_verdict_first():
    m = reported(started(MemberMachine(WID)))
    # A heal order and the next fragment's order wait for the verdict of the reported attempt.
    assert jobs(m.received(HealOrder("w3", "heal7"))) == []
    m.session_sends(submit(fid=1))
    assert jobs(m.received(order(fid=1))) == []
    # The commit runs first, then the heal, then fragment 1's reduce: one at a time.
    assert jobs(m.received(commit())) == [CommitJob(0, 0, "D")]
    (serve,) = jobs(m.completed(Committed({"a": "new"})))
    assert isinstance(serve, ServeHealJob) and serve.order.joiner == "w3"
    (reduce,) = jobs(m.completed(HealServed(True)))
    assert isinstance(reduce, ReduceJob) and reduce.order.fragment_id == 1 and reduce.submit == submit(fid=1)


def test_m2_a_failed_report_holds_nothing_back():
    m = started(MemberMachine(WID))
    jobs(m.received(order()))
    (report,) = to_coordinator(m.completed(Reduced("", "the all-reduce timed out")))
    assert not report.ok and "timed out" in report.detail
    (serve,) = jobs(m.received(HealOrder("w3", "heal7")))
    assert isinstance(serve, ServeHealJob)


# --------------------------------------------------------------------------- M3


def test_m3_adopt_the_commit_of_the_proposal():
    m = reported(started(MemberMachine(WID)))
    assert jobs(m.received(commit(digest="D"))) == [CommitJob(0, 0, "D")]
    (result,) = to_session(m.completed(Committed({"a": "new"})))
    assert result.params == {"a": "new"} and result.digest == "" and not result.delta
    assert m.held.round_ids == (1, 0) and m.held.digests == ("D", "d1") and list(m.adopted) == [(0, 0, "D")]


def test_m3_a_commit_of_another_digest_rolls_back_and_rejoins():
    m = reported(started(MemberMachine(WID)), digest="MINE")
    actions = m.received(commit(digest="THEIRS"))
    assert jobs(actions) == [RollbackJob((0,))]
    (event,) = to_session(actions)
    assert event.kind is PlaneEventKind.LOST_TRACK
    m.completed(RolledBack())
    assert m.held.round_ids == (0, 0) and not m.proposals and not m.adopted


def test_m3_a_commit_for_no_attempt_of_this_member_is_lost_track():
    m = started(MemberMachine(WID))
    (event,) = to_session(m.received(commit(fid=1, rid=3)))
    assert event == PlaneEvent(PlaneEventKind.LOST_TRACK, event.detail) and "round 3" in event.detail


# --------------------------------------------------------------------------- M4


def test_m4_an_abort_rolls_back_and_a_stale_abort_does_nothing():
    m = reported(started(MemberMachine(WID)))
    assert jobs(m.received(ReduceAbort(0, 0, 5, "timeout"))) == []  # another attempt's
    assert jobs(m.received(ReduceAbort(0, 0, 0, "timeout"))) == [RollbackJob((0,))]


def test_m4_an_order_aborted_before_it_ran_is_dropped_and_one_aborted_while_running_rolled_back():
    m = reported(started(MemberMachine(WID)))
    m.session_sends(submit(fid=1))
    m.received(order(fid=1))                      # queued behind the verdict
    m.received(ReduceAbort(1, 0, 0, "member_lost"))
    assert jobs(m.received(ReduceAbort(0, 0, 0, "timeout"))) == [RollbackJob((0,))]
    assert jobs(m.completed(RolledBack())) == []  # fragment 1's order never runs
    # Aborted while its reduce runs: no report, and its proposal is rolled back once it ends.
    (job,) = jobs(m.received(order(fid=0, rid=0, attempt=1)))
    m.received(ReduceAbort(0, 0, 1, "member_lost"))
    actions = m.completed(Reduced("LATE"))
    assert to_coordinator(actions) == [] and jobs(actions) == [RollbackJob((0,))]


def test_m4_a_newer_attempt_of_the_same_round_supersedes_the_open_one():
    m = reported(started(MemberMachine(WID)))
    actions = m.received(order(attempt=1))
    assert jobs(actions) == [RollbackJob((0,))]
    (job,) = jobs(m.completed(RolledBack()))
    assert isinstance(job, ReduceJob) and job.order.attempt == 1


@pytest.mark.parametrize("committed_it", [True, False, "another digest", "another round"])
def test_m4_a_welcome_voids_attempts_and_the_start_settles_the_orphan(committed_it):
    m = reported(started(MemberMachine(WID)), digest="D")
    # Only the round and digest the orphan proposed count as its commit (C4): the same round with
    # another member's digest, or another round, is rolled back.
    record = ({True: (0, "D"), False: (-1, ""), "another digest": (0, "E"), "another round": (1, "D")}[committed_it],
              (-1, ""))
    committed_it = committed_it is True
    (job,) = jobs(m.received(welcome(rounds=(7, 3), committed=record)))
    assert job.keep and job.adopt == ((0,) if committed_it else ()) and job.rollback == (() if committed_it else (0,))
    assert to_coordinator(m.received(commit())) == []  # the voided attempt's verdict: no attempt is open
    (handed,) = to_session(m.completed(Started(("D" if committed_it else "d0", "d1"), {"a": "p"})))
    assert isinstance(handed, Welcome) and handed.params == {"a": "p"}
    assert m.held.round_ids == (7, 3) and not m.proposals
    assert list(m.adopted) == ([(0, 0, "D")] if committed_it else [])


def test_m4_a_welcome_while_a_reduce_runs_leaves_its_proposal_for_the_start():
    m = started(MemberMachine(WID))
    jobs(m.received(order()))
    assert jobs(m.received(welcome(rounds=(1, 0), committed=((0, "D"), (-1, ""))))) == []  # the reduce runs
    actions = m.completed(Reduced("D"))
    assert to_coordinator(actions) == []                   # voided: no report
    (start,) = jobs(actions)
    assert start.keep and start.adopt == (0,)


# --------------------------------------------------------------------------- M5


def test_m5_a_submit_stays_and_goes_out_as_a_ready():
    m = started(MemberMachine(WID))
    (ready,) = to_coordinator(m.session_sends(submit(rid=0)))
    assert ready.tensors == {} and ready.scales == {} and ready.round_id == 0


def test_m5_the_join_offers_what_is_held():
    m = started(MemberMachine(WID))
    (join,) = to_coordinator(m.session_sends(Join(WID, PROTOCOL_VERSION, SPEC)))
    assert join.holds_params and join.held_rounds == (0, 0) and join.held_digests == ("d0", "d1")
    fresh = MemberMachine(WID)
    fresh.restored = RestoredState({"a": "ckpt"}, FRAGMENTS, (4, 4), ("c0", "c1"), outer_states=["m0", "m1"])
    (join,) = to_coordinator(fresh.session_sends(Join(WID, PROTOCOL_VERSION, SPEC)))
    assert join.holds_params and join.held_rounds == (4, 4) and join.held_digests == ("c0", "c1")
    (start,) = jobs(fresh.received(welcome()))
    assert start.params == {"a": "ckpt"} and start.outer_states == ["m0", "m1"]


def test_m5_start_params_stay_here_and_join_resends_wait_for_the_withheld_welcome():
    m = MemberMachine(WID)
    assert to_session(m.received(Error(ErrorCode.START_PARAMS_REQUIRED, "start it", "Join")))[0].code \
        is ErrorCode.START_PARAMS_REQUIRED
    (join,) = to_coordinator(m.session_sends(Join(WID, PROTOCOL_VERSION, SPEC, dict(PARAMS))))
    assert join.params == {} and join.holds_params
    m.received(welcome())
    assert m.session_sends(Join(WID, PROTOCOL_VERSION, SPEC)) == [] and m.stats["join_resends_held"] == 1


def test_m5_a_submit_while_a_heal_is_under_way_is_no_ready():
    # A member waiting for a Result re-joins (its coordinator restarted, or thawed and declared it
    # dead); its session sends the round's Submit again while the heal runs. Forwarded, the ready
    # put the member into a group it could not serve before its heal was done: every attempt of
    # the round failed until the heal ended.
    m = started(MemberMachine(WID))
    m.session_sends(Join(WID, PROTOCOL_VERSION, SPEC))
    (heal,) = jobs(m.received(welcome(source="w2")))
    assert isinstance(heal, HealJob) and m.welcome_withheld
    assert m.session_sends(submit(rid=0)) == [] and m.stats["submits_held"] == 1
    out = m.completed(Healed((0, 0), ("h0", "h1"), {"a": "p", "b": "p"}))
    assert [type(x) for x in to_session(out)] == [Welcome]
    (ready,) = to_coordinator(m.session_sends(submit(rid=0)))  # after the Welcome: a ready again
    assert ready.round_id == 0 and ready.tensors == {}


# --------------------------------------------------------------------------- M6


def test_m6_a_failed_heal_rejoins_then_gives_up():
    m = MemberMachine(WID)
    m.session_sends(Join(WID, PROTOCOL_VERSION, SPEC))
    for attempt in range(1, MAX_HEAL_ATTEMPTS + 1):
        (job,) = jobs(m.received(welcome(source="w2")))
        assert isinstance(job, HealJob)
        actions = m.completed(HealFailed("timed out"))
        if attempt < MAX_HEAL_ATTEMPTS:
            leave, join = to_coordinator(actions)
            assert leave == Leave(WID) and isinstance(join, Join) and not join.holds_params
            assert to_session(actions) == []
    (event,) = to_session(actions)
    assert event.kind is PlaneEventKind.HEAL_FAILED and f"{MAX_HEAL_ATTEMPTS} tries" in event.detail


def test_m6_a_heal_that_succeeds_resets_the_count():
    m = MemberMachine(WID)
    m.session_sends(Join(WID, PROTOCOL_VERSION, SPEC))
    jobs(m.received(welcome(source="w2")))
    m.completed(HealFailed("timed out"))
    jobs(m.received(welcome(source="w3")))
    (handed,) = to_session(m.completed(Healed((5, 5), ("h0", "h1"), {"a": "healed"})))
    assert handed.round_ids == (5, 5) and handed.params == {"a": "healed"} and handed.parked == ()
    assert m.held.digests == ("h0", "h1") and m.stats["healed"] == 1 and m._heal_attempts == 0


# --------------------------------------------------------------------------- M7


def test_m7_the_session_never_sees_orders_aborts_heal_orders_or_reports():
    m = reported(started(MemberMachine(WID)))
    seen = to_session(m.received(HealOrder("w3", "h")))
    seen += to_session(m.received(ReduceAbort(0, 0, 0, "timeout")))
    seen += to_session(m.completed(RolledBack()))
    seen += to_session(m.received(order(attempt=1)))
    assert seen == []
    stop = Result(0, 0, "stop", 0)
    assert to_session(m.received(stop)) == [stop]  # a stop is the session's


def test_m7_a_hub_welcome_passes_through_and_so_does_everything_after_it():
    m = MemberMachine(WID)
    hub = welcome(plane="hub")
    assert to_session(m.received(hub)) == [hub]
    applied = Result(0, 0, "applied", 1, params={"a": "p"})
    assert to_session(m.received(applied)) == [applied]
    assert to_coordinator(m.session_sends(submit())) == [submit()]


# --------------------------------------------------------------------------- M8


def test_m8_a_job_that_fails_unexpectedly_is_told_and_the_machine_goes_on():
    m = started(MemberMachine(WID))
    jobs(m.received(order()))
    (event,) = to_session(m.completed(JobFailed("ValueError: boom")))
    assert event.kind is PlaneEventKind.JOB_FAILED and "boom" in event.detail
    (serve,) = jobs(m.received(HealOrder("w3", "heal7")))  # the queue moves on
    assert isinstance(serve, ServeHealJob)
    # A start that failed lets the session's join resend through.
    s = MemberMachine(WID)
    s.received(Error(ErrorCode.START_PARAMS_REQUIRED, "start it", "Join"))
    s.session_sends(Join(WID, PROTOCOL_VERSION, SPEC, dict(PARAMS)))
    s.received(welcome())
    s.completed(JobFailed("RuntimeError: no memory"))
    assert to_coordinator(s.session_sends(Join(WID, PROTOCOL_VERSION, SPEC)))


# --------------------------------------------------------------------------- M9


def test_m9_checks_judge_each_contribution_against_its_declared_norm():
    o = ReduceOrder(0, 0, 0, ("w1", "w2", "w3"), "g0", norms=(1.0, 2.0, 3.0))
    assert judge_contributions(o, (1.0, 2.0, 3.0)) == ()
    assert judge_contributions(o, (1.0 + 1e-6, 2.0, 3.0)) == ()        # rounding: within the slack
    assert judge_contributions(o, (1.5, 2.0, float("nan"))) == ("w1", "w3")
    assert judge_contributions(o, (1.0, float("inf"), 3.0)) == ("w2",)
    # fp32's mean: bounded by the mean of the declared norms (2.0 here).
    assert not judge_mean(o, 2.0) and judge_mean(o, 2.1) and judge_mean(o, float("nan"))


def test_m9_checks_a_refused_reduce_reports_its_blame_even_after_the_attempt_ended():
    m = started(MemberMachine(WID))
    jobs(m.received(order()))
    (report,) = to_coordinator(m.completed(Reduced("", "w2's contribution fails", blame=("w2",))))
    assert not report.ok and report.blame == ("w2",) and not m.proposals
    # Another member's report ended the next attempt first: the blame still goes out.
    m.session_sends(submit())
    jobs(m.received(order(attempt=1)))
    m.received(ReduceAbort(0, 0, 1, "reduce_failed"))
    (late,) = to_coordinator(m.completed(Reduced("", "w2's contribution fails", blame=("w2",))))
    assert late.attempt == 1 and late.blame == ("w2",) and not late.ok
    # fp32's refused mean: reported as such, no proposal to wait for.
    jobs(m.received(order(attempt=2)))
    (refused,) = to_coordinator(m.completed(Reduced("", "the mean fails", mean_refused=True)))
    assert refused.mean_refused and not refused.ok
    assert isinstance(jobs(m.received(HealOrder("w3", "h")))[0], ServeHealJob)  # nothing held back


# --------------------------------------------------------------------------- M10


def test_m10_provenance_a_relabelled_older_state_is_not_checkpointable_until_a_commit():
    m = MemberMachine(WID)
    m.restored = RestoredState({"a": "old"}, FRAGMENTS, (219, 219), ("old0", "old1"))
    m.session_sends(Join(WID, PROTOCOL_VERSION, SPEC))
    # The run's record: fragment 0 last committed at 225 (digest "new0"); fragment 1 never.
    (start,) = jobs(m.received(welcome(rounds=(226, 0), committed=((225, "new0"), (-1, "")))))
    m.completed(Started(("old0", "old1"), {"a": "old"}))
    assert m.held.round_ids == (226, 0) and not m.state_confirmed   # round 226's label, round 219's state
    m.session_sends(submit(rid=226))
    jobs(m.received(order(rid=226)))
    m.completed(Reduced("D226"))
    jobs(m.received(commit(rid=226, digest="D226")))
    m.completed(Committed({"a": "new"}))
    assert m.state_confirmed                                        # a commit of this run made it


def test_m10_provenance_the_state_the_last_commits_made_is_confirmed_at_once():
    m = MemberMachine(WID)
    m.restored = RestoredState({"a": "ckpt"}, FRAGMENTS, (226, 0), ("new0", "d1"))
    m.session_sends(Join(WID, PROTOCOL_VERSION, SPEC))
    jobs(m.received(welcome(rounds=(226, 0), committed=((225, "new0"), (-1, "")))))
    m.completed(Started(("new0", "d1"), {"a": "ckpt"}))
    assert m.state_confirmed
    healer = MemberMachine(WID)
    healer.session_sends(Join(WID, PROTOCOL_VERSION, SPEC))
    jobs(healer.received(welcome(source="w2", committed=((4, "h0"), (-1, "")))))
    healer.completed(Healed((5, 0), ("h0", "d1"), {"a": "healed"}))
    assert healer.state_confirmed
    hub = MemberMachine(WID)
    hub.received(welcome(plane="hub"))
    assert hub.state_confirmed  # nothing to confirm off the collective plane


# --------------------------------------------------------------------------- M11


def test_m11_the_step_is_bounded_from_the_declared_mean_and_a_refused_step_is_no_proposal():
    o = ReduceOrder(0, 0, 0, ("w1", "w2"), "g0", norms=(1.0, 3.0))
    assert mean_bound(o) == pytest.approx(2.0 * (1 + NORM_SLACK))
    assert mean_bound(order()) == math.inf  # no declared norms: only finiteness bounds the step
    # What the replica refuses (``StepRefused``) completes the reduce with no digest: a failed
    # report, no proposal held, nothing waited for.
    m = started(MemberMachine(WID))
    jobs(m.received(order()))
    (report,) = to_coordinator(m.completed(Reduced("", "fragment 0: the outer step's norm 9 is beyond its bound 1")))
    assert not report.ok and not report.digest and "beyond its bound" in report.detail
    assert not m.proposals and not report.blame and not report.mean_refused
    assert isinstance(jobs(m.received(HealOrder("w3", "h")))[0], ServeHealJob)


# --------------------------------------------------------------------------- what it says, exactly
#
# The rules above, pinned to the exact words and fields the machine sends: what the coordinator,
# the session and an operator's logs read (and what mutation testing holds it to, tests/MUTANTS.md).


def test_exact_the_checks_judge_at_their_bounds():
    o = ReduceOrder(0, 0, 0, ("w1", "w2", "w3"), "g0", norms=(1.0, 2.0))  # w3 declared no norm
    edge = 1.0 * (1 + NORM_SLACK) + 1e-12
    assert judge_contributions(o, (edge, 2.0, 1e30)) == ()                 # at the bound: not beyond
    assert judge_contributions(o, (edge * (1 + 1e-9), 2.0, 5.0)) == ("w1",)
    assert judge_contributions(o, (1.0, 2.0, float("nan"))) == ("w3",)     # undeclared: only finiteness
    assert mean_bound(o) == 1.5 * (1 + NORM_SLACK) + 1e-12
    assert not judge_mean(o, 1.5 * (1 + NORM_SLACK) + 1e-12) and judge_mean(o, 1.5 * (1 + NORM_SLACK) + 2e-12)


def test_exact_judge_reduce_reports_blame_or_a_refused_mean_and_measures_the_mean_only_without_norms():
    o = ReduceOrder(0, 4, 1, ("w1", "w2"), "g0", norms=(1.0, 3.0))
    measured = []

    def mean_norm():
        measured.append(1)
        return 2.0

    assert judge_reduce(o, (1.0, 3.0), mean_norm) is None and not measured
    assert judge_reduce(o, (1.0, 30.0), mean_norm) == Reduced(
        "", "contributions failing the checks (norm as decoded > declared): w2 (30 > 3)", blame=("w2",))
    assert judge_reduce(o, (), mean_norm) is None and measured == [1]     # 2.0 <= mean of (1, 3)
    assert judge_reduce(o, (), lambda: 2.5) == Reduced(
        "", "the all-reduced mean's norm 2.5 fails the checks (the declared norms bound it by 2)",
        mean_refused=True)


def test_exact_a_reduce_with_nothing_to_contribute_reports_why_and_counts_it():
    m = started(MemberMachine(WID))
    out = m.received(ReduceOrder(0, 0, 0, ("w2", "w3"), "g0"))  # a group without this member
    assert out == [ToCoordinator(ReduceReport(WID, 0, 0, 0, False, "",
                                              "no pseudo-gradient of fragment 0 round 0 on this worker"))]
    assert m.stats["reduce_failed"] == 1
    # The next attempt includes it again and runs: the failed one left no open attempt behind.
    assert isinstance(jobs(m.received(order(attempt=1)))[0], ReduceJob)
    m2 = started(MemberMachine(WID))
    assert to_coordinator(m2.received(order(fid=1))) == [ReduceReport(
        WID, 1, 0, 0, False, "", "no pseudo-gradient of fragment 1 round 0 on this worker")]  # no Submit


def test_exact_reports_of_a_reduce_carry_every_field():
    m = started(MemberMachine(WID))
    jobs(m.received(order()))
    assert to_coordinator(m.completed(Reduced("", "x" * 2000, blame=("w2",), mean_refused=True))) == [
        ReduceReport(WID, 0, 0, 0, False, "", "x" * 1000, ("w2",), True)]
    assert m.stats["reduce_failed"] == 1 and not m.proposals
    m.session_sends(submit())
    jobs(m.received(order(attempt=1)))
    m.received(ReduceAbort(0, 0, 1, "reduce_failed"))            # ended by another member's report
    assert to_coordinator(m.completed(Reduced("", "blamed", blame=("w2",)))) == [
        ReduceReport(WID, 0, 0, 1, False, "", "blamed", ("w2",))]
    jobs(m.received(order(attempt=2)))
    m.received(ReduceAbort(0, 0, 2, "reduce_failed"))
    assert m.completed(Reduced("", "plain failure")) == []         # no blame: nothing to add


def test_exact_a_commit_reaches_the_session_as_fp32_params_and_a_stop_rolls_back():
    m = reported(started(MemberMachine(WID)), digest="D")
    result = Result(0, 0, "applied", 1, delta=True, wire_dtype="int8", scales={"a": "s"}, digest="D")
    (job,) = jobs(m.received(result))
    assert job == CommitJob(0, 0, "D")
    (handed,) = to_session(m.completed(Committed({"a": "new"})))
    assert handed == Result(0, 0, "applied", 1, params={"a": "new"}, delta=False, wire_dtype="fp32", scales={},
                            digest="")
    assert m.held.round_ids == (1, 0) and m.held.digests[0] == "D" and list(m.adopted) == [(0, 0, "D")]
    assert m.stats["committed"] == 1 and m.state_confirmed
    # A stop Result while a proposal waits: the proposal is rolled back and the session told.
    m.session_sends(submit(rid=1))
    jobs(m.received(order(rid=1)))
    m.completed(Reduced("E"))
    stop = Result(0, 1, "stop", 0)
    out = m.received(stop)
    assert jobs(out) == [RollbackJob((0,))] and to_session(out) == [stop]
    m.completed(RolledBack())
    assert m.stats["aborted"] == 1 and not m.proposals


def test_exact_a_result_without_a_digest_is_the_session_s_and_ends_the_attempt():
    m = started(MemberMachine(WID))
    jobs(m.received(order()))
    plain = Result(0, 0, "applied", 1)
    out = m.received(plain)
    assert to_session(out) == [plain] and jobs(out) == []
    assert m.completed(Reduced("LATE")) != [] and not to_coordinator(m.completed(RolledBack()))


def test_exact_completions_after_close_or_of_the_wrong_kind():
    m = started(MemberMachine(WID))
    jobs(m.received(order()))
    with pytest.raises(TypeError, match="^Committed does not answer a ReduceJob$"):
        m.completed(Committed({}))
    m2 = started(MemberMachine(WID))
    jobs(m2.received(order()))
    m2.close()
    assert m2.closed and m2.completed(Reduced("D")) == [] and m2.session_sends(submit(rid=1)) != []
    assert jobs(m2.received(order(attempt=1))) == []                  # nothing runs once closed


def test_exact_a_stale_order_is_counted_and_a_newer_one_supersedes():
    m = started(MemberMachine(WID))
    m.received(order(attempt=3))
    assert m.received(order(attempt=2)) == [] and m.stats["stale_orders"] == 1
    assert m.received(order(attempt=3)) == [] and m.stats["stale_orders"] == 2


def test_exact_the_start_and_heal_paths_say_what_went_wrong():
    # Welcomed as the start with nothing to start from.
    m = MemberMachine(WID)
    m.session_sends(Join(WID, PROTOCOL_VERSION, SPEC))
    assert m.received(welcome()) == [NewStore(7, 2.0), ToSession(PlaneEvent(
        PlaneEventKind.NO_START_STATE,
        "the coordinator welcomed this worker as the run's start, but it sent no params to start from"))]
    assert not m.welcome_withheld and m.collective
    # A collective_timeout_s of 0 falls back to 30 s for the store client.
    m0 = MemberMachine(WID)
    m0.session_sends(Join(WID, PROTOCOL_VERSION, SPEC))
    assert m0.received(Welcome(WID, (0, 0), (), "sync", FRAGMENTS, 2, False, 1.0, {}, data_plane="collective",
                               store_port=9, heal_source="w3", heal_prefix="h"))[0] == NewStore(9, 30.0)
    assert m0.welcome_withheld
    # Holding another fragment layout, welcomed as the start without params.
    other = started(MemberMachine(WID))
    other.received(Error(ErrorCode.START_PARAMS_REQUIRED, "start it", "Join"))
    layout = Welcome(WID, (0,), (), "sync", (("a", "b"),), 2, False, 1.0, {}, data_plane="collective",
                     store_port=7, collective_timeout_s=2.0)
    assert to_session(other.received(layout)) == [PlaneEvent(
        PlaneEventKind.NO_START_STATE, "welcomed as the run's start with another fragment layout than the state "
                                       "this worker holds, and no params to start from")]
    assert not other.welcome_withheld


def test_exact_a_restored_checkpoint_starts_the_run_with_its_momentum_if_the_layout_matches():
    for states, layout, expected in ((["m0", "m1"], FRAGMENTS, ["m0", "m1"]), (["m0"], FRAGMENTS, None)):
        m = MemberMachine(WID)
        m.restored = RestoredState({"a": "ckpt"}, FRAGMENTS, (4, 4), ("d0", "d1"), states)
        m.received(Error(ErrorCode.START_PARAMS_REQUIRED, "start it", "Join"))
        (join,) = to_coordinator(m.session_sends(Join(WID, PROTOCOL_VERSION, SPEC, dict(PARAMS))))
        assert join.holds_params and join.held_rounds == (4, 4) and join.params == {}
        (job,) = jobs(m.received(welcome(rounds=(4, 4))))
        assert job.params == {"a": "ckpt"} and job.outer_states == expected and not job.keep
        m.completed(Started(("d0", "d1"), {"a": "ckpt"}))
        assert m.restored is None and m.held == HeldState(FRAGMENTS, (4, 4), ("d0", "d1"))


def test_exact_a_kept_replica_relabelled_and_its_orphans_are_counted():
    m = reported(started(MemberMachine(WID)), digest="D")
    (job,) = jobs(m.received(welcome(rounds=(7, 3), committed=((0, "D"), (-1, "")))))
    (handed,) = to_session(m.completed(Started(("D", "d1"), {"a": "p"})))
    assert handed.round_ids == (7, 3) and m.stats["adopted_after_reconnect"] == 1 and m.stats["relabelled"] == 1
    assert m.held == HeldState(FRAGMENTS, (7, 3), ("D", "d1"))
    # Welcomed again at the rounds it holds: nothing relabelled.
    jobs(m.received(welcome(rounds=(7, 3), committed=((6, "D"), (2, "d1")))))
    m.completed(Started(("D", "d1"), {"a": "p"}))
    assert m.stats["relabelled"] == 1 and m.state_confirmed


def test_exact_heals_failing_rejoin_without_the_failed_state_then_give_up():
    m = MemberMachine(WID)
    m.session_sends(Join(WID, PROTOCOL_VERSION, SPEC))
    for attempt in range(1, MAX_HEAL_ATTEMPTS + 1):
        (job,) = jobs(m.received(welcome(source="w3")))
        assert isinstance(job, HealJob) and m.welcome_withheld
        assert m.session_sends(Join(WID, PROTOCOL_VERSION, SPEC)) == []           # held back while healing
        out = m.completed(HealFailed("source gone"))
        assert m.stats["heals_failed"] == attempt and not m.welcome_withheld
        if attempt < MAX_HEAL_ATTEMPTS:
            assert to_coordinator(out) == [Leave(WID), Join(WID, PROTOCOL_VERSION, SPEC)]
        else:
            assert out == [ToSession(PlaneEvent(
                PlaneEventKind.HEAL_FAILED,
                f"could not copy the run's state from 'w3' ({MAX_HEAL_ATTEMPTS} tries): source gone"))]
    assert m.stats["join_resends_held"] == MAX_HEAL_ATTEMPTS


def test_exact_a_heal_offers_the_state_it_holds_when_it_joins_again():
    m = started(MemberMachine(WID))
    m.received(welcome(source="w3"))  # a re-join after a lost track: heal
    out = m.completed(HealFailed("timed out"))
    assert to_coordinator(out) == [Leave(WID), Join(WID, PROTOCOL_VERSION, SPEC, holds_params=True,
                                                    held_rounds=(0, 0), held_digests=("d0", "d1"))]


def test_exact_a_heal_hands_on_its_rounds_and_no_parked_fragments():
    m = MemberMachine(WID)
    m.session_sends(Join(WID, PROTOCOL_VERSION, SPEC))
    w = dataclasses.replace(welcome(source="w3"), parked=((0, 1),))
    jobs(m.received(w))
    (handed,) = to_session(m.completed(Healed((5, 2), ("h0", "h1"), {"a": "healed"})))
    assert handed == dataclasses.replace(w, round_ids=(5, 2), parked=(), params={"a": "healed"})
    assert m.stats["healed"] == 1 and not m.welcome_withheld and m.held.round_ids == (5, 2)


def test_exact_a_failed_job_is_named_and_frees_its_attempt():
    m = started(MemberMachine(WID))
    jobs(m.received(order()))
    out = m.completed(JobFailed("boom"))
    assert out == [ToSession(PlaneEvent(PlaneEventKind.JOB_FAILED, "collective data plane, ReduceJob: boom"))]
    assert m.stats["internal_errors"] == 1
    # The attempt is no longer open here: a commit of it is not this member's proposal.
    assert to_session(m.received(commit(digest="D")))[0].kind is PlaneEventKind.LOST_TRACK
    assert isinstance(jobs(m.received(order(attempt=1)))[0], ReduceJob)
    h = MemberMachine(WID)
    h.session_sends(Join(WID, PROTOCOL_VERSION, SPEC))
    jobs(h.received(welcome(source="w3")))
    h.completed(JobFailed("torch"))
    assert not h.welcome_withheld and h.stats["internal_errors"] == 1


def test_exact_serving_heals_is_counted_and_only_the_newest_order_per_joiner_is_served():
    m = started(MemberMachine(WID))
    (job,) = jobs(m.received(HealOrder("w3", "h1")))
    m.received(HealOrder("w3", "h2"))                       # w3 joined again meanwhile
    m.received(HealOrder("w4", "h3"))
    (nxt,) = jobs(m.completed(HealServed(True)))
    assert nxt == ServeHealJob(HealOrder("w3", "h2"))       # h1 ran; the later w3 order is served too
    (last,) = jobs(m.completed(HealServed(False)))
    assert last == ServeHealJob(HealOrder("w4", "h3"))
    m.completed(HealServed(True))
    assert m.stats["heals_served"] == 2 and m.stats["heals_failed"] == 1
    fresh = MemberMachine(WID)                               # holds nothing: serves nothing
    fresh.received(welcome(plane="collective", source="w9"))
    assert jobs(fresh.received(HealOrder("w3", "h9"))) == []


def test_exact_lost_track_is_counted_and_explained():
    m = started(MemberMachine(WID))
    out = m.received(commit(digest="Z"))
    assert out == [ToSession(PlaneEvent(PlaneEventKind.LOST_TRACK, "fragment 0 round 0 committed without a "
                                                                   "proposal of this worker's: joining again to heal"))]
    assert m.stats["lost_track"] == 1


def test_exact_a_welcome_drops_queued_reduces_but_keeps_other_jobs():
    m = reported(started(MemberMachine(WID)))
    m.received(HealOrder("w3", "h1"))                         # queued behind the verdict
    m.session_sends(submit(fid=1))
    m.received(order(fid=1))                                  # queued too
    (served,) = jobs(m.received(welcome(rounds=(1, 0), committed=((0, "D"), (-1, "")))))
    assert served == ServeHealJob(HealOrder("w3", "h1"))      # the heal order stays (no verdict to wait for) ...
    (job,) = jobs(m.completed(HealServed(True)))
    assert isinstance(job, StartJob) and job.adopt == (0,)    # ... the start follows ...
    assert jobs(m.completed(Started(("D", "d1"), {"a": "p"}))) == []  # ... and the voided reduce is gone


def test_exact_counters_count_every_event():
    m = started(MemberMachine(WID))
    for rid in (0, 1):                                    # two commits adopted
        m.session_sends(submit(rid=rid))
        jobs(m.received(order(rid=rid)))
        m.completed(Reduced(f"D{rid}"))
        m.received(commit(rid=rid, digest=f"D{rid}"))
        m.completed(Committed({"a": rid}))
    m.received(commit(rid=5, digest="Z"))                 # two commits it never proposed for
    m.received(commit(rid=6, digest="Z"))
    for attempt in (0, 1):                                # two failed reduces
        m.session_sends(submit(rid=2))
        jobs(m.received(order(rid=2, attempt=attempt)))
        m.completed(Reduced("", "failed"))
    for attempt in (2, 3):                                # two jobs that raised
        jobs(m.received(order(rid=2, attempt=attempt)))
        m.completed(JobFailed("boom"))
    assert m.stats == {"committed": 2, "lost_track": 2, "reduce_failed": 2, "internal_errors": 2}
    h = MemberMachine(WID)
    h.session_sends(Join(WID, PROTOCOL_VERSION, SPEC))
    for _ in range(2):                                    # two heals
        jobs(h.received(welcome(source="w3")))
        h.completed(Healed((1, 1), ("h0", "h1"), {"a": "x"}))
    assert h.stats == {"healed": 2}
    k = started(MemberMachine(WID))
    for n in (1, 2):                                      # two restarts that keep an orphan and relabel
        k.session_sends(submit(rid=n - 1))
        jobs(k.received(order(rid=n - 1)))
        k.completed(Reduced(f"O{n}"))
        jobs(k.received(welcome(rounds=(10 * n, 10 * n), committed=((n - 1, f"O{n}"), (-1, "")))))
        k.completed(Started((f"O{n}", "d1"), {"a": "p"}))
    assert k.stats == {"adopted_after_reconnect": 2, "relabelled": 2, "committed": 2}


def test_exact_two_blamed_members_are_both_named():
    o = ReduceOrder(0, 0, 0, ("w1", "w2"), "g0", norms=(1.0, 1.0))
    assert judge_reduce(o, (5.0, 6.0), lambda: 0.0) == Reduced(
        "", "contributions failing the checks (norm as decoded > declared): w1 (5 > 1), w2 (6 > 1)",
        blame=("w1", "w2"))


def test_exact_provenance_with_a_short_record_and_a_round_zero_commit():
    m = MemberMachine(WID)
    m.restored = RestoredState({"a": "old"}, FRAGMENTS, (1, 3), ("x0", "old1"))
    m.session_sends(Join(WID, PROTOCOL_VERSION, SPEC))
    # The record names fragment 0's commit at round 0 with another digest, and nothing of fragment 1.
    jobs(m.received(welcome(rounds=(1, 3), committed=((0, "other"),))))
    m.completed(Started(("x0", "old1"), {"a": "old"}))
    assert not m.state_confirmed                          # fragment 0: not the state round 0 made
    assert m._confirmed == [False, True]                  # fragment 1: the run never committed it


def test_exact_a_commit_of_its_own_proposal_says_nothing_else_to_the_session():
    m = reported(started(MemberMachine(WID)), digest="D")
    out = m.received(commit(digest="D"))
    assert out == [RunJob(CommitJob(0, 0, "D"))]


def test_exact_a_commit_while_its_reduce_runs_is_one_lost_track():
    m = started(MemberMachine(WID))
    jobs(m.received(order()))
    out = m.received(commit(digest="D"))
    assert [a.item.kind for a in out if isinstance(a, ToSession)] == [PlaneEventKind.LOST_TRACK]
    assert m.stats["lost_track"] == 1


def test_exact_an_abort_drops_only_its_own_queued_reduce():
    m = started(MemberMachine(WID))
    jobs(m.received(order()))                             # fragment 0's reduce runs
    m.session_sends(submit(fid=1))
    m.received(order(fid=1))                              # fragment 1's waits behind it
    m.received(HealOrder("w3", "h1"))                     # and a heal order
    running = ReduceJob(order(), submit())
    # M13: aborted while it runs: its forming group is abandoned (CancelJob), and it is rolled back.
    assert m.received(ReduceAbort(0, 0, 0, "timeout")) == [CancelJob(running)]
    (rollback,) = jobs(m.completed(Reduced("D")))
    assert rollback == RollbackJob((0,))
    (nxt,) = jobs(m.completed(RolledBack()))
    assert isinstance(nxt, ReduceJob) and nxt.order.fragment_id == 1
    # Aborting the queued one instead drops it, and keeps the heal order.
    q = started(MemberMachine(WID))
    jobs(q.received(order()))
    q.session_sends(submit(fid=1))
    q.received(order(fid=1))
    q.received(HealOrder("w3", "h1"))
    q.received(ReduceAbort(1, 0, 0, "timeout"))
    (report,) = to_coordinator(q.completed(Reduced("D")))
    assert report.ok and jobs(q.received(commit(digest="D"))) == [CommitJob(0, 0, "D")]
    assert jobs(q.completed(Committed({"a": 1}))) == [ServeHealJob(HealOrder("w3", "h1"))]


def test_exact_a_voided_reduce_is_forgotten_once_it_ends():
    m = started(MemberMachine(WID))
    jobs(m.received(order()))
    jobs(m.received(welcome(rounds=(0, 0))))              # a restarted coordinator: the reduce is voided
    assert to_coordinator(m.completed(Reduced("", "failed"))) == []
    m.completed(Started(("d0", "d1"), {"a": "p"}))
    m.session_sends(submit())
    jobs(m.received(order()))                             # its own attempt 0 of round 0
    (report,) = to_coordinator(m.completed(Reduced("D")))
    assert report.ok and report.attempt == 0


def test_exact_an_overlapping_submit_survives_the_commit_of_the_round_before():
    m = reported(started(MemberMachine(WID)), digest="D")
    m.session_sends(submit(rid=1))                        # overlap: round 1's Submit before round 0's Result
    jobs(m.received(commit(digest="D")))
    m.completed(Committed({"a": "new"}))
    (job,) = jobs(m.received(order(rid=1)))
    assert isinstance(job, ReduceJob) and job.submit.round_id == 1


def test_exact_a_failed_heal_of_a_member_that_offered_start_params_joins_again_without_them():
    m = MemberMachine(WID)
    m.received(Error(ErrorCode.START_PARAMS_REQUIRED, "start it", "Join"))
    (join,) = to_coordinator(m.session_sends(Join(WID, PROTOCOL_VERSION, SPEC, dict(PARAMS))))
    assert join.holds_params
    jobs(m.received(welcome(source="w3")))               # another member started the run meanwhile
    out = m.completed(HealFailed("gone"))
    assert to_coordinator(out) == [Leave(WID), Join(WID, PROTOCOL_VERSION, SPEC)]


def test_exact_a_job_failing_after_its_attempt_was_aborted():
    m = started(MemberMachine(WID))
    jobs(m.received(order()))
    m.received(ReduceAbort(0, 0, 0, "timeout"))
    assert to_session(m.completed(JobFailed("late")))[0].kind is PlaneEventKind.JOB_FAILED


def test_exact_off_the_collective_plane_everything_passes_through_unchanged():
    m = MemberMachine(WID)
    assert m.state_confirmed and not m.collective
    join = Join(WID, PROTOCOL_VERSION, SPEC, dict(PARAMS))  # the hub's params_required answer
    ready = Submit(WID, 0, 0, {"a": "pg"}, scales={"a": "s"})
    assert m.session_sends(join) == [ToCoordinator(join)] and m.session_sends(ready) == [ToCoordinator(ready)]


def test_exact_a_collective_ready_carries_no_tensors_and_no_scales():
    m = started(MemberMachine(WID))
    out = m.session_sends(Submit(WID, 0, 0, {"a": "pg"}, scales={"a": "s"}, norm=2.0))
    assert out == [ToCoordinator(Submit(WID, 0, 0, {}, scales={}, norm=2.0))]


def test_exact_adopted_keeps_the_last_4096_commits():
    m = started(MemberMachine(WID))
    for rid in range(4097):
        m.session_sends(submit(rid=rid))
        jobs(m.received(order(rid=rid)))
        m.completed(Reduced(f"D{rid}"))
        m.received(commit(rid=rid, digest=f"D{rid}"))
        m.completed(Committed({}))
    assert len(m.adopted) == 4096 and m.adopted[0] == (0, 1, "D1") and m.adopted[-1] == (0, 4096, "D4096")


def test_exact_a_completion_with_nothing_running_or_of_another_job_kind():
    m = started(MemberMachine(WID))
    assert m.completed(RolledBack()) == []                   # nothing runs: nothing to answer
    for wrong in (Started((), {}), HealFailed("x"), HealServed(True), Healed((), (), {})):
        m2 = started(MemberMachine(WID))
        jobs(m2.received(order()))
        with pytest.raises(TypeError, match=f"^{type(wrong).__name__} does not answer a ReduceJob$"):
            m2.completed(wrong)


def test_exact_aborts_and_failed_dispatches_are_counted_past_one():
    m = started(MemberMachine(WID))
    for attempt in (0, 1):
        m.session_sends(submit())
        jobs(m.received(order(attempt=attempt)))
        m.completed(Reduced("D"))
        m.received(ReduceAbort(0, 0, attempt, "timeout"))
        m.completed(RolledBack())
    for attempt in (2, 3):
        m.received(ReduceOrder(0, 0, attempt, ("w2", "w3"), "g0"))  # not in the group
    assert m.stats == {"aborted": 2, "reduce_failed": 2}


def test_exact_an_orphan_of_a_fragment_the_record_does_not_name_is_rolled_back():
    m = started(MemberMachine(WID))
    m.session_sends(submit(fid=1))
    jobs(m.received(order(fid=1)))
    m.completed(Reduced("P"))
    (job,) = jobs(m.received(welcome(rounds=(0, 0), committed=((-1, ""),))))  # a record of one fragment
    assert job.keep and job.adopt == () and job.rollback == (1,)


def test_exact_a_kept_start_carries_no_params_even_after_a_start_params_request():
    m = started(MemberMachine(WID))
    m.received(Error(ErrorCode.START_PARAMS_REQUIRED, "start it", "Join"))
    m.session_sends(Join(WID, PROTOCOL_VERSION, SPEC, dict(PARAMS)))
    (job,) = jobs(m.received(welcome()))
    assert job.keep and job.params is None


def test_exact_a_member_that_holds_nothing_serves_no_heal():
    m = MemberMachine(WID)
    m.session_sends(Join(WID, PROTOCOL_VERSION, SPEC))
    m.received(welcome())                                    # NO_START_STATE: collective, nothing held
    assert m.collective and m.held is None
    assert m.received(HealOrder("w3", "h1")) == []


# --------------------------------------------------------------------------- the spec names these tests


def test_spec_section_7c_names_only_tests_that_exist():
    import fnmatch
    import re
    from pathlib import Path

    spec = (Path(__file__).resolve().parents[2] / "SPEC.md").read_text(encoding="utf-8")
    section = spec[spec.index("## 7c. The collective member"):spec.index("## 8. Policies")]
    rules = re.findall(r"^- \*\*(M\d+) [^*]+\.\*\*(.*?)(?=^- \*\*M|\Z)", section, re.S | re.M)
    assert [r for r, _ in rules] == [f"M{i}" for i in range(1, 14)]
    tests = [name for name in globals() if name.startswith("test_")]
    for rule, text in rules:
        names = re.findall(r"`(test_\w+\*?)`", text)
        assert names, f"{rule} names no test"
        for name in names:
            assert fnmatch.filter(tests, name), f"{rule} names {name}, which matches no test"


# --------------------------------------------------------------------------- M12


def test_m12_a_withdrawn_heal_running_is_cancelled_and_ends_as_a_failed_serve():
    m = started(MemberMachine(WID))
    (serve,) = jobs(m.received(HealOrder("w3", "heal7")))
    assert isinstance(serve, ServeHealJob)
    assert m.received(HealOrder("w4", "")) == []  # another joiner's withdrawal: nothing to stop
    assert m.received(HealOrder("w3", "")) == [CancelJob(serve)]
    m.completed(HealServed(False, "stopped"))
    assert m.stats["heals_failed"] == 1
    # The machine is free again: the next order runs.
    (job,) = jobs(m.received(order()))
    assert isinstance(job, ReduceJob)


def test_m12_a_withdrawn_heal_still_queued_never_runs():
    m = started(MemberMachine(WID))
    (serve,) = jobs(m.received(HealOrder("w3", "heal7")))
    assert jobs(m.received(HealOrder("w4", "heal8"))) == []  # queued behind the first serve
    assert m.received(HealOrder("w4", "")) == []  # not running: nothing to cancel
    assert jobs(m.completed(HealServed(True))) == []  # w4's serve was dropped
    assert m.stats["heals_served"] == 1


def test_m12_a_new_order_after_a_withdrawal_is_served():
    m = started(MemberMachine(WID))
    (first,) = jobs(m.received(HealOrder("w3", "heal7")))
    assert m.received(HealOrder("w3", "")) == [CancelJob(first)]
    assert jobs(m.received(HealOrder("w3", "heal9"))) == []  # queued behind the cancelled one
    (second,) = jobs(m.completed(HealServed(False, "stopped")))
    assert isinstance(second, ServeHealJob) and second.order.prefix == "heal9"


def test_m13_an_attempt_that_ends_while_its_reduce_runs_cancels_that_reduce_and_no_other():
    running = ReduceJob(order(), submit())
    # Aborted, superseded by a newer attempt, or committed without this member: the same cancel.
    for end in (ReduceAbort(0, 0, 0, "timeout"), order(attempt=1), commit(digest="D")):
        m = started(MemberMachine(WID))
        assert jobs(m.received(order())) == [running]
        assert [a for a in m.received(end) if isinstance(a, CancelJob)] == [CancelJob(running)], end
    # Another fragment's abort, or another attempt's, leaves the running reduce alone.
    m = started(MemberMachine(WID))
    jobs(m.received(order()))
    m.session_sends(submit(fid=1))
    m.received(order(fid=1))
    assert not [a for a in m.received(ReduceAbort(1, 0, 0, "timeout")) if isinstance(a, CancelJob)]
    assert not [a for a in m.received(ReduceAbort(0, 0, 7, "timeout")) if isinstance(a, CancelJob)]
    # The cancelled reduce's failure is no report: its attempt is over; the next job runs.
    m = started(MemberMachine(WID))
    jobs(m.received(order()))
    m.received(ReduceAbort(0, 0, 0, "timeout"))
    out = m.completed(Reduced("", "group 'g0' abandoned while it formed: the attempt is over"))
    assert not to_coordinator(out)
