"""Refusals say why, in the words SPEC.md uses: a second drain is refused because the run is
already draining (P4), and a snapshot claiming an async run is draining is refused because an
async drain stops at once (P4, section 10 "SnapshotError naming the field").
"""

from __future__ import annotations

import copy

import pytest

from diloco.core import (
    ContributionSubmitted,
    Mode,
    Phase,
    Reject,
    RejectReason,
    RoundFSM,
    ShutdownKind,
    ShutdownRequested,
    SnapshotError,
    WorkerJoined,
)
from diloco.testing import fsm_after

J, S = WorkerJoined, ContributionSubmitted


machine = fsm_after


def test_a_second_drain_is_refused_with_a_detail_saying_the_run_is_already_draining():
    fsm = machine(J("A"), J("B"), S("A", 0, 0), ShutdownRequested(ShutdownKind.DRAIN), min_workers=2)
    assert fsm.phase is Phase.DRAINING
    (rej,) = fsm.step(ShutdownRequested(ShutdownKind.DRAIN))
    assert rej == Reject("", RejectReason.SHUTTING_DOWN, "the run is already draining")


@pytest.mark.parametrize("restore", [RoundFSM.restore, RoundFSM.resume], ids=["restore", "resume"])
def test_an_async_snapshot_in_draining_is_refused_saying_an_async_drain_stops_at_once(restore):
    snap = copy.deepcopy(machine(J("A"), J("B"), mode=Mode.ASYNC, min_workers=2).snapshot())
    snap["phase"] = Phase.DRAINING.value
    with pytest.raises(SnapshotError) as info:
        restore(snap)
    assert str(info.value) == (
        "snapshot.phase='draining' contradicts mode='async' (an async drain stops at once, P4)"
    )
