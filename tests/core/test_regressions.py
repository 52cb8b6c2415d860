"""Scenario tests, readable as transcripts (etcd-raft style), and shrunk Hypothesis counterexamples.

Each test feeds events to a fresh ``RoundFSM`` and states the exact effects
it expects, so a test reads like::

    join A / join B / submit A r0 / crash B   ->  nothing applies, A parked

Rule numbers refer to SPEC.md.
"""

from __future__ import annotations

import pytest

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
    WorkerJoined,
    WorkerLeft,
)
from model import Tracker

APPLIED = ReleaseOutcome.APPLIED
FINAL = ReleaseOutcome.APPLIED_FINAL
STOP = ReleaseOutcome.STOP


class Run:
    """A machine plus the shared tracking model: every step is also checked against the invariants."""

    def __init__(self, **config) -> None:
        config.setdefault("heartbeat_timeout_s", 10.0)
        self.fsm = RoundFSM(FSMConfig(**config))
        self.tracker = Tracker.fresh(self.fsm.config)

    def step(self, event) -> list:
        effects = self.fsm.step(event)
        self.tracker.observe(event, effects)
        self.tracker.check_state(self.fsm)
        return effects

    # transcript verbs
    def join(self, wid):
        return self.step(WorkerJoined(wid))

    def submit(self, wid, rid, fid=0):
        return self.step(ContributionSubmitted(wid, fid, rid))

    def leave(self, wid, cause=LeaveCause.LEFT):
        return self.step(WorkerLeft(wid, cause))

    def crash(self, wid):
        return self.step(WorkerLeft(wid, LeaveCause.CRASHED))

    def tick(self, now_s):
        return self.step(Ticked(now_s))

    def heartbeat(self, wid):
        return self.step(HeartbeatSeen(wid))

    def set_min(self, n):
        return self.step(MinWorkersChanged(n))

    def shutdown(self, kind=ShutdownKind.DRAIN):
        return self.step(ShutdownRequested(kind))

    @property
    def parked(self):
        return self.fsm.status().parked_workers


def kinds(effects) -> list[type]:
    return [type(e) for e in effects]


# --------------------------------------------------- shrunk counterexamples


@pytest.mark.parametrize("event", [
    HeartbeatSeen(["A"]),
    WorkerLeft(["A"]),
    ContributionSubmitted(["A"], 0, 0),
    ContributionSubmitted({"id": "A"}, 0, 0),
])
@pytest.mark.parametrize("mode", list(Mode))
def test_unhashable_worker_id_is_rejected_not_a_type_error(event, mode):
    """Found by test_fsm_stateful: ``heartbeat(wid=['A'])`` raised TypeError from ``wid in members``.

    R3: every field a peer chooses is untrusted; a non-string id is an unknown
    worker, answered with one Reject, and nothing changes (R2).
    """
    run = Run(min_workers=1, mode=mode)
    run.join("A")
    before = run.fsm.snapshot()
    effects = run.step(event)
    assert effects == [Reject("", RejectReason.UNKNOWN_WORKER, effects[0].detail)]
    assert "['A']" in effects[0].detail or "{'id': 'A'}" in effects[0].detail
    assert run.fsm.snapshot() == before


@pytest.mark.parametrize("last_s, now_s, timeout_s, dies", [
    # 1.0 - 0.7 == 0.30000000000000004 > 0.3, but 0.7 < 1.0 - 0.3 is False.
    (0.7, 1.0, 0.3, True),
    # 11.8 - 1.8 == 10.0, not > 10.0, but 1.8 < 11.8 - 10.0 is True.
    (1.8, 11.8, 10.0, False),
])
def test_heartbeat_deadline_is_exactly_now_minus_last_greater_than_timeout(last_s, now_s, timeout_s, dies):
    """Found by test_reference_model (shrunk): ``tick 0.7 / join A / tick 1.0`` with timeout 0.3.

    R9 defines death as ``now_s - last_seen > heartbeat_timeout_s``. The core
    computed ``last_seen < now_s - heartbeat_timeout_s``, which in floating
    point disagrees with the rule at the boundary, in both directions.
    """
    run = Run(heartbeat_timeout_s=timeout_s)
    run.tick(last_s)
    run.join("A")
    effects = run.tick(now_s)
    assert (now_s - last_s > timeout_s) is dies
    if dies:
        assert effects[0] == DeclareDead("A", last_s)
        assert not run.fsm.is_member("A")
    else:
        assert effects == [] and run.fsm.is_member("A")


