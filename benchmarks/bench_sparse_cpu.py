"""The CPU rates of a sparse round's own work on this machine (``diloco plan --measure-cpu``).

A sparse sync costs each worker CPU time beside its link time (``diloco.planner.model``, "The sparse
wire's CPU work"). This times the real code a worker runs in a round, on a synthetic model, and
splits it into the two rates the model takes:

* a **submit**: ``ReplicaKeeper.pseudo_gradient`` with error feedback -- global - local, the
  accumulator's decay, the norm, the chunk-wise top-k encode, its own payload taken out of the
  accumulator;
* a **receipt** of a Result carrying ``M`` payloads: ``DeltaParams.resolve`` (each payload checked,
  decoded and added into zeros, the step, the finiteness check) and ``ReplicaKeeper.install``.

A receipt is timed with 1 and with ``workers`` payloads: the difference is the per-entry cost
(``entry_rate``, payload entries decoded and added per second); what is left of a submit and a
one-payload receipt, less that one payload's entries, is the per-parameter cost (``cpu_rate``,
parameters per second). Each time is the best of ``repeats`` runs.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass


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


def _best(f, repeats: int) -> float:
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_sparse_rates(params: int = 10_000_000, workers: int = 8, repeats: int = 3,
                         threads: int | None = None) -> CpuRates:
    """Time a worker's sparse round on about ``params`` parameters (4 square layers with biases) at
    diloco's default sparse format (module docstring), on ``threads`` threads (None: torch's own count,
    what a worker process uses unless OMP_NUM_THREADS says otherwise)."""
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
        submit_s, enc = math.inf, None
        for r in range(repeats):
            with torch.no_grad():  # what the round's training did (not timed)
                for p in model.values():
                    p.add_(1e-3)
            t0 = time.perf_counter()
            enc, _, _ = keeper.pseudo_gradient(0, r, names, "sparse", True, False, wire)
            submit_s = min(submit_s, time.perf_counter() - t0)
        assert enc is not None

        def receive(m: int):
            result = compression.DeltaParams({n: torch.cat([enc.values[n]] * m) for n in names},
                                             {n: torch.cat([enc.scales[n]] * m) for n in names}, "sparse", wire)
            return lambda: keeper.install(names, result.resolve(keeper.global_, names, "measure"), True, False,
                                          False)

        one_s = _best(receive(1), repeats)
        all_s = _best(receive(workers), repeats)
    finally:
        torch.set_num_threads(before)
    entry_s = max(all_s - one_s, 1e-12) / ((workers - 1) * kept)
    param_s = max(submit_s + one_s - kept * entry_s, 1e-12) / total
    return CpuRates(1.0 / param_s, 1.0 / entry_s, total, workers, threads, submit_s, one_s, all_s)
