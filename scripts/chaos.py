#!/usr/bin/env python3
"""Chaos soak on real processes: kill workers and the coordinator at seeded random moments, then check the run.

    python scripts/chaos.py --minutes 30 --workers 4 --seed 1     # the long soak (README)
    python scripts/chaos.py --minutes 1.5 --workers 3 --seed 7    # the CI variant
    python scripts/chaos.py --minutes 30 --workers 4 --data-plane collective --worker-kill-every 8 --coordinator-kill-every 75

A small supervisor starts ``diloco server --checkpoint-dir DIR --resume DIR``
and N ``diloco worker`` processes (the built-in char transformer) on
127.0.0.1, then, at moments drawn from one seeded generator (printed first):

* ``kill -9`` a random live worker, and restart it (same id, same
  ``--checkpoint-dir``) after a short delay;
* ``kill -9`` the coordinator, and restart it with ``--resume`` on the same
  address after a short delay (workers ride out the outage);
* change ``min_workers`` (``diloco set-min-workers``) to a random value in
  1..N.

At the end it drains the run and checks, **from the audit log
(``DIR/events.jsonl``) and the final checkpoint only**:

1. no round applied with fewer contributors than the ``min_workers`` in force;
2. no (fragment, round) applied twice, across every coordinator incarnation;
3. round ids strictly increasing per fragment across restarts;
4. the final params finite;
5. held-out loss of the final params lower than of the initial ones;

On the collective plane (``--data-plane collective``) the coordinator's
checkpoint holds no params: the workers write theirs after every commit
(``--checkpoint-every 1``), and checks 4 and 5 read the newest worker
checkpoint's committed params; in addition

6. every two workers whose checkpoints hold the same round ids hold
   bit-identical committed params (the replicas never diverge).

Every run ends with trace validation (``diloco check-log``): the audit log's
inputs, replayed through the pure machine from each incarnation's snapshot,
must give exactly the effects and decisions the live coordinators logged; a
divergence is a violation (``trace_divergences`` in the RESULT line).

It reports how many applied rounds a coordinator kill lost (the rounds the
log recorded before the kill minus those the restarted coordinator resumed
with: persist-before-announce makes it 0). Last line::

    RESULT chaos data_plane=P minutes=M worker_kills=N coordinator_kills=N rounds_applied=N violations=N max_lost_rounds=N
        trace_inputs=N trace_divergences=N

A coordinator that exits by itself (for example, refusing to resume) and a
final ``shutdown --save`` that fails are violations too: a run that cannot
be resumed has lost the crash-safety it exists for. Exit 1 on any
violation. Every process it starts is killed by pid at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    def __init__(self, name: str, args: list[str], log_dir: Path, env: dict) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "ab")
        self._log.write(f"===== start {time.strftime('%H:%M:%S')} {' '.join(args)}\n".encode())
        self._log.flush()
        self.popen = subprocess.Popen([sys.executable, "-m", "diloco", *args], stdout=self._log,
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=log_dir)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill9(self) -> None:
        if self.alive():
            os.kill(self.popen.pid, signal.SIGKILL)
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")


class Soak:
    def __init__(self, args, out: Path) -> None:
        self.args = args
        self.out = out
        self.ckpt = out / "ckpt"
        self.rng = random.Random(args.seed)
        self.address = f"tcp://127.0.0.1:{free_port()}"
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self.server: Proc | None = None
        self.workers: dict[str, Proc] = {}
        self.restart_at: dict[str, float] = {}      # worker id -> when to restart it
        self.server_restart_at: float | None = None
        self.worker_kills = 0
        self.coordinator_kills = 0
        self.min_worker_changes = 0
        self.server_starts = 0
        #: Coordinator processes that exited by themselves (not killed here): each is a violation.
        self.server_failures: list[str] = []

    # ------------------------------------------------------------------ processes

    def start_server(self) -> None:
        self.server_starts += 1
        self.server = Proc(f"server-{self.server_starts:03d}", [
            "server", "--bind", self.address, "--min-workers", str(self.args.min_workers),
            "--heartbeat-timeout", str(self.args.heartbeat_timeout), "--checkpoint-dir", str(self.ckpt),
            "--resume", str(self.ckpt), *self.plane_args()], self.out, self.env)

    def plane_args(self) -> list[str]:
        if self.args.data_plane != "collective":
            return []
        return ["--data-plane", "collective"]

    def start_worker(self, wid: str) -> None:
        if wid in self.workers:
            self.workers[wid].kill9()
        self.workers[wid] = Proc(f"worker-{wid}", [
            "worker", "--connect", self.address, "--id", wid, "--checkpoint-dir", str(self.out / f"ckpt-{wid}"),
            "--sync-every", str(self.args.sync_every), "--coordinator-timeout", "600",
            *(["--checkpoint-every", "1"] if self.args.data_plane == "collective" else [])], self.out, self.env)

    def admin(self, *args: str) -> int:
        r = subprocess.run([sys.executable, "-m", "diloco", *args, "--connect", self.address, "--timeout", "10"],
                           capture_output=True, text=True, env=self.env, timeout=60)
        return r.returncode

    def close(self) -> None:
        for p in [*self.workers.values(), *([self.server] if self.server else [])]:
            p.kill9()

    # ------------------------------------------------------------------ the soak

    def say(self, text: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {text}", flush=True)

    def run(self) -> None:
        a = self.args
        self.start_server()
        for i in range(a.workers):
            self.start_worker(f"w{i + 1}")
        t0 = time.monotonic()
        end = t0 + a.minutes * 60
        warmup = min(30.0, a.minutes * 60 / 4)
        next_worker_kill = t0 + warmup + self.rng.expovariate(1 / a.worker_kill_every)
        next_coord_kill = t0 + warmup + self.rng.expovariate(1 / a.coordinator_kill_every)
        next_min_change = t0 + warmup + self.rng.expovariate(1 / a.min_workers_every)
        last_report = t0
        while time.monotonic() < end:
            now = time.monotonic()
            for wid, at in list(self.restart_at.items()):
                if now >= at:
                    del self.restart_at[wid]
                    self.start_worker(wid)
            if self.server_restart_at is not None and now >= self.server_restart_at:
                self.server_restart_at = None
                self.start_server()
                self.say("coordinator restarted with --resume")
            if now >= next_worker_kill:
                live = [w for w, p in self.workers.items() if p.alive() and w not in self.restart_at]
                if live:
                    wid = self.rng.choice(sorted(live))
                    self.workers[wid].kill9()
                    self.worker_kills += 1
                    self.restart_at[wid] = now + self.rng.uniform(1.0, a.worker_restart_max_s)
                    self.say(f"kill -9 worker {wid} (kill {self.worker_kills})")
                next_worker_kill = now + self.rng.expovariate(1 / a.worker_kill_every)
            if now >= next_coord_kill and self.server_restart_at is None and self.server is not None:
                self.server.kill9()
                self.coordinator_kills += 1
                self.server_restart_at = now + self.rng.uniform(0.5, a.coordinator_restart_max_s)
                self.say(f"kill -9 coordinator (kill {self.coordinator_kills})")
                next_coord_kill = now + self.rng.expovariate(1 / a.coordinator_kill_every)
            if now >= next_min_change and self.server_restart_at is None:
                n = self.rng.randint(1, a.workers)
                rc = self.admin("set-min-workers", str(n))
                self.min_worker_changes += rc == 0
                self.say(f"set-min-workers {n} (exit {rc})")
                next_min_change = now + self.rng.expovariate(1 / a.min_workers_every)
            if self.server_restart_at is None and self.server is not None and not self.server.alive():
                # A coordinator must never die on its own, least of all refuse to resume: a
                # violation; restart it as a supervisor would (and again, if it keeps failing).
                last = [ln for ln in self.server.output().splitlines() if ln.strip()][-1:]
                self.server_failures.append(f"{self.server.name} exited ({self.server.popen.returncode}) "
                                            f"by itself: {last[0] if last else ''}")
                self.say(f"VIOLATION coordinator exited by itself: {self.server_failures[-1]}")
                self.server.kill9()
                self.server_restart_at = now + 2.0
            for wid, p in self.workers.items():
                if not p.alive() and wid not in self.restart_at:
                    self.say(f"worker {wid} exited on its own ({p.popen.returncode}); restarting it")
                    self.restart_at[wid] = now + 1.0
            if now - last_report >= 30:
                last_report = now
                self.say(f"{(now - t0) / 60:.1f} min: {self.worker_kills} worker kills, "
                         f"{self.coordinator_kills} coordinator kills")
            time.sleep(0.2)
        # Heal and end: everyone back, the quorum reachable, then a drain.
        if self.server_restart_at is not None or self.server is None or not self.server.alive():
            self.start_server()
        for wid in list(self.restart_at):
            self.start_worker(wid)
        self.restart_at.clear()
        time.sleep(5)
        self.admin("set-min-workers", "1")
        time.sleep(3)
        rc = self.admin("shutdown", "--save")
        self.say(f"shutdown --save (exit {rc})")
        if rc != 0:
            self.server_failures.append(f"the final `shutdown --save` failed (exit {rc}): the run did not end cleanly")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and self.server.alive():
            time.sleep(0.2)


# ------------------------------------------------------------------ checks (audit log and checkpoint only)

def check_audit_log(path: Path) -> tuple[list[str], dict]:
    violations: list[str] = []
    applied: dict[tuple[int, int], int] = {}
    last_round: dict[int, int] = {}
    rounds_by_incarnation: dict[int, int] = {}
    resumed_with: dict[int, int] = {}
    lines = path.read_text().splitlines() if path.exists() else []
    n_applied = 0
    for i, raw in enumerate(lines, 1):
        try:
            e = json.loads(raw)
        except ValueError:
            if i != len(lines):
                violations.append(f"events.jsonl line {i} is not JSON (and not the last, torn line)")
            continue
        inc = e.get("incarnation")
        if inc not in resumed_with:
            # The first line of an incarnation carries the rounds it resumed with (its counter before it).
            resumed_with[inc] = e.get("rounds_applied", 0) - (1 if e.get("event") in ("apply", "step_refused") else 0)
        if e.get("event") == "apply":
            n_applied += 1
            fid, rid = e["fragment_id"], e["round_id"]
            contributors = e.get("contributors", [])
            if len(contributors) < e.get("min_workers", 1):
                violations.append(f"line {i}: fragment {fid} round {rid} applied with {len(contributors)} "
                                  f"contributors < min_workers {e.get('min_workers')}")
            if (fid, rid) in applied:
                violations.append(f"line {i}: fragment {fid} round {rid} applied twice (first at line "
                                  f"{applied[(fid, rid)]})")
            applied[(fid, rid)] = i
            if fid in last_round and rid <= last_round[fid]:
                violations.append(f"line {i}: fragment {fid} round {rid} after round {last_round[fid]}")
            last_round[fid] = rid
            rounds_by_incarnation[inc] = e.get("rounds_applied", 0)
    incs = sorted(i for i in resumed_with if isinstance(i, int))
    lost = [max(0, rounds_by_incarnation[prev] - resumed_with[nxt])
            for prev, nxt in zip(incs, incs[1:]) if prev in rounds_by_incarnation]
    return violations, {"rounds_applied": n_applied, "incarnations": len(incs), "max_lost_rounds": max(lost, default=0)}


def collective_params(out: Path) -> tuple[list[str], dict | None, str]:
    """Check 6 and the newest committed params among the workers' checkpoints (collective plane)."""
    import torch

    from diloco.tensorfile import CheckpointError
    from diloco.worker.checkpoint import load_worker_checkpoint

    violations: list[str] = []
    by_rounds: dict[tuple[int, ...], tuple[str, dict]] = {}
    newest: tuple[tuple[int, ...], str, dict] | None = None
    for path in sorted(out.glob("ckpt-*/worker-*.safetensors")):
        try:
            ckpt = load_worker_checkpoint(path)
        except CheckpointError as exc:
            violations.append(f"{path}: unreadable worker checkpoint ({exc})")
            continue
        rounds = tuple(ckpt.round_ids)
        if rounds in by_rounds:
            other, params = by_rounds[rounds]
            diff = [n for n, t in ckpt.global_params.items() if not torch.equal(t, params[n])]
            if diff:
                violations.append(f"{path} and {other} hold rounds {list(rounds)} with different params {diff[:3]}")
        else:
            by_rounds[rounds] = (str(path), ckpt.global_params)
        if newest is None or rounds > newest[0]:
            newest = (rounds, str(path), ckpt.global_params)
    if newest is None:
        return violations + ["no worker checkpoint to read the committed params from"], None, ""
    return violations, newest[2], newest[1]


