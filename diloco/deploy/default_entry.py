"""The built-in training setup of ``diloco worker`` (no ``--entry``): a tiny char transformer.

Model: ``diloco.models`` char transformer (d_model 64, 2 layers, context 64,
~120k parameters), built from seed 0 so every worker starts from the same
weights (the first worker to join supplies the run's initial params; the
others must match its shapes). Data: the Python standard library's own source
text (``diloco.data``, nothing downloaded), 2 MB of it; each worker samples
its own random windows (seed derived from its worker id: i.i.d. shards), or,
in a run with data work units (``diloco server --data-units N``), windows of
the unit the run hands it each round (unit i: the i-th of N equal slices).
Inner optimizer: AdamW, lr 3e-3. Batch 8: one inner step takes ~20 ms on one
thread, so with the default H = 20 a round applies every second or so on a
2-core machine.

Your own entry point looks the same: a function returning ``TrainingSetup``
(optionally taking ``worker_id``, and ``rank``/``world_size``/``device`` for a
multi-rank worker), passed as ``--entry module:function``.
"""

from __future__ import annotations

import torch

from diloco.data import BatchSampler, Corpus, derive_seed
from diloco.models import ModelConfig, build_model
from diloco.worker import TrainingSetup

#: Inner steps per round for the built-in demo (``--sync-every`` overrides).
SYNC_EVERY = 20
CORPUS_BYTES = 2_000_000
BATCH_SIZE = 8
SEQ_LEN = 64
LR = 3e-3


def _loss(model, batch) -> torch.Tensor:
    inputs, targets = batch
    return model.loss(inputs, targets)


def _tokens(batch) -> int:
    """The characters a batch predicts: what ``--token-budget`` and ``--merge tokens`` count."""
    return batch[1].numel()


def unit_slice(train: torch.Tensor, index: int, units: int) -> torch.Tensor:
    """Data unit ``index`` of ``units``: its contiguous share of the train text (at least one window's worth)."""
    share = train.numel() // units
    if share < SEQ_LEN + 1:
        raise ValueError(f"--data-units {units}: the built-in corpus ({train.numel():,} characters) is too small "
                         f"for that many units (at most {max(1, train.numel() // (SEQ_LEN + 1)):,})")
    start = index * share
    return train[start:start + share]


def make_setup(worker_id: str = "worker", rank: int = 0) -> TrainingSetup:
    corpus = Corpus.from_stdlib(max_bytes=CORPUS_BYTES)
    model = build_model(ModelConfig(seq_len=SEQ_LEN), seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    # Each rank of a multi-rank worker samples its own windows (rank 0 keeps a one-rank worker's stream).
    tags = ("worker", worker_id) if rank == 0 else ("worker", worker_id, "rank", rank)
    batches = BatchSampler(corpus.train, BATCH_SIZE, SEQ_LEN, seed=derive_seed(0, *tags))

    def unit_batches(index: int, units: int) -> BatchSampler:
        # The same windows for a unit whoever trains it: seeded by the unit, not the worker.
        return BatchSampler(unit_slice(corpus.train, index, units), BATCH_SIZE, SEQ_LEN,
                            seed=derive_seed(0, "unit", index, units))

    return TrainingSetup(model=model, optimizer=optimizer, batches=batches, loss_fn=_loss, tokens_of=_tokens,
                         unit_batches=unit_batches)
