"""A worker bigger than one device: diloco's char transformer, sharded with FSDP2 across a member's ranks.

Each member is a ``torchrun`` group; FSDP2 (``fully_shard``) shards the model
across its ranks, so each rank holds its shard of the params and of AdamW's
state, and diloco keeps its own per-parameter state per shard too. The
coordinator sees one worker per member. On the CPU (gloo) as here, or on GPUs
(NCCL) unchanged::

    diloco server --min-workers 2 --checkpoint-dir ckpt &
    torchrun --nproc-per-node 2 --master-port 29501 -m diloco worker --id w1 \\
        --entry examples/fsdp2_member.py:make_setup --checkpoint-dir ckpt-w1 &
    torchrun --nproc-per-node 2 --master-port 29502 -m diloco worker --id w2 \\
        --entry examples/fsdp2_member.py:make_setup --checkpoint-dir ckpt-w2

Or in your own loop with ``diloco.Worker`` (every rank runs this file; rank 0
talks to the coordinator, the others follow it)::

    torchrun --nproc-per-node 2 examples/fsdp2_member.py --connect tcp://127.0.0.1:5555 --worker-id w1

A member's checkpoint is a ``torch.distributed.checkpoint`` directory
(``ckpt-w1/worker-w1.dcp``, each rank its shards); ``diloco export
ckpt-w1/worker-w1.dcp out.safetensors`` joins its copy of the global params.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from diloco.deploy.default_entry import BATCH_SIZE, CORPUS_BYTES, LR, SEQ_LEN, _loss, _tokens
from diloco.data import BatchSampler, Corpus, derive_seed
from diloco.models import ModelConfig, build_model
from diloco.worker import TrainingSetup


def sharded_model(config: ModelConfig | None = None) -> torch.nn.Module:
    """The char transformer with each block and then the whole model sharded (FSDP2's usual recipe).

    Needs the ranks' process group (``diloco worker`` starts it under torchrun; a script calls
    ``torch.distributed.init_process_group`` first)."""
    from torch.distributed.fsdp import fully_shard

    model = build_model(config or ModelConfig(seq_len=SEQ_LEN), seed=0)  # every member: the same weights
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def make_setup(worker_id: str = "worker", rank: int = 0, world_size: int = 1) -> TrainingSetup:
    """``diloco worker --entry examples/fsdp2_member.py:make_setup``: the model already sharded."""
    corpus = Corpus.from_stdlib(max_bytes=CORPUS_BYTES)
    model = sharded_model()
    # Each rank its own windows: FSDP2 averages the ranks' gradients, as data parallelism does.
    batches = BatchSampler(corpus.train, BATCH_SIZE, SEQ_LEN, seed=derive_seed(0, "worker", worker_id, "rank", rank))
    return TrainingSetup(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=LR), batches=batches,
                         loss_fn=_loss, tokens_of=_tokens)


def main(argv: list[str] | None = None) -> int:
    import torch.distributed as dist

    import diloco

    parser = argparse.ArgumentParser(description="one rank of a sharded DiLoCo member, in a loop of your own "
                                                 "(run it under torchrun)")
    parser.add_argument("--connect", default="tcp://127.0.0.1:5555", help="the coordinator's address")
    parser.add_argument("--worker-id", required=True, help="the member's id (every rank gives the same)")
    parser.add_argument("--sync-every", type=int, default=20, help="inner steps per round")
    parser.add_argument("--steps", type=int, default=200, help="inner steps to train, at most")
    args = parser.parse_args(argv)
    dist.init_process_group("gloo")  # "nccl" on GPUs
    try:
        setup = make_setup(args.worker_id, dist.get_rank(), dist.get_world_size())
        model, opt = setup.model, setup.optimizer
        loss = None
        with diloco.Worker(model, opt, connect=args.connect, sync_every=args.sync_every,
                           worker_id=args.worker_id) as worker:
            for step, batch in zip(range(args.steps), setup.batches):
                loss = setup.loss_fn(model, batch)
                loss.backward()
                opt.step()
                opt.zero_grad()
                if not worker.step():
                    break
        if dist.get_rank() == 0:
            print(f"RESULT member={args.worker_id} ranks={dist.get_world_size()} inner_steps={worker.inner_step} "
                  f"rounds={worker.rounds_synced} last_loss={float(loss) if loss is not None else float('nan'):.4f}",
                  flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # FSDP2 keeps the process group's object alive after destroy_process_group; gloo's threads torn
    # down while the interpreter finalizes abort the process now and then. Skip the finalization.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