# ------------------------------------------------ the motivating regression


def _a_parked_b_dead(run: Run, how: str) -> list:
    """min_workers=2 / join A / join B / submit A r0 / B dies."""
    assert run.join("A") == [AcceptJoin("A", (0,))]
    effects = run.join("B")
    assert kinds(effects) == [AcceptJoin, QuorumChanged, PhaseChanged]
    assert effects[2] == PhaseChanged(Phase.FORMING, Phase.RUNNING)
    if how == "tick":
        run.tick(5.0)
        assert run.submit("A", 0) == [AcceptContribution("A", 0, 0)]  # A last seen 5.0, B 0.0
        return run.tick(10.5)  # B silent 10.5 s > 10 s; A 5.5 s
    assert run.submit("A", 0) == [AcceptContribution("A", 0, 0)]
    return run.crash("B")


@pytest.mark.parametrize("how", ["crash", "tick"])
def test_a_death_never_releases_a_round_below_quorum(how):
    """The bug a gate on the submit path alone lets through (R5, R7, I1).

    min_workers=2 / join A / join B / submit A r0 / B dies
      -> no ApplyRound; A stays parked; round 0 still open; PAUSED
    join C / submit C r0
      -> ApplyRound(r0, contributors A, C); A and C released APPLIED
    """
    run = Run(min_workers=2)
    effects = _a_parked_b_dead(run, how)
    dead = [DeclareDead("B", 0.0)] if how == "tick" else []
    assert kinds(effects) == [type(e) for e in dead] + [QuorumChanged, PhaseChanged]
    assert effects[: len(dead)] == dead
    qc = effects[len(dead)]
    assert (qc.below_min_workers, qc.live_workers, qc.min_workers) == (True, 1, 2)
    assert effects[-1] == PhaseChanged(Phase.RUNNING, Phase.PAUSED)
    assert not any(isinstance(e, (ApplyRound, ReleaseWorker)) for e in effects)
    st = run.fsm.status()
    assert st.phase is Phase.PAUSED and st.below_min_workers
    assert st.parked_workers == ("A",)
    assert st.fragments[0].round_id == 0 and st.fragments[0].contributed == ("A",)
    assert st.fragments[0].awaited == ()
    assert run.fsm.open_round_ids() == (0,) and run.fsm.rounds_applied == 0
    assert "waiting for 1 more" in st.quorum_reason

    # A replacement joins: quorum is back, but the round now waits for it (P2).
    effects = run.join("C")
    assert effects[0] == AcceptJoin("C", (0,))
    assert effects[-1] == PhaseChanged(Phase.PAUSED, Phase.RUNNING)
    assert not any(isinstance(e, ApplyRound) for e in effects)
    assert run.fsm.status().fragments[0].awaited == ("C",)

    assert run.submit("C", 0) == [
        AcceptContribution("C", 0, 0),
        ApplyRound(0, 0, ("A", "C")),
        ReleaseWorker("A", 0, 0, APPLIED),
        ReleaseWorker("C", 0, 0, APPLIED),
    ]
    assert run.fsm.open_round_ids() == (1,) and run.parked == ()


