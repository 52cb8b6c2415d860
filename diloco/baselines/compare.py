"""The calibration comparison: all three reference trainers on the same settings.

:func:`run_comparison` runs them; :func:`main` is ``python -m diloco.baselines``
(a benchmark of 10-25 minutes, not a test; the numbers are in :mod:`diloco.baselines`).
"""

from __future__ import annotations

from typing import Callable

from diloco.baselines.reference import simulate_diloco_reference
from diloco.baselines.settings import BaselineResult, TrainSettings
from diloco.baselines.trainers import train_single_worker, train_sync_data_parallel
from diloco.data.corpus import Corpus
from diloco.models.char_transformer import ModelConfig


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


def main(argv: list[str] | None = None) -> int:
    """``python -m diloco.baselines``: run the comparison and print a table (benchmark, minutes)."""
    import argparse
    import json

    import torch

    p = argparse.ArgumentParser(prog="python -m diloco.baselines", description=main.__doc__)
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
