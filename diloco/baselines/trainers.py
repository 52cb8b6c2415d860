"""The single worker and sync data parallel, and the inner step every trainer takes.

:func:`inner_optimizer`, :func:`inner_step` and :func:`worker_samplers` are
shared with :mod:`diloco.baselines.reference`, ``diloco demo`` and
``benchmarks/bench_training.py``, so their losses are comparable.
:class:`Tracker` collects a run's curves and builds its
:class:`~diloco.baselines.settings.BaselineResult`.
"""

from __future__ import annotations

import math
import time

import torch

from diloco.baselines.settings import (
    BaselineResult,
    ProgressFn,
    TrainSettings,
    check_int,
    comm_bytes_per_sync,
    prepare,
)
from diloco.data.corpus import BatchSampler, Corpus, derive_seed, make_shards
from diloco.models.char_transformer import (
    CharTransformer,
    build_model,
    count_params,
    evaluate_loss,
    param_bytes,
)


def train_single_worker(
    steps: int,
    *,
    settings: TrainSettings | None = None,
    corpus: Corpus | None = None,
    seed: int = 0,
    progress: ProgressFn | None = None,
) -> BaselineResult:
    """One worker, AdamW, on the full train set (see :mod:`diloco.baselines`, "Data")."""
    check_int("steps", steps, 1)
    s, corpus = prepare(settings, corpus)
    model = build_model(s.model, derive_seed(seed, "model"))
    opt, sched = inner_optimizer(model, s, steps)
    sampler = worker_samplers(corpus, 1, s, seed)[0]
    tracker = Tracker(model, corpus, s, steps)
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        loss = inner_step(model, opt, sched, sampler, s)
        tracker.record(step, loss, progress)
        if step % s.eval_every == 0 or step == steps:
            tracker.evaluate(step)
    return tracker.result(
        name="single", label="single worker", syncs=0, k=1, H=None, pbytes=param_bytes(model),
        wall_s=time.perf_counter() - t0, config=dict(steps=steps, seed=seed, settings=s.to_dict()),
    )


def train_sync_data_parallel(
    k: int,
    steps: int,
    *,
    settings: TrainSettings | None = None,
    corpus: Corpus | None = None,
    seed: int = 0,
    progress: ProgressFn | None = None,
) -> BaselineResult:
    """Fully synchronous data parallel: k shard batches -> averaged gradient -> one AdamW step.

    Equivalent to one worker with a ``k * batch_size`` batch drawn as k
    per-shard sub-batches. ``syncs == steps``; ``bytes_moved == steps * 2 * k * param_bytes``.
    """
    check_int("k", k, 1)
    check_int("steps", steps, 1)
    s, corpus = prepare(settings, corpus)
    model = build_model(s.model, derive_seed(seed, "model"))
    opt, sched = inner_optimizer(model, s, steps)
    samplers = worker_samplers(corpus, k, s, seed)
    tracker = Tracker(model, corpus, s, steps)
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for sampler in samplers:
            x, y = sampler.next()
            loss = model.loss(x, y)
            (loss / k).backward()  # grads accumulate: sum_i g_i / k = the all-reduced mean
            total += loss.item()
        _clip(model, s)
        opt.step()
        sched.step()
        tracker.record(step, total / k, progress)
        if step % s.eval_every == 0 or step == steps:
            tracker.evaluate(step)
    pbytes = param_bytes(model)
    return tracker.result(
        name="sync_dp", label=f"sync data parallel k={k}", syncs=steps, k=k, H=None, pbytes=pbytes,
        wall_s=time.perf_counter() - t0, config=dict(k=k, steps=steps, seed=seed, settings=s.to_dict()),
    )


# --------------------------------------------------------------------------- the shared inner step


def worker_samplers(corpus: Corpus, k: int, s: TrainSettings, seed: int) -> list[BatchSampler]:
    """One batch sampler per worker, each on its own shard of the train split (module doc, "Data")."""
    block_len = min(1024, max(2, corpus.train.numel() // (4 * k)))
    shards = make_shards(corpus.train, k, seed=seed, block_len=block_len, iid=s.iid_shards)
    return [
        BatchSampler(shard, s.batch_size, s.model.seq_len, derive_seed(seed, "worker", i))
        for i, shard in enumerate(shards)
    ]


def inner_optimizer(
    model: CharTransformer, s: TrainSettings, steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW and its schedule (warmup, then cosine or constant) over ``steps`` inner steps."""
    # No weight decay on biases, LayerNorm gains and position embeddings (1-D params);
    # the tied token embedding / head matrix is decayed like the other matrices.
    decay = [p for p in model.parameters() if p.dim() >= 2 and p is not model.pos_emb.weight]
    no_decay = [p for p in model.parameters() if not (p.dim() >= 2 and p is not model.pos_emb.weight)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": s.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=s.lr,
        betas=s.betas,
    )
    warm = s.warmup_steps

    def factor(i: int) -> float:  # i = optimizer steps taken so far
        if i < warm:
            return (i + 1) / warm
        if s.schedule == "constant" or steps <= warm:
            return 1.0
        frac = min(1.0, (i - warm) / max(1, steps - warm))
        return s.min_lr_ratio + (1.0 - s.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * frac))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def inner_step(model: CharTransformer, opt: torch.optim.Optimizer,
               sched: torch.optim.lr_scheduler.LRScheduler, sampler: BatchSampler, s: TrainSettings) -> float:
    """One inner AdamW step on the sampler's next batch (clip, step, schedule); the batch's loss.

    Every trainer here, ``diloco demo`` and ``benchmarks/bench_training.py`` take
    exactly this step, so their losses are comparable.
    """
    x, y = sampler.next()
    loss = model.loss(x, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    _clip(model, s)
    opt.step()
    sched.step()
    return loss.item()


def _clip(model: CharTransformer, s: TrainSettings) -> None:
    if s.grad_clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)


class Tracker:
    """Collects the loss curve, runs evaluations, builds the result."""

    def __init__(self, model: CharTransformer, corpus: Corpus, s: TrainSettings, total: int) -> None:
        self.model, self.corpus, self.s, self.total = model, corpus, s, total
        self.steps: list[int] = []
        self.losses: list[float] = []
        self.eval_steps: list[int] = []
        self.eval_losses: list[float] = []
        self.evaluate(0)

    def record(self, step: int, loss: float, progress: ProgressFn | None) -> None:
        self.steps.append(step)
        self.losses.append(loss)
        if progress is not None:
            progress(step, self.total, loss)

    def evaluate(self, step: int) -> None:
        self.eval_steps.append(step)
        self.eval_losses.append(
            evaluate_loss(
                self.model, self.corpus.eval, batch_size=self.s.eval_batch_size, num_batches=self.s.eval_batches
            )
        )

    def result(self, *, name, label, syncs, k, H, pbytes, wall_s, config) -> BaselineResult:
        return BaselineResult(
            name=name, label=label, steps=self.steps, train_losses=self.losses,
            eval_steps=self.eval_steps, eval_losses=self.eval_losses, final_eval_loss=self.eval_losses[-1],
            syncs=syncs, bytes_moved=syncs * comm_bytes_per_sync(k, pbytes), k=k, H=H,
            num_params=count_params(self.model), wall_s=wall_s, config=config,
            final_state={k: v.detach().clone() for k, v in self.model.state_dict().items()},
        )