def test_lowering_min_workers_releases_the_parked_round():
    """R8: a change of min_workers goes through the same gate and may apply a parked round."""
    run = Run(min_workers=2)
    _a_parked_b_dead(run, "crash")
    effects = run.set_min(1)
    assert kinds(effects) == [QuorumChanged, PhaseChanged, ApplyRound, ReleaseWorker]
    assert effects[0].below_min_workers is False and effects[0].min_workers == 1
    assert effects[1:] == [PhaseChanged(Phase.PAUSED, Phase.RUNNING), ApplyRound(0, 0, ("A",)),
                           ReleaseWorker("A", 0, 0, APPLIED)]


def test_lowering_min_workers_completes_a_forming_round():
    """min 3 / join A, B / both submit: complete but below quorum -> parked; min 2 -> applies."""
    run = Run(min_workers=3)
    run.join("A"), run.join("B")
    assert run.submit("A", 0) == [AcceptContribution("A", 0, 0)]
    assert run.submit("B", 0) == [AcceptContribution("B", 0, 0)]
    assert run.fsm.phase is Phase.FORMING and run.parked == ("A", "B")
    effects = run.set_min(2)
    assert effects[1:] == [PhaseChanged(Phase.FORMING, Phase.RUNNING), ApplyRound(0, 0, ("A", "B")),
                           ReleaseWorker("A", 0, 0, APPLIED), ReleaseWorker("B", 0, 0, APPLIED)]


def test_raising_min_workers_pauses_and_submissions_then_park():
    run = Run(min_workers=1)
    run.join("A"), run.join("B")
    effects = run.set_min(3)
    assert kinds(effects) == [QuorumChanged, PhaseChanged]
    assert effects[1] == PhaseChanged(Phase.RUNNING, Phase.PAUSED)
    assert run.fsm.below_min_workers
    run.submit("A", 0)
    assert run.submit("B", 0) == [AcceptContribution("B", 0, 0)]  # complete, but no quorum
    assert run.parked == ("A", "B") and run.fsm.rounds_applied == 0
    # Setting the same value again still announces it (R8) and changes nothing else.
    effects = run.set_min(3)
    assert kinds(effects) == [QuorumChanged] and effects[0].below_min_workers is True


# ------------------------------------------------------ deaths and leaves


def test_a_death_that_completes_a_round_applies_it_if_quorum_holds():
    """R7: the dead worker was the last one awaited; 2 live >= min 2, so the round applies on the death path."""
    run = Run(min_workers=2)
    for w in "ABC":
        run.join(w)
    run.submit("A", 0), run.submit("B", 0)
    assert run.crash("C") == [ApplyRound(0, 0, ("A", "B")), ReleaseWorker("A", 0, 0, APPLIED),
                              ReleaseWorker("B", 0, 0, APPLIED)]


def test_a_heartbeat_timeout_that_completes_a_round_applies_it():
    run = Run(min_workers=2)
    for w in "ABC":
        run.join(w)
    run.tick(6.0)
    run.submit("A", 0), run.submit("B", 0)  # A, B seen at 6.0; C at 0.0
    run.heartbeat("A")
    assert run.tick(10.0) == []  # C silent exactly 10 s: not more than the timeout
    assert run.tick(10.001) == [DeclareDead("C", 0.0), ApplyRound(0, 0, ("A", "B")),
                                ReleaseWorker("A", 0, 0, APPLIED), ReleaseWorker("B", 0, 0, APPLIED)]


def test_departed_contributor_counts_but_is_not_released():
    """P1: A's accepted contribution stays in its round after A crashes; it applies, nobody to wake."""
    run = Run(min_workers=2)
    for w in "ABC":
        run.join(w)
    run.submit("A", 0)
    assert run.crash("A") == []  # 2 live >= 2: no quorum change; the round waits for B and C
    st = run.fsm.status()
    assert st.fragments[0].contributed == ("A",) and st.fragments[0].awaited == ("B", "C")
    assert st.parked_workers == ()  # its work stays (P1), but a departed worker is parked nowhere
    run.submit("B", 0)
    assert run.submit("C", 0) == [
        AcceptContribution("C", 0, 0),
        ApplyRound(0, 0, ("A", "B", "C")),
        ReleaseWorker("B", 0, 0, APPLIED),
        ReleaseWorker("C", 0, 0, APPLIED),
    ]


