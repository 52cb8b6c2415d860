"""``status()`` and its JSON form (SPEC.md section 2 "Read-only views", section 11 ``AdminReply.data``):
members with last-seen times and ages, per fragment the open round (sync) or version (async)
with who contributed, who is awaited and what is held, parked workers, the quorum reason,
mode, ``min_workers``, the clock and ``rounds_applied``.
"""

from __future__ import annotations

import json

from diloco.core import (
    ContributionSubmitted,
    HeartbeatSeen,
    LeaveCause,
    MinWorkersChanged,
    Mode,
    Phase,
    RoundFSM,
    ShutdownKind,
    ShutdownRequested,
    Ticked,
    WorkerJoined,
    WorkerLeft,
    quorum_decision,
)
from diloco.core.status import FragmentStatus, MemberStatus
from diloco.testing import fsm_after

J, S, L, T = WorkerJoined, ContributionSubmitted, WorkerLeft, Ticked


def machine(*events, **config) -> RoundFSM:
    config.setdefault("heartbeat_timeout_s", 100.0)
    return fsm_after(*events, **config)


def sync_machine() -> RoundFSM:
    """min 2, F=2: C joins at 0, A at 2, B at 3.5; A submits fragment 0 at 6; clock 10."""
    return machine(J("C"), T(2.0), J("A"), T(3.5), J("B"), T(6.0), S("A", 0, 0), T(10.0),
                   min_workers=2, num_fragments=2)


def test_sync_status_lists_members_by_id_with_last_seen_and_age_by_the_machines_clock():
    st = sync_machine().status()
    assert st.members == (MemberStatus("A", 6.0, 4.0), MemberStatus("B", 3.5, 6.5),
                          MemberStatus("C", 0.0, 10.0))
    assert st.now_s == 10.0
    assert (st.phase, st.mode, st.min_workers, st.below_min_workers) == (Phase.RUNNING, Mode.SYNC, 2, False)
    assert st.quorum_reason == quorum_decision(3, 2).reason
    assert st.rounds_applied == 0


def test_sync_status_shows_each_fragments_open_round_contributed_and_awaited():
    st = sync_machine().status()
    assert st.fragments == (
        FragmentStatus(0, 0, ("A",), ("B", "C"), ()),
        FragmentStatus(1, 0, (), ("A", "B", "C"), ()),
    )
    assert st.parked_workers == ("A",)


def test_rounds_applied_counts_outer_steps_over_all_fragments():
    fsm = machine(J("A"), min_workers=1, num_fragments=3)
    for fid, rid in [(0, 0), (0, 1), (2, 0), (0, 2)]:
        fsm.step(S("A", fid, rid))
    assert fsm.open_round_ids() == (3, 0, 1)
    assert fsm.rounds_applied == 4 and fsm.status().rounds_applied == 4
    assert [f.round_id for f in fsm.status().fragments] == [3, 0, 1]


def test_a_member_parked_in_several_fragments_is_listed_once_and_a_departed_contributor_not_at_all():
    fsm = machine(J("A"), J("B"), J("C"), S("B", 1, 0), S("A", 0, 0), S("A", 1, 0), S("C", 0, 0),
                  min_workers=2, num_fragments=2)
    assert fsm.status().parked_workers == ("A", "C", "B")   # first seen fragment by fragment
    fsm.step(L("A", LeaveCause.CRASHED))
    st = fsm.status()
    # P1: A's work stays listed under both fragments, but nobody waits on it.
    assert st.fragments[0].contributed == ("A", "C") and st.fragments[1].contributed == ("B", "A")
    assert st.fragments[0].awaited == ("B",) and st.fragments[1].awaited == ("C",)
    assert st.parked_workers == ("C", "B")


def test_async_status_shows_per_fragment_versions_and_held_contributions_in_apply_order():
    fsm = machine(J("A"), J("B"), J("C"), S("A", 0, 0), S("A", 1, 0), S("B", 1, 0), S("A", 1, 1),
                  mode=Mode.ASYNC, min_workers=2, num_fragments=2, max_staleness=4)
    assert fsm.open_round_ids() == (1, 3) and fsm.rounds_applied == 4
    fsm.step(MinWorkersChanged(4))                       # below quorum: contributions are held
    fsm.step(T(5.0))
    fsm.step(S("C", 1, 3))
    fsm.step(S("B", 1, 2))
    fsm.step(S("A", 0, 1))
    st = fsm.status()
    assert (st.mode, st.min_workers, st.below_min_workers, st.phase) == (Mode.ASYNC, 4, True, Phase.PAUSED)
    assert st.fragments == (
        FragmentStatus(0, 1, (), (), ("A",)),
        FragmentStatus(1, 3, (), (), ("C", "B")),
    )
    assert st.rounds_applied == 4
    assert st.parked_workers == ("A", "C", "B")
    assert st.quorum_reason == quorum_decision(3, 4).reason
    assert [(m.worker_id, m.last_seen_s, m.age_s) for m in st.members] == [
        ("A", 5.0, 0.0), ("B", 5.0, 0.0), ("C", 5.0, 0.0)]
    fsm.step(L("C"))
    assert fsm.status().parked_workers == ("A", "B")    # C's held work stays, nobody waits on it
    assert fsm.status().fragments[1].held == ("C", "B")


def test_status_to_dict_is_the_json_of_diloco_status():
    fsm = sync_machine()
    fsm.step(HeartbeatSeen("C"))
    d = fsm.status().to_dict()
    assert d == {
        "phase": "running",
        "mode": "sync",
        "min_workers": 2,
        "below_min_workers": False,
        "quorum_reason": "quorum met: 3 live workers >= min_workers 2",
        "now_s": 10.0,
        "members": [
            {"worker_id": "A", "last_seen_s": 6.0, "age_s": 4.0},
            {"worker_id": "B", "last_seen_s": 3.5, "age_s": 6.5},
            {"worker_id": "C", "last_seen_s": 10.0, "age_s": 0.0},
        ],
        "fragments": [
            {"fragment_id": 0, "round_id": 0, "contributed": ["A"], "awaited": ["B", "C"], "held": []},
            {"fragment_id": 1, "round_id": 0, "contributed": [], "awaited": ["A", "B", "C"], "held": []},
        ],
        "parked_workers": ["A"],
        "rounds_applied": 0,
    }
    assert json.loads(json.dumps(d)) == d


def test_status_to_dict_of_an_async_run_below_quorum_and_of_a_stopped_one():
    fsm = machine(J("A"), J("B"), S("A", 0, 0), T(1.5), mode=Mode.ASYNC, min_workers=3)
    d = fsm.status().to_dict()
    assert d["phase"] == "forming" and d["mode"] == "async" and d["below_min_workers"] is True
    assert d["fragments"] == [{"fragment_id": 0, "round_id": 0, "contributed": [], "awaited": [], "held": ["A"]}]
    assert d["parked_workers"] == ["A"] and d["now_s"] == 1.5 and d["rounds_applied"] == 0
    assert d["quorum_reason"].startswith("paused: 2 live workers < min_workers 3")
    fsm.step(ShutdownRequested(ShutdownKind.ABORT))
    d = fsm.status().to_dict()
    assert d["phase"] == "stopped" and d["parked_workers"] == [] and d["fragments"][0]["held"] == []
