"""The async grace window (SPEC.md P5), transcript by transcript.

Contributions accepted within ``grace_window_s`` of the first pending one merge into one
``ApplyRound`` (every contributor, in arrival order); the window closes at the first tick at or
past its deadline, early when every live member has a contribution in it, at once when a member
departs (if the quorum allows), and as the final step of a drain. The quorum gate (R5) holds for
the merged step; staleness (P3) is checked per contribution; window 0 is one step per contribution.
"""

from __future__ import annotations

import math

import msgpack
import pytest

from diloco.core import (
    AcceptContribution,
    ApplyRound,
    ConfigError,
    ContributionSubmitted,
    FSMConfig,
    LeaveCause,
    MinWorkersChanged,
    Mode,
    Phase,
    PhaseChanged,
    Reject,
    RejectReason,
    ReleaseOutcome,
    ReleaseWorker,
    RoundFSM,
    ShutdownKind,
    ShutdownRequested,
    SnapshotError,
    StopRun,
    Ticked,
    WorkerJoined,
    WorkerLeft,
)

APPLIED = ReleaseOutcome.APPLIED


def machine(*workers: str, window: float = 2.0, **kw) -> RoundFSM:
    cfg = dict(mode=Mode.ASYNC, min_workers=2, heartbeat_timeout_s=100.0, grace_window_s=window)
    cfg.update(kw)
    fsm = RoundFSM(FSMConfig(**cfg))
    for w in workers:
        fsm.step(WorkerJoined(w))
    return fsm


def submit(fsm: RoundFSM, wid: str, base: int = 0, fid: int = 0) -> list:
    return fsm.step(ContributionSubmitted(wid, fid, base))


def applies(effects: list) -> list[ApplyRound]:
    return [e for e in effects if isinstance(e, ApplyRound)]


# ----------------------------------------------------------------- config


@pytest.mark.parametrize("bad", [-0.5, -1, math.nan, math.inf, -math.inf, True, "1", None])
def test_a_bad_window_is_refused_naming_the_field(bad):
    with pytest.raises(ConfigError, match=r"grace_window_s=.* is invalid: expected a finite number of seconds >= 0"):
        FSMConfig(mode=Mode.ASYNC, grace_window_s=bad)


def test_a_window_in_sync_mode_is_refused_clearly():
    with pytest.raises(ConfigError, match="grace_window_s=1.5 is invalid: expected 0 in sync mode"):
        FSMConfig(mode=Mode.SYNC, grace_window_s=1.5)
    assert FSMConfig(mode=Mode.SYNC, grace_window_s=0).grace_window_s == 0.0


def test_a_window_longer_than_the_heartbeat_timeout_is_refused():
    with pytest.raises(ConfigError, match="grace_window_s=31 is invalid: expected at most heartbeat_timeout_s=30"):
        FSMConfig(mode=Mode.ASYNC, grace_window_s=31)
    assert FSMConfig(mode=Mode.ASYNC, grace_window_s=30).grace_window_s == 30.0


def test_the_window_is_part_of_the_config_dict():
    cfg = FSMConfig(mode=Mode.ASYNC, grace_window_s=3)
    assert cfg.grace_window_s == 3.0 and cfg.to_dict()["grace_window_s"] == 3.0
    assert FSMConfig.from_dict(cfg.to_dict()) == cfg
    old = cfg.to_dict()
    del old["grace_window_s"]  # a snapshot written before the window existed
    assert FSMConfig.from_dict(old).grace_window_s == 0.0


# ------------------------------------------------------------- transcripts


def test_contributions_within_the_window_merge_and_close_at_its_deadline():
    fsm = machine("a", "b", "c")
    fsm.step(Ticked(10.0))
    assert submit(fsm, "a") == [AcceptContribution("a", 0, 0)]
    fsm.step(Ticked(11.0))
    assert submit(fsm, "b") == [AcceptContribution("b", 0, 0)]
    assert fsm.step(Ticked(11.99)) == []
    assert fsm.status().fragments[0].held == ("a", "b")
    assert fsm.step(Ticked(12.0)) == [ApplyRound(0, 0, ("a", "b")), ReleaseWorker("a", 0, 0, APPLIED),
                                      ReleaseWorker("b", 0, 0, APPLIED)]
    assert fsm.open_round_ids() == (1,)
    # The next contribution opens a new window, from its own acceptance.
    fsm.step(Ticked(20.0))
    submit(fsm, "c")
    assert fsm.step(Ticked(21.9)) == []
    assert applies(fsm.step(Ticked(22.0))) == [ApplyRound(0, 1, ("c",))]


