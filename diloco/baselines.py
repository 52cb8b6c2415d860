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
  optimizer (Nesterov SGD, lr 0.7, momentum 0.9 by default) steps the global
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
"""

from __future__ import annotations

import copy
import functools
import math
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

import torch

from diloco.data.corpus import BatchSampler, Corpus, derive_seed, make_shards
from diloco.models.char_transformer import (
    CharTransformer,
    ModelConfig,
    build_model,
    count_params,
    evaluate_loss,
    param_bytes,
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

#: ``progress(step, total, loss)``: called after every (inner) step with that step's mean train loss.
ProgressFn = Callable[[int, int, float], None]


@dataclass(frozen=True)
class TrainSettings:
    """Hyperparameters shared by all three trainers. Validated on construction."""

    #: The model to train.
    model: ModelConfig = field(default_factory=ModelConfig)
    #: Sequences per worker per (inner) step.
    batch_size: int = 32
    #: Peak AdamW learning rate (inner optimizer).
    lr: float = 1e-3
    #: AdamW decoupled weight decay.
    weight_decay: float = 0.1
    #: AdamW betas.
    betas: tuple[float, float] = (0.9, 0.95)
    #: Linear warmup steps (from lr/warmup_steps up to lr).
    warmup_steps: int = 50
    #: ``"cosine"`` (decay to ``min_lr_ratio * lr`` at the last step) or ``"constant"``.
    schedule: str = "cosine"
    #: Floor of the cosine schedule as a fraction of ``lr``.
    min_lr_ratio: float = 0.1
    #: Clip each optimizer step's gradient to this global L2 norm; ``None`` disables.
    grad_clip: float | None = 1.0
    #: Evaluate held-out loss every this many (inner) steps (DiLoCo: at the first sync at or after).
    eval_every: int = 100
    #: Held-out batches per evaluation.
    eval_batches: int = 8
    #: Sequences per held-out batch.
    eval_batch_size: int = 32
    #: i.i.d. shards (True) or contiguous ranges (False); see diloco.data.make_shards.
    iid_shards: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.model, ModelConfig):
            raise ValueError(f"TrainSettings.model={self.model!r} is invalid: expected a ModelConfig")
        for name in ("batch_size", "eval_every", "eval_batches", "eval_batch_size"):
            _check_int(f"TrainSettings.{name}", getattr(self, name), 1)
        _check_int("TrainSettings.warmup_steps", self.warmup_steps, 0)
        _check_float("TrainSettings.lr", self.lr, 0.0, math.inf, lo_open=True)
        _check_float("TrainSettings.weight_decay", self.weight_decay, 0.0, math.inf)
        _check_float("TrainSettings.min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        if self.grad_clip is not None:
            _check_float("TrainSettings.grad_clip", self.grad_clip, 0.0, math.inf, lo_open=True)
        if self.schedule not in ("cosine", "constant"):
            raise ValueError(f"TrainSettings.schedule={self.schedule!r} is invalid: expected 'cosine' or 'constant'")
        b = self.betas
        if not (isinstance(b, tuple) and len(b) == 2 and all(isinstance(x, float) and 0.0 <= x < 1.0 for x in b)):
            raise ValueError(f"TrainSettings.betas={b!r} is invalid: expected a pair of floats in [0, 1)")

    def with_(self, **changes) -> "TrainSettings":
        """A copy with some fields changed (validated)."""
        return replace(self, **changes)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["betas"] = list(self.betas)
        return d


@dataclass
class BaselineResult:
    """What a reference trainer returns."""

    #: ``"single"``, ``"sync_dp"`` or ``"diloco"``.
    name: str
    #: Human-readable label for plots, e.g. ``"DiLoCo k=4 H=10"``.
    label: str
    #: Inner steps 1..steps.
    steps: list[int]
    #: Train loss at each step (mean over workers for k > 1).
    train_losses: list[float]
    #: Steps at which held-out loss was measured (step 0 = initial model).
    eval_steps: list[int]
    #: Held-out loss at ``eval_steps``.
    eval_losses: list[float]
    #: Held-out loss of the final model (DiLoCo: the final *global* model).
    final_eval_loss: float
    #: Number of synchronisations (sync DP: steps; DiLoCo: outer rounds; single: 0).
    syncs: int
    #: Bytes moved over all syncs: ``syncs * 2 * k * param_bytes``.
    bytes_moved: int
    #: Workers k.
    k: int
    #: DiLoCo inner steps per round (None for the others).
    H: int | None
    #: Distinct model parameters.
    num_params: int
    #: Wall-clock seconds of the run (not deterministic, unlike everything else).
    wall_s: float
    #: The settings and arguments used.
    config: dict
    #: Final model parameters (DiLoCo: the global model), detached copies; not in ``to_dict()``.
    final_state: dict[str, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)

    def to_dict(self) -> dict:
        """JSON-serialisable summary (everything except ``final_state``)."""
        d = {f: getattr(self, f) for f in self.__dataclass_fields__ if f != "final_state"}
        return copy.deepcopy(d)

    def loss_curve(self, smooth: int = 1) -> tuple[list[int], list[float]]:
        """``(steps, train_losses)``, optionally a trailing moving average over ``smooth`` steps."""
        if smooth <= 1:
            return list(self.steps), list(self.train_losses)
        out, acc = [], 0.0
        for i, v in enumerate(self.train_losses):
            acc += v
            if i >= smooth:
                acc -= self.train_losses[i - smooth]
            out.append(acc / min(i + 1, smooth))
        return list(self.steps), out

    def eval_curve(self) -> tuple[list[int], list[float]]:
        """``(eval_steps, eval_losses)``."""
        return list(self.eval_steps), list(self.eval_losses)


def comm_bytes_per_sync(k: int, num_param_bytes: int) -> int:
    """Bytes one sync moves: every worker sends one model-sized tensor and receives one."""
    return 2 * k * num_param_bytes


@functools.lru_cache(maxsize=2)
def default_corpus() -> Corpus:
    """The standard-library corpus (default size), built once per process."""
    return Corpus.from_stdlib()


# --------------------------------------------------------------------------- trainers


def train_single_worker(
    steps: int,
    *,
    settings: TrainSettings | None = None,
    corpus: Corpus | None = None,
    seed: int = 0,
    progress: ProgressFn | None = None,
) -> BaselineResult:
    """One worker, AdamW, on the full train set (see module doc, "Data")."""
    _check_int("steps", steps, 1)
    s, corpus = _prepare(settings, corpus)
    model = build_model(s.model, derive_seed(seed, "model"))
    opt, sched = inner_optimizer(model, s, steps)
    sampler = worker_samplers(corpus, 1, s, seed)[0]
    tracker = _Tracker(model, corpus, s, steps)
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
    _check_int("k", k, 1)
    _check_int("steps", steps, 1)
    s, corpus = _prepare(settings, corpus)
    model = build_model(s.model, derive_seed(seed, "model"))
    opt, sched = inner_optimizer(model, s, steps)
    samplers = worker_samplers(corpus, k, s, seed)
    tracker = _Tracker(model, corpus, s, steps)
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


def simulate_diloco_reference(
    k: int,
    H: int,
    steps: int,
    outer_lr: float = 0.7,
    outer_momentum: float = 0.9,
    *,
    nesterov: bool = True,
    settings: TrainSettings | None = None,
    corpus: Corpus | None = None,
    seed: int = 0,
    progress: ProgressFn | None = None,
) -> BaselineResult:
    """DiLoCo in one process (Douillard et al. 2023, Algorithm 1), no networking.

    ``steps`` counts inner steps per worker. A round ends every ``H`` inner
    steps; if ``steps`` is not a multiple of ``H`` the last, shorter round is
    still synced so the result is a global model. Each round: pseudo-gradient
    ``delta = mean_i(global - local_i)`` is written to the global params'
    ``.grad``, ``torch.optim.SGD(lr=outer_lr, momentum=outer_momentum,
    nesterov=...)`` steps, and every replica copies the new global params.
    Each replica keeps its own AdamW state and lr schedule across rounds.
    Nesterov is silently off when ``outer_momentum == 0`` (torch requires
    momentum > 0 for it), so ``outer_lr=1, outer_momentum=0`` is plain
    parameter averaging.
    """
    _check_int("k", k, 1)
    _check_int("H", H, 1)
    _check_int("steps", steps, 1)
    _check_float("outer_lr", outer_lr, 0.0, math.inf, lo_open=True)
    _check_float("outer_momentum", outer_momentum, 0.0, 1.0, hi_open=True)
    s, corpus = _prepare(settings, corpus)
    global_model = build_model(s.model, derive_seed(seed, "model"))
    global_params = list(global_model.parameters())
    outer_opt = torch.optim.SGD(
        global_params, lr=outer_lr, momentum=outer_momentum, nesterov=bool(nesterov and outer_momentum > 0)
    )
    replicas = [copy.deepcopy(global_model) for _ in range(k)]
    inner = [inner_optimizer(r, s, steps) for r in replicas]
    replica_params = [list(r.parameters()) for r in replicas]
    samplers = worker_samplers(corpus, k, s, seed)
    tracker = _Tracker(global_model, corpus, s, steps)
    syncs = 0
    next_eval = s.eval_every
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        total = 0.0
        for replica, (opt, sched), sampler in zip(replicas, inner, samplers):
            total += inner_step(replica, opt, sched, sampler, s)
        tracker.record(step, total / k, progress)
        if step % H == 0 or step == steps:
            _outer_step(global_params, replica_params, outer_opt)
            syncs += 1
            if step >= next_eval or step == steps:
                tracker.evaluate(step)
                while next_eval <= step:
                    next_eval += s.eval_every
    pbytes = param_bytes(global_model)
    return tracker.result(
        name="diloco", label=f"DiLoCo k={k} H={H}", syncs=syncs, k=k, H=H, pbytes=pbytes,
        wall_s=time.perf_counter() - t0,
        config=dict(
            k=k, H=H, steps=steps, outer_lr=outer_lr, outer_momentum=outer_momentum,
            nesterov=nesterov, seed=seed, settings=s.to_dict(),
        ),
    )


# --------------------------------------------------------------------------- internals


@torch.no_grad()
def _outer_step(
    global_params: list[torch.Tensor], replica_params: list[list[torch.Tensor]], outer_opt: torch.optim.Optimizer
) -> None:
    k = len(replica_params)
    for j, gp in enumerate(global_params):
        delta = torch.zeros_like(gp)
        for params in replica_params:
            delta += gp - params[j]  # pseudo-gradient: global - local (points "uphill", like a gradient)
        gp.grad = delta / k
    outer_opt.step()
    outer_opt.zero_grad(set_to_none=True)
    for params in replica_params:
        for gp, rp in zip(global_params, params):
            rp.copy_(gp)


def _prepare(settings: TrainSettings | None, corpus: Corpus | None) -> tuple[TrainSettings, Corpus]:
    s = settings if settings is not None else TrainSettings()
    if not isinstance(s, TrainSettings):
        raise TypeError(f"settings must be a TrainSettings, got {type(s).__name__}")
    c = corpus if corpus is not None else default_corpus()
    if not isinstance(c, Corpus):
        raise TypeError(f"corpus must be a diloco.data.Corpus, got {type(c).__name__}")
    return s, c


def worker_samplers(corpus: Corpus, k: int, s: TrainSettings, seed: int) -> list[BatchSampler]:
    block_len = min(1024, max(2, corpus.train.numel() // (4 * k)))
    shards = make_shards(corpus.train, k, seed=seed, block_len=block_len, iid=s.iid_shards)
    return [
        BatchSampler(shard, s.batch_size, s.model.seq_len, derive_seed(seed, "worker", i))
        for i, shard in enumerate(shards)
    ]


def inner_optimizer(
    model: CharTransformer, s: TrainSettings, steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
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


class _Tracker:
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


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} is invalid: expected an int >= {minimum}")


def _check_float(
    name: str, value: object, lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False
) -> None:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if ok:
        ok = (value > lo if lo_open else value >= lo) and (value < hi if hi_open else value <= hi)
    if not ok:
        rng = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
        raise ValueError(f"{name}={value!r} is invalid: expected a finite number in {rng}")


# --------------------------------------------------------------------------- comparison / CLI


def run_comparison(
    k: int = 4,
    H: int = 10,
    steps: int = 1000,
    *,
    outer_lr: float = 0.7,
    outer_momentum: float = 0.9,
    which: tuple[str, ...] = ("sync_dp", "diloco", "single"),
    settings: TrainSettings | None = None,
    corpus: Corpus | None = None,
    seed: int = 0,
    progress: Callable[[str, int, int, float], None] | None = None,
) -> dict[str, BaselineResult]:
    """Run the calibration comparison (benchmarks/README.md); ``progress(name, step, total, loss)``.

    Returns ``{name: result}`` in the order of ``which`` (names: ``sync_dp``,
    ``diloco``, ``single``).
    """
    out: dict[str, BaselineResult] = {}
    for name in which:
        cb = (lambda st, tot, lo, _n=name: progress(_n, st, tot, lo)) if progress else None
        if name == "sync_dp":
            out[name] = train_sync_data_parallel(k, steps, settings=settings, corpus=corpus, seed=seed, progress=cb)
        elif name == "diloco":
            out[name] = simulate_diloco_reference(
                k, H, steps, outer_lr, outer_momentum, settings=settings, corpus=corpus, seed=seed, progress=cb
            )
        elif name == "single":
            out[name] = train_single_worker(steps, settings=settings, corpus=corpus, seed=seed, progress=cb)
        else:
            raise ValueError(f"which contains {name!r}: expected 'sync_dp', 'diloco' or 'single'")
    return out


def _main(argv: list[str] | None = None) -> int:
    """``python -m diloco.baselines``: run the comparison and print a table (benchmark, minutes)."""
    import argparse
    import json

    p = argparse.ArgumentParser(prog="python -m diloco.baselines", description=_main.__doc__)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--H", type=int, default=10)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.9)
    p.add_argument("--lr", type=float, default=TrainSettings.lr)
    p.add_argument("--batch-size", type=int, default=TrainSettings.batch_size)
    p.add_argument("--seq-len", type=int, default=ModelConfig.seq_len)
    p.add_argument("--schedule", default=TrainSettings.schedule)
    p.add_argument("--warmup-steps", type=int, default=TrainSettings.warmup_steps)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--which", default="sync_dp,diloco,single")
    p.add_argument("--json", help="write results here")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    s = TrainSettings(
        model=ModelConfig(seq_len=a.seq_len), lr=a.lr, batch_size=a.batch_size, schedule=a.schedule,
        warmup_steps=a.warmup_steps,
    )

    def prog(name: str, step: int, total: int, loss: float) -> None:
        if step % 100 == 0 or step == total:
            print(f"  {name:8s} {step:5d}/{total} train loss {loss:.3f}", flush=True)

    results = run_comparison(
        a.k, a.H, a.steps, outer_lr=a.outer_lr, outer_momentum=a.outer_momentum,
        which=tuple(a.which.split(",")), settings=s, seed=a.seed, progress=prog,
    )
    print(f"k={a.k} H={a.H} steps={a.steps} outer_lr={a.outer_lr} outer_momentum={a.outer_momentum}")
    for r in results.values():
        print(
            f"{r.label:28s} eval {r.final_eval_loss:.4f}  syncs {r.syncs:5d}  "
            f"moved {r.bytes_moved / 1e6:9.1f} MB  {r.wall_s:7.1f} s"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({n: r.to_dict() for n, r in results.items()}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
