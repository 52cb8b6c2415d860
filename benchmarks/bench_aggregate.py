"""Benchmark: what the overflow-proof running sum and the post-step check cost the coordinator.

What it measures
----------------
One 10M-parameter fp32 fragment (12 tensors, as in bench_transport: four of
2.25M and eight of 125k elements) and 4 contributions, in-process, no network:

* **fp32 sum**: the old running sum -- copy the first contribution, ``add_``
  the others in fp32, ``div_`` by the count. Four finite contributions near
  fp32's largest value sum to inf this way.
* **scaled sum**: ``ParamStore.accumulate`` for each contribution and
  ``ParamStore.take_mean`` -- an fp32 sum of the contributions times 2^-20, so
  that it cannot overflow (what the coordinator does now; SPEC.md section 12,
  "Aggregation"). An earlier float64 sum cost about 3x the fp32 one.
* **outer step**: ``torch.optim.SGD(nesterov)`` stepping the fragment on that
  mean, for scale.
* **post-step check**: what ``Coordinator._apply`` adds around the step --
  clone the params, deep-copy the optimizer state, ``all_finite`` on every
  param afterwards (SPEC.md section 12, "Non-finite steps").

Repetitions are interleaved (every variant in each repetition) and the
median kept. The process applies the malloc tuning ``diloco server`` applies
(``diloco.deploy.tuning.keep_freed_memory``), as the coordinator runs with it.

Run it::

    python benchmarks/bench_aggregate.py           # 15 repetitions, about 30 s
    python benchmarks/bench_aggregate.py --quick   # 5 repetitions

The last line printed is machine-readable::

    RESULT bench_aggregate fp32_sum_ms=X safe_sum_ms=X safe_sum_ratio=R step_ms=X check_ms=X check_ratio=R
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from diloco.coordinator.params import ParamStore, all_finite
from diloco.deploy.tuning import keep_freed_memory


def make_tensors(num_params: int, seed: int) -> dict[str, torch.Tensor]:
    """12 tensors: four of 22.5% and eight of 1.25% of ``num_params`` (the rest in the last)."""
    g = torch.Generator().manual_seed(seed)
    big, small = int(num_params * 0.225), int(num_params * 0.0125)
    sizes = [big] * 4 + [small] * 8
    sizes[-1] += num_params - sum(sizes)
    return {f"t{i}": torch.randn(n, generator=g) * 1e-3 for i, n in enumerate(sizes)}


def fp32_sum(contributions: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The old scheme: an fp32 running sum, divided in place."""
    s = {n: t.to(torch.float32).clone() for n, t in contributions[0].items()}
    for c in contributions[1:]:
        for n, t in c.items():
            s[n].add_(t)
    for t in s.values():
        t.div_(len(contributions))
    return s


def safe_sum(store: ParamStore, contributions: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    for c in contributions:
        store.accumulate(0, c)
    return store.take_mean(0, len(contributions))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=int, default=10_000_000, help="fragment size in fp32 parameters (default 10M)")
    ap.add_argument("--contributions", type=int, default=4, help="contributions per round (default 4)")
    ap.add_argument("--reps", type=int, default=None, help="interleaved repetitions, median kept (default 15; quick 5)")
    ap.add_argument("--quick", action="store_true", help="5 repetitions")
    args = ap.parse_args(argv)
    reps = args.reps or (5 if args.quick else 15)
    tuned = keep_freed_memory()
    torch.set_num_threads(1)  # the coordinator's work is memory-bound; one thread, as on a loaded box

    params = make_tensors(args.params, 0)
    contributions = [make_tensors(args.params, 1 + i) for i in range(args.contributions)]
    store = ParamStore(params, 1)
    live = store.fragment_params(0)
    opt = torch.optim.SGD(list(live.values()), lr=0.7, momentum=0.9, nesterov=True)

    # Both schemes give the same mean up to fp32 rounding of the sum.
    a, b = fp32_sum(contributions), safe_sum(store, contributions)
    worst = max(float((a[n] - b[n]).abs().max()) for n in a)
    assert worst < 1e-9, worst
    huge = [{n: torch.full_like(t, 3e38) for n, t in c.items()} for c in contributions[:2]]
    assert not all_finite(fp32_sum(huge)["t0"]) and all_finite(safe_sum(store, huge)["t0"])

    times: dict[str, list[float]] = {k: [] for k in ("fp32_sum", "safe_sum", "step", "check")}

    def step(mean):
        for n, p in live.items():
            p.grad = mean[n]
        opt.step()
        for p in live.values():
            p.grad = None

    step(safe_sum(store, contributions))  # the optimizer's state exists from here on
    for _ in range(reps):
        t0 = time.perf_counter()
        fp32_sum(contributions)
        times["fp32_sum"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        mean = safe_sum(store, contributions)
        times["safe_sum"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        before = {n: p.detach().clone() for n, p in live.items()}
        opt_before = copy.deepcopy(opt.state_dict())
        t1 = time.perf_counter()
        step(mean)
        t2 = time.perf_counter()
        ok = all(all_finite(p) for p in live.values())
        t3 = time.perf_counter()
        assert ok
        del before, opt_before
        times["step"].append(t2 - t1)
        times["check"].append((t1 - t0) + (t3 - t2))

    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"fragment of {args.params:,} fp32 params (12 tensors), {args.contributions} contributions, "
          f"{reps} interleaved repetitions, medians; malloc tuning {'on' if tuned else 'off'}")
    print(f"  {'fp32 running sum + mean':32} {med['fp32_sum']:8.1f} ms")
    print(f"  {'scaled fp32 running sum + mean':32} {med['safe_sum']:8.1f} ms   "
          f"x{med['safe_sum'] / med['fp32_sum']:.2f}")
    print(f"  {'outer step (Nesterov)':32} {med['step']:8.1f} ms")
    print(f"  {'post-step check (copies+finite)':32} {med['check']:8.1f} ms   "
          f"x{med['check'] / med['step']:.2f} of the step")
    print(f"RESULT bench_aggregate fp32_sum_ms={med['fp32_sum']:.1f} safe_sum_ms={med['safe_sum']:.1f} "
          f"safe_sum_ratio={med['safe_sum'] / med['fp32_sum']:.2f} step_ms={med['step']:.1f} "
          f"check_ms={med['check']:.1f} check_ratio={med['check'] / med['step']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
