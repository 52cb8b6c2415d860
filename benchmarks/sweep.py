"""Train grids of (settings, H, outer lr, momentum) cells: single worker, sync DP and DiLoCo each.

The shared machinery of ``bench_demo.py`` (the demo's settings) and
``bench_training.py --outer-sweep`` (outer lr and momentum). For every cell it
trains, on the default corpus and seed, a single worker
(``train_single_worker``), synchronous data parallel with k workers
(``train_sync_data_parallel``) and DiLoCo with k workers
(``simulate_diloco_reference``: the real system's arithmetic in one process;
``diloco demo`` with the same settings ends within 0.1% of it), and keeps
each distinct training once: cells that share a baseline train it once.
Trainings run in separate processes with one torch thread each; the CPU
seconds they report are per training.
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass


@dataclass(frozen=True)
class Cell:
    steps: int
    batch: int
    seq_len: int
    lr: float
    warmup: int
    H: int
    outer_lr: float
    outer_momentum: float
    #: An outer-momentum schedule (``OuterConfig`` fields: momentum_warmup, momentum_decay_start,
    #: momentum_decay_rounds, momentum_final); empty: constant momentum.
    schedule: tuple = ()

    def label(self) -> str:
        sched = f" schedule={':'.join(f'{x:g}' for x in self.schedule)}" if self.schedule else ""
        return (f"steps={self.steps} batch={self.batch} seq={self.seq_len} lr={self.lr:g} warm={self.warmup} "
                f"H={self.H} olr={self.outer_lr:g} mom={self.outer_momentum:g}{sched}")

    def momentum_at(self):
        """The schedule as ``OuterConfig.momentum_at`` (None without one)."""
        if not self.schedule:
            return None
        from diloco.outer import OuterConfig

        warm, start, rounds, final = self.schedule
        return OuterConfig("nesterov", self.outer_lr, self.outer_momentum, momentum_warmup=warm,
                           momentum_decay_start=start, momentum_decay_rounds=rounds, momentum_final=final).momentum_at

    def train_key(self) -> tuple:
        return (self.steps, self.batch, self.seq_len, self.lr, self.warmup)


def _settings(cell: Cell):
    from diloco.baselines import TrainSettings
    from diloco.models import ModelConfig

    return TrainSettings(batch_size=cell.batch, lr=cell.lr, warmup_steps=cell.warmup,
                         eval_every=max(50, cell.steps // 6), model=ModelConfig(seq_len=cell.seq_len))


def _job(args: tuple) -> tuple[tuple, float, float]:
    """Train one method of one cell in this process; returns (key, final held-out loss, CPU s)."""
    method, cell, k, seed = args
    import torch

    torch.set_num_threads(1)
    from diloco.baselines import simulate_diloco_reference, train_single_worker, train_sync_data_parallel
    from diloco.baselines.settings import default_corpus

    corpus, s = default_corpus(), _settings(cell)
    t0 = time.process_time()
    if method == "single":
        r = train_single_worker(cell.steps, settings=s, corpus=corpus, seed=seed)
    elif method == "sync":
        r = train_sync_data_parallel(k, cell.steps, settings=s, corpus=corpus, seed=seed)
    else:
        r = simulate_diloco_reference(k, cell.H, cell.steps, cell.outer_lr, cell.outer_momentum,
                                      settings=s, corpus=corpus, seed=seed, momentum_at=cell.momentum_at())
    return (method, key_of(method, cell)), r.final_eval_loss, time.process_time() - t0


def key_of(method: str, cell: Cell) -> tuple:
    if method != "diloco":
        return cell.train_key()
    return (cell.train_key(), cell.H, cell.outer_lr, cell.outer_momentum, cell.schedule)


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


@dataclass(frozen=True)
class Row:
    cell: Cell
    single: float
    sync: float
    diloco: float
    cpu_s: float

    @property
    def vs_single(self) -> float:
        return self.diloco / self.single

    @property
    def vs_sync(self) -> float:
        return self.diloco / self.sync


def run_grid(cells: list[Cell], k: int, seed: int, jobs: int, label: str = "bench_demo") -> list[Row]:
    """Train every cell's three methods (each distinct training once) in ``jobs`` processes."""
    todo: dict[tuple, tuple] = {}
    for cell in cells:
        for method in ("single", "sync", "diloco"):
            todo.setdefault((method, key_of(method, cell)), (method, cell, k, seed))
    print(f"{label}: {len(cells)} cells, {len(todo)} trainings, k={k}, seed={seed}, {jobs} processes",
          file=sys.stderr)
    done: dict[tuple, tuple[float, float]] = {}
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        for key, loss, cpu in pool.map(_job, list(todo.values())):
            done[key] = (loss, cpu)
            print(f"  [{len(done)}/{len(todo)} {time.perf_counter() - t0:.0f}s] {key[0]} {key[1]}: "
                  f"loss {loss:.4f}, {cpu:.1f} CPU s", file=sys.stderr)
    rows = []
    for c in cells:
        (s_loss, s_cpu), (d_loss, d_cpu), (l_loss, l_cpu) = (
            done[(m, key_of(m, c))] for m in ("single", "sync", "diloco"))
        rows.append(Row(c, s_loss, d_loss, l_loss, s_cpu + d_cpu + l_cpu))
    return rows


def print_table(rows: list[Row], mark=None) -> None:
    """A markdown table of the rows; ``mark(row)`` fills the last column (e.g. whether goals are met)."""
    print("| steps | batch | seq | inner lr | H | outer lr | mom | single | sync DP | DiLoCo "
          "| DiLoCo/single | DiLoCo/sync | CPU s (single+sync+DiLoCo) |" + (" |" if mark else ""))
    print("|" + "---|" * (13 + bool(mark)))
    for r in rows:
        c = r.cell
        print(f"| {c.steps} | {c.batch} | {c.seq_len} | {c.lr:g} | {c.H} | {c.outer_lr:g} | {c.outer_momentum:g} "
              f"| {r.single:.4f} | {r.sync:.4f} | {r.diloco:.4f} | {r.vs_single:.3f} | {r.vs_sync:.3f} "
              f"| {r.cpu_s:.0f} |" + (f" {mark(r)} |" if mark else ""))
