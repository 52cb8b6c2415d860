"""The sparse wire on real processes: a worker killed with SIGKILL comes back from its checkpoint
with its error-feedback accumulator (SPEC.md section 11), and the run goes on with it."""

from __future__ import annotations

import time

import pytest

from diloco.cli import main
from diloco.worker.checkpoint import load_worker_checkpoint

pytestmark = pytest.mark.slow

SPARSE = ("--wire-dtype", "sparse", "--sparsity", "0.25", "--sparse-chunk", "16")


def test_a_worker_killed_with_its_submit_held_comes_back_without_that_rounds_accumulator(cluster, capsys):
    cluster.server("--min-workers", "2", *SPARSE, heartbeat_timeout_s=3.0)
    workers = {w: cluster.worker(w, "--checkpoint-dir", f"ckpt-{w}", "--checkpoint-every", "1") for w in ("w1", "w2")}
    cluster.wait_status(lambda s: s["rounds_applied"] >= 3, 120, "three sparse rounds")
    # Hold the run: each worker submits its next round and waits, parked, its checkpoint written at
    # that sync point (the accumulator in it is the one the Submit was taken from).
    assert main(["set-min-workers", "3", "--connect", cluster.address]) == 0
    for w in workers.values():
        w.wait_for(r"paused: the run is below quorum \(min_workers 3\)", 60)
    held = cluster.status()
    ckpt = load_worker_checkpoint(cluster.tmp / "ckpt-w1" / "worker-w1.safetensors")
    assert ckpt.residual and any(bool(t.abs().sum() > 0) for t in ckpt.residual.values())
    assert ckpt.residual_rounds == {0: held["fragments"][0]["round_id"]}  # made for the round that is open

    workers["w1"].kill9()
    cluster.wait_status(lambda s: cluster.members(s) == {"w2"}, 30, "w1 declared gone")
    again = cluster.worker("w1", "--checkpoint-dir", "ckpt-w1", "--checkpoint-every", "1")
    again.wait_for(rf"restored from its checkpoint at inner step \d+ with the error-feedback residual of "
                   rf"{len(ckpt.residual)} params", 60)
    assert main(["set-min-workers", "2", "--connect", cluster.address]) == 0
    cluster.wait_status(lambda s: s["rounds_applied"] >= held["rounds_applied"] + 2 and
                        cluster.members(s) == {"w1", "w2"}, 120, "the run goes on with w1's accumulator")
    # The Welcome parks the Submit the killed process sent, taken from this very accumulator: its
    # mass travels in that payload, so the restored copy must not travel again. Dropped, and said.
    assert "is dropped, not sent into a later round" in again.output()
    capsys.readouterr()


def test_kill9_while_training_and_resume_keeps_the_accumulator_exactly(cluster, capsys):
    # Long rounds (400 inner steps, about 4 s): the kill lands while w1 trains, after the checkpoint
    # it wrote when its last Result came in.
    cluster.server("--min-workers", "2", *SPARSE, heartbeat_timeout_s=3.0)
    workers = {w: cluster.worker(w, "--checkpoint-dir", f"ckpt-{w}", "--checkpoint-every", "1", sync_every=400)
               for w in ("w1", "w2")}
    workers["w1"].wait_for(r"synced: next round \[3\]", 120)
    time.sleep(1.0)
    workers["w1"].kill9()
    ckpt = load_worker_checkpoint(cluster.tmp / "ckpt-w1" / "worker-w1.safetensors")
    assert ckpt.round_ids == [3] and ckpt.residual_rounds == {0: 3}  # made for the round it trains
    assert any(bool(t.abs().sum() > 0) for t in ckpt.residual.values())
    cluster.wait_status(lambda s: cluster.members(s) == {"w2"}, 30, "w1 declared gone")
    again = cluster.worker("w1", "--checkpoint-dir", "ckpt-w1", "--checkpoint-every", "1", sync_every=400)
    again.wait_for(rf"restored from its checkpoint at inner step \d+ with the error-feedback residual of "
                   rf"{len(ckpt.residual)} params", 60)
    # The run waited below quorum: round 3 is still open, the residual is for it, and it travels.
    again.wait_for(r"synced: next round \[4\]", 120)
    assert "is dropped" not in again.output()
    after = load_worker_checkpoint(cluster.tmp / "ckpt-w1" / "worker-w1.safetensors")
    assert after.round_ids == [4] and after.residual_rounds == {0: 4}
    capsys.readouterr()
