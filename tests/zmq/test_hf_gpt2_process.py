"""The GPT-2 example end to end: a Hugging Face ``Trainer`` and ``diloco worker --entry`` train the same
``transformers`` model in one run against a real ``diloco server``, and the run exports to a directory
``from_pretrained`` loads.

The Trainer counts optimizer steps with gradient accumulation on (2 micro-batches each), so its 40
optimizer steps with H = 10 are 4 rounds; the other worker runs the example's ``make_setup`` through
diloco's own loop. Every round applies with both; the Trainer's held-out loss falls; ``diloco export``
plus the model's config make a directory whose ``GPT2LMHeadModel.from_pretrained`` holds exactly the run's
params, and (the Trainer's params after its last sync being the global ones) gives the held-out loss the
Trainer reported.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from procs import REPO

pytest.importorskip("transformers")

EXAMPLE = REPO / "examples" / "hf_gpt2.py"
STEPS, H = 40, 10


def test_a_trainer_and_a_diloco_worker_train_gpt2_together_and_the_run_loads_with_from_pretrained(cluster):
    server = cluster.server("--min-workers", "2", "--checkpoint-dir", "ckpt")
    trainer = cluster.start("hf-w1", ["--connect", cluster.address, "--worker-id", "w1", "--steps", str(STEPS),
                                      "--sync-every", str(H), "--grad-accum", "2"], program=(str(EXAMPLE),))
    worker = cluster.start("w2", ["worker", "--connect", cluster.address, "--id", "w2",
                                  "--entry", f"{EXAMPLE}:make_setup", "--sync-every", str(H),
                                  "--max-steps", str(STEPS), "--coordinator-timeout", "120"])
    assert trainer.wait_exit(300) == 0, trainer.output()
    assert worker.wait_exit(120) == 0, worker.output()

    m = re.search(r"RESULT hf_gpt2 worker=w1 eval_loss_before=([\d.]+) eval_loss_after=([\d.]+) "
                  r"inner_steps=(\d+) rounds_synced=(\d+)", trainer.output())
    assert m, trainer.output()
    before, after = float(m.group(1)), float(m.group(2))
    assert (int(m.group(3)), int(m.group(4))) == (STEPS, STEPS // H), trainer.output()
    assert after < before - 1.0, (before, after)  # from ~5.5 (uniform over 256 bytes) to under 3.5
    server.wait_for(rf"applied\s+fragment 0 round {STEPS // H - 1} from", 30)  # its log line may trail the Result
    applied = re.findall(r"applied\s+fragment 0 round \d+ from 2 contributors \[(?:w1, w2|w2, w1)\]", server.output())
    assert len(applied) == STEPS // H, server.output()

    export = subprocess.run([sys.executable, "-m", "diloco", "export", "ckpt", "exported"], cwd=cluster.tmp,
                            env=cluster.env, capture_output=True, text=True, timeout=120)
    assert export.returncode == 0, export.stderr
    assert f"({STEPS // H} outer steps applied)" in export.stdout, export.stdout

    check = subprocess.run([sys.executable, "-c", LOAD_AND_EVAL, str(EXAMPLE.parent)], cwd=cluster.tmp,
                           env=cluster.env, capture_output=True, text=True, timeout=180)
    assert check.returncode == 0, check.stdout + check.stderr
    same, loss = check.stdout.split()[-2:]
    assert same == "identical", check.stdout
    assert abs(float(loss) - after) < 1e-3, (loss, after)


#: In a fresh process: the config beside the export, from_pretrained, compare with the run's params,
#: and the example's held-out loss of the loaded model.
LOAD_AND_EVAL = """
import sys, torch
sys.path.insert(0, sys.argv[1])
import hf_gpt2
from transformers import GPT2LMHeadModel
from diloco.deploy.export import read_run_params

hf_gpt2.make_config().save_pretrained("exported")
model = GPT2LMHeadModel.from_pretrained("exported").eval()
run = read_run_params("ckpt")
own = dict(model.named_parameters())
assert set(own) == set(run.params), (sorted(own), sorted(run.params))
same = all(torch.equal(own[n], t) for n, t in run.params.items())
loss = hf_gpt2.held_out_loss(model)
print("identical" if same else "different", f"{loss:.4f}")
"""
