"""Run ``diloco demo`` many times, several at once, to show it never stalls under load.

Each run is a separate ``python -m diloco demo`` process with its own output
folder, started ``--parallel`` at a time (two at a time on two cores means
every run competes for the CPU with another), killed by pid if it passes
``--timeout`` seconds. A run completes when it exits 0 with a RESULT line.
The summary says how many completed, their wall times, and how many distinct
RESULT lines they printed, leaving out ``paused_s`` (a wall-clock figure): the
same seed should print the same losses and counts.

Usage::

    python scripts/demo_soak.py                            # 10 full demos, two at a time (~25 min on 2 cores)
    python scripts/demo_soak.py --runs 20 -- --steps 120 --no-baselines   # 20 short ones
    python scripts/demo_soak.py --runs 2 --timeout 300     # a quick check

Arguments after ``--`` go to ``diloco demo``. The last line is::

    RESULT demo_soak completed=N runs=N failed=N timed_out=N max_wall_s=X median_wall_s=X distinct_results=N
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    demo_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, demo_args = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=10, help="demos to run (default 10)")
    p.add_argument("--parallel", type=int, default=2, help="demos at once (default 2)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before a run is killed (default 900)")
    args = p.parse_args(argv)
    if args.runs < 1 or args.parallel < 1 or not args.timeout > 0:
        p.error("--runs and --parallel must be >= 1 and --timeout > 0")

    root = Path(tempfile.mkdtemp(prefix="demo-soak-"))
    print(f"demo_soak: {args.runs} runs, {args.parallel} at a time, timeout {args.timeout:g} s, "
          f"demo args {demo_args or '(defaults)'}; logs in {root}", file=sys.stderr, flush=True)
    pending = list(range(args.runs))
    running: dict[int, tuple[subprocess.Popen, float, Path]] = {}
    walls: list[float] = []
    results: list[str] = []
    failed = timed_out = 0
    while pending or running:
        while pending and len(running) < args.parallel:
            i = pending.pop(0)
            log = root / f"run{i:02d}.log"
            cmd = [sys.executable, "-m", "diloco", "demo", "--out", str(root / f"out{i:02d}"), *demo_args]
            with log.open("w") as fh:
                proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT)
            running[i] = (proc, time.monotonic(), log)
        time.sleep(0.5)
        for i, (proc, t0, log) in list(running.items()):
            wall = time.monotonic() - t0
            if proc.poll() is None and wall <= args.timeout:
                continue
            if proc.poll() is None:
                proc.kill()  # by pid: this run's own process
                proc.wait()
                timed_out += 1
                status = f"TIMED OUT after {wall:.0f} s"
            else:
                result = [ln for ln in log.read_text(errors="replace").splitlines() if ln.startswith("RESULT demo ")]
                if proc.returncode == 0 and result:
                    walls.append(wall)
                    # paused_s is a wall-clock figure; the rest must repeat exactly for one seed.
                    results.append(re.sub(r" paused_s=\S+", "", result[-1]))
                    status = f"ok in {wall:.1f} s: {result[-1]}"
                else:
                    failed += 1
                    status = f"FAILED (exit {proc.returncode}) after {wall:.1f} s; see {log}"
            del running[i]
            print(f"run {i + 1}/{args.runs}: {status}", file=sys.stderr, flush=True)
    median = statistics.median(walls) if walls else float("nan")
    print(f"RESULT demo_soak completed={len(walls)} runs={args.runs} failed={failed} timed_out={timed_out} "
          f"max_wall_s={max(walls, default=float('nan')):.1f} median_wall_s={median:.1f} "
          f"distinct_results={len(set(results))}")
    return 0 if len(walls) == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
