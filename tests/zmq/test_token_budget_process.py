"""A real ``diloco server --token-budget`` run: it stops as ``shutdown --save`` does, and the workers stop with it.

The tiny entry's batches say nothing of their tokens, so each inner step
counts one (SPEC.md section 12, "Token budget").
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_a_run_stops_with_a_checkpoint_once_its_token_budget_is_trained(cluster):
    server = cluster.server("--min-workers", "1", "--checkpoint-dir", "ckpt", "--token-budget", "40")
    server.wait_for(r"token budget 40: the run stops as shutdown --save does", 10)
    w1 = cluster.worker("w1", sync_every=5)
    st = cluster.wait_status(lambda s: s["tokens"]["trained"] >= 10, 120, "two rounds trained")
    assert st["tokens"]["budget"] == 40
    server.wait_for(r"budget +reached: \d+ tokens trained of 40 \(--token-budget\)", 120)
    server.wait_for(r"stopped +save_and_stop", 30)
    assert w1.wait_exit(60) == 0
    assert server.wait_exit(60) == 0
    assert list((cluster.tmp / "ckpt").glob("coordinator-*.safetensors")), "the stop saved a checkpoint"