def test_departed_contributor_does_not_count_towards_quorum():
    """P1/R5: contributions of departed workers never stand in for live members."""
    run = Run(min_workers=2)
    run.join("A"), run.join("B")
    run.submit("A", 0)
    run.crash("A")  # PAUSED: 1 live < 2
    assert run.submit("B", 0) == [AcceptContribution("B", 0, 0)]
    assert run.fsm.phase is Phase.PAUSED and run.fsm.rounds_applied == 0
    assert run.parked == ("B",)  # A's work stays pending (P1) but A is no member: parked is B alone
    assert run.fsm.status().fragments[0].contributed == ("A", "B")


def test_rejoin_of_a_departed_contributor_parks_it_and_can_complete_the_round():
    """P1/P2: the same id re-joins while its contribution is pending: parked on it; the join completes the round."""
    run = Run(min_workers=2)
    run.join("A"), run.join("B")
    run.submit("A", 0)
    run.leave("A")
    run.submit("B", 0)  # complete, but 1 live < 2
    effects = run.join("A")
    assert effects[0] == AcceptJoin("A", (0,), ((0, 0),))
    assert kinds(effects) == [AcceptJoin, QuorumChanged, PhaseChanged, ApplyRound, ReleaseWorker, ReleaseWorker]
    assert effects[-3:] == [ApplyRound(0, 0, ("A", "B")), ReleaseWorker("A", 0, 0, APPLIED),
                            ReleaseWorker("B", 0, 0, APPLIED)]


def test_join_of_a_live_member_is_already_member_and_leave_then_join_restarts_it():
    """R6: a second join for a live id is refused; the driver reports the old incarnation gone first."""
    run = Run(min_workers=1)
    run.join("A"), run.join("B")
    run.submit("A", 0)
    before = run.fsm.snapshot()
    effects = run.join("A")
    assert len(effects) == 1 and effects[0].reason is RejectReason.ALREADY_MEMBER
    assert run.fsm.snapshot() == before
    run.crash("A")  # the coordinator saw a new connection for "A": old one gone
    assert run.join("A")[0] == AcceptJoin("A", (0,), ((0, 0),))
    # The restarted worker is parked on its old contribution; a second one is a duplicate (R4).
    assert run.submit("A", 0)[0].reason is RejectReason.DUPLICATE
    assert run.submit("B", 0)[1] == ApplyRound(0, 0, ("A", "B"))


# --------------------------------------------------------------- shutdown


@pytest.mark.parametrize("kind", [ShutdownKind.SAVE_AND_STOP, ShutdownKind.ABORT])
def test_save_and_abort_wake_parked_workers_with_stop_and_nothing_applies_after(kind):
    """P4/R12/I5: save-and-stop and abort stop at once; every parked member gets STOP."""
    run = Run(min_workers=2, num_fragments=2)
    for w in "ABC":
        run.join(w)
    run.submit("A", 0), run.submit("B", 0), run.submit("C", 0, fid=1)
    run.crash("B")  # B's contribution stays pending (P1); B is nobody to wake
    effects = run.shutdown(kind)
    assert effects == [
        DiscardContribution("A", 0, 0, DiscardReason.SHUTDOWN), ReleaseWorker("A", 0, 0, STOP),
        DiscardContribution("B", 0, 0, DiscardReason.SHUTDOWN),
        DiscardContribution("C", 1, 0, DiscardReason.SHUTDOWN), ReleaseWorker("C", 1, 0, STOP),
        PhaseChanged(Phase.RUNNING, Phase.STOPPED),
        StopRun(kind),
    ]
    assert run.parked == () and run.fsm.phase is Phase.STOPPED
    for ev in (ContributionSubmitted("A", 0, 0), WorkerLeft("C"), MinWorkersChanged(1)):
        with pytest.raises(MachineStoppedError):
            run.fsm.step(ev)
    assert run.fsm.rounds_applied == 0


