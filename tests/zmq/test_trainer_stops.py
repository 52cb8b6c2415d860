"""Trainer callbacks at the edges, with real processes: a Trainer that raises leaves the run at once, and
a run that stops stops the Trainer.

* The Hugging Face Trainer calls no hook on an exception: the callback's exit hook sends Leave, so the
  server logs the worker as *left* (not dead) as the process ends, with a heartbeat timeout of 60 s that
  would otherwise hold the run for a minute.
* Lightning calls ``on_exception``: the same, from the hook.
* A token budget set at run time (``diloco set-token-budget``) is reached while a Trainer wants 100
  steps: the Trainer stops at the round that reaches it, exits 0, and reports why.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

SCRIPT = str(Path(__file__).with_name("trainer_faults.py"))


def _left_at_once(cluster, server, mode: str, worker_id: str, error: str) -> None:
    proc = cluster.start(worker_id, [mode, cluster.address, worker_id], program=(SCRIPT,))
    server.wait_for(rf"applied\s+fragment 0 round 0 from 1 contributors \[{worker_id}\]", 180)
    assert proc.wait_exit(120) != 0, proc.output()
    assert error in proc.output(), proc.output()
    # Well inside the 60 s heartbeat timeout: the worker said it left.
    server.wait_for(rf"left\s+{worker_id} \(left\)", 15)
    assert not re.search(rf"dead\s+{worker_id}", server.output()), server.output()


def test_a_hugging_face_trainer_that_raises_leaves_and_a_token_budget_stops_the_next(cluster):
    server = cluster.server("--min-workers", "1", heartbeat_timeout_s=60.0)
    _left_at_once(cluster, server, "hf-raise", "hf-raise", "RuntimeError: injected data error")

    trained = cluster.status()["tokens"]["trained"]
    # Each round of the example trains 5 steps x 8 windows x 64 bytes = 2,560 tokens: two rounds reach it.
    budget = trained + 4_000
    admin = subprocess.run([sys.executable, "-m", "diloco", "set-token-budget", str(budget),
                            "--connect", cluster.address], env=cluster.env, capture_output=True, text=True,
                           timeout=60)
    assert admin.returncode == 0, admin.stdout + admin.stderr
    trainer = cluster.start("hf-train", ["hf-train", cluster.address, "hf-train"], program=(SCRIPT,))
    assert trainer.wait_exit(240) == 0, trainer.output()
    m = re.search(r"RESULT trainer worker=hf-train inner_steps=(\d+) rounds_synced=(\d+) stop_reason=(\S+)",
                  trainer.output())
    assert m, trainer.output()
    # Two rounds applied; the stop comes with the second's Result or at the next sync point (step 15),
    # never the 100 steps the Trainer asked for.
    assert int(m.group(2)) == 2 and int(m.group(1)) in (10, 15), trainer.output()
    assert m.group(3) == "save_and_stop", trainer.output()  # the budget stops the run as shutdown --save
    server.wait_for(r"budget +reached", 30)


def test_a_lightning_trainer_that_raises_leaves_from_on_exception(cluster):
    pytest.importorskip("lightning")
    server = cluster.server("--min-workers", "1", heartbeat_timeout_s=60.0)
    _left_at_once(cluster, server, "lightning-raise", "lt-raise", "RuntimeError: injected training error")
