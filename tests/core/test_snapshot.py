"""Snapshots: plain data, msgpack round-trips, restore equivalence (I9) and resume (SPEC.md section 10)."""

from __future__ import annotations

import json

import msgpack
import pytest

from diloco.core import RejectReason

from diloco.core import (
    AcceptJoin,
    ContributionSubmitted,
    DriverError,
    FSMConfig,
    HeartbeatSeen,
    LeaveCause,
    MachineStoppedError,
    MinWorkersChanged,
    Mode,
    Phase,
    RoundFSM,
    ShutdownKind,
    ShutdownRequested,
    Ticked,
    WorkerJoined,
    WorkerLeft,
)

J, S, L = WorkerJoined, ContributionSubmitted, WorkerLeft


def roundtrip(snap: dict) -> dict:
    return msgpack.unpackb(msgpack.packb(snap, use_bin_type=True), raw=False)


def run(config: FSMConfig, events) -> RoundFSM:
    fsm = RoundFSM(config)
    for ev in events:
        fsm.step(ev)
    return fsm


#: name -> (config, prefix that leaves interesting state, continuation)
SCENARIOS = {
    "sync-parked-and-departed": (
        FSMConfig(min_workers=2, heartbeat_timeout_s=10.0),
        [J("A"), J("B"), J("C"), Ticked(3.0), S("A", 0, 0), HeartbeatSeen("B"), S("C", 0, 0), L("C", LeaveCause.CRASHED)],
        [S("B", 0, 0), J("C"), Ticked(12.5), J("D"), S("D", 0, 1), MinWorkersChanged(1), S("A", 0, 1),
         ShutdownRequested(ShutdownKind.DRAIN)],
    ),
    "sync-fragments-paused": (
        FSMConfig(min_workers=2, num_fragments=3, heartbeat_timeout_s=5.0),
        [J("A"), J("B"), S("A", 2, 0), S("B", 2, 0), S("A", 0, 0), S("B", 1, 0), L("B")],
        [J("C"), S("C", 0, 0), S("C", 1, 0), S("A", 1, 0), Ticked(100.0), J("E"), ShutdownRequested(ShutdownKind.ABORT)],
    ),
    "sync-draining": (
        FSMConfig(min_workers=1, num_fragments=2),
        [J("A"), J("B"), S("A", 0, 0), S("B", 1, 0), ShutdownRequested(ShutdownKind.DRAIN)],
        [S("A", 1, 0), J("C"), S("B", 0, 0)],
    ),
    "async-held": (
        FSMConfig(min_workers=3, mode=Mode.ASYNC, max_staleness=2, num_fragments=2),
        [J("A"), J("B"), S("A", 0, 0), S("B", 1, 0), L("A")],
        [S("B", 0, 0), J("A"), J("C"), S("C", 0, 1), S("A", 0, 2), J("D"), S("D", 1, 0),
         ShutdownRequested(ShutdownKind.SAVE_AND_STOP)],
    ),
}


def outcomes(fsm: RoundFSM, events) -> list:
    out = []
    for ev in events:
        try:
            out.append(fsm.step(ev))
        except DriverError as exc:
            out.append(type(exc))
    return out


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_msgpack_roundtrip_restores_an_equivalent_machine(name):
    """I9: restore(msgpack(snapshot)) has the same state, status and future effects."""
    config, prefix, cont = SCENARIOS[name]
    original = run(config, prefix)
    snap = original.snapshot()
    wire = msgpack.packb(snap, use_bin_type=True)
    restored = RoundFSM.restore(msgpack.unpackb(wire, raw=False))
    assert restored.snapshot() == snap
    assert restored.status() == original.status()
    assert (restored.phase, restored.below_min_workers, restored.min_workers, restored.now_s) == (
        original.phase, original.below_min_workers, original.min_workers, original.now_s)
    expected = outcomes(original, cont)
    assert outcomes(restored, cont) == expected
    assert restored.snapshot() == original.snapshot()
    # The continuation does real work, so the equivalence is not vacuous.
    assert any(isinstance(x, list) and x for x in expected)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_restore_at_every_step_continues_identically(name):
    config, prefix, cont = SCENARIOS[name]
    events = prefix + cont
    reference = outcomes(RoundFSM(config), events)
    fsm = RoundFSM(config)
    for i, ev in enumerate(events):
        tail = outcomes(RoundFSM.restore(roundtrip(fsm.snapshot())), events[i:])
        assert tail == reference[i:], f"restored before step {i} ({ev!r}) diverged"
        outcomes(fsm, [ev])


def test_snapshot_is_plain_json_and_msgpack_data():
    fsm = run(SCENARIOS["async-held"][0], SCENARIOS["async-held"][1])
    snap = fsm.snapshot()

    def check(v, path="snapshot"):
        if isinstance(v, dict):
            for k, x in v.items():
                assert isinstance(k, str), path
                check(x, f"{path}.{k}")
        elif isinstance(v, list):
            for i, x in enumerate(v):
                check(x, f"{path}[{i}]")
        else:
            assert type(v) in (str, int, float, bool), f"{path} is {type(v).__name__}"

    check(snap)
    assert json.loads(json.dumps(snap)) == snap
    assert roundtrip(snap) == snap
    assert snap["format"] == "diloco.round_fsm" and snap["version"] == 1
    assert snap["config"] == fsm.config.to_dict()