def check_checkpoint(ckpt_dir: Path, params_from_workers: Path | None = None) -> tuple[list[str], dict]:
    import torch
    from safetensors.torch import load_file

    from diloco.coordinator.checkpoint import find_newest
    from diloco.data import Corpus
    from diloco.deploy import default_entry
    from diloco.models import ModelConfig, build_model

    found = find_newest(ckpt_dir)
    if found is None:
        return [f"no valid checkpoint in {ckpt_dir}"], {}
    violations = []
    if params_from_workers is not None:
        violations, tensors, path = collective_params(params_from_workers)
        if tensors is None:
            return violations, {}
    else:
        path = found.path
        tensors = load_file(str(path))  # plain safetensors: what anyone outside diloco would read
    model = build_model(ModelConfig(seq_len=default_entry.SEQ_LEN), seed=0)
    names = set(dict(model.named_parameters()))
    params = {n: t for n, t in tensors.items() if n in names}
    if set(params) != names:
        violations.append(f"{path}: the checkpoint lacks parameters {sorted(names - set(params))[:3]}")
        return violations, {}
    bad = [n for n, t in params.items() if not bool(torch.isfinite(t).all())]
    if bad:
        violations.append(f"{path}: non-finite params {bad[:3]}")
        return violations, {}
    corpus = Corpus.from_stdlib(max_bytes=default_entry.CORPUS_BYTES)
    initial = build_model(ModelConfig(seq_len=default_entry.SEQ_LEN), seed=0)
    final = build_model(ModelConfig(seq_len=default_entry.SEQ_LEN), seed=0)
    final.load_state_dict(params, strict=False)
    loss0, loss1 = held_out_loss(initial, corpus), held_out_loss(final, corpus)
    if not loss1 < loss0:
        violations.append(f"held-out loss did not improve: {loss0:.4f} at the start, {loss1:.4f} at the end")
    return violations, {"loss_start": loss0, "loss_end": loss1, "checkpoint": str(path)}


