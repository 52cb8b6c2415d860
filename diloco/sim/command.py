"""``diloco sim``: run seeded deterministic simulations, replay traces, swarm many seeds."""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from typing import TYPE_CHECKING

from diloco.argtypes import flag_value
from diloco.sim.config import (
    DATA_PLANES,
    FAULT_LEVELS,
    MAX_FRAGMENTS,
    MAX_GRACE_WINDOW_S,
    MAX_ROUNDS,
    MAX_WORKERS,
    OVERRIDE_NAMES,
    REDUCE_FAULT_KINDS,
    SHUTDOWN_KINDS,
    WIRE_DTYPES,
    derive_config,
)

if TYPE_CHECKING:  # diloco.sim.run loads the coordinator and torch: only when a run starts
    from diloco.sim.run import RunResult

EXIT_OK, EXIT_PROBLEM, EXIT_USAGE = 0, 1, 2

DESCRIPTION = """\
Simulate whole diloco runs, deterministically, from one seed (TigerBeetle VOPR style).

The seed derives every knob (worker count, min_workers, sync/async, fragments,
fault rates, timings, the shutdown at the end); flags override single knobs.
The real RoundFSM, Coordinator and worker session (WorkerSession) run
unchanged; time, the network (per-link FIFO, delays, partitions), the worker
processes around the session (no training) and the faults (crashes,
restarts, replacements, freezes, partitions, stragglers, coordinator
crash/restart from its last snapshot, min_workers changes, kicks) are
simulated. Hours of simulated time take seconds.

A run has a safety phase under faults, then a liveness phase: faults stop,
everything heals, and every fragment must apply another round within a stated
bound. A checker reads only the trace and verifies SPEC.md's invariants (I1
quorum safety, I2, I3, I4, I5, I6, I7, I11, I12), every outer step against an
independent Nesterov / Delayed Nesterov computation, every worker's params
against the coordinator's, and the workers' own rules (W5 train only with
nothing pending, W6 pause below quorum, W8 retry held_limit a heartbeat later).

--data-plane collective runs the coordinator on the collective plane (SPEC.md
C1-C7, sync only): the coordinator holds no model; each simulated worker keeps
a replica (the real diloco.collective.replica.Replica), all-reduces its
pseudo-gradient with its group over a simulated gloo (groups formed on the
coordinator's store, rebuilt when the prefix moves), proposes the outer step,
reports its digest and adopts it only on the commit; joiners heal from a
member. On top of the faults above, a member's reduce may be hit by one of
  REDUCE_FAULTS:
it dies inside the reduce, its report is lost, it reports another digest, its
collective fails, or its data plane wedges past the reduce timeout; a heal
fails when its source is gone. The checker then also verifies I13
(every commit is the open attempt's whole group, at least min_workers, each
confirming the committed digest), I14 (orders and aborts), C5 (a broken
attempt is not left open), C4 (no worker adopts an outer step that was not
committed, nor one it did not propose; one commit, one set of params), C6
(who starts the run, who heals from whom, and that a heal copies its source)
and "fork" (honest members of an attempt proposing different digests).

The seed is printed first, and again with the exact re-run command on any
failure. The last line is machine-readable:
  RESULT sim seed=N events=N applied_rounds=N trace_sha256=HEX violations=N
""".replace("REDUCE_FAULTS", ", ".join(REDUCE_FAULT_KINDS))

EPILOG = """\
examples:
  diloco sim --seed 7                                  one run, summary table
  diloco sim --seed 7 --workers 8 --faults heavy --trace run.jsonl --plot run.png
  diloco sim --replay run.jsonl                        re-run it; exit 1 at the first differing record
  diloco sim --swarm 200 --seed 1000 --jobs 2          seeds 1000..1199; report the failing seeds
  diloco sim --swarm 50 --data-plane collective        the collective data plane, 50 seeds
  diloco sim --swarm 20 --grace-window 1.5             async with a 1.5 s grace window, 20 seeds
  diloco sim --swarm 20 --grace-window auto            the window set from the arrivals (P5 checked at each length)

exit codes: 0 every invariant held (and a replay matched), 1 a violation, a crash or
a divergence (the seed is printed), 2 bad usage"""


def _int_in(name: str, low: int, high: int):
    return flag_value(int, lambda v: low <= v <= high, f"an integer in {low}..{high}", name)


def _float_in(name: str, low: float, high: float):
    return flag_value(float, lambda v: low <= v <= high, f"a number of seconds in {low:g}..{high:g}", name)


