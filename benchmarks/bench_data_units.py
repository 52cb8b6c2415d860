"""bench_data_units: data work units under churn, with real processes (SPEC.md section 12, "Data work units").

What it measures
----------------
Two runs on 127.0.0.1, one after the other, each a ``diloco server`` (port 0,
``--min-workers 1``, ``--checkpoint-dir``: the audit log ``events.jsonl``) and
``--workers`` K workers on the built-in entry (``python -m diloco worker
--connect ADDR --id wN --sync-every H``, no ``--entry``: the tiny char
transformer, which reads the unit the run hands it each round), every process
with ``OMP_NUM_THREADS=1``. The clock of a run starts once all K workers have
joined (a worker's start-up, torch's imports, takes seconds on a loaded
machine). In both runs the same churn: every ``--kill-every`` C seconds of that
clock one worker (round-robin w1, w2, ...) is killed with SIGKILL (by its pid)
and started again at once under the same id.

1. **units**: the server has ``--data-units N``. It runs until ``--epochs`` E
   epochs are done (``diloco status``: ``units.epochs_done >= E``), then
   ``diloco shutdown``. From the audit log: how many times each unit of the
   E completed epochs (unit ids ``0 .. E*N - 1``) appears in the
   ``units_finished`` lines -- exactly once each is the ledger's promise
   (U4): ``exactly_once=X/Y``, ``duplicates`` (units finished more than once),
   ``lost`` (units never finished); the units given back (``unit_back``
   lines) and how many of them were handed out again before the run stopped
   (``rehanded``; a unit given back by the last kill, after the E-th epoch
   was done, may not be); the kills done; the wall time; the rounds applied
   in it (status ``rounds_applied`` when the E-th epoch was seen done, less
   its value when the clock started; the ``"event":"apply"`` lines, which
   also count the rounds before and after, are printed beside it).
2. **plain**: the same K, H, checkpoint directory and kill schedule (by time
   since all K joined), without ``--data-units``, for the same wall time as
   run 1; then the rounds applied in that time.

``ratio`` = rounds/s (units) / rounds/s (plain): what the ledger costs the run
(expected near 1.0). Both figures include the stalls the kills cause (a
killed worker's round, its replacement's start-up), and the machine may be
shared: one pair of runs is noisy; run it again before reading much into a
few percent.

Usage (from the repository root)::

    python benchmarks/bench_data_units.py            # K=3, H=20, N=96, E=3, C=8 s: a few minutes
    python benchmarks/bench_data_units.py --quick    # N=32, E=1, C=3 s: under a minute

A unit is one worker's round (H inner steps), so a run's length is about
E*N/K rounds plus the kills' stalls; on an idle machine a round of the
built-in entry takes well under a second, so N is large enough for several
kills to land while units are held.

The last line is machine-readable::

    RESULT data_units workers=K H=H units=N epochs=E kill_every_s=C exactly_once=X/Y duplicates=D lost=L
        given_back=G rehanded=R kills=KU wall_s=S rounds_units=A rounds_plain=B ratio=R

Every process it starts is killed by its pid at the end (also on an error or
Ctrl-C) and its temporary directories are removed, except when a unit was
finished twice or lost: then the run's directory (logs, ``ckpt/events.jsonl``)
is kept and its path printed, as evidence.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from diloco.wire.messages import AdminRequest  # noqa: E402
from diloco.wire.zmq import CoordinatorUnreachable, admin_request  # noqa: E402

START_TIMEOUT_S = 120.0


def _env() -> dict:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


class Proc:
    """``python -m diloco ARGS`` with its output in ``log_dir/NAME.log``."""

    def __init__(self, name: str, args: list[str], log_dir: Path) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "ab")
        self.popen = subprocess.Popen([sys.executable, "-m", "diloco", *args], cwd=log_dir, env=_env(),
                                      stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill9(self) -> None:
        if self.alive():
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()


@dataclass
class RunResult:
    label: str
    wall_s: float
    rounds: int
    kills: int
    events: list[dict] = field(default_factory=list)
    status: dict = field(default_factory=dict)
    run_dir: Path | None = None


def _status(address: str) -> dict | None:
    try:
        reply = admin_request(address, AdminRequest("status"), timeout_s=3.0)
    except CoordinatorUnreachable:
        return None
    return reply.data if reply.ok else None


def run_once(label: str, args, run_dir: Path, units: int | None, duration_s: float | None) -> RunResult:
    """One run with churn: until ``args.epochs`` epochs are done (``units``) or for ``duration_s``."""
    procs: list[Proc] = []
    server_args = ["server", "--bind", "tcp://127.0.0.1:0", "--min-workers", "1",
                   "--heartbeat-timeout", str(args.heartbeat_timeout), "--checkpoint-dir", "ckpt"]
    if units is not None:
        server_args += ["--data-units", str(units)]
    try:
        server = Proc("server", server_args, run_dir)
        procs.append(server)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (m := re.search(r"listening on (tcp://127\.0\.0\.1:\d+)", server.output())):
            if not server.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{label}: the server did not start:\n{server.output()}")
            time.sleep(0.05)
        address = m.group(1)

        def worker(wid: str) -> Proc:
            p = Proc(wid, ["worker", "--connect", address, "--id", wid, "--sync-every", str(args.sync_every),
                           "--coordinator-timeout", "120"], run_dir)
            procs.append(p)
            return p

        ids = [f"w{i + 1}" for i in range(args.workers)]
        workers = {wid: worker(wid) for wid in ids}
        # The clock starts once all K have joined (a worker's start-up, torch's imports, takes seconds).
        t_spawn = time.monotonic()
        while True:
            s0 = _status(address) or {}
            if len(s0.get("members", ())) >= len(ids):
                break
            if time.monotonic() - t_spawn > START_TIMEOUT_S:
                raise RuntimeError(f"{label}: {len(ids)} workers did not join within {START_TIMEOUT_S:g} s; "
                                   f"logs in {run_dir}")
            time.sleep(0.25)
        t0 = time.monotonic()
        rounds0 = int(s0.get("rounds_applied", 0))
        print(f"   [{label}] all {len(ids)} workers joined after {t0 - t_spawn:.1f} s "
              f"({rounds0} rounds applied by then): the clock starts", flush=True)
        kills = 0
        next_kill = t0 + args.kill_every
        last_print = t0
        status: dict = {}
        while True:
            now = time.monotonic()
            elapsed = now - t0
            if duration_s is not None and elapsed >= duration_s:
                break
            if duration_s is None and elapsed > args.max_wall:
                raise RuntimeError(f"{label}: {args.epochs} epochs not done within {args.max_wall:g} s "
                                   f"(status units: {status.get('units')}); logs in {run_dir}")
            if now >= next_kill:
                wid = ids[kills % len(ids)]
                workers[wid].kill9()
                workers[wid] = worker(wid)
                kills += 1
                next_kill += args.kill_every
                print(f"   [{label} {elapsed:6.1f} s] kill -9 {wid}, restarted", flush=True)
            status = _status(address) or status
            u = status.get("units") or {}
            if now - last_print >= 5.0:
                last_print = now
                extra = (f", epoch {u.get('epoch')} finished {u.get('finished')}/{u.get('units')} "
                         f"epochs_done {u.get('epochs_done')}") if u else ""
                print(f"   [{label} {elapsed:6.1f} s] rounds {status.get('rounds_applied', '?')}{extra}", flush=True)
            if duration_s is None and u.get("epochs_done", 0) >= args.epochs:
                break
            if not server.alive():
                raise RuntimeError(f"{label}: the server exited:\n{server.output()[-4000:]}")
            time.sleep(0.25)
        wall = time.monotonic() - t0
        final = _status(address) or status
        rounds = int(final.get("rounds_applied", 0)) - rounds0
        stop = Proc("shutdown", ["shutdown", "--connect", address], run_dir)
        procs.append(stop)
        try:
            stop.popen.wait(60)
            server.popen.wait(60)
        except subprocess.TimeoutExpired:
            print(f"   [{label}] shutdown did not finish within 60 s; killing", flush=True)
        events = []
        log = run_dir / "ckpt" / "events.jsonl"
        if log.exists():
            for raw in log.read_text().splitlines():
                try:
                    events.append(json.loads(raw))
                except json.JSONDecodeError:
                    pass
        return RunResult(label, wall, rounds, kills, events, final, run_dir)
    finally:
        for p in procs:
            p.kill9()


def ledger_report(events: list[dict], units: int, epochs: int) -> dict:
    finished = collections.Counter()
    handed = collections.Counter()
    back: list[tuple[int, int]] = []  # (line index, unit)
    handed_at: dict[int, list[int]] = collections.defaultdict(list)
    for i, line in enumerate(events):
        ev = line.get("event")
        if ev == "units_finished":
            finished.update(int(u) for u in line["units"])
        elif ev == "unit":
            handed[int(line["unit"])] += 1
            handed_at[int(line["unit"])].append(i)
        elif ev == "unit_back":
            back.append((i, int(line["unit"])))
    ids = range(units * epochs)
    once = sum(1 for u in ids if finished[u] == 1)
    dups = sorted(u for u in ids if finished[u] > 1)
    lost = sorted(u for u in ids if finished[u] == 0)
    rehanded = sum(1 for i, u in back if any(j > i for j in handed_at[u]))
    return {"exactly_once": once, "of": len(ids), "duplicates": dups, "lost": lost, "given_back": len(back),
            "rehanded": rehanded, "mismatch": sum(1 for e in events if e.get("event") == "unit_mismatch"),
            "applies": sum(1 for e in events if e.get("event") == "apply")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="N=32, E=1, C=3 s: about a minute")
    p.add_argument("--workers", type=int, default=3, help="K workers (default 3)")
    p.add_argument("--sync-every", type=int, default=20,
                   help="H inner steps per round (default 20, the built-in entry's)")
    p.add_argument("--units", type=int, default=None, help="N data units per epoch (default 96; quick 32)")
    p.add_argument("--epochs", type=int, default=None, help="E epochs to finish (default 3; quick 1)")
    p.add_argument("--kill-every", type=float, default=None, help="C seconds between kills (default 8; quick 3)")
    p.add_argument("--heartbeat-timeout", type=float, default=5.0, help="the server's (default 5 s)")
    p.add_argument("--max-wall", type=float, default=900.0, help="give up on run 1 after this (default 900 s)")
    p.add_argument("--keep", action="store_true", help="keep the runs' directories")
    args = p.parse_args(argv)
    args.units = args.units or (32 if args.quick else 96)
    args.epochs = args.epochs or (1 if args.quick else 3)
    args.kill_every = args.kill_every or (3.0 if args.quick else 8.0)

    print(f"bench_data_units: K={args.workers} H={args.sync_every} N={args.units} E={args.epochs} "
          f"C={args.kill_every:g} s, heartbeat timeout {args.heartbeat_timeout:g} s", flush=True)
    base = Path(tempfile.mkdtemp(prefix="bench_data_units-"))
    keep = args.keep
    t_start = time.monotonic()
    try:
        (base / "units").mkdir()
        (base / "plain").mkdir()
        print(f"-- run 1: --data-units {args.units}, until {args.epochs} epoch(s) done", flush=True)
        u = run_once("units", args, base / "units", args.units, None)
        rep = ledger_report(u.events, args.units, args.epochs)
        print(f"   done: {u.wall_s:.1f} s, {u.rounds} rounds applied ({rep['applies']} apply lines), "
              f"{u.kills} kills; status units {u.status.get('units')}", flush=True)
        print(f"   ledger: {rep['exactly_once']}/{rep['of']} units finished exactly once, duplicates "
              f"{rep['duplicates']}, lost {rep['lost']}; {rep['given_back']} given back, {rep['rehanded']} "
              f"of them handed out again; {rep['mismatch']} unit_mismatch lines", flush=True)
        if rep["duplicates"] or rep["lost"]:
            keep = True
            for line in u.events:
                if line.get("event") in ("unit", "unit_back", "units_finished", "unit_mismatch"):
                    if set(line.get("units", [line.get("unit")])) & set(rep["duplicates"] + rep["lost"]):
                        print("   EVIDENCE " + json.dumps(line), flush=True)
            print(f"   LEDGER VIOLATION: evidence kept in {u.run_dir}", flush=True)

        print(f"-- run 2: no --data-units, the same {u.wall_s:.1f} s and kill schedule", flush=True)
        q = run_once("plain", args, base / "plain", None, u.wall_s)
        plain_applies = sum(1 for e in q.events if e.get("event") == "apply")
        print(f"   done: {q.wall_s:.1f} s, {q.rounds} rounds applied ({plain_applies} apply lines), "
              f"{q.kills} kills", flush=True)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        if keep:
            print(f"run directories kept in {base}", flush=True)
        else:
            shutil.rmtree(base, ignore_errors=True)

    rate_u = u.rounds / u.wall_s if u.wall_s > 0 else 0.0
    rate_q = q.rounds / q.wall_s if q.wall_s > 0 else 0.0
    ratio = rate_u / rate_q if rate_q > 0 else float("nan")
    print(f"rounds/s: units {rate_u:.3f}, plain {rate_q:.3f}, ratio {ratio:.2f} (one pair of runs on a "
          f"possibly shared machine: noisy); total {time.monotonic() - t_start:.0f} s", flush=True)
    print(f"RESULT data_units workers={args.workers} H={args.sync_every} units={args.units} epochs={args.epochs} "
          f"kill_every_s={args.kill_every:g} exactly_once={rep['exactly_once']}/{rep['of']} "
          f"duplicates={len(rep['duplicates'])} lost={len(rep['lost'])} given_back={rep['given_back']} "
          f"rehanded={rep['rehanded']} kills={u.kills} wall_s={u.wall_s:.1f} rounds_units={u.rounds} "
          f"rounds_plain={q.rounds} ratio={ratio:.2f}", flush=True)
    return 1 if rep["duplicates"] or rep["lost"] else 0


if __name__ == "__main__":
    sys.exit(main())
