"""The sharded-member process tests' setup: an MLP that FSDP2 shards across the worker's ranks.

``make_setup`` returns the model already sharded (``fully_shard`` on each linear
layer and on the root, over the worker's gloo group) with ``torch.optim.AdamW``,
so every rank holds its shard of the params and of the inner optimizer's state.
With ``SHARD_ENTRY_REPLICATED=1`` the same model is left whole (the replicated
multi-rank worker): the two runs see the same data and seeds, so their losses
can be compared. Each rank trains on its own data (a seed per rank).

Every rank writes its pid to ``<RANK_TRACE_DIR>/<worker>.rank<k>.pid``, registers an ``atexit``
hook that writes ``<worker>.rank<k>.finalized`` (a worker in a group must end without the
interpreter's finalization), and,
before each inner step, ``<step> <sha256 of its local shards> <loss of the
previous step>`` to ``<worker>.rank<k>.trace``.
"""

from __future__ import annotations

import atexit
import hashlib
import os
from pathlib import Path

import torch

from tiny_entry import DIM, _batches  # the same synthetic regression problem
HIDDEN = 17  # odd: the shards of a rank differ in size


def local_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)  # every member starts from the same weights
    return torch.nn.Sequential(torch.nn.Linear(DIM, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 1))


def make_setup(worker_id: str = "w", rank: int = 0, world_size: int = 1):
    from diloco.worker import TrainingSetup

    model = build_model()
    if os.environ.get("SHARD_ENTRY_REPLICATED") != "1":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    out = Path(os.environ["RANK_TRACE_DIR"])
    (out / f"{worker_id}.rank{rank}.pid").write_text(str(os.getpid()))
    atexit.register((out / f"{worker_id}.rank{rank}.finalized").write_text, "atexit ran")
    trace = open(out / f"{worker_id}.rank{rank}.trace", "a", buffering=1)
    step, last = 0, float("nan")

    def loss_fn(m, batch):
        nonlocal step, last
        trace.write(f"{step} {local_digest(m)} {last!r}\n")
        step += 1
        x, y = batch
        loss = torch.nn.functional.mse_loss(m(x), y)
        last = float(loss.detach())
        return loss

    return TrainingSetup(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.01),
                         batches=_batches(sum(map(ord, worker_id)) + 1000 * rank), loss_fn=loss_fn)