def test_drain_below_quorum_stops_at_once_and_wakes_the_paused_worker():
    """P4: a paused run must always be stoppable."""
    run = Run(min_workers=2)
    _a_parked_b_dead(run, "crash")
    assert run.shutdown(ShutdownKind.DRAIN) == [
        DiscardContribution("A", 0, 0, DiscardReason.SHUTDOWN), ReleaseWorker("A", 0, 0, STOP),
        PhaseChanged(Phase.PAUSED, Phase.STOPPED), StopRun(ShutdownKind.DRAIN),
    ]


def test_drain_finishes_the_round_in_flight_with_applied_final():
    """P4: drain / joins refused / the round completes -> APPLIED_FINAL, then the machine stops."""
    run = Run(min_workers=2)
    run.join("A"), run.join("B")
    run.submit("A", 0)
    assert run.shutdown(ShutdownKind.DRAIN) == [PhaseChanged(Phase.RUNNING, Phase.DRAINING)]
    assert run.join("C")[0].reason is RejectReason.SHUTTING_DOWN
    assert run.heartbeat("A") == []
    assert run.submit("B", 0) == [
        AcceptContribution("B", 0, 0),
        ApplyRound(0, 0, ("A", "B")),
        ReleaseWorker("A", 0, 0, FINAL),
        ReleaseWorker("B", 0, 0, FINAL),
        PhaseChanged(Phase.DRAINING, Phase.STOPPED),
        StopRun(ShutdownKind.DRAIN),
    ]
    assert run.fsm.rounds_applied == 1


def test_drain_with_fragments_stops_after_the_first_round_and_discards_the_rest():
    run = Run(min_workers=2, num_fragments=2)
    run.join("A"), run.join("B")
    run.submit("A", 0), run.submit("B", 0, fid=1)
    run.shutdown(ShutdownKind.DRAIN)
    assert run.submit("B", 0) == [
        AcceptContribution("B", 0, 0),
        ApplyRound(0, 0, ("A", "B")),
        ReleaseWorker("A", 0, 0, FINAL), ReleaseWorker("B", 0, 0, FINAL),
        DiscardContribution("B", 1, 0, DiscardReason.SHUTDOWN), ReleaseWorker("B", 1, 0, STOP),
        PhaseChanged(Phase.DRAINING, Phase.STOPPED), StopRun(ShutdownKind.DRAIN),
    ]


def test_drain_that_loses_quorum_stops_at_once():
    run = Run(min_workers=2)
    run.join("A"), run.join("B")
    run.submit("A", 0)
    run.shutdown(ShutdownKind.DRAIN)
    effects = run.crash("B")
    assert kinds(effects) == [QuorumChanged, DiscardContribution, ReleaseWorker, PhaseChanged, StopRun]
    assert effects[1:] == [DiscardContribution("A", 0, 0, DiscardReason.SHUTDOWN), ReleaseWorker("A", 0, 0, STOP),
                           PhaseChanged(Phase.DRAINING, Phase.STOPPED), StopRun(ShutdownKind.DRAIN)]


def test_drain_in_async_stops_at_once():
    run = Run(min_workers=1, mode=Mode.ASYNC)
    run.join("A")
    assert run.shutdown(ShutdownKind.DRAIN) == [PhaseChanged(Phase.RUNNING, Phase.STOPPED),
                                                StopRun(ShutdownKind.DRAIN)]


# ------------------------------------------------------------------ async


