"""The multi-rank process tests' setup: ``tiny_entry``'s model, a data shard per rank, and a trace.

Every rank writes its pid to ``<RANK_TRACE_DIR>/<worker>.rank<k>.pid`` (so a
test can kill one rank by pid) and, before each inner step, a line
``<step> <sha256 of the params' bytes>`` to ``<worker>.rank<k>.trace``: two
ranks of one worker hold bit-identical params exactly when their lines for a
step are equal.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from tiny_entry import make_setup as tiny_setup
from tiny_entry import _batches
from diloco.worker import TrainingSetup


def params_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def make_setup(worker_id: str = "w", rank: int = 0, world_size: int = 1) -> TrainingSetup:
    out = Path(os.environ["RANK_TRACE_DIR"])
    (out / f"{worker_id}.rank{rank}.pid").write_text(str(os.getpid()))
    trace = open(out / f"{worker_id}.rank{rank}.trace", "a", buffering=1)
    setup = tiny_setup(worker_id)
    step = 0

    def loss_fn(model, batch):
        nonlocal step
        trace.write(f"{step} {params_digest(model)}\n")
        step += 1
        return setup.loss_fn(model, batch)

    # Each rank its own data: the ranks' gradients differ, so only the all-reduce keeps them equal.
    return TrainingSetup(model=setup.model, optimizer=setup.optimizer,
                         batches=_batches(sum(map(ord, worker_id)) + 1000 * rank), loss_fn=loss_fn)
