"""The simulator on the sparse wire (SPEC.md section 11): real sessions, a real coordinator summing
sparse payloads, and a checker that rebuilds every worker's accumulator from the trace alone."""

from __future__ import annotations

import pytest

from diloco.worker.residuals import Residuals
from diloco.sim import derive_config, run_seed
from diloco.sim.config import SimConfigError, config_from_dict

#: Seeds whose runs re-join, park, retry and restart workers from checkpoints mid-round: every
#: rule of the accumulator is exercised (the breaking tests below show each one matters here).
SEEDS = (103, 126, 154)


@pytest.mark.parametrize("seed", SEEDS)
def test_every_payload_is_its_workers_accumulator_and_every_step_the_methods(seed):
    r = run_seed(seed, wire_dtype="sparse", worker_checkpoints=True)
    assert r.ok, [str(v) for v in r.violations[:5]]
    assert r.counts["payloads_checked"] > 50 and r.counts["outer_steps_checked"] > 5
    assert r.counts["checkpoints_checked"] > 0


def test_heavy_faults_and_coordinator_crashes_keep_the_accumulators_exact():
    r = run_seed(506, wire_dtype="sparse", faults="heavy")
    assert r.ok, [str(v) for v in r.violations[:5]]
    assert r.counts["coordinator_crashes"] > 0 and r.counts["payloads_checked"] > 50


def _broken(monkeypatch, what: str):
    if what == "stale":  # a residual kept whatever round the Welcome opens, and sent into any round
        monkeypatch.setattr(Residuals, "stale_at", lambda *a, **k: [])
        monkeypatch.setattr(Residuals, "drop_stale", lambda *a, **k: False)
    else:  # a round sent again gets a new payload (its delta counted twice, the first payload's mass lost)
        monkeypatch.setattr(Residuals, "resend", lambda *a, **k: None)


@pytest.mark.parametrize("what", ["stale", "resend"])
def test_the_checker_catches_a_worker_that_breaks_an_accumulator_rule(monkeypatch, what):
    _broken(monkeypatch, what)
    r = run_seed(154, wire_dtype="sparse", worker_checkpoints=True)
    assert not r.ok
    assert {v.rule for v in r.violations} == {"sparse"}


def test_the_sparse_override_is_sync_on_the_hub_and_its_knobs_come_from_their_own_stream():
    fp32, sparse = derive_config(7), derive_config(7, wire_dtype="sparse")
    assert sparse.mode == "sync" and sparse.outer_momentum == 0.0 and sparse.sparse
    assert 2 <= sparse.sparse_chunk <= 4 and 1 <= sparse.sparse_k < sparse.sparse_chunk
    assert 0.5 <= sparse.sparse_beta < 1.0
    # Every other knob is the seed's (the sparse ones are drawn from their own stream).
    same = {k for k, v in fp32.to_dict().items() if sparse.to_dict().get(k) == v}
    assert set(fp32.to_dict()) - same <= {"mode", "outer_momentum", "overrides"}
    assert "wire_dtype" not in fp32.to_dict()
    assert config_from_dict(sparse.to_dict()) == sparse and config_from_dict(fp32.to_dict()) == fp32


@pytest.mark.parametrize("kwargs", [dict(data_plane="collective"), dict(mode="async"), dict(grace_window=1.0)])
def test_the_sparse_wire_is_refused_where_it_does_not_run(kwargs):
    with pytest.raises(SimConfigError, match="wire_dtype='sparse' is invalid"):
        derive_config(3, wire_dtype="sparse", **kwargs)
    with pytest.raises(SimConfigError, match="wire_dtype='int4' is invalid"):
        derive_config(3, wire_dtype="int4")


def test_a_sparse_run_replays_record_for_record(tmp_path):
    from diloco.sim.run import replay_trace

    path = tmp_path / "run.jsonl"
    first = run_seed(121, wire_dtype="sparse", trace_path=str(path))
    again = replay_trace(str(path))
    assert first.ok and again.ok and again.divergence is None
    assert again.trace_sha256 == first.trace_sha256