def test_the_window_closes_early_when_every_live_member_is_in_it():
    fsm = machine("a", "b", "c")
    submit(fsm, "b")
    submit(fsm, "c")
    out = submit(fsm, "a")
    assert out == [AcceptContribution("a", 0, 0), ApplyRound(0, 0, ("b", "c", "a")),
                   ReleaseWorker("b", 0, 0, APPLIED), ReleaseWorker("c", 0, 0, APPLIED),
                   ReleaseWorker("a", 0, 0, APPLIED)]


def test_a_departure_inside_the_window_releases_it():
    fsm = machine("a", "b", "c", "d")
    submit(fsm, "a")
    submit(fsm, "b")
    fsm.step(Ticked(0.5))
    # c (not in the window) leaves: the window closes with what it has, quorum 2 still holds,
    # though d is live and not in it, and the deadline (2.0) has not come.
    assert fsm.step(WorkerLeft("c", LeaveCause.CRASHED)) == [
        ApplyRound(0, 0, ("a", "b")), ReleaseWorker("a", 0, 0, APPLIED), ReleaseWorker("b", 0, 0, APPLIED)]


def test_a_departed_contributors_work_stays_in_the_window_p1():
    fsm = machine("a", "b", "c", min_workers=1)
    submit(fsm, "a")
    out = fsm.step(WorkerLeft("a", LeaveCause.LEFT))
    # Released at once: a's contribution applies, and nobody is woken for it.
    assert out == [ApplyRound(0, 0, ("a",))]


def test_below_quorum_the_window_is_held_and_a_released_window_closes_when_quorum_returns():
    fsm = machine("a", "b", "c", min_workers=3)
    submit(fsm, "a")
    submit(fsm, "b")
    fsm.step(Ticked(0.5))
    out = fsm.step(WorkerLeft("c", LeaveCause.CRASHED))  # releases the window, but quorum is lost
    assert not applies(out) and fsm.phase is Phase.PAUSED
    assert fsm.status().fragments[0].held == ("a", "b")
    assert fsm.step(Ticked(100.0)) == []  # past the deadline, still below quorum: held (R5)
    out = fsm.step(WorkerJoined("d"))
    assert applies(out) == [ApplyRound(0, 0, ("a", "b"))]  # one merged step, not one per contribution


def test_quorum_returning_before_the_deadline_keeps_the_window_open():
    fsm = machine("a", "b", min_workers=3)
    fsm.step(Ticked(1.0))
    submit(fsm, "a")
    out = fsm.step(WorkerJoined("c"))  # quorum returns at 1.0; the deadline is 3.0
    assert not applies(out) and fsm.phase is Phase.RUNNING
    submit(fsm, "b")
    assert applies(fsm.step(Ticked(3.0))) == [ApplyRound(0, 0, ("a", "b"))]


def test_raising_min_workers_inside_the_window_holds_it_and_lowering_it_closes_a_due_one():
    fsm = machine("a", "b")
    submit(fsm, "a")
    fsm.step(MinWorkersChanged(3))
    assert fsm.step(Ticked(5.0)) == []
    assert applies(fsm.step(MinWorkersChanged(2))) == [ApplyRound(0, 0, ("a",))]


def test_staleness_is_checked_per_contribution_and_the_window_does_not_age_its_contents():
    fsm = machine("a", "b", "c", max_staleness=1)
    submit(fsm, "a")
    submit(fsm, "b")
    fsm.step(Ticked(2.0))  # version 1
    submit(fsm, "a", base=1)
    fsm.step(Ticked(4.0))  # version 2
    assert fsm.open_round_ids() == (2,)
    out = submit(fsm, "c", base=0)
    assert [type(e) for e in out] == [Reject] and out[0].reason is RejectReason.STALE_ROUND
    assert submit(fsm, "c", base=1) == [AcceptContribution("c", 0, 1)]


