"""The checker catches what it claims to: each test tampers with one record of a real trace.

The trace comes from a small fault-free run (seed 2, sync, stopped by a shutdown) and a
faulty one (seed 13: coordinator crashes, rollbacks, restarts), both clean as recorded.
"""

from __future__ import annotations

import copy
import json

import pytest

from diloco.sim import derive_config
from diloco.sim.checker import check_records
from diloco.sim.simulation import Simulation
from diloco.sim.trace import TraceWriter


def _records(seed: int, **overrides) -> list[dict]:
    out: list[dict] = []
    Simulation(derive_config(seed, **overrides), TraceWriter(None, [lambda r, line: out.append(json.loads(line))])).run()
    return out


@pytest.fixture(scope="module")
def clean():
    recs = _records(2, mode="sync", shutdown="abort", fragments=1)
    violations, _ = check_records(recs)
    assert violations == []
    return recs


@pytest.fixture(scope="module")
def faulty():
    recs = _records(13)
    violations, checker = check_records(recs)
    assert violations == [] and checker.counts["coordinator_crashes"] > 0 and checker.counts["rolled_back_rounds"] > 0
    return recs


def _tamper(records, predicate, change, nth=0):
    recs = copy.deepcopy(records)
    hits = [i for i, r in enumerate(recs) if predicate(r)]
    assert len(hits) > nth, "nothing to tamper with"
    change(recs[hits[nth]])
    violations, _ = check_records(recs)
    return {v.rule for v in violations}, violations


def _is_apply(r):
    return r["k"] == "obs" and r["what"] == "apply"


def test_wrong_outer_step_is_caught(clean):
    def nudge(r):
        name = next(iter(r["p"]))
        r["p"][name][0] += 1e-3
    rules, _ = _tamper(clean, _is_apply, nudge, nth=2)
    assert "outer" in rules


def test_an_apply_without_a_live_members_contribution_is_caught(clean):
    rules, _ = _tamper(clean, lambda r: _is_apply(r) and len(r["contributors"]) > 1,
                       lambda r: r["contributors"].pop(), nth=1)
    assert {"I1", "I4"} <= rules


def test_rounds_out_of_order_are_caught(clean):
    rules, _ = _tamper(clean, _is_apply, lambda r: r.update(round_id=r["round_id"] + 1), nth=1)
    assert "I3" in rules


def test_a_wrong_below_min_workers_in_a_heartbeat_reply_is_caught(clean):
    rules, _ = _tamper(clean, lambda r: r["k"] == "send" and r.get("type") == "HeartbeatReply" and r["command"] == "continue",
                       lambda r: r.update(below_min_workers=not r["below_min_workers"]), nth=5)
    assert "I6" in rules


def test_a_result_with_other_params_is_caught(clean):
    rules, _ = _tamper(clean, lambda r: r["k"] == "send" and r.get("type") == "Result" and r["outcome"] == "applied",
                       lambda r: r.update(h="0" * 16), nth=3)
    assert "params" in rules


def test_a_worker_installing_other_params_is_caught(clean):
    rules, _ = _tamper(clean, lambda r: r["k"] == "adopt", lambda r: r.update(h="f" * 16), nth=7)
    assert "params" in rules


def test_a_missed_liveness_bound_is_caught(clean):
    rules, _ = _tamper(clean, lambda r: r["k"] == "phase" and r["what"] == "heal", lambda r: r.update(bound_s=1e-6))
    assert "I7" in rules


def test_a_worker_left_running_after_the_stop_is_caught(clean):
    recs = copy.deepcopy(clean)
    last_worker = next(r for r in reversed(recs) if r["k"] == "worker")
    recs.insert(len(recs) - 1, dict(last_worker, state="waiting"))
    violations, _ = check_records(recs)
    assert any(v.rule == "I5" and "still waiting" in v.detail for v in violations)


def test_an_accepted_contribution_for_the_wrong_round_is_caught(clean):
    rules, _ = _tamper(clean, lambda r: r["k"] == "recv" and r.get("type") == "Submit" and "worker_id" in r,
                       lambda r: r.update(round_id=r["round_id"] + 5), nth=10)
    assert rules & {"I2", "R4"}


def test_a_restart_that_does_not_restore_the_snapshot_is_caught(faulty):
    rules, _ = _tamper(faulty, lambda r: r["k"] == "fault" and r["what"] == "coord_restart",
                       lambda r: r.update(rounds=[x + 1 for x in r["rounds"]]))
    assert "snapshot" in rules


def test_forgetting_that_a_crash_loses_pending_contributions_is_caught(faulty):
    # Remove the first coordinator crash: the checker then expects what was pending to apply.
    recs = [r for r in faulty if not (r["k"] == "fault" and r["what"] == "coord_crash")]
    violations, _ = check_records(recs)
    assert violations


def test_a_reordering_within_one_connection_is_caught(clean):
    recs = copy.deepcopy(clean)
    # Swap two consecutive deliveries on the same coordinator -> worker link.
    first = next(i for i, r in enumerate(recs) if r["k"] == "recv" and "s" not in r and r["type"] == "HeartbeatReply")
    link = (recs[first]["src"], recs[first]["dst"])
    second = next(i for i in range(first + 1, len(recs))
                  if recs[i]["k"] == "recv" and "s" not in recs[i] and (recs[i]["src"], recs[i]["dst"]) == link)
    recs[first]["m"], recs[second]["m"] = recs[second]["m"], recs[first]["m"]
    violations, _ = check_records(recs)
    assert any(v.rule == "net" and "FIFO" in v.detail for v in violations)


def test_a_refused_step_that_changed_the_params_is_caught(clean):
    """A ``step_refused`` report promises the apply left the params as they were."""
    recs = copy.deepcopy(clean)
    at = [i for i, r in enumerate(recs) if _is_apply(r)][2]
    apply = recs[at]
    recs.insert(at, {"k": "obs", "t": apply["t"], "s": apply["s"], "what": "step_refused",
                     "fragment_id": apply["fragment_id"], "round_id": apply["round_id"],
                     "contributors": list(apply["contributors"]), "tensor": next(iter(apply["p"]))})
    violations, _ = check_records(recs)
    assert any(v.rule == "outer" and "refused" in v.detail for v in violations)


def test_a_run_with_a_refused_outer_step_checks_clean(monkeypatch):
    """Every worker submits 3.4e38s for round 1: finite, but Nesterov with lr 0.7 steps to an
    infinity. The coordinator refuses that step (SPEC.md section 12) and the run goes on; the
    checker accepts the unchanged params and keeps its optimizer model where it was."""
    import dataclasses

    import torch

    import diloco.sim.worker as sim_worker

    real = sim_worker.seeded_update

    def huge_in_round_1(seed, worker_id, fragment_id, round_id, names, sizes):
        out = real(seed, worker_id, fragment_id, round_id, names, sizes)
        if round_id == 1:
            out = {n: torch.full_like(t, 3.4e38) for n, t in out.items()}
        return out

    monkeypatch.setattr(sim_worker, "seeded_update", huge_in_round_1)
    cfg = dataclasses.replace(derive_config(2, mode="sync", shutdown="abort", fragments=1, faults="none"),
                              outer_lr=0.7, outer_momentum=0.9)
    out: list[dict] = []
    Simulation(cfg, TraceWriter(None, [lambda r, line: out.append(json.loads(line))])).run()
    violations, checker = check_records(out)
    assert violations == []
    assert checker.counts["steps_refused"] == 1 and checker.counts["outer_steps_checked"] > 2
