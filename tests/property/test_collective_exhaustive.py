"""Exhaustive search of the collective plane's commit protocol: every order of a small alphabet.

Breadth-first from a fresh collective machine (3 workers, one fragment) for each
``min_workers`` in 1..3, to a fixed depth, states deduplicated by snapshot. The
alphabet is what a group's world can do: join, be ready, report ok with the
common digest or another one, report failure, crash, change the quorum, let the
reduce deadline pass, drain. Every edge is judged by the same independent oracle
as the stateful test (I13 commit, I14 order, I15 liveness, I6, I3), rejects must
change nothing (I10), and a machine restored from the child's snapshot must give
the same effects on a probe event (I9).
"""

from __future__ import annotations

import copy
import json

import msgpack
import pytest

from diloco.core import (
    ContributionSubmitted,
    FSMConfig,
    LeaveCause,
    MinWorkersChanged,
    Phase,
    ReduceReported,
    Reject,
    RoundFSM,
    ShutdownKind,
    ShutdownRequested,
    Ticked,
    WorkerJoined,
    WorkerLeft,
)
from test_collective_stateful import Oracle

WORKERS = ("A", "B", "C")
REDUCE_TIMEOUT_S = 4.0


def alphabet(fsm: RoundFSM, oracle: Oracle) -> list:
    rid = fsm.open_round_ids()[0]
    events: list = [WorkerJoined(w) for w in WORKERS]
    events += [ContributionSubmitted(w, 0, rid) for w in WORKERS]
    attempt = oracle.open.get(0)
    if attempt is not None:
        number, group, _ = attempt
        events += [ReduceReported(w, 0, rid, number, True, "x") for w in group]
        events += [ReduceReported(group[-1], 0, rid, number, True, "y"),
                   ReduceReported(group[0], 0, rid, number, False, "")]
        if number > 0:
            events.append(ReduceReported(group[0], 0, rid, number - 1, True, "x"))  # a late report
    events += [WorkerLeft(w, LeaveCause.CRASHED) for w in WORKERS]
    events += [MinWorkersChanged(n) for n in (1, 2, 3)]
    events += [Ticked(oracle.now_s + REDUCE_TIMEOUT_S + 1.0), ShutdownRequested(ShutdownKind.DRAIN)]
    return events


def _key(fsm: RoundFSM) -> str:
    snap = fsm.snapshot()
    # The clock matters only relative to the reduce deadline and last-seen times (heartbeats never
    # expire here): states that differ only in absolute time are the same state.
    snap["now_s"] = 0.0
    for f in snap["fragments"]:
        if f.get("reducing"):
            f["reducing"] = dict(f["reducing"], deadline_s=f["reducing"]["deadline_s"] - fsm.now_s)
    snap["members"] = [[w, 0.0] for w, _ in snap["members"]]
    return json.dumps(snap, sort_keys=True)


@pytest.mark.parametrize("min_workers, depth", [(1, 5), (2, 5), (3, 5)])
def test_every_reachable_state_keeps_the_collective_invariants(min_workers, depth):
    config = FSMConfig(data_plane="collective", min_workers=min_workers, heartbeat_timeout_s=1e6,
                       reduce_timeout_s=REDUCE_TIMEOUT_S)
    frontier = [(RoundFSM(config), Oracle(config))]
    seen = {_key(frontier[0][0])}
    edges = commits = 0
    for _ in range(depth):
        nxt = []
        for fsm, oracle in frontier:
            if fsm.phase is Phase.STOPPED:
                continue
            for event in alphabet(fsm, oracle):
                child, tracker = copy.deepcopy(fsm), copy.deepcopy(oracle)
                before = child.snapshot()
                effects = child.step(event)
                edges += 1
                twin = copy.deepcopy(fsm)
                assert twin.step(event) == effects, "I8"
                if any(isinstance(e, Reject) for e in effects):
                    assert len(effects) == 1 and child.snapshot() == before, f"I10: {event!r}"
                    continue
                tracker.observe(event, effects)
                tracker.check_commit_votes(event)
                tracker.check(child)
                commits += sum(type(e).__name__ == "ApplyRound" for e in effects)
                snap = msgpack.unpackb(msgpack.packb(child.snapshot()), raw=False)
                restored = RoundFSM.restore(snap)
                probe = Ticked(child.now_s + REDUCE_TIMEOUT_S + 1.0) if child.phase is not Phase.STOPPED else None
                if probe is not None:
                    assert copy.deepcopy(child).step(probe) == restored.step(probe), f"I9 after {event!r}"
                key = _key(child)
                if key not in seen:
                    seen.add(key)
                    nxt.append((child, tracker))
        frontier = nxt
    assert commits > 0 and len(seen) > 50, (commits, len(seen))
