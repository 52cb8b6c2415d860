"""Benchmark: events per second of ``RoundFSM.step`` under a realistic event mix.

What it measures
----------------
A sync run with one fragment and ``min_workers = N // 2`` at N = 8, 1,000 and
10,000 workers, in steady state (all N workers joined before the clock
starts). The timed event list is mostly ``HeartbeatSeen``, plus
``ContributionSubmitted`` for the open round (so rounds complete and apply),
``Ticked`` advancing the clock slowly enough that no live worker times out,
and occasional ``WorkerLeft`` deaths with ``WorkerJoined`` replacements (so
membership churns). The mix is the same at every N, so the time per event is
comparable across sizes: SPEC.md R13 wants the per-event path O(1) in the
number of workers.

The event list is generated up front from a seeded ``random.Random`` by a
shadow model of the sync rules (who is live, the open round id, who has
contributed), then replayed once through a real ``RoundFSM`` untimed to prove
it is valid: no ``Reject``, no ``DeclareDead``, and the same number of applied
rounds as the shadow predicted. Only the replay loop is timed.

The "floor" replays the same list through the least bookkeeping that could
do the job -- a last-seen dict, a contributed set per round with the
completion and quorum check, membership add/remove -- with no effects, no
validation and no last-seen ordering. ``core_vs_floor`` says how much the
core's contract (effects, reason codes, O(1) timeouts, phases) costs on top.

Each figure is the best (minimum) of several repetitions, with the garbage
collector off during the timed loop (as ``timeit`` does); timings on a shared
machine are noisy and the minimum is the least noisy estimate. Repetitions
are interleaved across sizes and between core and floor, so a burst of
outside load does not skew one side of a ratio.

Run it::

    python benchmarks/bench_fsm.py            # full run (well under 2 minutes)
    python benchmarks/bench_fsm.py --quick    # a few seconds, rougher figures
    python benchmarks/bench_fsm.py --profile  # also cProfile the 10,000-worker replay

The last line printed is machine-readable::

    RESULT bench_fsm events_per_s_8=N events_per_s_1000=N events_per_s_10000=N cost_ratio_10000_vs_8=R core_vs_floor=R

About 450 lines: one benchmark is one file, run and read top to bottom; the
event mix, its generator and the report share one setup, and this docstring is
a good part of it.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import random
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from diloco.core import (
    AcceptContribution,
    AcceptJoin,
    ApplyRound,
    ContributionSubmitted,
    DiscardContribution,
    FSMConfig,
    HeartbeatSeen,
    LeaveCause,
    Mode,
    ReleaseWorker,
    RoundFSM,
    Ticked,
    WorkerJoined,
    WorkerLeft,
)

SIZES = (8, 1_000, 10_000)
HEARTBEAT_TIMEOUT_S = 30.0

# The event mix (fractions of the timed events). A worker sends about 8-9
# heartbeats per submission, i.e. per round, at every N.
P_HEARTBEAT = 0.86
P_SUBMIT = 0.10
P_TICK = 0.03
P_LEAVE = 0.005
P_JOIN = 0.005
assert abs(P_HEARTBEAT + P_SUBMIT + P_TICK + P_LEAVE + P_JOIN - 1.0) < 1e-9

# Goals (see benchmarks/README.md).
GOAL_EVENTS_PER_S_10000 = 200_000
GOAL_COST_RATIO = 1.5
GOAL_CORE_VS_FLOOR = 8.0

# Effects a valid steady-state run may produce; anything else (Reject,
# DeclareDead, QuorumChanged, PhaseChanged, StopRun) means the list is wrong.
EXPECTED_EFFECTS = (AcceptContribution, AcceptJoin, ApplyRound, ReleaseWorker, DiscardContribution)


@dataclass
class Workload:
    n_workers: int
    min_workers: int
    #: Untimed: the joins that bring the run to steady state.
    setup: list
    #: Timed.
    events: list
    #: Rounds the shadow model says the timed events apply.
    rounds: int
    counts: dict[str, int] = field(default_factory=dict)

    def config(self) -> FSMConfig:
        return FSMConfig(
            min_workers=self.min_workers,
            mode=Mode.SYNC,
            num_fragments=1,
            heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
            max_workers=max(10_000, self.n_workers),
        )


def make_workload(n: int, n_events: int, seed: int) -> Workload:
    """Generate a valid event list with a shadow model of the sync rules (SPEC.md R5, R7, R9, P1, P2).

    Replacements always get fresh ids, so no join is ever a re-join of a live member (R6).
    """
    rng = random.Random(f"bench_fsm:{seed}:{n}")
    min_workers = max(1, n // 2)
    # At most this many workers are dead and not yet replaced; never near quorum.
    max_absent = max(1, n // 50)
    # Clock advance per tick. Half the heartbeats go to the longest-silent
    # worker, so each worker is heard from about every 2.3 N events; keep
    # that well under half the timeout. A tick that would still expire
    # someone becomes a heartbeat from that worker instead (see below). At
    # small N, cap the step so that a timeout spans many ticks.
    tick_dt = min(0.1 * HEARTBEAT_TIMEOUT_S, 0.25 * HEARTBEAT_TIMEOUT_S / (2.3 * n * P_TICK))

    members: OrderedDict[str, float] = OrderedDict()  # wid -> last seen, oldest first (as the core)
    member_list: list[str] = []  # for uniform random choice
    member_pos: dict[str, int] = {}
    contributed: dict[str, None] = {}
    pending: list[str] = []  # candidates to submit next (lazily cleaned)
    round_id = 0
    rounds = 0
    now = 0.0
    next_id = 0

    def add_member(wid: str) -> None:
        members[wid] = now
        member_pos[wid] = len(member_list)
        member_list.append(wid)

    def remove_member(wid: str) -> None:
        del members[wid]
        i = member_pos.pop(wid)
        last = member_list.pop()
        if last != wid:
            member_list[i] = last
            member_pos[last] = i
        # P1: its accepted contribution stays in the round, but it is no longer
        # a live member, so it no longer counts toward completion: the shadow
        # (and the floor) track *live* contributors only.
        contributed.pop(wid, None)

    def new_id() -> str:
        nonlocal next_id
        next_id += 1
        return f"w{next_id:06d}"

    def maybe_apply() -> None:
        # R5: complete = every live member contributed; applies only with quorum.
        nonlocal round_id, rounds, pending
        if contributed and len(contributed) == len(members) and len(members) >= min_workers:
            round_id += 1
            rounds += 1
            contributed.clear()
            pending = list(members)
            rng.shuffle(pending)

    setup = []
    for _ in range(n):
        wid = new_id()
        setup.append(WorkerJoined(wid))
        add_member(wid)
    pending = list(members)
    rng.shuffle(pending)

    events: list = []
    counts = {"heartbeat": 0, "submit": 0, "tick": 0, "leave": 0, "join": 0}

    def heartbeat(wid: str) -> None:
        members[wid] = now
        members.move_to_end(wid)
        events.append(HeartbeatSeen(wid))
        counts["heartbeat"] += 1

    def some_heartbeat() -> None:
        if rng.random() < 0.5:
            heartbeat(next(iter(members)))
        else:
            heartbeat(member_list[rng.randrange(len(member_list))])

    for _ in range(n_events):
        r = rng.random()
        if r < P_HEARTBEAT:
            some_heartbeat()
        elif r < P_HEARTBEAT + P_SUBMIT:
            wid = None
            while pending:
                cand = pending.pop()
                if cand in members and cand not in contributed:
                    wid = cand
                    break
            if wid is None:  # cannot happen while the shadow is right; keep the mix valid anyway
                some_heartbeat()
                continue
            contributed[wid] = None
            members[wid] = now  # a submission is proof of life (R9)
            members.move_to_end(wid)
            events.append(ContributionSubmitted(wid, 0, round_id))
            counts["submit"] += 1
            maybe_apply()
        elif r < P_HEARTBEAT + P_SUBMIT + P_TICK:
            new_now = now + tick_dt * (0.5 + rng.random())
            oldest = next(iter(members))
            if members[oldest] < new_now - 0.5 * HEARTBEAT_TIMEOUT_S:
                heartbeat(oldest)
                continue
            now = new_now
            events.append(Ticked(now))
            counts["tick"] += 1
        elif r < P_HEARTBEAT + P_SUBMIT + P_TICK + P_LEAVE:
            if len(members) <= max(n - max_absent, min_workers):
                some_heartbeat()
                continue
            wid = member_list[rng.randrange(len(member_list))]
            remove_member(wid)
            events.append(WorkerLeft(wid, LeaveCause.CRASHED))
            counts["leave"] += 1
            maybe_apply()  # R7: a death can complete the round
        else:
            if len(members) >= n:
                some_heartbeat()
                continue
            wid = new_id()
            add_member(wid)
            # P2: the joiner is enlisted in the open round at once.
            pending.append(wid)
            j = rng.randrange(len(pending))
            pending[j], pending[-1] = pending[-1], pending[j]
            events.append(WorkerJoined(wid))
            counts["join"] += 1
            maybe_apply()
    return Workload(n, min_workers, setup, events, rounds, counts)


def fresh_machine(wl: Workload) -> RoundFSM:
    fsm = RoundFSM(wl.config())
    for ev in wl.setup:
        fsm.step(ev)
    return fsm


def validate(wl: Workload) -> dict[str, int]:
    """Replay once, untimed: the list must be valid against the real machine."""
    fsm = fresh_machine(wl)
    assert fsm.live_workers == wl.n_workers and not fsm.below_min_workers, "setup did not reach quorum"
    tally: dict[str, int] = {}
    for i, ev in enumerate(wl.events):
        for eff in fsm.step(ev):
            if not isinstance(eff, EXPECTED_EFFECTS):
                raise AssertionError(f"N={wl.n_workers}: event #{i} {ev!r} produced unexpected {eff!r}")
            name = type(eff).__name__
            tally[name] = tally.get(name, 0) + 1
    applied = tally.get("ApplyRound", 0)
    if applied != wl.rounds or fsm.rounds_applied != wl.rounds:
        raise AssertionError(f"N={wl.n_workers}: machine applied {applied} rounds, shadow expected {wl.rounds}")
    return tally


def time_core_once(wl: Workload) -> float:
    """Seconds to step every timed event through a fresh steady-state machine."""
    fsm = fresh_machine(wl)
    step = fsm.step
    events = wl.events
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        for ev in events:
            step(ev)
        elapsed = time.perf_counter() - t0
    finally:
        gc.enable()
    if fsm.rounds_applied != wl.rounds:
        raise AssertionError("timed replay diverged from the validated one")
    return elapsed


def floor_run(wl: Workload) -> tuple[float, int]:
    """The same bookkeeping as a bare loop: the least any implementation could do. Returns (s, rounds)."""
    last_seen = {ev.worker_id: 0.0 for ev in wl.setup}
    contributed: set[str] = set()
    min_workers = wl.min_workers
    round_id = 0
    rounds = 0
    now = 0.0
    HB, CS, TK, WL, WJ = HeartbeatSeen, ContributionSubmitted, Ticked, WorkerLeft, WorkerJoined
    events = wl.events
    t0 = time.perf_counter()
    for ev in events:
        t = type(ev)
        if t is HB:
            wid = ev.worker_id
            if wid in last_seen:
                last_seen[wid] = now
        elif t is CS:
            wid = ev.worker_id
            if wid in last_seen and ev.round_id == round_id and wid not in contributed:
                contributed.add(wid)
                last_seen[wid] = now
                if len(contributed) == len(last_seen) and len(last_seen) >= min_workers:
                    round_id += 1
                    rounds += 1
                    contributed = set()
        elif t is TK:
            now = ev.now_s
        elif t is WL:
            wid = ev.worker_id
            if wid in last_seen:
                del last_seen[wid]
                contributed.discard(wid)
                if contributed and len(contributed) == len(last_seen) and len(last_seen) >= min_workers:
                    round_id += 1
                    rounds += 1
                    contributed = set()
        elif t is WJ:
            last_seen[ev.worker_id] = now
    return time.perf_counter() - t0, rounds


def time_floor_once(wl: Workload) -> float:
    gc.collect()
    gc.disable()
    try:
        elapsed, rounds = floor_run(wl)
    finally:
        gc.enable()
    if rounds != wl.rounds:
        raise AssertionError(f"floor applied {rounds} rounds, expected {wl.rounds}")
    return elapsed


def measure(workloads: dict[int, Workload], reps: int) -> dict[int, tuple[float, float]]:
    """Best (core s, floor s) per size.

    The repetitions are interleaved -- every size and both loops in each
    repetition, in alternating order -- so that a burst of load from
    something else on the machine hits all the figures a ratio is made of,
    and each minimum can come from a quiet moment.
    """
    best = {n: [float("inf"), float("inf")] for n in workloads}
    sizes = list(workloads)
    for rep in range(reps):
        for n in (sizes if rep % 2 == 0 else sizes[::-1]):
            wl = workloads[n]
            best[n][0] = min(best[n][0], time_core_once(wl))
            best[n][1] = min(best[n][1], time_floor_once(wl))
    return {n: (c, f) for n, (c, f) in best.items()}


def profile_core(wl: Workload, top: int = 15) -> str:
    fsm = fresh_machine(wl)
    step = fsm.step
    prof = cProfile.Profile()
    prof.enable()
    for ev in wl.events:
        step(ev)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short run: fewer events and repetitions")
    parser.add_argument("--events", type=int, default=None, help="timed events per size (default 400000, quick 40000)")
    parser.add_argument("--reps", type=int, default=None, help="repetitions per measurement, best kept (default 7, quick 2)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    parser.add_argument("--profile", action="store_true", help="cProfile the core at the largest size")
    args = parser.parse_args(argv)
    n_events = args.events or (40_000 if args.quick else 400_000)
    reps = args.reps or (2 if args.quick else 7)

    print(f"bench_fsm: RoundFSM.step, sync, 1 fragment, min_workers = N//2, seed {args.seed}, "
          f"{n_events:,} timed events per size, best of {reps}, Python {sys.version.split()[0]}")
    print(f"event mix: heartbeat {P_HEARTBEAT:.0%}, submit {P_SUBMIT:.0%}, tick {P_TICK:.0%}, "
          f"leave {P_LEAVE:.1%}, join {P_JOIN:.1%} (leave/join fall back to heartbeats when churn is at its cap)")
    print()
    header = (f"{'workers':>8} {'events':>8} {'hb':>7} {'submit':>7} {'tick':>6} {'leave':>6} {'join':>6} "
              f"{'rounds':>7} {'core ev/s':>11} {'core ns/ev':>10} {'floor ev/s':>11} {'floor ns/ev':>11} "
              f"{'core/floor':>10}")
    print(header)
    print("-" * len(header))
    workloads = {}
    for n in SIZES:
        workloads[n] = wl = make_workload(n, n_events, args.seed)
        validate(wl)
    timings = measure(workloads, reps)
    rows = {}
    for n in SIZES:
        wl = workloads[n]
        core_s, floor_s = timings[n]
        m = len(wl.events)
        c = wl.counts
        rows[n] = (m / core_s, core_s / m, m / floor_s, floor_s / m)
        print(f"{n:>8,} {m:>8,} {c['heartbeat']:>7,} {c['submit']:>7,} {c['tick']:>6,} {c['leave']:>6,} "
              f"{c['join']:>6,} {wl.rounds:>7,} {rows[n][0]:>11,.0f} {rows[n][1] * 1e9:>10.0f} "
              f"{rows[n][2]:>11,.0f} {rows[n][3] * 1e9:>11.0f} {core_s / floor_s:>10.2f}")

    big, small = SIZES[-1], SIZES[0]
    eps_big = rows[big][0]
    cost_ratio = rows[big][1] / rows[small][1]
    core_vs_floor = rows[big][1] / rows[big][3]
    print()
    goals = [
        (f"events/s at {big:,} workers >= {GOAL_EVENTS_PER_S_10000:,}", eps_big >= GOAL_EVENTS_PER_S_10000,
         f"{eps_big:,.0f}"),
        (f"cost ratio {big:,} vs {small} workers <= {GOAL_COST_RATIO}", cost_ratio <= GOAL_COST_RATIO,
         f"{cost_ratio:.2f}"),
        (f"core vs floor at {big:,} workers <= {GOAL_CORE_VS_FLOOR}", core_vs_floor <= GOAL_CORE_VS_FLOOR,
         f"{core_vs_floor:.2f}"),
    ]
    for text, ok, value in goals:
        print(f"goal {'met   ' if ok else 'MISSED'}  {text}: {value}")

    if args.profile:
        print()
        print(f"cProfile of the core replay at {big:,} workers (sorted by own time):")
        print(profile_core(workloads[big]))

    print(f"RESULT bench_fsm events_per_s_8={rows[8][0]:.0f} events_per_s_1000={rows[1000][0]:.0f} "
          f"events_per_s_10000={rows[10000][0]:.0f} cost_ratio_10000_vs_8={cost_ratio:.2f} "
          f"core_vs_floor={core_vs_floor:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
