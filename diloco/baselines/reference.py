"""DiLoCo in one process, no networking: the reference the distributed system is measured against.

See :mod:`diloco.baselines` for the data, the accounting and the calibration numbers.
"""

from __future__ import annotations

import copy
import math
import time
from typing import Callable

import torch

from diloco.baselines.settings import BaselineResult, ProgressFn, TrainSettings, check_float, check_int, prepare
from diloco.baselines.trainers import Tracker, inner_optimizer, inner_step, worker_samplers
from diloco.data.corpus import Corpus, derive_seed
from diloco.models.char_transformer import build_model, param_bytes


def simulate_diloco_reference(
    k: int,
    H: int,
    steps: int,
    outer_lr: float = 0.7,
    outer_momentum: float = 0.8,
    *,
    nesterov: bool = True,
    settings: TrainSettings | None = None,
    corpus: Corpus | None = None,
    seed: int = 0,
    progress: ProgressFn | None = None,
    momentum_at: Callable[[int], float] | None = None,
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
    parameter averaging. ``momentum_at(r)``, if given, is the outer momentum of
    outer step ``r`` (0 for the first): a schedule (``OuterConfig.momentum_at``).
    """
    check_int("k", k, 1)
    check_int("H", H, 1)
    check_int("steps", steps, 1)
    check_float("outer_lr", outer_lr, 0.0, math.inf, lo_open=True)
    check_float("outer_momentum", outer_momentum, 0.0, 1.0, hi_open=True)
    s, corpus = prepare(settings, corpus)
    global_model = build_model(s.model, derive_seed(seed, "model"))
    global_params = list(global_model.parameters())
    outer_opt = torch.optim.SGD(
        global_params, lr=outer_lr, momentum=outer_momentum, nesterov=bool(nesterov and outer_momentum > 0)
    )
    replicas = [copy.deepcopy(global_model) for _ in range(k)]
    inner = [inner_optimizer(r, s, steps) for r in replicas]
    replica_params = [list(r.parameters()) for r in replicas]
    samplers = worker_samplers(corpus, k, s, seed)
    tracker = Tracker(global_model, corpus, s, steps)
    syncs = 0
    next_eval = s.eval_every
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        total = 0.0
        for replica, (opt, sched), sampler in zip(replicas, inner, samplers):
            total += inner_step(replica, opt, sched, sampler, s)
        tracker.record(step, total / k, progress)
        if step % H == 0 or step == steps:
            if momentum_at is not None:
                outer_opt.param_groups[0]["momentum"] = momentum_at(syncs)
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