def test_async_held_contributions_flush_fifo_when_quorum_returns():
    """R5/P3: below quorum, contributions are held in arrival order; a join brings quorum; they apply one by one."""
    run = Run(min_workers=3, mode=Mode.ASYNC)
    run.join("A"), run.join("B")
    assert run.submit("B", 0) == [AcceptContribution("B", 0, 0)]
    assert run.submit("A", 0) == [AcceptContribution("A", 0, 0)]
    assert run.fsm.status().fragments[0].held == ("B", "A")
    effects = run.join("C")
    assert effects[0] == AcceptJoin("C", (0,))
    assert effects[-4:] == [
        ApplyRound(0, 0, ("B",)), ReleaseWorker("B", 0, 0, APPLIED),
        ApplyRound(0, 1, ("A",)), ReleaseWorker("A", 0, 0, APPLIED),
    ]
    assert run.fsm.open_round_ids() == (2,)
    # With quorum, each contribution applies on arrival.
    assert run.submit("C", 1) == [AcceptContribution("C", 0, 1), ApplyRound(0, 2, ("C",)),
                                  ReleaseWorker("C", 0, 1, APPLIED)]


def test_async_held_contribution_of_a_departed_worker_still_applies():
    """P1 in async: held, worker leaves, quorum returns -> it applies; no ReleaseWorker for the departed."""
    run = Run(min_workers=2, mode=Mode.ASYNC)
    run.join("A")
    run.submit("A", 0)
    run.leave("A")
    effects = run.join("B")
    assert effects[0] == AcceptJoin("B", (0,))
    effects = run.join("C")
    assert effects[-1] == ApplyRound(0, 0, ("A",))


def test_async_staleness_window():
    """P3: base version b accepted iff 0 <= v - b <= max_staleness."""
    run = Run(min_workers=1, mode=Mode.ASYNC, max_staleness=1)
    run.join("A"), run.join("B")
    run.submit("A", 0), run.submit("A", 1)  # version 2
    assert run.submit("B", 0)[0].reason is RejectReason.STALE_ROUND
    assert run.submit("B", 1)[1] == ApplyRound(0, 2, ("B",))
    assert run.submit("B", 4)[0].reason is RejectReason.FUTURE_ROUND


def test_async_rejoined_worker_cannot_count_a_previous_incarnations_work_twice():
    """P3/R4: a joiner's work counts only from the version it joined at.

    join A / A submits base 0 (applies, version 1) / A crashes / A re-joins at version 1
      -> base 0 is DUPLICATE (the old incarnation's base-0 work already applied); base 1 is fine.
    """
    run = Run(min_workers=1, mode=Mode.ASYNC, max_staleness=4)
    run.join("A")
    assert run.submit("A", 0)[1] == ApplyRound(0, 0, ("A",))
    run.crash("A")
    assert run.join("A")[0] == AcceptJoin("A", (1,))
    assert run.submit("A", 0)[0].reason is RejectReason.DUPLICATE
    assert run.submit("A", 1)[1] == ApplyRound(0, 1, ("A",))


# -------------------------------------------------------------- fragments


def test_fragments_have_independent_counters_and_barriers():
    """R11: a submission touches only its fragment."""
    run = Run(min_workers=1, num_fragments=3)
    run.join("A"), run.join("B")
    run.submit("A", 0, fid=1)
    assert run.submit("B", 0, fid=1)[1] == ApplyRound(1, 0, ("A", "B"))
    assert run.fsm.open_round_ids() == (0, 1, 0)
    assert run.submit("A", 1, fid=0)[0].reason is RejectReason.FUTURE_ROUND
    assert run.submit("A", 0, fid=2) == [AcceptContribution("A", 2, 0)]
    assert run.submit("A", 0, fid=1)[0].reason is RejectReason.STALE_ROUND
    st = run.fsm.status()
    assert [f.contributed for f in st.fragments] == [(), (), ("A",)]
    assert run.join("C")[0] == AcceptJoin("C", (0, 1, 0))


# ------------------------------------------------------------------ limits


def test_max_workers_limit():
    run = Run(max_workers=2)
    run.join("A"), run.join("B")
    effects = run.join("C")
    assert effects[0].reason is RejectReason.TOO_MANY_WORKERS and "max_workers=2" in effects[0].detail
    run.leave("A")
    assert run.join("C")[0] == AcceptJoin("C", (0,))