def _window(text: str):
    """``--grace-window``: seconds, or ``auto`` (each window from the arrivals, at most the ceiling)."""
    return "auto" if text == "auto" else _float_in("--grace-window", 0.0, MAX_GRACE_WINDOW_S)(text)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "sim", help="deterministic simulation: seeded runs, replay, swarms of seeds",
        description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    run = p.add_argument_group("one run (every knob not given comes from the seed)")
    run.add_argument("--seed", type=_int_in("--seed", 0, 2**63 - 1), metavar="N",
                     help="the seed (default: a random one, printed); with --swarm, the first seed")
    run.add_argument("--workers", type=_int_in("--workers", 1, MAX_WORKERS), metavar="K",
                     help="workers at the start")
    run.add_argument("--rounds", type=_int_in("--rounds", 1, MAX_ROUNDS), metavar="R",
                     help="outer steps (all fragments together) the safety phase runs for")
    run.add_argument("--faults", choices=FAULT_LEVELS, help="fault injection level")
    run.add_argument("--mode", choices=("sync", "async"), help="round mode")
    run.add_argument("--fragments", type=_int_in("--fragments", 1, MAX_FRAGMENTS), metavar="F",
                     help="Streaming DiLoCo fragments")
    run.add_argument("--shutdown", choices=SHUTDOWN_KINDS, help="how the run ends after the liveness phase")
    run.add_argument("--data-plane", choices=DATA_PLANES, dest="data_plane",
                     help="where rounds are combined: hub (default: the coordinator runs the outer step) or "
                          "collective (the workers all-reduce, propose and vote; sync only, so the seed's mode "
                          "is ignored; adds the reduce faults and the I13/I14/C4-C6 checks)")
    run.add_argument("--grace-window", type=_window, metavar="S|auto",
                     dest="grace_window",
                     help="async grace window in seconds (SPEC.md P5): contributions within S of the first "
                          "pending one merge into one outer step; auto: each window as long as the recent "
                          f"arrivals say, at most {MAX_GRACE_WINDOW_S:g} s; async only (the seed's mode is "
                          "ignored); adds the P5 checks (default 0: none)")
    run.add_argument("--worker-checkpoints", action="store_true", default=None, dest="worker_checkpoints",
                     help="every worker writes a checkpoint at each sync point it may (as --checkpoint-every 1), "
                          "a crashed worker restarts from its last one, and the checker holds every checkpoint's "
                          "round labels against the commits that made its state (SPEC.md M10)")
    run.add_argument("--wire-dtype", choices=WIRE_DTYPES, dest="wire_dtype",
                     help="what workers send (SPEC.md section 11): fp32 (default), or sparse -- each worker's "
                          "error-feedback accumulator, top-k of each chunk at 2 bits, the seed drawing chunk, k "
                          "and beta; sync on the hub plane (the seed's mode is ignored), plain SGD outside; adds "
                          "the accumulator checks (every payload recomputed from the worker's own accumulator, "
                          "no stale mass after a re-join or restart)")
    out = p.add_argument_group("output")
    out.add_argument("--trace", metavar="FILE.jsonl", help="write the trace (one JSON record per line)")
    out.add_argument("--plot", metavar="FILE.png", help="write the membership timeline (PNG)")
    modes = p.add_argument_group("other modes")
    modes.add_argument("--replay", metavar="FILE.jsonl",
                       help="re-run the seed and config a trace records and compare record by record")
    modes.add_argument("--swarm", type=_int_in("--swarm", 1, 1_000_000), metavar="N",
                       help="run N seeds (from --seed, default random) and report the failing ones")
    modes.add_argument("--jobs", type=_int_in("--jobs", 1, 64), default=1, metavar="J",
                       help="--swarm: processes to use (default 1)")
    p.set_defaults(handler=handle)


def _usage(msg: str):
    from diloco.exits import UsageError

    return UsageError(msg)


def _overrides(args) -> dict:
    return {k: getattr(args, k) for k in OVERRIDE_NAMES if getattr(args, k) is not None}


