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
