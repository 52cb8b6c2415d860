"""Benchmark: what making every round durable costs the coordinator (SPEC.md section 5).

What it measures
----------------
A real ``Coordinator`` with a 10M-parameter fp32 model (12 tensors, as in
bench_transport and bench_aggregate: four of 2.25M and eight of 125k
elements), the default outer optimizer (SGD Nesterov, so a 40 MB momentum
buffer too: 80 MB per checkpoint), one worker applying a round per
submission. After each applied round it times what ``runner.serve`` does
before sending that round's Results when ``--checkpoint-dir`` is set:

* **write**: ``save_coordinator`` -- the sha256 of every tensor, then
  ``safetensors.torch.save_file`` straight from the live tensors to a
  temporary name, fsync of the file, rename, fsync of the folder, and the
  keep-3 rotation (a delete per round once three files exist);
* **audit**: appending the round's line to ``events.jsonl`` and its fsync.

It reports the median and the 90th percentile over the rounds, and the
share of a round: of bench_training's real round (~5 s at H=10, see
README.md) and of bench_transport's outer step (the ZeroMQ exchange of
Submits and Results, ~0.2 s), both given as options.

Run it::

    python benchmarks/bench_durable.py            # 20 rounds
    python benchmarks/bench_durable.py --quick    # 5 rounds

The last line printed is machine-readable::

    RESULT bench_durable params=N write_ms=X write_p90_ms=X audit_ms=X share_of_round=R share_of_outer_step=R
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diloco.coordinator import Coordinator, CoordinatorConfig  # noqa: E402
from diloco.coordinator.audit import AuditLog, Tee  # noqa: E402
from diloco.coordinator.checkpoint import save_coordinator  # noqa: E402
from diloco.core import FSMConfig  # noqa: E402
from diloco.deploy.tuning import keep_freed_memory  # noqa: E402
from diloco.wire.messages import PROTOCOL_VERSION, Join, Submit, spec_of  # noqa: E402


def make_params(num_params: int) -> dict[str, torch.Tensor]:
    big, small = int(num_params * 0.225), int(num_params * 0.0125)
    g = torch.Generator().manual_seed(0)
    out = {f"big{i}.weight": torch.randn(big, generator=g) for i in range(4)}
    out.update({f"small{i}.weight": torch.randn(small, generator=g) for i in range(8)})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=int, default=10_000_000)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="5 rounds")
    ap.add_argument("--round-s", type=float, default=5.0, help="a real round's seconds (bench_training, H=10)")
    ap.add_argument("--outer-step-s", type=float, default=0.2, help="bench_transport's outer_step_s")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    args = ap.parse_args(argv)
    rounds = 5 if args.quick else args.rounds
    keep_freed_memory()

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        ck = Path(tmp)
        audit = AuditLog(ck)
        c = Coordinator(CoordinatorConfig(fsm=FSMConfig(min_workers=1)), 0.0, observer=Tee(audit))
        audit.attach(c)
        params = make_params(args.params)
        c.handle("p", Join("w1", PROTOCOL_VERSION, spec_of(params), params), 1.0)
        grad = {n: torch.full_like(t, 1e-3) for n, t in params.items()}
        writes, audits, steps = [], [], []
        for r in range(rounds + 1):
            t0 = time.perf_counter()
            c.handle("p", Submit("w1", 0, r, grad), 2.0 + r)
            t1 = time.perf_counter()
            save_coordinator(c, ck, keep=3)
            t2 = time.perf_counter()
            audit.flush()
            t3 = time.perf_counter()
            if r:  # the first round pays one-time costs (imports, first file)
                steps.append(t1 - t0)
                writes.append(t2 - t1)
                audits.append(t3 - t2)
        audit.close()
        size_mb = sum(p.stat().st_size for p in ck.glob("coordinator-*.safetensors")) / 3 / 1e6

    write, audit_s = statistics.median(writes), statistics.median(audits)
    p90 = sorted(writes)[int(0.9 * (len(writes) - 1))]
    total = write + audit_s
    print(f"{args.params:,} params, checkpoint {size_mb:.1f} MB, {rounds} rounds")
    print(f"apply (in-process handle of the Submit): median {statistics.median(steps) * 1e3:.1f} ms")
    print(f"write: median {write * 1e3:.1f} ms, p90 {p90 * 1e3:.1f} ms, min {min(writes) * 1e3:.1f} ms, "
          f"max {max(writes) * 1e3:.1f} ms; audit line: median {audit_s * 1e3:.2f} ms")
    print(f"share of a {args.round_s:g} s round: {total / args.round_s:.1%}; "
          f"of a {args.outer_step_s:g} s outer step: {total / args.outer_step_s:.0%}")
    print(f"RESULT bench_durable params={args.params} write_ms={write * 1e3:.1f} write_p90_ms={p90 * 1e3:.1f} "
          f"audit_ms={audit_s * 1e3:.2f} share_of_round={total / args.round_s:.4f} "
          f"share_of_outer_step={total / args.outer_step_s:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