def _rerun_command(seed: int, overrides: dict, extra: str = "") -> str:
    flags = "".join(f" --{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in overrides.items())
    return f"diloco sim --seed {seed}{flags}{extra}"


def handle(args) -> int:
    if args.data_plane == "collective" and args.mode == "async":
        raise _usage("--data-plane collective is sync only (SPEC.md C1): drop --mode async")
    if args.grace_window and (args.mode == "sync" or args.data_plane == "collective"):
        raise _usage("--grace-window is async only (SPEC.md P5): drop --mode sync / --data-plane collective")
    if args.replay is not None:
        given = [f"--{k.replace('_', '-')}" for k in ("seed",) + OVERRIDE_NAMES if getattr(args, k) is not None]
        if args.swarm is not None:
            given.append("--swarm")
        if args.trace is not None:
            given.append("--trace")
        if given:
            raise _usage(f"--replay takes the seed and config from the trace; drop {', '.join(given)}")
        if not os.path.isfile(args.replay):
            raise _usage(f"--replay {args.replay!r}: no such file")
        return _replay(args)
    if args.plot is not None and not args.plot.lower().endswith(".png"):
        raise _usage(f"--plot {args.plot!r}: the file name must end in .png")
    if args.jobs != 1 and args.swarm is None:
        raise _usage("--jobs only applies to --swarm")
    if args.swarm is not None:
        if args.trace is not None or args.plot is not None:
            raise _usage("--trace and --plot write one run; re-run a failing seed of the swarm alone with them")
        return _swarm(args)
    for path, flag in ((args.trace, "--trace"), (args.plot, "--plot")):
        if path is not None:
            parent = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(parent):
                raise _usage(f"{flag} {path!r}: directory {parent!r} does not exist")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    overrides = _overrides(args)
    print(f"seed={seed}", flush=True)
    cfg = derive_config(seed, **overrides)
    print(f"config: {cfg.describe()}", flush=True)
    from diloco.sim.run import run_config

    result = run_config(cfg, trace_path=args.trace, plot_path=args.plot)
    for line in format_summary(result):
        print(line)
    if not result.ok:
        extra = "".join(f" --{k} {v}" for k, v in (("trace", args.trace or "run.jsonl"),
                                                   ("plot", args.plot or "run.png")))
        print(f"seed={seed} FAILED ({result.violation_count} violation(s)); re-run: "
              f"{_rerun_command(seed, overrides, extra)}")
    print(result_line(result))
    return EXIT_OK if result.ok else EXIT_PROBLEM


def result_line(r: RunResult) -> str:
    return (f"RESULT sim seed={r.cfg.seed} events={r.stats.events} applied_rounds={r.applied_rounds} "
            f"trace_sha256={r.trace_sha256} violations={r.violation_count}")


def format_summary(r: RunResult) -> list[str]:
    s, c, cfg = r.stats, r.counts, r.cfg
    rate = s.events / r.wall_s if r.wall_s > 0 else 0.0
    rows: list[tuple[str, str]] = []
    phases = f"safety until {s.heal_at_s:.1f} s" if s.heal_at_s is not None else "safety phase only"
    if s.liveness_s is not None:
        phases += f"; liveness: every fragment applied {s.liveness_s:.1f} s after the heal (bound " \
                  f"{cfg.liveness_bound_s:.1f} s)"
    rows.append(("simulated time", f"{s.sim_time_s:,.1f} s ({phases})"))
    rows.append(("events", f"{s.events:,} in {r.wall_s:.2f} s wall ({rate:,.0f} events/s); {r.records:,} trace records"))
    rows.append(("messages", f"{s.messages_sent:,} sent, {s.messages_delivered:,} delivered, "
                             f"{s.messages_dropped:,} dropped"))
    rolled = c.get("rolled_back_rounds", 0)
    rows.append(("applied rounds", f"{c.get('applied_rounds', s.applied):,}"
                                   + (f" ({rolled} rolled back by coordinator restarts)" if rolled else "")
                                   + f"; {s.worker_rounds:,} worker-rounds; "
                                     f"{c.get('outer_steps_checked', 0):,} outer steps recomputed"))
    rows.append(("contributions", f"{c.get('accepted', 0):,} accepted: {c.get('applied_contributions', 0):,} applied, "
                                  f"{c.get('discarded_at_stop', 0)} discarded at the stop, "
                                  f"{c.get('lost_with_crash', 0)} lost with a coordinator crash, "
                                  f"{c.get('pending_at_end', 0)} pending at the end"))
    rows.append(("membership", f"{c.get('joins', 0)} joins, {c.get('deaths', 0)} declared dead, "
                               f"{c.get('leaves', 0)} left or kicked"))
    faults = ", ".join(f"{k} {v}" for k, v in sorted(s.faults.items())) or "none"
    rows.append(("faults", faults))
    rows.append(("coordinator", f"{c.get('coordinator_crashes', 0)} crashes, {c.get('snapshots', 0)} snapshots"))
    if cfg.collective:
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(c.get("abort_reasons", {}).items())) or "none"
        rows.append(("collective", f"{c.get('reduce_orders', 0):,} orders, {c.get('commits', 0):,} commits, "
                                   f"{c.get('reduce_aborts', 0):,} aborts ({reasons}); {c.get('reports', 0):,} "
                                   f"reports; adopted {c.get('adopt_commit', 0):,} commits, "
                                   f"{c.get('adopt_heal', 0):,} heals, {c.get('adopt_start', 0):,} starts"))
    end = s.end_reason
    if s.stop_at_s is not None:
        end += f" ({cfg.shutdown}{', while paused' if cfg.shutdown_paused else ''}) at {s.stop_at_s:,.1f} s"
    rows.append(("end", end))
    if r.divergence is not None:
        rows.append(("replay", "DIVERGED"))
    verdict = "all hold" if r.violation_count == 0 else f"{r.violation_count} VIOLATION(S)"
    checked = "I1 I2 I3 I4 I5 I6 I7 I11 I12 I13 I14, C4 C5 C6, W5 W6 W8" if cfg.collective else \
        "I1 I2 I3 I4 I5 I6 I7 I11 I12, W5 W6 W8, outer steps, params"
    if cfg.grace_window_s:
        checked += f", P5{' auto (' + format(c.get('windows_changed', 0), ',') + ' lengths set)' if cfg.grace_auto else ''}"
    if cfg.sparse:
        checked += f", sparse accumulators ({c.get('payloads_checked', 0):,} payloads)"
    if cfg.worker_checkpoints:
        checked += f", M10 ({c.get('checkpoints_checked', 0):,} checkpoints)"
    rows.append(("invariants", f"{verdict} ({checked})"))
    if r.plot_path:
        rows.append(("plot", r.plot_path))
    width = max(len(k) for k, _ in rows)
    lines = [f"  {k:<{width}}  {v}" for k, v in rows]
    if s.error:
        lines.append("crash:")
        lines.extend("  " + ln for ln in s.error.rstrip().splitlines())
    if r.violations:
        lines.append(f"violations ({r.violation_count}, first {min(len(r.violations), 20)}):")
        lines.extend(f"  {v}" for v in r.violations[:20])
    return lines


