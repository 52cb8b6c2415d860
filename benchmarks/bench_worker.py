"""bench_worker: what the worker's communication thread costs, and what it buys.

``DilocoWorker`` by default runs a communication thread (``diloco.worker.link``)
that owns the endpoint -- it polls every ``COMM_POLL_S`` (10 ms), sends
heartbeats on time and answers the coordinator while the training thread runs
an inner step. With ``comm_thread=False`` the training thread pumps the
endpoint itself between steps. Three measurements, all over the in-process
transport (``InprocNetwork``) with a real ``Coordinator`` in a
``CoordinatorThread``:

1. **Cost** (``comm_ratio``, ``cpu_ratio``): k = 2 worker threads train a
   small MLP (AdamW, fixed batches; one inner step is a few ms with one torch
   thread) for ``--steps`` inner steps each, H = 50, sync mode,
   ``min_workers = 2``. Timed from the moment both workers have joined (a
   barrier) to the moment the last one returns from its last ``step_done``
   (the last round's Result installed); leaving and the coordinator's
   shutdown are not timed. The two variants -- ``comm_thread=True``
   (threaded) and ``comm_thread=False`` (inline) -- alternate within every
   repetition (which goes first alternates too); ``comm_ratio`` is the median
   over repetitions of threaded wall / inline wall, ``cpu_ratio`` the same for
   the process's CPU time. Also per variant: inner steps per second per
   worker, and where the time went -- the inner steps themselves (wall and
   thread CPU) and ``step_done`` at sync points (submit, wait for the
   Result, install: ``sync_ms``).

2. **What it buys** (heartbeat gaps): one worker (``min_workers = 1``,
   heartbeat interval ``--hb-interval``, default 0.25 s) takes normal steps
   for two intervals, then ``--sleeps`` inner steps that each sleep
   ``--sleep`` seconds (default 1.0). The coordinator's endpoint is wrapped (a
   thin object forwarding recv/send/close) to record when each ``Heartbeat``
   arrives, and the worker's endpoint to record when each is sent. The figure
   is the longest gap between consecutive heartbeats the coordinator received
   from the worker over the long steps, divided by the heartbeat interval; the
   median over repetitions, for each variant.

3. **Idle cost**: the process's CPU share while one joined worker's training
   thread sleeps -- what polling costs when there is nothing to do.

The process runs one torch intra-op thread (``torch.set_num_threads(1)``):
the two training threads, the coordinator thread and (threaded) two
communication threads share the cores and the GIL.

Usage::

    python benchmarks/bench_worker.py            # 15 repetitions of 1000 steps, 3 heartbeat reps; 2.5-3 min
    python benchmarks/bench_worker.py --quick    # 3 repetitions of 500 steps, 1 heartbeat rep; about 40 s

Progress goes to stderr; the report to stdout, whose last line is::

    RESULT bench_worker comm_ratio=R steps_per_s_threaded=X steps_per_s_inline=X
        max_hb_gap_threaded_over_interval=R max_hb_gap_inline_over_interval=R cpu_ratio=R
        sync_ms_threaded=X sync_ms_inline=X idle_cpu_pct_threaded=X idle_cpu_pct_inline=X

About 550 lines: one benchmark is one file, run and read top to bottom; its two
arms (with and without the communication thread) share one setup and the
report.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import threading
import time

import torch

from diloco.coordinator import Coordinator, CoordinatorConfig, OuterConfig
from diloco.coordinator.runner import CoordinatorThread
from diloco.core import FSMConfig
from diloco.transport.inproc import InprocNetwork
from diloco.wire.messages import AdminRequest, Heartbeat, Result, Submit
from diloco.worker import DilocoWorker
import diloco.worker.link as link
from diloco.worker.link import COMM_POLL_S

H = 50
K = 2
VARIANTS = ("threaded", "inline")


def note(text: str) -> None:
    print(f"[bench_worker {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- the model


def make_mlp(seed: int, d_in: int, hidden: int, d_out: int = 10) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(d_in, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
                               torch.nn.ReLU(), torch.nn.Linear(hidden, d_out))


def make_batches(seed: int, n: int, batch: int, d_in: int, d_out: int = 10) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, d_in, generator=g), torch.randint(0, d_out, (batch,), generator=g))
            for _ in range(n)]


def inner_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch) -> None:
    x, y = batch
    opt.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def calibrate(args) -> float:
    """Median ms of one inner step alone on this thread (for the report)."""
    model = make_mlp(0, args.d_in, args.hidden)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = make_batches(0, 8, args.batch, args.d_in)
    for i in range(30):
        inner_step(model, opt, batches[i % 8])
    times = []
    for i in range(200):
        t0 = time.perf_counter()
        inner_step(model, opt, batches[i % 8])
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


# --------------------------------------------------------------------------- endpoint wrappers


class RecordingWorkerEndpoint:
    """Forwards to a worker endpoint; records when each Heartbeat and Submit is sent and each Result received."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self.heartbeats_sent: list[float] = []
        self.submits_sent: list[float] = []
        self.results_received: list[float] = []

    def send(self, message) -> None:
        if isinstance(message, Heartbeat):
            self.heartbeats_sent.append(time.perf_counter())
        elif isinstance(message, Submit):
            self.submits_sent.append(time.perf_counter())
        self._inner.send(message)

    def recv(self, timeout_s: float):
        message = self._inner.recv(timeout_s)
        if isinstance(message, Result):
            self.results_received.append(time.perf_counter())
        return message

    def close(self) -> None:
        self._inner.close()

    def wake(self) -> None:
        self._inner.wake()  # the worker's communication thread is woken to send a queued Submit