def held_out_loss(model, corpus, batches: int = 20) -> float:
    import torch

    from diloco.data import BatchSampler
    from diloco.deploy import default_entry

    sampler = BatchSampler(corpus.eval, 16, default_entry.SEQ_LEN, seed=1234)
    model.eval()
    total = 0.0
    with torch.no_grad():
        for _ in range(batches):
            x, y = sampler.next()
            total += float(model.loss(x, y))
    return total / batches


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0, help="how long to inject faults (default 30)")
    ap.add_argument("--workers", type=int, default=4, help="worker processes (default 4)")
    ap.add_argument("--seed", type=int, default=1, help="seeds every fault's moment and target (default 1)")
    ap.add_argument("--min-workers", type=int, default=2, help="the quorum at the start (default 2)")
    ap.add_argument("--heartbeat-timeout", type=float, default=10.0, help="server --heartbeat-timeout (default 10)")
    ap.add_argument("--sync-every", type=int, default=10, help="inner steps per round (default 10)")
    ap.add_argument("--worker-kill-every", type=float, default=15.0, help="mean seconds between worker kills")
    ap.add_argument("--coordinator-kill-every", type=float, default=120.0,
                    help="mean seconds between coordinator kills")
    ap.add_argument("--min-workers-every", type=float, default=60.0, help="mean seconds between quorum changes")
    ap.add_argument("--worker-restart-max-s", type=float, default=5.0)
    ap.add_argument("--coordinator-restart-max-s", type=float, default=3.0)
    ap.add_argument("--out", default=None, help="folder for logs and checkpoints (default: a new temporary one)")
    ap.add_argument("--data-plane", choices=("hub", "collective"), default="hub",
                    help="the server's --data-plane (collective: workers also checkpoint every commit)")
    args = ap.parse_args(argv)
    if args.workers < 1 or not 1 <= args.min_workers <= args.workers or args.minutes <= 0:
        ap.error("need --workers >= 1, 1 <= --min-workers <= --workers, --minutes > 0")
    out = Path(args.out or tempfile.mkdtemp(prefix="diloco-chaos-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"chaos: seed {args.seed}, {args.minutes:g} min, {args.workers} workers, min_workers {args.min_workers}, "
          f"data plane {args.data_plane}, "
          f"logs and checkpoints in {out}", flush=True)
    soak = Soak(args, out)
    try:
        soak.run()
    finally:
        soak.close()
    violations, log_stats = check_audit_log(out / "ckpt" / "events.jsonl")
    violations += soak.server_failures
    ck_violations, ck_stats = check_checkpoint(out / "ckpt", out if args.data_plane == "collective" else None)
    violations += ck_violations
    from diloco.coordinator.tracecheck import check_log

    trace = check_log(out / "ckpt")
    print(f"trace validation: {trace.summary()}", flush=True)
    if not trace.ok:
        violations.append(f"trace validation: {trace.summary()}")
    for v in violations:
        print(f"VIOLATION {v}", flush=True)
    print(f"audit log: {log_stats['rounds_applied']} applied rounds over {log_stats['incarnations']} coordinator "
          f"incarnations; checkpoint {ck_stats.get('checkpoint')}: held-out loss {ck_stats.get('loss_start', math.nan):.4f} "
          f"-> {ck_stats.get('loss_end', math.nan):.4f}; {soak.min_worker_changes} min_workers changes", flush=True)
    print(f"RESULT chaos data_plane={args.data_plane} minutes={args.minutes:g} worker_kills={soak.worker_kills} "
          f"coordinator_kills={soak.coordinator_kills} rounds_applied={log_stats['rounds_applied']} "
          f"violations={len(violations)} max_lost_rounds={log_stats['max_lost_rounds']} "
          f"trace_inputs={trace.inputs} trace_divergences={0 if trace.divergence is None else 1}", flush=True)
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