def test_max_held_per_fragment_limit():
    run = Run(min_workers=3, mode=Mode.ASYNC, max_held_per_fragment=2, num_fragments=2)
    for w in "AB":
        run.join(w)
    run.submit("A", 0), run.submit("B", 0)
    run.leave("B")
    run.join("C")
    effects = run.submit("C", 0)
    assert effects[0].reason is RejectReason.HELD_LIMIT and "max_held_per_fragment=2" in effects[0].detail
    assert run.submit("C", 0, fid=1) == [AcceptContribution("C", 1, 0)]  # the limit is per fragment


def test_max_worker_id_len_limit():
    run = Run(max_worker_id_len=4)
    assert run.join("ABCD")[0] == AcceptJoin("ABCD", (0,))  # exactly at the limit: fine
    effects = run.join("ABCDE")
    assert effects[0].reason is RejectReason.INVALID_WORKER_ID and "at most 4 characters" in effects[0].detail


def test_async_rejoin_onto_a_held_contribution_refuses_the_dead_incarnations_bases():
    """P3: a worker re-joining while its old contribution (base 1) is still held is given
    version 3; bases between the held one and the version before it joined at (here 2)
    could only come from the dead incarnation and are refused. Found by an independent
    checker written from SPEC.md: the last base used to be set to the held base (1)."""
    fsm = RoundFSM(FSMConfig(min_workers=2, mode=Mode.ASYNC, max_staleness=3))
    for w in "ABC":
        fsm.step(WorkerJoined(w))
    for base in (0, 1, 2):
        fsm.step(ContributionSubmitted("B", 0, base))
    assert fsm.open_round_ids() == (3,)
    fsm.step(WorkerLeft("C", LeaveCause.CRASHED))
    fsm.step(WorkerLeft("B", LeaveCause.CRASHED))               # below quorum: A's work is held
    assert fsm.step(ContributionSubmitted("A", 0, 1)) == [AcceptContribution("A", 0, 1)]
    fsm.step(WorkerLeft("A", LeaveCause.CRASHED))
    assert fsm.step(WorkerJoined("A"))[0] == AcceptJoin("A", (3,), ((0, 1),))   # parked on base 1
    effects = fsm.step(WorkerJoined("B"))                        # quorum: the held base 1 applies
    assert ApplyRound(0, 3, ("A",)) in effects and fsm.open_round_ids() == (4,)
    reject = fsm.step(ContributionSubmitted("A", 0, 2))
    assert [type(e) for e in reject] == [Reject] and reject[0].reason is RejectReason.DUPLICATE
    assert fsm.step(ContributionSubmitted("A", 0, 3)) == [AcceptContribution("A", 0, 3), ApplyRound(0, 4, ("A",)),
                                                         ReleaseWorker("A", 0, 3, APPLIED)]


def test_a_snapshot_after_an_async_rejoin_onto_held_work_restores():
    """I9 with P3: after a re-join onto a held contribution (base 1) at version 3 the last base
    is 2, above the held base; the snapshot of that state restores and behaves the same."""
    fsm = RoundFSM(FSMConfig(min_workers=2, mode=Mode.ASYNC, max_staleness=3))
    for w in "ABC":
        fsm.step(WorkerJoined(w))
    for base in (0, 1, 2):
        fsm.step(ContributionSubmitted("B", 0, base))
    fsm.step(WorkerLeft("C", LeaveCause.CRASHED))
    fsm.step(WorkerLeft("B", LeaveCause.CRASHED))
    fsm.step(ContributionSubmitted("A", 0, 1))
    fsm.step(WorkerLeft("A", LeaveCause.CRASHED))
    fsm.step(WorkerJoined("A"))
    back = RoundFSM.restore(fsm.snapshot())
    assert back.snapshot() == fsm.snapshot()
    for machine in (fsm, back):
        machine.step(WorkerJoined("B"))
    assert back.step(ContributionSubmitted("A", 0, 2)) == fsm.step(ContributionSubmitted("A", 0, 2))