class RecordingCoordinatorEndpoint:
    """Forwards to the coordinator's endpoint; records when each Heartbeat arrives, by peer."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self.heartbeats: dict[str, list[float]] = {}

    def recv(self, timeout_s: float):
        arrival = self._inner.recv(timeout_s)
        if arrival is not None and isinstance(arrival.message, Heartbeat):
            self.heartbeats.setdefault(arrival.peer, []).append(time.perf_counter())
        return arrival

    def lost_peers(self) -> list[str]:
        return self._inner.lost_peers()

    def arriving_peers(self) -> list[str]:
        return self._inner.arriving_peers()

    def send(self, peer, message) -> None:
        self._inner.send(peer, message)

    def close(self) -> None:
        self._inner.close()


def shutdown(net: InprocNetwork, thread: CoordinatorThread) -> None:
    admin = net.connect("bench-admin")
    admin.send(AdminRequest("shutdown", {"kind": "drain"}))
    admin.recv(5.0)
    admin.close()
    thread.stop(5.0)
    if thread.is_alive():
        raise RuntimeError("the coordinator thread did not stop")
    if thread.error is not None:
        raise RuntimeError("the coordinator loop failed") from thread.error


# --------------------------------------------------------------------------- 1. cost: k = 2 workers, H = 50


def training_run(threaded: bool, steps: int, args, seed: int = 0) -> dict:
    """k workers, ``steps`` inner steps each; wall time from both joined to the last round installed."""
    net = InprocNetwork()
    coordinator = Coordinator(CoordinatorConfig(FSMConfig(min_workers=K), OuterConfig("nesterov", 0.7, 0.9)),
                              now_s=time.monotonic())
    thread = CoordinatorThread(net.coordinator(), coordinator)
    barrier = threading.Barrier(K)
    out: dict[str, dict] = {}
    errors: list[BaseException] = []

    def work(index: int) -> None:
        wid = f"worker-{index + 1}"
        w = None
        try:
            model = make_mlp(seed, args.d_in, args.hidden)  # same init everywhere (Join params)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            batches = make_batches(seed * 1000 + index + 1, 16, args.batch, args.d_in)
            ep = RecordingWorkerEndpoint(net.connect(wid))
            w = DilocoWorker(model, opt, ep, worker_id=wid, sync_every=H,
                             coordinator_timeout_s=120.0, comm_thread=threaded)
            w.join()
            barrier.wait(60.0)
            t_start = time.perf_counter()
            compute = compute_cpu = sync_wait = other_wait = 0.0
            sync_at: list[tuple[float, float]] = []  # (step_done called, returned) at each sync point
            done = 0
            for step in range(1, steps + 1):
                t0, c0 = time.perf_counter(), time.thread_time()
                inner_step(model, opt, batches[step % len(batches)])
                t1, c1 = time.perf_counter(), time.thread_time()
                ok = w.step_done()
                t2 = time.perf_counter()
                compute += t1 - t0
                compute_cpu += c1 - c0
                if step % H == 0:
                    sync_wait += t2 - t1
                    sync_at.append((t1, t2))
                else:
                    other_wait += t2 - t1
                if not ok:
                    break
                done = step
            t_end = time.perf_counter()
            # One fragment: one Submit and one Result per sync point, in order.
            if len(ep.submits_sent) != len(sync_at) or len(ep.results_received) != len(sync_at):
                raise RuntimeError(f"{wid}: {len(sync_at)} sync points, {len(ep.submits_sent)} Submits sent, "
                                   f"{len(ep.results_received)} Results received")
            submit_delay = [s - a for (a, _), s in zip(sync_at, ep.submits_sent)]
            resume_delay = [b - r for (_, b), r in zip(sync_at, ep.results_received)]
            out[wid] = dict(start=t_start, end=t_end, steps=done, rounds=w.rounds_synced, compute_s=compute,
                            compute_cpu_s=compute_cpu, submit_delay=submit_delay, resume_delay=resume_delay,
                            sync_wait_s=sync_wait, step_done_s=other_wait, uses_comm_thread=w.uses_comm_thread,
                            stop_reason=w.stop_reason)
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()
        finally:
            if w is not None:
                w.leave()

    thread.start()
    workers = [threading.Thread(target=work, args=(i,), name=f"bench-worker-{i + 1}", daemon=True)
               for i in range(K)]
    cpu0 = time.process_time()
    try:
        for t in workers:
            t.start()
        for t in workers:
            t.join(600.0)
        cpu = time.process_time() - cpu0  # every thread of the process: workers, comm threads, coordinator
        if any(t.is_alive() for t in workers):
            raise RuntimeError("a worker did not finish in 600 s")
    finally:
        shutdown(net, thread)
    if errors:
        raise RuntimeError(f"a worker failed: {errors[0]!r}") from errors[0]
    rounds = steps // H
    for wid, r in out.items():
        if r["steps"] != steps or r["rounds"] != rounds or r["uses_comm_thread"] != threaded:
            raise RuntimeError(f"{wid}: {r['steps']} steps, {r['rounds']} rounds, comm thread "
                               f"{r['uses_comm_thread']} (expected {steps}, {rounds}, {threaded})")
    wall = max(r["end"] for r in out.values()) - min(r["start"] for r in out.values())
    n = len(out)
    return dict(wall_s=wall, steps_per_s=steps / wall, cpu_s=cpu,
                compute_ms_per_step=sum(r["compute_s"] for r in out.values()) / n / steps * 1e3,
                compute_cpu_ms_per_step=sum(r["compute_cpu_s"] for r in out.values()) / n / steps * 1e3,
                sync_ms_per_round=sum(r["sync_wait_s"] for r in out.values()) / n / rounds * 1e3,
                step_done_us_per_step=sum(r["step_done_s"] for r in out.values()) / n / (steps - rounds) * 1e6,
                # step_done at a sync point -> the Submit leaves the worker's endpoint
                submit_ms=statistics.mean(d for r in out.values() for d in r["submit_delay"]) * 1e3,
                # the Result reaches the worker's endpoint -> step_done returns (params installed)
                resume_ms=statistics.mean(d for r in out.values() for d in r["resume_delay"]) * 1e3)


# --------------------------------------------------------------------------- 2. what it buys: heartbeat gaps


def heartbeat_run(threaded: bool, args, seed: int = 0) -> dict:
    """One worker; a few normal steps, then ``args.sleeps`` steps of ``args.sleep`` s each."""
    interval = args.hb_interval
    timeout = max(10.0, 4 * args.sleep + 4 * interval)  # the inline worker must not be declared dead
    net = InprocNetwork()
    coordinator = Coordinator(CoordinatorConfig(FSMConfig(min_workers=1, heartbeat_timeout_s=timeout),
                                                heartbeat_interval_s=interval), now_s=time.monotonic())
    cep = RecordingCoordinatorEndpoint(net.coordinator())
    thread = CoordinatorThread(cep, coordinator)
    wep = RecordingWorkerEndpoint(net.connect("worker-1"))
    model = make_mlp(seed, args.d_in, args.hidden)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = make_batches(seed + 1, 4, args.batch, args.d_in)
    thread.start()
    w = DilocoWorker(model, opt, wep, worker_id="worker-1", sync_every=10_000, coordinator_timeout_s=120.0,
                     comm_thread=threaded)
    try:
        w.join()
        if w.heartbeat_interval_s != interval or w.uses_comm_thread != threaded:
            raise RuntimeError(f"worker: heartbeat interval {w.heartbeat_interval_s}, comm thread "
                               f"{w.uses_comm_thread}; expected {interval}, {threaded}")
        # Normal steps for two intervals, so heartbeats are flowing before the long steps.
        t_normal = time.perf_counter() + 2 * interval
        while time.perf_counter() < t_normal:
            inner_step(model, opt, batches[0])
            if not w.step_done():
                raise RuntimeError(f"worker stopped early ({w.stop_reason})")
        t_a = time.perf_counter()
        for i in range(args.sleeps):
            inner_step(model, opt, batches[i % len(batches)])
            time.sleep(args.sleep)  # the long step: the training thread is busy for args.sleep s
            if not w.step_done():
                raise RuntimeError(f"worker stopped during the long steps ({w.stop_reason})")
        t_b = time.perf_counter()
        time.sleep(0.05)  # let the coordinator thread take the last heartbeat
    finally:
        w.leave()
        shutdown(net, thread)

    def max_gap(times: list[float]) -> float:
        # Heartbeats up to the end of the long steps, from the last one before they began.
        ts = [t for t in times if t <= t_b + 0.04]
        before = [t for t in ts if t <= t_a]
        ts = ([before[-1]] if before else []) + [t for t in ts if t > t_a]
        if len(ts) < 2:
            return math.nan
        return max(b - a for a, b in zip(ts, ts[1:]))

    received = cep.heartbeats.get("worker-1", [])
    gap_recv, gap_sent = max_gap(received), max_gap(wep.heartbeats_sent)
    in_window = [t for t in received if t_a < t <= t_b + 0.04]
    return dict(max_gap_s=gap_recv, max_gap_sent_s=gap_sent, gap_over_interval=gap_recv / interval,
                heartbeats_in_long_steps=len(in_window), long_steps_s=t_b - t_a)


# --------------------------------------------------------------------------- 3. the idle cost of polling


def idle_run(threaded: bool, seconds: float, seed: int = 0) -> float:
    """CPU share of one core used by the process while one joined worker's training thread sleeps.

    The coordinator thread's own ticks (every 50 ms) are in both variants; the
    difference is what the communication thread's polling costs when there is
    nothing to do.
    """
    net = InprocNetwork()
    coordinator = Coordinator(CoordinatorConfig(FSMConfig(min_workers=1)), now_s=time.monotonic())
    thread = CoordinatorThread(net.coordinator(), coordinator)
    model = make_mlp(seed, 8, 8)
    thread.start()
    w = DilocoWorker(model, torch.optim.SGD(model.parameters(), lr=0.1), net.connect("worker-1"),
                     worker_id="worker-1", sync_every=H, coordinator_timeout_s=120.0, comm_thread=threaded)
    try:
        w.join()
        time.sleep(0.3)
        c0, t0 = time.process_time(), time.perf_counter()
        time.sleep(seconds)
        return (time.process_time() - c0) / (time.perf_counter() - t0)
    finally:
        w.leave()
        shutdown(net, thread)


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="The last line printed is 'RESULT bench_worker key=value ...'; see benchmarks/README.md.")
    parser.add_argument("--quick", action="store_true",
                        help="a shorter, rougher run: 500 steps x 3 repetitions, 1 heartbeat repetition of 2 "
                             "long steps, 2 s idle (under a minute)")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"inner steps per worker in each timed training run, a multiple of H={H} "
                             "(default 1000; quick 500)")
    parser.add_argument("--reps", type=int, default=None,
                        help="interleaved repetitions of each variant for comm_ratio, median kept "
                             "(default 15; quick 3)")
    parser.add_argument("--hb-reps", type=int, default=None,
                        help="repetitions of each variant for the heartbeat gaps, median kept (default 3; quick 1)")
    parser.add_argument("--sleep", type=float, default=1.0,
                        help="seconds each long inner step sleeps in the heartbeat test (default %(default)s)")
    parser.add_argument("--sleeps", type=int, default=None,
                        help="long inner steps per heartbeat run (default 3; quick 2)")
    parser.add_argument("--hb-interval", type=float, default=0.25,
                        help="the coordinator's heartbeat interval in the heartbeat test, s (default %(default)s)")
    parser.add_argument("--d-in", type=int, default=128, help="MLP input width (default %(default)s)")
    parser.add_argument("--hidden", type=int, default=256, help="MLP hidden width, two hidden layers "
                        "(default %(default)s)")
    parser.add_argument("--batch", type=int, default=64, help="batch size per inner step (default %(default)s)")
    parser.add_argument("--idle-s", type=float, default=None,
                        help="seconds of each idle measurement (the polling's CPU cost with nothing to do; "
                             "default 4; quick 2; 0 skips it)")
    parser.add_argument("--comm-poll-ms", type=float, default=None,
                        help="diagnosis only: override diloco.worker.link.COMM_POLL_S (10 ms) for this process, "
                             "to see how the cost depends on the poll rate")
    parser.add_argument("--json", metavar="PATH", help="also write every repetition's figures here")
    args = parser.parse_args(argv)
    steps = args.steps or (500 if args.quick else 1000)
    reps = args.reps or (3 if args.quick else 15)
    hb_reps = args.hb_reps or (1 if args.quick else 3)
    args.sleeps = args.sleeps or (2 if args.quick else 3)
    idle_s = args.idle_s if args.idle_s is not None else (2.0 if args.quick else 4.0)
    if steps <= 0 or steps % H:
        parser.error(f"--steps {steps}: expected a positive multiple of H={H}")
    if not 0 < args.hb_interval < args.sleep:
        parser.error("--hb-interval must be > 0 and shorter than --sleep (else there is no gap to close)")

    poll_s = COMM_POLL_S
    if args.comm_poll_ms is not None:
        if not args.comm_poll_ms > 0:
            parser.error("--comm-poll-ms must be > 0")
        poll_s = link.COMM_POLL_S = args.comm_poll_ms / 1e3  # read by the comm thread's loop at each turn
        note(f"communication thread poll overridden: {args.comm_poll_ms:g} ms")

    torch.set_num_threads(1)
    started = time.perf_counter()
    step_ms = calibrate(args)
    n_params = sum(p.numel() for p in make_mlp(0, args.d_in, args.hidden).parameters())
    note(f"MLP {args.d_in}-{args.hidden}-{args.hidden}-10 ({n_params:,} params), batch {args.batch}: "
         f"{step_ms:.2f} ms per inner step alone, 1 torch thread")

    # Warm-up (untimed): the first optimizer, threads and lazy inits cost more than the rest.
    for threaded in (True, False):
        training_run(threaded, 2 * H, args)
    note("warm-up done")

    # 1. cost, interleaved
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    ratios: list[float] = []
    cpu_ratios: list[float] = []
    for rep in range(reps):
        order = (True, False) if rep % 2 == 0 else (False, True)
        this: dict[str, dict] = {}
        for threaded in order:
            name = "threaded" if threaded else "inline"
            r = training_run(threaded, steps, args)
            this[name] = r
            runs[name].append(r)
        ratios.append(this["threaded"]["wall_s"] / this["inline"]["wall_s"])
        cpu_ratios.append(this["threaded"]["cpu_s"] / this["inline"]["cpu_s"])
        note(f"rep {rep + 1}/{reps}: threaded {this['threaded']['wall_s']:.2f} s, inline "
             f"{this['inline']['wall_s']:.2f} s, ratio {ratios[-1]:.3f} (CPU {cpu_ratios[-1]:.3f})")

    def med(variant: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[variant])

    comm_ratio = statistics.median(ratios)
    cpu_ratio = statistics.median(cpu_ratios)

    # 2. heartbeat gaps
    hb: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for rep in range(hb_reps):
        order = (True, False) if rep % 2 == 0 else (False, True)
        for threaded in order:
            name = "threaded" if threaded else "inline"
            r = heartbeat_run(threaded, args)
            hb[name].append(r)
            note(f"heartbeats rep {rep + 1}/{hb_reps}, {name}: longest gap {r['max_gap_s']:.3f} s "
                 f"({r['gap_over_interval']:.2f} intervals), {r['heartbeats_in_long_steps']} heartbeats in "
                 f"{r['long_steps_s']:.2f} s of long steps")

    def hb_med(variant: str, key: str) -> float:
        return statistics.median(r[key] for r in hb[variant])

    # 3. idle polling cost
    idle: dict[str, float] = {}
    if idle_s > 0:
        for threaded in (True, False):
            name = "threaded" if threaded else "inline"
            idle[name] = idle_run(threaded, idle_s)
        note(f"idle: threaded {idle['threaded'] * 100:.2f}% of a core, inline {idle['inline'] * 100:.2f}%")

    wall_total = time.perf_counter() - started

    print(f"k={K} workers, H={H}, {steps} inner steps each, {reps} interleaved repetitions per variant, medians; "
          f"MLP {n_params:,} params, {step_ms:.2f} ms per inner step alone; comm thread polls every "
          f"{poll_s * 1e3:g} ms")
    print(f"  {'variant':10} {'wall s':>7} {'steps/s':>8} {'CPU s':>6} {'step ms':>8} {'step CPU ms':>12} "
          f"{'sync ms':>8} {'submit ms':>10} {'resume ms':>10} {'step_done us':>13}")
    for v in VARIANTS:
        print(f"  {v:10} {med(v, 'wall_s'):7.2f} {med(v, 'steps_per_s'):8.1f} {med(v, 'cpu_s'):6.2f} "
              f"{med(v, 'compute_ms_per_step'):8.2f} {med(v, 'compute_cpu_ms_per_step'):12.2f} "
              f"{med(v, 'sync_ms_per_round'):8.1f} {med(v, 'submit_ms'):10.2f} {med(v, 'resume_ms'):10.2f} "
              f"{med(v, 'step_done_us_per_step'):13.1f}")
    print(f"  per-repetition threaded/inline wall: {', '.join(f'{r:.3f}' for r in ratios)}; median {comm_ratio:.3f}")
    print(f"  per-repetition threaded/inline CPU:  {', '.join(f'{r:.3f}' for r in cpu_ratios)}; median {cpu_ratio:.3f}")
    print("  (steps/s: inner steps per second per worker; CPU s: the whole process's CPU time in the run; step ms / "
          "step CPU ms: wall / thread CPU time of one forward/backward/AdamW; sync ms: time in step_done at a sync "
          "point, per round; of it, submit ms: until the Submit leaves the worker's endpoint, resume ms: from the "
          "Result's arrival at the endpoint to step_done's return; step_done us: time in step_done elsewhere)")
    print(f"heartbeats: interval {args.hb_interval} s, {args.sleeps} inner steps of {args.sleep} s each, "
          f"{hb_reps} repetition(s), medians")
    print(f"  {'variant':10} {'max gap s':>10} {'/ interval':>11} {'(as sent) s':>12} {'hb in long steps':>17}")
    for v in VARIANTS:
        print(f"  {v:10} {hb_med(v, 'max_gap_s'):10.3f} {hb_med(v, 'gap_over_interval'):11.2f} "
              f"{hb_med(v, 'max_gap_sent_s'):12.3f} {hb_med(v, 'heartbeats_in_long_steps'):17.0f}")
    if idle:
        print(f"idle (one joined worker, training thread asleep, {idle_s:g} s): process CPU threaded "
              f"{idle['threaded'] * 100:.2f}% of a core, inline {idle['inline'] * 100:.2f}%")
    print(f"total {wall_total:.0f} s")

    result = dict(
        comm_ratio=comm_ratio,
        steps_per_s_threaded=med("threaded", "steps_per_s"),
        steps_per_s_inline=med("inline", "steps_per_s"),
        max_hb_gap_threaded_over_interval=hb_med("threaded", "gap_over_interval"),
        max_hb_gap_inline_over_interval=hb_med("inline", "gap_over_interval"),
        cpu_ratio=cpu_ratio,
        sync_ms_threaded=med("threaded", "sync_ms_per_round"),
        sync_ms_inline=med("inline", "sync_ms_per_round"),
        submit_ms_threaded=med("threaded", "submit_ms"),
        submit_ms_inline=med("inline", "submit_ms"),
        idle_cpu_pct_threaded=idle["threaded"] * 100 if idle else math.nan,
        idle_cpu_pct_inline=idle["inline"] * 100 if idle else math.nan,
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(result=result, config=dict(k=K, H=H, steps=steps, reps=reps, hb_reps=hb_reps,
                                                      sleep=args.sleep, sleeps=args.sleeps,
                                                      hb_interval=args.hb_interval, d_in=args.d_in,
                                                      hidden=args.hidden, batch=args.batch, n_params=n_params,
                                                      step_ms_alone=step_ms, comm_poll_s=poll_s, idle_s=idle_s),
                           ratios=ratios, cpu_ratios=cpu_ratios, training=runs, heartbeats=hb, idle=idle,
                           wall_s=wall_total), f, indent=1)
    print("RESULT bench_worker " + " ".join(
        f"{k}={v:.3f}" if k.endswith("ratio") else f"{k}={v:.1f}" if k.startswith(("steps", "sync")) else
        f"{k}={v:.2f}" for k, v in result.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