def test_a_duplicate_in_the_window_and_the_held_limit_are_rejected():
    fsm = machine("a", "b", "c", max_held_per_fragment=2)
    submit(fsm, "a")
    assert submit(fsm, "a")[0].reason is RejectReason.DUPLICATE
    submit(fsm, "b")
    assert submit(fsm, "c")[0].reason is RejectReason.HELD_LIMIT


def test_fragments_have_windows_of_their_own():
    fsm = machine("a", "b", num_fragments=2)
    submit(fsm, "a", fid=0)
    fsm.step(Ticked(1.0))
    submit(fsm, "b", fid=1)
    assert applies(fsm.step(Ticked(2.0))) == [ApplyRound(0, 0, ("a",))]
    assert applies(fsm.step(Ticked(3.0))) == [ApplyRound(1, 0, ("b",))]


def test_a_drain_closes_the_open_window_as_its_final_step():
    fsm = machine("a", "b", "c")
    submit(fsm, "a")
    submit(fsm, "b")
    out = fsm.step(ShutdownRequested(ShutdownKind.DRAIN))
    final = ReleaseOutcome.APPLIED_FINAL
    assert out == [PhaseChanged(Phase.RUNNING, Phase.DRAINING), ApplyRound(0, 0, ("a", "b")),
                   ReleaseWorker("a", 0, 0, final), ReleaseWorker("b", 0, 0, final),
                   PhaseChanged(Phase.DRAINING, Phase.STOPPED), StopRun(ShutdownKind.DRAIN)]


def test_an_async_drain_with_nothing_open_stops_at_once():
    fsm = machine("a", "b")
    assert fsm.step(ShutdownRequested(ShutdownKind.DRAIN)) == [PhaseChanged(Phase.RUNNING, Phase.STOPPED),
                                                              StopRun(ShutdownKind.DRAIN)]


def test_window_zero_applies_each_contribution_on_its_own():
    fsm = machine("a", "b", window=0.0)
    assert applies(submit(fsm, "a")) == [ApplyRound(0, 0, ("a",))]
    assert applies(submit(fsm, "b")) == [ApplyRound(0, 1, ("b",))]
    assert "deadline_s" not in fsm.snapshot()["fragments"][0]


# ---------------------------------------------------------------- snapshots


def _roundtrip(snap: dict) -> dict:
    return msgpack.unpackb(msgpack.packb(snap), raw=False)


def test_an_open_window_survives_snapshot_and_restore():
    fsm = machine("a", "b", "c")
    fsm.step(Ticked(1.0))
    submit(fsm, "a")
    snap = fsm.snapshot()
    assert snap["fragments"][0]["deadline_s"] == 3.0
    back = RoundFSM.restore(_roundtrip(snap))
    assert back.snapshot() == snap
    for m in (fsm, back):
        submit(m, "b")
    assert back.step(Ticked(2.9)) == fsm.step(Ticked(2.9)) == []
    assert back.step(WorkerLeft("c")) == fsm.step(WorkerLeft("c")) != []


def test_resume_drops_the_window_with_what_was_pending():
    fsm = machine("a", "b", "c")
    submit(fsm, "a")
    fsm.step(ShutdownRequested(ShutdownKind.SAVE_AND_STOP))
    back = RoundFSM.resume(fsm.snapshot(), 5.0)
    assert back.snapshot()["fragments"][0]["deadline_s"] is None


def _window_snapshot() -> dict:
    fsm = machine("a", "b", "c")
    fsm.step(Ticked(1.0))
    submit(fsm, "a")
    return fsm.snapshot()


@pytest.mark.parametrize("edit,match", [
    (lambda s: s["fragments"][0].update(deadline_s="soon"), r"deadline_s='soon': expected a number"),
    (lambda s: s["fragments"][0].update(deadline_s=3.5), r"later than now_s \+ grace_window_s"),
    (lambda s: s["fragments"][0].update(deadline_s=0.5), r"held .*although quorum holds"),
    (lambda s: s["fragments"][0].update(held=[]), r"deadline_s=3.0: expected None"),
    (lambda s: s["config"].update(grace_window_s=0.0), r"a grace window deadline in a run without one"),
])
def test_a_snapshot_that_contradicts_its_window_is_refused(edit, match):
    snap = _window_snapshot()
    edit(snap)
    with pytest.raises(SnapshotError, match=match):
        RoundFSM.restore(snap)
