"""Plain-PyTorch reference trainers, for comparison and for tests.

Nothing here uses the diloco coordinator, transports or state machine: these
are the yardsticks the distributed system is measured against, all in one
process, all deterministic given ``seed``.

* :func:`train_single_worker` -- one worker, AdamW, batch ``batch_size``.
* :func:`train_sync_data_parallel` -- k simulated workers; every step each
  computes a gradient on its own shard batch, the gradients are averaged and
  one AdamW step is taken (identical to one worker with a k-times batch).
* :func:`simulate_diloco_reference` -- DiLoCo (Douillard et al. 2023,
  Algorithm 1) without networking: k replicas each with its own AdamW; every
  H inner steps the pseudo-gradients (global - local) are averaged, the outer
  optimizer (Nesterov SGD, lr 0.7, momentum 0.8 by default) steps the global
  params, and every replica restarts from them.

Data. The train split of the corpus is cut into k i.i.d. shards
(:func:`diloco.data.make_shards`, seeded by ``seed``); worker ``i`` samples
batches from shard ``i`` with a sampler seeded by
``derive_seed(seed, "worker", i)``. The single worker uses the k = 1 "shard",
which is the *full* train set (block-shuffled), with worker 0's sampler seed.
So the single worker is handicapped only by compute (k times fewer tokens per
step), not by seeing less data, and the k = 1 cases of all three trainers
consume exactly the same batches -- which is what makes the equivalence tests
(sync DP with k = 1, DiLoCo with k = 1, H = 1, outer lr 1, momentum 0 =
single worker) meaningful.

Communication accounting (``bytes_moved``): each sync every worker sends one
full-model tensor (a gradient, or a pseudo-gradient) up and receives one
(averaged gradient, or new global params) back, so one sync moves
``2 * k * param_bytes`` bytes (parameter-server / all-reduce-to-root view;
float32, no compression). Sync data parallel syncs every step; DiLoCo every H
inner steps.

Calibration (benchmarks/README.md; measured here with the defaults: 125k-param
model, seq_len 128, batch 32 per worker, inner AdamW lr 1e-3 cosine, k = 4,
H = 10, outer Nesterov 0.7 / 0.9, 1000 inner steps, seed 0, one thread)::

    sync data parallel  eval 1.820  (1000 syncs, 3990 MB moved)
    DiLoCo H=10         eval 1.789  ( 100 syncs,  399 MB moved)
    single worker       eval 2.015

DiLoCo starts behind sync DP (outer momentum needs rounds to build up) and
crosses it after ~80 rounds, as in the design's table (1.760 / 1.701 /
2.100). The default inner lr (1e-3) is the one that reproduces this: at
lr 3e-3 sync DP gets far better (1.409) and DiLoCo with outer lr 0.7 or 0.3
at H = 10 stays clearly behind it over 1000 steps. The outer optimizer turns
a round's averaged displacement into a step of about
``outer_lr / (1 - outer_momentum)`` times it (7x at 0.7 / 0.9), which helps
when the inner lr is below what a k-times batch could use and hurts when it
is not. Reproduce with ``python -m diloco.baselines`` (about 10-25 minutes on
this machine; a benchmark, not a test).

Learning rate. Linear warmup for ``warmup_steps`` then cosine decay to
``min_lr_ratio * lr`` at ``steps`` (the inner schedule of the DiLoCo paper);
``schedule="constant"`` keeps lr after warmup. In DiLoCo each replica runs the
same schedule on its own inner-step counter.

Layout. :mod:`~diloco.baselines.settings` (``TrainSettings``,
``BaselineResult``, the argument checks), :mod:`~diloco.baselines.trainers`
(the single worker, sync data parallel and the inner step all trainers share),
:mod:`~diloco.baselines.reference` (DiLoCo and its outer step),
:mod:`~diloco.baselines.compare` (``run_comparison`` and the command line of
``python -m diloco.baselines``). Import from ``diloco.baselines``.
"""

from diloco.baselines.compare import run_comparison
from diloco.baselines.reference import simulate_diloco_reference
from diloco.baselines.settings import (
    BaselineResult,
    ProgressFn,
    TrainSettings,
    comm_bytes_per_sync,
    default_corpus,
)
from diloco.baselines.trainers import (
    inner_optimizer,
    inner_step,
    train_single_worker,
    train_sync_data_parallel,
    worker_samplers,
)

__all__ = [
    "TrainSettings",
    "BaselineResult",
    "ProgressFn",
    "default_corpus",
    "train_single_worker",
    "train_sync_data_parallel",
    "simulate_diloco_reference",
    "comm_bytes_per_sync",
    "inner_optimizer",
    "inner_step",
    "worker_samplers",
    "run_comparison",
]