def test_snapshot_and_restore_do_not_alias_the_machine():
    config, prefix, _ = SCENARIOS["sync-parked-and-departed"]
    fsm = run(config, prefix)
    snap = fsm.snapshot()
    pristine = json.loads(json.dumps(snap))
    snap["members"].clear()
    snap["fragments"][0]["contributed"].append("Z")
    assert fsm.snapshot() == pristine
    restored = RoundFSM.restore(pristine)
    pristine["members"].clear()
    pristine["fragments"][0]["contributed"].clear()
    assert restored.snapshot() == fsm.snapshot()


def test_restored_machine_keeps_the_last_seen_order_for_timeouts():
    """R9: members are kept in last-seen order; a restored machine declares deaths in the same order."""
    fsm = run(FSMConfig(heartbeat_timeout_s=10.0), [J("C"), J("A"), J("B"), Ticked(1.0), HeartbeatSeen("C"),
                                                     Ticked(2.0), HeartbeatSeen("A")])
    restored = RoundFSM.restore(roundtrip(fsm.snapshot()))
    dead = [e.worker_id for e in restored.step(Ticked(50.0)) if type(e).__name__ == "DeclareDead"]
    assert dead == ["B", "C", "A"]
    assert [e.worker_id for e in fsm.step(Ticked(50.0)) if type(e).__name__ == "DeclareDead"] == dead


def test_restore_of_a_stopped_machine_is_stopped():
    fsm = run(FSMConfig(), [J("A"), ShutdownRequested(ShutdownKind.ABORT)])
    restored = RoundFSM.restore(roundtrip(fsm.snapshot()))
    assert restored.phase is Phase.STOPPED
    with pytest.raises(MachineStoppedError):
        restored.step(J("B"))


# ------------------------------------------------------------------ resume


def test_resume_after_save_and_stop_keeps_counters_and_quorum_only():
    """Section 10: same config, min_workers and counters; no members, nothing pending; FORMING."""
    config = FSMConfig(min_workers=2, num_fragments=2)
    fsm = run(config, [J("A"), J("B"), S("A", 0, 0), S("B", 0, 0), S("A", 1, 0), S("B", 1, 0),
                       MinWorkersChanged(1), S("A", 0, 1), ShutdownRequested(ShutdownKind.SAVE_AND_STOP)])
    assert fsm.open_round_ids() == (1, 1) and fsm.phase is Phase.STOPPED
    resumed = RoundFSM.resume(roundtrip(fsm.snapshot()), now_s=100.0)
    assert resumed.config == config
    assert resumed.phase is Phase.FORMING and resumed.live_workers == 0
    assert resumed.min_workers == 1 and resumed.below_min_workers
    assert resumed.open_round_ids() == (1, 1)
    assert resumed.now_s == 100.0
    assert resumed.status().parked_workers == ()
    # Workers re-join and continue from the checkpointed rounds.
    effects = resumed.step(J("A"))
    assert effects[0] == AcceptJoin("A", (1, 1))
    assert resumed.phase is Phase.RUNNING
    assert resumed.step(S("A", 0, 1))[1].round_id == 1  # the discarded round 1 is redone (P4)


def test_resume_after_a_coordinator_crash_forgets_members_and_pending():
    """A crash snapshot still has members and parked work; the new incarnation starts clean."""
    config = FSMConfig(min_workers=2, mode=Mode.ASYNC)
    fsm = run(config, [J("A"), S("A", 0, 0), J("B"), S("B", 0, 1), L("B"), S("A", 0, 1)])
    assert fsm.status().fragments[0].held == ("A",) and fsm.open_round_ids() == (2,)
    resumed = RoundFSM.resume(fsm.snapshot())
    assert resumed.snapshot()["fragments"] == [{"version": 2, "held": [], "last_base": []}]
    assert resumed.snapshot()["members"] == [] and resumed.now_s == 0.0
    resumed.step(J("A"))
    resumed.step(J("B"))
    # P3: a joiner's work starts from the version it was given (2); base 1 would be a
    # previous incarnation's, which may already have applied, so it cannot count again.
    (reject,) = resumed.step(S("A", 0, 1))
    assert reject.reason is RejectReason.DUPLICATE
    assert resumed.step(S("A", 0, 2))[1].round_id == 2


def test_resume_refuses_a_corrupt_snapshot():
    from diloco.core import SnapshotError

    snap = run(FSMConfig(), [J("A")]).snapshot()
    snap["version"] = 2
    with pytest.raises(SnapshotError, match="version=2 is not supported"):
        RoundFSM.resume(snap)