def _replay(args) -> int:
    from diloco.sim.run import replay_trace

    try:
        result = replay_trace(args.replay)
    except (ValueError, KeyError, TypeError) as exc:
        raise _usage(f"--replay {args.replay!r}: {exc}") from None
    print(f"seed={result.cfg.seed}", flush=True)
    print(f"replay: {args.replay} ({result.cfg.describe()})")
    for line in format_summary(result):
        print(line)
    if result.divergence is not None:
        print(result.divergence.describe())
        print(f"seed={result.cfg.seed} REPLAY DIVERGED")
    else:
        print(f"replay: identical, {result.records:,} records")
    if result.violation_count:
        print(f"seed={result.cfg.seed} FAILED ({result.violation_count} violation(s))")
    print(result_line(result))
    return EXIT_OK if result.ok else EXIT_PROBLEM


def _swarm_one(item):
    seed, overrides = item
    from diloco.sim.run import run_config

    try:
        r = run_config(derive_config(seed, **overrides))
    except Exception as exc:  # noqa: BLE001 - a crash of one seed is a failure of that seed
        return seed, False, f"crash: {type(exc).__name__}: {exc}", "", 0, 0.0, ""
    first = str(r.violations[0]) if r.violations else (r.stats.error.strip().splitlines()[-1] if r.stats.error else "")
    desc = ("coll " if r.cfg.collective else "") + \
        f"{r.cfg.mode:<5} w={r.cfg.workers:<3} min={r.cfg.min_workers:<3} f={r.cfg.num_fragments} " \
           f"faults={r.cfg.faults:<5} end={r.cfg.shutdown}"
    return seed, r.ok, first, desc, r.stats.events, r.wall_s, r.trace_sha256


def _swarm(args) -> int:
    start = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    overrides = _overrides(args)
    n = args.swarm
    print(f"seed={start}", flush=True)
    print(f"swarm: {n} seeds from {start}" + (f" with {overrides}" if overrides else "")
          + f", {args.jobs} job(s)", flush=True)
    items = [(start + i, overrides) for i in range(n)]
    t0 = time.perf_counter()
    failed: list[tuple[int, str]] = []
    events = 0

    def report(i, res):
        nonlocal events
        seed, ok, first, desc, ev, wall, _sha = res
        events += ev
        status = "ok" if ok else "FAIL"
        print(f"[{i:>{len(str(n))}}/{n}] seed={seed} {desc} events={ev} {status} {wall:.1f}s", flush=True)
        if not ok:
            failed.append((seed, first))
            print(f"    {first}", flush=True)

    if args.jobs > 1:
        import multiprocessing

        ctx = multiprocessing.get_context("fork" if sys.platform != "win32" else "spawn")
        with ctx.Pool(args.jobs) as pool:
            for i, res in enumerate(pool.imap(_swarm_one, items), 1):
                report(i, res)
    else:
        for i, item in enumerate(items, 1):
            report(i, _swarm_one(item))
    wall = time.perf_counter() - t0
    print(f"swarm: {n} seeds, {len(failed)} failed, {events:,} events in {wall:.1f} s")
    for seed, first in failed:
        print(f"  seed={seed}: {first}")
        print(f"    re-run: {_rerun_command(seed, overrides, ' --trace run.jsonl --plot run.png')}")
    print(f"RESULT sim_swarm seeds={n} failed={len(failed)} failing_seeds="
          f"{','.join(str(s) for s, _ in failed) or '-'}")
    return EXIT_OK if not failed else EXIT_PROBLEM
