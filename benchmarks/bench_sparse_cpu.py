"""bench_sparse_cpu: the CPU rates of a sparse round's own work on this machine, for ``diloco plan``.

A sparse sync costs each worker CPU time beside its link time (``diloco.planner.model``, "The sparse
wire's CPU work": ``N / cpu_rate + M x N x 64/4096 / entry_rate``). This times the real code a worker
runs in a round, on a synthetic model, and splits it into the two rates the model takes
(``diloco plan --cpu-rate --entry-rate``):

* a **submit**: ``ReplicaKeeper.pseudo_gradient`` with error feedback -- global - local, the
  accumulator's decay, the norm, the chunk-wise top-k encode, its own payload taken out of the
  accumulator;
* a **receipt** of a Result carrying ``M`` payloads: ``DeltaParams.resolve`` (each payload checked,
  decoded and added into zeros, the step, the finiteness check) and ``ReplicaKeeper.install``.

A receipt is timed with 1 and with ``workers`` payloads: the difference is the per-entry cost
(``entry_rate``, payload entries decoded and added per second); what is left of a submit and a
one-payload receipt, less that one payload's entries, is the per-parameter cost (``cpu_rate``,
parameters per second). Each time is the median of ``repeats`` runs.

``measure_concurrently(k)`` (``--concurrent K``) runs ``k`` such measurements at once, one process
each on one thread, timed over the same seconds: what each of ``k`` workers sharing this machine
gets (its cores, their caches and memory bandwidth, the page faults of fresh tensors), the rate to
plan with when ``k`` workers run on one host (``bench_links.py`` does, before each sparse run).

Usage (from the repository root)::

    python benchmarks/bench_sparse_cpu.py                  # one process, torch's threads
    OMP_NUM_THREADS=1 python benchmarks/bench_sparse_cpu.py  # one core's: diloco plan's defaults
    python benchmarks/bench_sparse_cpu.py --concurrent 4   # each of 4 processes at once, one thread each

Last line::

    RESULT sparse_cpu params=N workers=8 threads=T concurrent=K cpu_rate=X entry_rate=X submit_s=X receive_one_s=X receive_all_s=X
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's diloco


@dataclass(frozen=True)
class CpuRates:
    #: Parameters per second of the passes over all of a worker's params (``model.DEFAULT_CPU_RATE``).
    cpu_rate: float
    #: Payload entries per second decoded and added into the sum (``model.DEFAULT_ENTRY_RATE``).
    entry_rate: float
    params: int
    workers: int
    threads: int
    submit_s: float
    receive_one_s: float
    receive_all_s: float


def _median(f, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_sparse_rates(params: int = 10_000_000, workers: int = 8, repeats: int = 5,
                         threads: int | None = None, start_at: float | None = None) -> CpuRates:
    """Time a worker's sparse round on about ``params`` parameters (4 square layers with biases) at
    diloco's default sparse format (module docstring), on ``threads`` threads (None: torch's own count,
    what a worker process uses unless OMP_NUM_THREADS says otherwise). ``start_at``: a wall-clock time
    to wait for once the model is built (``measure_concurrently``)."""
    import torch

    from diloco.wire import compression
    from diloco.wire.sparse import SparseFormat, SparseWire
    from diloco.worker.keeper import ReplicaKeeper

    if workers < 2:
        raise ValueError(f"workers must be at least 2 to tell the per-entry cost apart, got {workers}")
    before = torch.get_num_threads()
    threads = before if threads is None else threads
    torch.set_num_threads(threads)
    try:
        d = max(1, int((-1 + math.sqrt(1 + params)) / 2))  # 4 x (d*d + d) ~ params
        g = torch.Generator().manual_seed(0)
        model = {f"{i}.{w}": torch.nn.Parameter(torch.randn((d, d) if w == "weight" else (d,), generator=g))
                 for i in range(4) for w in ("weight", "bias")}
        keeper = ReplicaKeeper(model)
        for n, p in model.items():
            keeper.set_global(n, p.detach())
        names = list(model)
        wire = SparseWire(SparseFormat())
        total = sum(p.numel() for p in model.values())
        kept = sum(wire.fmt.kept(p.numel()) for p in model.values())
        if start_at is not None:
            time.sleep(max(0.0, start_at - time.time()))
        submits, enc = [], None
        for r in range(repeats):
            with torch.no_grad():  # what the round's training did (not timed)
                for p in model.values():
                    p.add_(1e-3)
            t0 = time.perf_counter()
            enc, _, _ = keeper.pseudo_gradient(0, r, names, "sparse", True, False, wire)
            submits.append(time.perf_counter() - t0)
        submit_s = statistics.median(submits)
        assert enc is not None

        def receive(m: int):
            result = compression.DeltaParams({n: torch.cat([enc.values[n]] * m) for n in names},
                                             {n: torch.cat([enc.scales[n]] * m) for n in names}, "sparse", wire)
            return lambda: keeper.install(names, result.resolve(keeper.global_, names, "measure"), True, False,
                                          False)

        one_s = _median(receive(1), repeats)
        all_s = _median(receive(workers), repeats)
    finally:
        torch.set_num_threads(before)
    entry_s = max(all_s - one_s, 1e-12) / ((workers - 1) * kept)
    param_s = max(submit_s + one_s - kept * entry_s, 1e-12) / total
    return CpuRates(1.0 / param_s, 1.0 / entry_s, total, workers, threads, submit_s, one_s, all_s)


#: Seconds the processes of ``measure_concurrently`` get to start (import torch, build the model) before
#: they all begin timing at once.
START_S = 15.0


def measure_concurrently(k: int, params: int = 10_000_000, workers: int = 8, repeats: int = 5) -> CpuRates:
    """``k`` measurements at once, one process each on one thread (module docstring), all timing over the
    same seconds; the median process's rates and times."""
    start_at = time.time() + START_S
    argv = [sys.executable, str(Path(__file__).resolve()), "--json", "--params", str(params), "--workers",
            str(workers), "--repeats", str(repeats), "--threads", "1", "--start-at", f"{start_at:.3f}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env) for _ in range(k)]
    outs = []
    for p in procs:
        out, _ = p.communicate()
        if p.returncode != 0:
            raise RuntimeError(f"a measuring process failed ({p.returncode})")
        outs.append(CpuRates(**json.loads(out)))
    median = {f: statistics.median(getattr(o, f) for o in outs)
              for f in ("cpu_rate", "entry_rate", "submit_s", "receive_one_s", "receive_all_s")}
    return CpuRates(params=outs[0].params, workers=workers, threads=1, **median)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=int, default=10_000_000, help="model parameters (default 10M)")
    p.add_argument("--workers", type=int, default=8, help="payloads in the larger receipt (default 8)")
    p.add_argument("--repeats", type=int, default=5, help="runs of each timing, the median taken (default 5)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default torch's own)")
    p.add_argument("--concurrent", type=int, default=1, metavar="K",
                   help="K processes at once, one thread each; their median (default 1: this process)")
    p.add_argument("--start-at", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.concurrent > 1:
        rates = measure_concurrently(args.concurrent, args.params, args.workers, args.repeats)
    else:
        rates = measure_sparse_rates(args.params, args.workers, args.repeats, args.threads, args.start_at)
    if args.json:
        print(json.dumps(asdict(rates)))
        return 0
    print(f"RESULT sparse_cpu params={rates.params} workers={rates.workers} threads={rates.threads} "
          f"concurrent={args.concurrent} cpu_rate={rates.cpu_rate:.3g} entry_rate={rates.entry_rate:.3g} "
          f"submit_s={rates.submit_s:.3f} receive_one_s={rates.receive_one_s:.3f} "
          f"receive_all_s={rates.receive_all_s:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
