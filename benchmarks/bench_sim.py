"""Benchmark: how fast the deterministic simulator runs whole diloco runs.

What it measures
----------------
1. **The big run**: 1,000 workers x 100 outer rounds, sync, one fragment, no
   faults, seed 8 (``diloco sim --seed 8 --workers 1000 --rounds 100 --faults
   none --mode sync --fragments 1 --shutdown none``): the real ``Coordinator``
   and ``RoundFSM`` drive 1,000 simulated workers, each running the real
   ``WorkerSession``; every message, observer event and state change is
   traced (serialised to JSON and hashed, not written to a file) and checked
   online by the trace checker. Seed 8 has a median ratio
   of training time to heartbeat interval among seeds (about 9 heartbeats per
   worker per round; a real run with H = 500 steps of 0.15 s and 7.5 s
   heartbeats has about 10), no stragglers and little speed spread.
   Goal: under 60 s of wall time.
2. **The mix**: the first ``--mix`` seeds of the CI swarm (small runs, mixed
   modes, faults and shutdowns), for events per second on faulty runs.

``events`` are the simulator's discrete events (message deliveries and
timers); ``worker-rounds`` are contributions applied (the sum of every applied
round's contributors). Wall time and CPU time (``time.process_time``) are both
reported: on a shared machine wall time also counts other processes.

Run it::

    python benchmarks/bench_sim.py              # the big run and a 40-seed mix (about 1-2 minutes)
    python benchmarks/bench_sim.py --quick      # 200 workers x 20 rounds, 10 seeds
    python benchmarks/bench_sim.py --profile    # also cProfile a 1,000 x 5 run, by component

The last line printed is machine-readable::

    RESULT bench_sim events_per_s=N worker_rounds_per_s=N big_run_wall_s=S big_run_cpu_s=S mix_events_per_s=N
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import sys
import time

from diloco.sim import derive_config, run_config

GOAL_EVENTS_PER_S = 50_000
GOAL_BIG_RUN_S = 60.0
BIG_SEED = 8


def _run(cfg):
    c0 = time.process_time()
    r = run_config(cfg)
    cpu = time.process_time() - c0
    return r, cpu


def big_run(workers: int, rounds: int):
    cfg = derive_config(BIG_SEED, workers=workers, rounds=rounds, faults="none", mode="sync", fragments=1,
                        shutdown="none")
    r, cpu = _run(cfg)
    return cfg, r, cpu


def mix(n: int):
    events = wall = cpu = 0.0
    failed = []
    for seed in range(n):
        r, c = _run(derive_config(seed))
        events += r.stats.events
        wall += r.wall_s
        cpu += c
        if not r.ok:
            failed.append(seed)
    return events, wall, cpu, failed


def profile(workers: int, rounds: int) -> None:
    cfg = derive_config(BIG_SEED, workers=workers, rounds=rounds, faults="none", mode="sync", fragments=1,
                        shutdown="none")
    prof = cProfile.Profile()
    prof.enable()
    run_config(cfg)
    prof.disable()
    stats = pstats.Stats(prof)
    by = collections.Counter()
    for (path, _line, _fn), (_cc, _nc, tt, _ct, _callers) in stats.stats.items():
        if "diloco/" in path:
            key = "diloco/" + path.split("diloco/")[-1]
        elif "torch" in path:
            key = "torch"
        elif path == "~":
            key = "builtins (dicts, heapq, hashlib, json C code)"
        else:
            key = "stdlib " + path.rsplit("/", 1)[-1]
        by[key] += tt
    total = sum(by.values())
    print(f"\nprofile of a {workers} x {rounds} run: self time by component")
    for key, t in by.most_common(14):
        print(f"  {100 * t / total:5.1f}%  {key}")
    print("\ntop functions by self time:")
    stats.sort_stats("tottime").print_stats(18)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="200 workers x 20 rounds and 10 seeds")
    ap.add_argument("--workers", type=int, default=None, help="workers in the big run (default 1000)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds in the big run (default 100)")
    ap.add_argument("--mix", type=int, default=None, help="seeds in the mix (default 40)")
    ap.add_argument("--profile", action="store_true", help="cProfile a 1,000-worker run, 5 rounds")
    args = ap.parse_args(argv)
    workers = args.workers or (200 if args.quick else 1000)
    rounds = args.rounds or (20 if args.quick else 100)
    n_mix = args.mix if args.mix is not None else (10 if args.quick else 40)

    # Warm-up: the first torch optimizer a process builds costs seconds (imports); not the simulator's.
    run_config(derive_config(2, workers=3, rounds=2, faults="none"))

    cfg, r, cpu = big_run(workers, rounds)
    s = r.stats
    ev_s = s.events / r.wall_s
    wr_s = s.worker_rounds / r.wall_s
    hb_per_round = cfg.train_s * cfg.speed_spread / cfg.heartbeat_interval_s
    print(f"big run: seed {BIG_SEED}, {workers} workers x {rounds} rounds, sync, 1 fragment, no faults")
    print(f"  config            heartbeat every {cfg.heartbeat_interval_s:.2f} s, segments {cfg.train_s:.1f}-"
          f"{cfg.train_s * cfg.speed_spread * 1.1:.1f} s (about {hb_per_round:.0f} heartbeats per worker-round)")
    print(f"  simulated         {s.sim_time_s:,.0f} s, {r.applied_rounds} rounds applied, {s.worker_rounds:,} worker-rounds")
    print(f"  events            {s.events:,} ({s.events / max(1, s.worker_rounds):.1f} per worker-round); "
          f"{r.records:,} trace records; {s.messages_delivered:,} messages delivered")
    print(f"  time              wall {r.wall_s:.1f} s, cpu {cpu:.1f} s")
    print(f"  rate              {ev_s:,.0f} events/s, {wr_s:,.0f} worker-rounds/s (wall); "
          f"{s.events / cpu:,.0f} events/s (cpu)")
    print(f"  invariants        {'all hold' if r.ok else f'{r.violation_count} VIOLATIONS'}")
    if not r.ok:
        for v in r.violations[:5]:
            print(f"    {v}")

    mix_rate = 0.0
    if n_mix:
        events, wall, mcpu, failed = mix(n_mix)
        mix_rate = events / wall
        print(f"mix: seeds 0..{n_mix - 1} (derived configs, faults and shutdowns as the seeds say)")
        print(f"  {events:,.0f} events in {wall:.1f} s wall, {mcpu:.1f} s cpu: {mix_rate:,.0f} events/s (wall), "
              f"{events / mcpu:,.0f} (cpu); failing seeds: {failed or 'none'}")

    big_goal = workers == 1000 and rounds == 100
    print("goals:")
    print(f"  events/s >= {GOAL_EVENTS_PER_S:,}: {ev_s:,.0f} -> {'goal met' if ev_s >= GOAL_EVENTS_PER_S else 'goal MISSED'}")
    if big_goal:
        print(f"  1,000 x 100 under {GOAL_BIG_RUN_S:.0f} s: {r.wall_s:.1f} s -> "
              f"{'goal met' if r.wall_s < GOAL_BIG_RUN_S else 'goal MISSED'}")
    if args.profile:
        profile(1000, 5)
    print(f"RESULT bench_sim events_per_s={ev_s:.0f} worker_rounds_per_s={wr_s:.0f} big_run_wall_s={r.wall_s:.1f} "
          f"big_run_cpu_s={cpu:.1f} mix_events_per_s={mix_rate:.0f}")
    return 0 if r.ok else 1


if __name__ == "__main__":
    sys.exit(main())
