#!/usr/bin/env python3
"""Chaos soak on real processes: kill and freeze workers and the coordinator at seeded moments, then check the run.

    python scripts/chaos.py --minutes 30 --workers 4 --seed 1     # the long soak (README)
    python scripts/chaos.py --minutes 1.5 --workers 3 --seed 7 \\
        --at-least worker_kills=3,coordinator_kills=1,partitions=1 --max-minutes 3.5   # the CI variant's shape
    python scripts/chaos.py --minutes 30 --workers 4 --data-plane collective --worker-kill-every 8 --coordinator-kill-every 75

A small supervisor starts ``diloco server --checkpoint-dir DIR --resume DIR``
and N ``diloco worker`` processes (the built-in char transformer) on
127.0.0.1, then, at moments drawn from one seeded generator (printed first):

* ``kill -9`` a random live worker, and restart it (same id, same
  ``--checkpoint-dir``) after a short delay;
* ``kill -9`` the coordinator, and restart it with ``--resume`` on the same
  address after a short delay (workers ride out the outage);
* change ``min_workers`` (``diloco set-min-workers``) to a random value in
  1..N;
* freeze a random live worker (``SIGSTOP``) and thaw it (``SIGCONT``) after
  a while, without restarting it (``--worker-freeze-every``): the durations
  take turns, longer than the heartbeat timeout (it is declared dead and must
  re-join when it thaws), shorter (nothing happens), and longer than both
  its own ``--coordinator-timeout`` and the link timeout (its own freeze is
  not the coordinator's silence: it must not give up);
* freeze the coordinator (``--coordinator-freeze-every``), taking turns:
  longer than the heartbeat timeout but shorter than the workers'
  ``--coordinator-timeout`` (they wait and carry on; it declares them dead as
  it thaws and they re-join), shorter than the heartbeat timeout, and longer
  than the workers' ``--coordinator-timeout`` (they write their checkpoints
  and exit 3, and are restarted here as a supervisor would);
* partition a random live worker's link (``--partition-every``): every
  worker but ``w1`` reaches the coordinator through its own
  ``scripts/faultlink.py`` port, which, in turn, black-holes it, drops it
  (connections reset, new ones refused), cuts what it sends (``cut up``),
  cuts what it receives (``cut down``, a half-open link) or delays it, for
  a time that takes turns between past the heartbeat timeout (within the
  workers' ``--coordinator-timeout``) and within it, then heals it. A
  worker has one fault at a time (a partitioned one is neither killed nor
  frozen until healed); the coordinator's faults overlap them.

With ``--at-least KIND=N,...`` (and ``--max-minutes B``) the run injects at
least N faults of each kind named (``worker_kills``, ``coordinator_kills``,
``worker_freezes``, ``coordinator_freezes``, ``partitions``,
``min_worker_changes``: the changes that went through) and goes on until at
least ``rounds_applied=N`` rounds applied (the audit log's ``apply``
lines), whatever the clock and the machine's load: a test that asserts on
the counts cannot fail by chance. A fault of a kind still short of its
count that comes due while it cannot be done (no worker free to take it, the
coordinator not steady) stays due and is done as soon as it can, instead of
being skipped; a quorum change whose admin call failed is tried again 2 s
later. The fault phase lasts at least ``--minutes``, every kind on its
ordinary schedule; past them, the kinds that have their counts stop, each
fault kind still short is due at once and then at most its mean interval
apart, and the run goes on until every count is reached -- but not past
``--max-minutes``: a count still short then is a violation, named in a
``VIOLATION`` line (the system could not take what was asked for). Without
``--at-least`` faults that find no target are skipped and the phase ends at
``--minutes``, as the long soak's figures were measured.

Worker ``w1`` is never killed, frozen nor partitioned, and keeps the default
``--coordinator-timeout`` (600 s): it is the long-lived worker whose memory
and file descriptors are measured, and the one that rides out every
coordinator freeze. The others run with ``--coordinator-timeout`` (default
twice the heartbeat timeout). A worker that exits by itself is restarted
(same id and checkpoint folder) a second later; its exit is a violation
unless it is exit 3 after the coordinator was out of its reach for the whole
of its ``--coordinator-timeout``: killed, frozen, or behind a fault of the
worker's own link, one after the other (through a delayed link a new
connection's handshake alone takes several round trips).

At the end it drains the run and checks, **from the audit log
(``DIR/events.jsonl``) and the final checkpoint only** (the liveness and
growth checks also use what the supervisor did and measured):

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

And on both planes:

7. liveness: the longest stretch with no applied round while the quorum
   held -- the clock runs while the audit log's last ``quorum`` line says
   the run is not below ``min_workers`` (a ``start`` line: below, until its
   quorum forms) and the coordinator is not out by this script's doing (from
   a kill to the next ``start`` line, from a freeze to its thaw), stops
   otherwise and goes on from where it stopped (a quorum that comes and
   goes does not hide a run that never applies), and an ``apply`` resets
   it -- must stay under ``2 x heartbeat timeout + 4 x round + 10 s``
   (round: the median time between applied rounds). A fault costs at most
   the heartbeat timeout (a frozen member is awaited until it is declared
   dead) and a round or two (a member that re-joins mid-round trains the
   round from its Welcome); the bound allows two overlapping ones.
8. growth: resident memory (``VmRSS``) and open file descriptors of the
   coordinator and of ``w1``, sampled every 2 s (``DIR/samples.jsonl``),
   from a 10 s window once the process is warm (10 rounds in by its own
   log, and at least 10 s after it started: start-up and first-round
   allocations done; for ``w1``, at least a tenth of ``--minutes`` too: a
   collective member's heap settles over its first minutes, its bytes in
   use flat while the free space between them grows to a plateau) to a
   10 s window after the heal at the end (every
   worker back), must grow by less than 5 %. RSS is the least sample of
   each window (a transient buffer does not count; a leak raises the
   floor). The fds figure leaves out established TCP connections, which
   come and go with the members (a connection left in another state, such
   as CLOSE_WAIT, still counts), and compares the most of the first window
   with the least of the last. A restarted coordinator is a new process:
   the last incarnation is measured from its own warm-up (the heal waits,
   up to a minute, for a young one's windows; if it is still too young, the
   longest-lived one is measured, from its warm-up to its last samples, and
   the line says which).
9. a worker frozen past the heartbeat timeout re-joins (a ``join`` line)
   within 60 s of its thaw, as the same process;
10. partitions (SPEC.md section 13, "Partitions"): a worker black-holed,
   dropped or cut up past the heartbeat timeout was let go (``dead``, or
   ``left`` crashed) unless the coordinator was out meanwhile, and re-joins
   within 60 s of the heal as the same process; one delayed or cut down was
   not let go unless the coordinator was out meanwhile. A worker not yet a
   member when its link was cut (restarting, or not yet joined to a
   coordinator that restarted: a ``start`` line forgets every member) has
   nothing to be let go of: it must join within 60 s of the heal.

Every run ends with trace validation (``diloco check-log``): the audit log's
inputs, replayed through the pure machine from each incarnation's snapshot,
must give exactly the effects and decisions the live coordinators logged; a
divergence is a violation (``trace_divergences`` in the RESULT line).

It reports how many applied rounds a coordinator kill lost (the rounds the
log recorded before the kill minus those the restarted coordinator resumed
with: persist-before-announce makes it 0). Last line::

    RESULT chaos data_plane=P minutes=M worker_kills=N coordinator_kills=N worker_freezes=N coordinator_freezes=N
        partitions=N workers_gave_up=N rounds_applied=N violations=N max_lost_rounds=N trace_inputs=N trace_divergences=N
        max_stall_s=S stall_bound_s=S rss_growth=+P% fd_growth=+P%

(``rss_growth`` and ``fd_growth``: the larger of the coordinator's and
``w1``'s; with ``--at-least``, ``minutes`` is how long the fault phase
lasted.) Besides the logs and checkpoints, ``--out DIR`` keeps
``samples.jsonl`` (the memory and descriptor samples) and ``faults.json``
(every outage, kill, exit, freeze and partition, with wall-clock times).

A coordinator that exits by itself (for example, refusing to resume) and a
final ``shutdown --save`` that fails are violations too: a run that cannot
be resumed has lost the crash-safety it exists for. Exit 1 on any
violation. Every process it starts is thawed (``SIGCONT``) and killed by pid
at the end.

About 1,300 lines in one script: the README's soak is run and read as one
program -- the seeded fault schedule, the supervision of the real processes it
kills, freezes and restarts, and the checks over the run's event log share one
run's state, and the CI variant runs the same code.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from diloco.transport.zmq.options import DEFAULT_LINK_TIMEOUT_MS

sys.path.insert(0, str(Path(__file__).resolve().parent))
from faultlink import FaultLink  # noqa: E402


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
        self.started = time.monotonic()
        self.frozen = False
        self.popen = subprocess.Popen([sys.executable, "-m", "diloco", *args], stdout=self._log,
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=log_dir)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def freeze(self) -> None:
        if self.alive():
            os.kill(self.pid, signal.SIGSTOP)
            self.frozen = True

    def thaw(self) -> None:
        if self.frozen and self.alive():
            os.kill(self.pid, signal.SIGCONT)
        self.frozen = False

    def kill9(self) -> None:
        self.thaw()  # a stopped process dies of SIGKILL too, but is never left stopped
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def listening(self) -> bool:
        """A server: it printed its address (read from its log until it has)."""
        if not getattr(self, "_listening", False):
            self._listening = "listening on tcp://" in self.output()
        return self._listening


def established_inodes(pid: int) -> set[str]:
    """Socket inodes of the established TCP connections in the process's network namespace."""
    inodes = set()
    for name in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 9 and cols[3] == "01":  # ESTABLISHED
                inodes.add(cols[9])
    return inodes


def proc_figures(pid: int) -> tuple[int, int, int] | None:
    """(VmRSS in kB, open fds, of which established TCP connections) of a process, or None if it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        rss = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
        fds = os.listdir(f"/proc/{pid}/fd")
        established = established_inodes(pid)
        connections = 0
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            connections += target.startswith("socket:[") and target[8:-1] in established
        return rss, len(fds), connections
    except (OSError, StopIteration, ValueError):
        return None


#: Freeze kinds, taken in turn (the first of each target's is the one that matters most).
WORKER_FREEZES = ("past the heartbeat timeout", "within the heartbeat timeout",
                  "past its coordinator timeout and the link timeout")
COORDINATOR_FREEZES = ("past the heartbeat timeout", "within the heartbeat timeout",
                       "past the workers' coordinator timeout")
#: Partition kinds, in turn (scripts/faultlink.py); their durations take turns too (PARTITION_SPANS), and
#: five kinds against two spans meet every pairing within ten partitions.
PARTITIONS = ("blackhole", "drop", "cut up", "cut down", "delay")
PARTITION_SPANS = ("past the heartbeat timeout", "within the heartbeat timeout")
#: Kinds after which, past the heartbeat timeout, the coordinator has heard nothing and must have let the
#: worker go (dead, or lost: a reset connection); the others keep it a member (SPEC.md section 13).
SEVERING = ("blackhole", "drop", "cut up")
LINK_TIMEOUT_S = DEFAULT_LINK_TIMEOUT_MS / 1000
MEASURED = "w1"  # never killed nor frozen; default --coordinator-timeout
SAMPLE_EVERY_S = 2.0
#: A measured process is warm (its start window begins) this long after it started and this many rounds in.
WARM_S = 10.0
#: ``w1``'s growth is measured from this share of the fault phase on (at least ``WARM_S``): a
#: collective member's heap settles over its first minutes -- its bytes in use stay flat, the free
#: space between them grows to a plateau (glibc ``mallinfo2``, no faults: arena 151.9 -> 156.6 MB
#: in 4 min, then flat; in use 133-139 MB throughout) -- and a leak is what grows after that.
WORKER_SETTLE_SHARE = 0.1
WARM_ROUNDS = 10
WINDOW_S = 10.0
#: A worker's exit is seen at most this long after it gave up.
EXIT_S = 10.0
#: A thawed worker is not frozen again for this long.
REJOIN_S = 10.0
#: The fault kinds ``--at-least`` counts (named as the RESULT line names them), each with the option that sets
#: its mean interval, in the order their first moments are drawn (the seeded sequence depends on it).
FAULT_EVERY = {"worker_kills": "worker_kill_every", "coordinator_kills": "coordinator_kill_every",
               "min_worker_changes": "min_workers_every", "worker_freezes": "worker_freeze_every",
               "coordinator_freezes": "coordinator_freeze_every", "partitions": "partition_every"}
#: What ``--at-least`` counts: the fault kinds, and the rounds applied (the audit log's ``apply`` lines: no fault,
#: the run only goes on until that many applied, so that a loaded machine cannot leave it with too few).
COUNTED = (*FAULT_EVERY, "rounds_applied")
#: Kinds that take a worker other than ``w1`` (which is never faulted): they need a second worker.
WORKER_FAULTS = ("worker_kills", "worker_freezes", "partitions")
#: A quorum change whose admin call failed is tried again this long after, while its kind is owed.
RETRY_S = 2.0


class AppliedRounds:
    """The rounds applied so far by every coordinator incarnation: the audit log's ``apply`` lines, read as
    it grows (whole lines only: the last may be half-written)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._read = 0
        self._count = 0

    def count(self) -> int:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._read)
                data = f.read()
        except OSError:  # not written yet
            return self._count
        whole = data.rfind(b"\n") + 1
        for line in data[:whole].splitlines():
            try:
                self._count += json.loads(line).get("event") == "apply"
            except ValueError:
                pass  # a line torn by a kill -9: check_audit_log judges it
        self._read += whole
        return self._count


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
        self.thaw_at: dict[str, float] = {}         # frozen worker id -> when to thaw it
        self.server_thaw_at: float | None = None
        self.worker_kills = 0
        self.kill_log: list[tuple[float, str]] = []  # (wall clock, worker id) of each worker kill
        self.coordinator_kills = 0
        self.worker_freezes = 0
        self.coordinator_freezes = 0
        self.workers_gave_up = 0
        self.min_worker_changes = 0
        self.server_starts = 0
        #: Coordinator processes that exited by themselves (not killed here): each is a violation.
        self.server_failures: list[str] = []
        #: Workers that exited by themselves: (wall clock, worker id, exit code, last line).
        self.worker_exits: list[tuple[float, str, int, str]] = []
        #: Coordinator outages this script caused: [kind, wall start, wall end or None (kill: until the
        #: next incarnation's ``start`` line; freeze: the thaw)].
        self.outages: list[list] = []
        #: Worker freezes: (worker id, pid, wall freeze, wall thaw, seconds).
        self.frozen_workers: list[tuple[str, int, float, float, float]] = []
        self._freezing: dict[str, tuple[int, float, float]] = {}  # worker id -> (pid, wall, monotonic)
        self._thawed_at: dict[str, float] = {}  # worker id -> when it last thawed (monotonic)
        self._server_frozen_at: tuple[float, float] | None = None
        #: Samples per process name: (monotonic, VmRSS kB, fds); process name -> (pid, monotonic start).
        self.samples: dict[str, list[tuple[float, int, int]]] = {}
        self.sampled: dict[str, tuple[int, float]] = {}
        self.warm_at: dict[str, float] = {}  # process name -> when it was warm (the start window begins)
        self.heal_at: float | None = None
        self.heal_wall: float | None = None
        self.measured_until: float | None = None
        self._worker_freeze_turn = 0
        self._coordinator_freeze_turn = 0
        #: When the coordinator was last back (thawed or restarted): its next fault waits a few seconds.
        self.coordinator_back_at = 0.0
        #: Each worker but ``w1`` reaches the coordinator through its own FaultLink (with partitions on).
        self.links: dict[str, FaultLink] = {}
        self.heal_link_at: dict[str, float] = {}  # partitioned worker id -> when to heal its link
        self._partitioning: dict[str, tuple[int, str, float, float]] = {}  # id -> (pid, kind, wall, monotonic)
        self._healed_at: dict[str, float] = {}
        #: Partitions: (worker id, pid, kind, wall start, wall heal, seconds).
        self.partitions: list[tuple[str, int, str, float, float, float]] = []
        self._partition_turn = 0
        #: --at-least: past --minutes, only the kinds still short go on (each due at once, then at most its
        #: mean interval apart); the fault phase's length in minutes, and the counts it did not reach.
        self.overtime = False
        self.fault_minutes = 0.0
        self.unreached: dict[str, tuple[int, int]] = {}
        self.applied = AppliedRounds(self.ckpt / "events.jsonl")

    # ------------------------------------------------------------------ --at-least

    def done(self, kind: str) -> int:
        """How many faults of ``kind`` the soak has injected (a partition counts from when it starts)."""
        if kind == "partitions":
            return len(self.partitions) + len(self._partitioning)
        if kind == "rounds_applied":
            return self.applied.count()
        return getattr(self, kind)

    def owed(self, kind: str) -> bool:
        """``--at-least`` asks for more of ``kind`` than were injected: a due one that cannot be done stays due."""
        return self.done(kind) < (self.args.at_least or {}).get(kind, 0)

    def shortfall(self) -> dict[str, tuple[int, int]]:
        """The kinds still short of their ``--at-least`` counts: kind -> (done, asked)."""
        return {kind: (self.done(kind), n) for kind, n in (self.args.at_least or {}).items() if self.owed(kind)}

    def keep_injecting(self, now: float, bound: float, due: dict[str, float]) -> bool:
        """Past ``--minutes``: whether the fault phase goes on (a count still short, and ``--max-minutes`` ahead).

        The first time it does, the kinds that have their counts stop (the ones still short get the run to
        themselves) and each kind still short is due at once: it was owed already.
        """
        short = self.shortfall()
        if not short or now >= bound:
            return False
        if not self.overtime:
            self.overtime = True
            for kind in due:
                due[kind] = now if self.owed(kind) else math.inf
            self.say(f"{self.args.minutes:g} min of faults done, still short of --at-least: {counts_text(short)}; "
                     f"going on with those kinds alone until they are done, {self.args.max_minutes:g} min at most")
        return True

    def end_at_least(self) -> None:
        """The fault phase is over: say whether every ``--at-least`` count was reached (``unreached``: which not)."""
        self.unreached = self.shortfall()
        if self.unreached:
            self.say(f"--at-least not reached by --max-minutes {self.args.max_minutes:g}: "
                     f"{counts_text(self.unreached)}")
        else:
            reached = {kind: (self.done(kind), n) for kind, n in self.args.at_least.items()}
            self.say(f"--at-least reached in {self.fault_minutes:.2f} min of faults: {counts_text(reached)}")

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

    def worker_address(self, wid: str) -> str:
        """The coordinator's address for ``wid``: its own FaultLink's when partitions are on (never w1's)."""
        if self.args.partition_every <= 0 or wid == MEASURED:
            return self.address
        if wid not in self.links:
            host, port = self.address.removeprefix("tcp://").rsplit(":", 1)
            self.links[wid] = FaultLink((host, int(port)), name=wid).start()
        return self.links[wid].address

    def start_worker(self, wid: str) -> None:
        if wid in self.workers:
            self.workers[wid].kill9()
        timeout = 600 if wid == MEASURED else self.args.coordinator_timeout
        self.workers[wid] = Proc(f"worker-{wid}", [
            "worker", "--connect", self.worker_address(wid), "--id", wid, "--checkpoint-dir", str(self.out / f"ckpt-{wid}"),
            "--sync-every", str(self.args.sync_every), "--coordinator-timeout", f"{timeout:g}",
            *(["--checkpoint-every", "1"] if self.args.data_plane == "collective" else [])], self.out, self.env)

    def admin(self, *args: str) -> int:
        r = subprocess.run([sys.executable, "-m", "diloco", *args, "--connect", self.address, "--timeout", "10"],
                           capture_output=True, text=True, env=self.env, timeout=60)
        return r.returncode

    def close(self) -> None:
        for p in [*self.workers.values(), *([self.server] if self.server else [])]:
            p.kill9()
        for link in self.links.values():
            link.close()

    # ------------------------------------------------------------------ partitions

    def partition(self, wid: str, now: float) -> None:
        a, hb = self.args, self.args.heartbeat_timeout
        kind = PARTITIONS[self._partition_turn % len(PARTITIONS)]
        span = PARTITION_SPANS[self._partition_turn % len(PARTITION_SPANS)]
        self._partition_turn += 1
        # Past the heartbeat timeout but within the workers' --coordinator-timeout (they must not give up),
        # or well within the heartbeat timeout (nothing but time may change).
        seconds = (self.rng.uniform(1.2 * hb, max(1.3 * hb, 0.8 * a.coordinator_timeout))
                   if span == PARTITION_SPANS[0] else self.rng.uniform(0.2 * hb, 0.8 * hb))
        mode = kind
        if kind == "delay":  # a slow link for a while: each byte late by a fraction of the heartbeat timeout
            mode = f"delay {self.rng.uniform(0.05, 0.25) * hb:.2f}"
            seconds *= 2
        self.links[wid].set(mode)
        self.heal_link_at[wid] = now + seconds
        self._partitioning[wid] = (self.workers[wid].pid, mode, time.time(), now)
        self.say(f"partition worker {wid} (pid {self.workers[wid].pid}): {mode} for {seconds:.1f} s, {span} "
                 f"(partition {len(self.partitions) + len(self._partitioning)})")

    def heal_link(self, wid: str, now: float) -> None:
        self.heal_link_at.pop(wid, None)
        pid, mode, wall, mono = self._partitioning.pop(wid)
        self.links[wid].set("pass")
        self._healed_at[wid] = now
        self.partitions.append((wid, pid, mode, wall, time.time(), now - mono))
        self.say(f"heal worker {wid}'s link ({mode}) after {now - mono:.1f} s")

    # ------------------------------------------------------------------ freezes

    def worker_freeze_s(self) -> tuple[float, str]:
        a, hb = self.args, self.args.heartbeat_timeout
        kind = WORKER_FREEZES[self._worker_freeze_turn % len(WORKER_FREEZES)]
        self._worker_freeze_turn += 1
        if kind == WORKER_FREEZES[0]:
            return self.rng.uniform(1.2 * hb, max(1.3 * hb, min(2.0 * hb, 0.9 * a.coordinator_timeout))), kind
        if kind == WORKER_FREEZES[1]:
            return self.rng.uniform(0.2 * hb, 0.8 * hb), kind
        return self.rng.uniform(1.1, 1.3) * max(a.coordinator_timeout, LINK_TIMEOUT_S), kind

    def coordinator_freeze_s(self) -> tuple[float, str]:
        a, hb = self.args, self.args.heartbeat_timeout
        kind = COORDINATOR_FREEZES[self._coordinator_freeze_turn % len(COORDINATOR_FREEZES)]
        self._coordinator_freeze_turn += 1
        if kind == COORDINATOR_FREEZES[0]:
            return self.rng.uniform(1.2 * hb, max(1.3 * hb, 0.9 * a.coordinator_timeout)), kind
        if kind == COORDINATOR_FREEZES[1]:
            return self.rng.uniform(0.2 * hb, 0.8 * hb), kind
        return self.rng.uniform(1.1, 1.4) * a.coordinator_timeout, kind

    def freeze_worker(self, wid: str, now: float) -> None:
        seconds, kind = self.worker_freeze_s()
        p = self.workers[wid]
        p.freeze()
        self.worker_freezes += 1
        self.thaw_at[wid] = now + seconds
        self._freezing[wid] = (p.pid, time.time(), now)
        self.say(f"freeze worker {wid} (pid {p.pid}) for {seconds:.1f} s, {kind} "
                 f"(freeze {self.worker_freezes})")

    def thaw_worker(self, wid: str, now: float) -> None:
        self.thaw_at.pop(wid, None)
        pid, wall, mono = self._freezing.pop(wid)
        p = self.workers[wid]
        p.thaw()
        self._thawed_at[wid] = now
        self.frozen_workers.append((wid, pid, wall, time.time(), now - mono))
        self.say(f"thaw worker {wid} (pid {pid}) after {now - mono:.1f} s")

    def freeze_server(self, now: float) -> None:
        seconds, kind = self.coordinator_freeze_s()
        self.server.freeze()
        self.coordinator_freezes += 1
        self.server_thaw_at = now + seconds
        self._server_frozen_at = (time.time(), now)
        self.outages.append(["freeze", time.time(), None])
        self.say(f"freeze coordinator (pid {self.server.pid}) for {seconds:.1f} s, {kind} "
                 f"(freeze {self.coordinator_freezes})")

    def thaw_server(self, now: float) -> None:
        self.server_thaw_at = None
        self.coordinator_back_at = now
        self.server.thaw()
        self.outages[-1][2] = time.time()
        self.say(f"thaw coordinator (pid {self.server.pid}) after {now - self._server_frozen_at[1]:.1f} s")

    # ------------------------------------------------------------------ memory and descriptors

    def sample(self, now: float) -> None:
        """VmRSS and open fds of the coordinator and ``w1`` (also appended to ``samples.jsonl``)."""
        procs = [self.server] if self.server is not None else []
        if MEASURED in self.workers:
            procs.append(self.workers[MEASURED])
        for p in procs:
            if not p.alive():
                continue
            figures = proc_figures(p.pid)
            if figures is None:
                continue
            rss, fds, connections = figures
            self.sampled.setdefault(p.name, (p.pid, p.started))
            # Established connections come and go with the members: the fds figure leaves them out.
            self.samples.setdefault(p.name, []).append((now, rss, fds - connections))
            warm_s = WARM_S if p.name.startswith("server") else max(WARM_S, WORKER_SETTLE_SHARE * self.args.minutes * 60)
            if p.name not in self.warm_at and now - p.started >= warm_s:
                # Warm once it has also been through a few rounds (first-round allocations done).
                text = p.output()
                if text.count("applied  fragment" if p.name.startswith("server") else "synced: next") >= WARM_ROUNDS:
                    self.warm_at[p.name] = now
            with open(self.out / "samples.jsonl", "a") as f:
                f.write(json.dumps({"t": round(time.time(), 2), "process": p.name, "pid": p.pid, "rss_kb": rss,
                                    "fds": fds, "connections": connections, "warm": p.name in self.warm_at}) + "\n")

    def growth(self, end: float) -> dict[str, dict]:
        """The coordinator's and ``w1``'s figures after their warm-up and at the end (check 8).

        The start window is the 10 s from when the process was warm (``WARM_S`` after it
        started, and ``WARM_ROUNDS`` rounds in); the end window the last 10 s before
        ``end`` (after the heal: every worker back), or before the process died. RSS: the
        least sample of each window; open fds (but established TCP connections): the most
        of the start window against the least of the end window.
        """
        spans = {}
        for name, samples in self.samples.items():
            pid, started = self.sampled[name]
            warm = self.warm_at.get(name, math.inf)
            first = [x for x in samples if warm <= x[0] <= warm + WINDOW_S]
            last_t = min(end, samples[-1][0])
            last = [x for x in samples if last_t - WINDOW_S <= x[0] <= last_t]
            if first and last and last[0][0] > first[-1][0]:
                spans[name] = {"pid": pid, "from": first[0][0], "to": last[-1][0],
                               "rss": (min(x[1] for x in first), min(x[1] for x in last)),
                               "fds": (max(x[2] for x in first), min(x[2] for x in last))}
        servers = sorted(n for n in self.samples if n.startswith("server-"))
        out = {}
        if servers:
            last = servers[-1]
            if last in spans:
                out["coordinator"] = {**spans[last], "name": last}
            else:
                measured = [n for n in servers if n in spans]
                if measured:
                    best = max(measured, key=lambda n: spans[n]["to"] - spans[n]["from"])
                    out["coordinator"] = {**spans[best], "name": best,
                                          "note": f"{last}, the last, was too young to measure"}
        if f"worker-{MEASURED}" in spans:
            out[MEASURED] = {**spans[f"worker-{MEASURED}"], "name": f"worker-{MEASURED}"}
        return out

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
        bound = t0 + a.max_minutes * 60 if a.at_least is not None else end
        warmup = min(30.0, a.minutes * 60 / 4)

        def first(every: float) -> float:
            return t0 + warmup + self.rng.expovariate(1 / every) if every > 0 else math.inf

        def after(now: float, kind: str) -> float:
            every = getattr(a, FAULT_EVERY[kind])
            if self.overtime and not self.owed(kind):
                return math.inf  # past --minutes, a kind with its count stops
            gap = self.rng.expovariate(1 / every) if every > 0 else math.inf
            # Past --minutes, no long draw may stand between a kind still short and --max-minutes.
            return now + (min(gap, every) if self.overtime else gap)

        def skipped(now: float, kind: str) -> None:
            """A due fault found nothing to take it: skipped until its next moment, unless it is owed."""
            if not self.owed(kind):
                due[kind] = after(now, kind)

        due = {kind: first(getattr(a, every)) for kind, every in FAULT_EVERY.items()}
        last_report = t0
        next_sample = t0
        while True:
            now = time.monotonic()
            if now >= end and not self.keep_injecting(now, bound, due):
                break
            for wid, at in list(self.thaw_at.items()):
                if now >= at:
                    self.thaw_worker(wid, now)
            for wid, at in list(self.heal_link_at.items()):
                if now >= at:
                    self.heal_link(wid, now)
            if self.server_thaw_at is not None and now >= self.server_thaw_at:
                self.thaw_server(now)
            for wid, at in list(self.restart_at.items()):
                if now >= at:
                    del self.restart_at[wid]
                    self.start_worker(wid)
            if self.server_restart_at is not None and now >= self.server_restart_at:
                self.server_restart_at = None
                self.start_server()
                self.coordinator_back_at = math.inf  # until it listens
                self.say("coordinator restarted with --resume")
            server_up = self.server_restart_at is None and self.server is not None
            server_frozen = self.server_thaw_at is not None
            if server_up and self.coordinator_back_at == math.inf and self.server.listening():
                self.coordinator_back_at = now
            # The coordinator's faults do not follow each other without it serving a while in between.
            server_steady = server_up and not server_frozen and now >= self.coordinator_back_at + 5.0
            # One fault per worker at a time: a partitioned worker is neither killed nor frozen until healed.
            targets = sorted(w for w, p in self.workers.items()
                             if p.alive() and w not in self.restart_at and w not in self.thaw_at and w != MEASURED
                             and w not in self.heal_link_at)
            if now >= due["worker_kills"]:
                if targets:
                    wid = self.rng.choice(targets)
                    self.workers[wid].kill9()
                    self.worker_kills += 1
                    self.kill_log.append((time.time(), wid))
                    self.restart_at[wid] = now + self.rng.uniform(1.0, a.worker_restart_max_s)
                    self.say(f"kill -9 worker {wid} (kill {self.worker_kills})")
                    targets.remove(wid)
                    due["worker_kills"] = after(now, "worker_kills")
                else:
                    skipped(now, "worker_kills")
            if now >= due["worker_freezes"]:
                # Not a worker that thawed moments ago: it re-joins first (check 9).
                thawed = [w for w in targets if now >= max(self._thawed_at.get(w, -math.inf),
                                                           self._healed_at.get(w, -math.inf)) + REJOIN_S]
                if thawed:
                    wid = self.rng.choice(thawed)
                    self.freeze_worker(wid, now)
                    targets.remove(wid)  # one fault at a time: not partitioned in this same pass
                    due["worker_freezes"] = after(now, "worker_freezes")
                else:
                    skipped(now, "worker_freezes")
            if now >= due["partitions"]:
                # Not one that thawed or healed moments ago: it re-joins first (check 9).
                settled = [w for w in targets if now >= max(self._thawed_at.get(w, -math.inf),
                                                            self._healed_at.get(w, -math.inf)) + REJOIN_S]
                if settled:
                    wid = self.rng.choice(settled)
                    self.partition(wid, now)
                    targets.remove(wid)
                    due["partitions"] = after(now, "partitions")
                else:
                    skipped(now, "partitions")
            # The coordinator's faults and the quorum change stay due while the coordinator cannot take them.
            if now >= due["coordinator_kills"] and server_steady:
                self.server.kill9()
                self.coordinator_kills += 1
                self.outages.append(["kill", time.time(), None])
                self.server_restart_at = now + self.rng.uniform(0.5, a.coordinator_restart_max_s)
                self.say(f"kill -9 coordinator (kill {self.coordinator_kills})")
                due["coordinator_kills"] = after(now, "coordinator_kills")
                server_up = server_steady = False
            if now >= due["coordinator_freezes"] and server_steady and self.server.alive():
                self.freeze_server(now)
                due["coordinator_freezes"] = after(self.server_thaw_at, "coordinator_freezes")
                server_frozen = True
            if now >= due["min_worker_changes"] and server_up and not server_frozen:
                n = self.rng.randint(1, a.workers)
                rc = self.admin("set-min-workers", str(n))
                self.min_worker_changes += rc == 0
                self.say(f"set-min-workers {n} (exit {rc})")
                # Refused or unanswered, an owed change is tried again soon (not at once: each try is a process).
                due["min_worker_changes"] = (now + RETRY_S if rc != 0 and self.owed("min_worker_changes")
                                             else after(now, "min_worker_changes"))
            if self.server_restart_at is None and self.server is not None and not self.server.alive():
                # A coordinator must never die on its own, least of all refuse to resume: a
                # violation; restart it as a supervisor would (and again, if it keeps failing).
                lines = [ln for ln in self.server.output().splitlines() if ln.strip()]
                aborted = [ln for ln in lines if "Assertion failed" in ln]
                self.server_failures.append(f"{self.server.name} exited ({self.server.popen.returncode}) "
                                            f"by itself: {(aborted or lines or [''])[-1]}")
                self.say(f"VIOLATION coordinator exited by itself: {self.server_failures[-1]}")
                if self.server_thaw_at is not None:
                    self.server_thaw_at = None
                    self.outages[-1][2] = time.time()
                self.server.kill9()
                self.outages.append(["failure", time.time(), None])
                self.server_restart_at = now + 2.0
            for wid, p in self.workers.items():
                if not p.alive() and wid not in self.restart_at:
                    rc = p.popen.returncode
                    lines = [ln for ln in p.output().splitlines() if ln.strip()]
                    self.worker_exits.append((time.time(), wid, rc, lines[-1] if lines else ""))
                    self.workers_gave_up += rc == 3
                    what = "gave up on the coordinator" if rc == 3 else "exited on its own"
                    self.say(f"worker {wid} {what} (exit {rc}); restarting it")
                    self.thaw_at.pop(wid, None)
                    if self._freezing.pop(wid, None):
                        p.frozen = False
                    self.restart_at[wid] = now + 1.0
            if now >= next_sample:
                next_sample = now + SAMPLE_EVERY_S
                self.sample(now)
            if now - last_report >= 30:
                last_report = now
                short = self.shortfall()
                self.say(f"{(now - t0) / 60:.1f} min: {self.worker_kills} worker kills, "
                         f"{self.coordinator_kills} coordinator kills, {self.worker_freezes} worker freezes, "
                         f"{self.coordinator_freezes} coordinator freezes, {len(self.partitions)} partitions"
                         + (f"; still short of --at-least: {counts_text(short)}" if short else ""))
            time.sleep(0.2)
        # Heal and end: everyone thawed and back, the quorum reachable, then a drain.
        self.heal_at = time.monotonic()
        self.heal_wall = time.time()
        self.fault_minutes = (self.heal_at - t0) / 60
        if a.at_least is not None:
            self.end_at_least()
        for wid in list(self.thaw_at):
            self.thaw_worker(wid, time.monotonic())
        for wid in list(self.heal_link_at):
            self.heal_link(wid, time.monotonic())
        if self.server_thaw_at is not None:
            self.thaw_server(time.monotonic())
        if self.server_restart_at is not None or self.server is None or not self.server.alive():
            self.start_server()
        for wid in list(self.restart_at):
            self.start_worker(wid)
        self.restart_at.clear()
        # Every worker back and trained on a while: the end window of the growth figures (for a young
        # coordinator, long enough for both of its windows, within a minute).
        settle_from = time.monotonic()
        while True:
            now = time.monotonic()
            warm = self.warm_at.get(self.server.name, math.inf)
            if now >= settle_from + 60 or (now >= settle_from + 5 + WINDOW_S + 1 and now >= warm + 2 * WINDOW_S + 1):
                break
            self.sample(now)
            time.sleep(SAMPLE_EVERY_S)
        self.measured_until = time.monotonic()
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


def read_events(path: Path) -> list[dict]:
    events = []
    for raw in (path.read_text().splitlines() if path.exists() else []):
        try:
            events.append(json.loads(raw))
        except ValueError:
            pass  # a torn line: check_audit_log reports one that is not the last
    return events


def merged(spans: list[tuple[float, float]], gap_s: float = 1.0) -> list[tuple[float, float]]:
    """Spans that overlap or nearly touch (within ``gap_s``) joined into one."""
    out: list[tuple[float, float]] = []
    for b, e in sorted(spans):
        if out and b <= out[-1][1] + gap_s:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((b, e))
    return out


def outage_spans(outages: list[list], events: list[dict], end: float) -> list[tuple[float, float]]:
    """The coordinator's outages this script caused, as merged (wall start, wall end) spans.

    ``outages``: [kind, wall start, wall end or None]; a kill's (and a failure's) lasts
    until the next ``start`` line of the audit log. Spans less than a second apart are one.
    """
    starts = [e["t"] for e in events if e.get("event") == "start"]
    spans = []
    for kind, begin, stop in outages:
        if kind in ("kill", "failure") or stop is None:
            stop = next((t for t in starts if t > begin), end)
        spans.append((begin, stop))
    return merged(spans)


def liveness(events: list[dict], outages: list[list], end_wall: float, heartbeat_timeout: float) -> dict:
    """Check 7: the longest stretch with no applied round while the quorum held and the coordinator was up."""
    spans = outage_spans(outages, events, end_wall)
    marks = sorted([(b, 1) for b, _ in spans] + [(e, -1) for _, e in spans])
    applies = [e["t"] for e in events if e.get("event") == "apply"]
    gaps = sorted(b - a for a, b in zip(applies, applies[1:]))
    round_s = gaps[len(gaps) // 2] if gaps else 0.0
    bound = 2 * heartbeat_timeout + 4 * round_s + 10.0
    # Walk the audit log and the outage marks in time order; the clock runs while both allow it.
    points = [(e["t"], 0, e) for e in events if e.get("event") in ("start", "quorum", "apply")]
    points += [(t, 1, d) for t, d in marks]
    points.sort(key=lambda x: (x[0], x[1]))
    quorum, out, stall, since, worst, last_t = False, 0, 0.0, None, (0.0, None, None), None
    for t, is_mark, what in points + [(end_wall, 2, None)]:
        if last_t is not None and quorum and out == 0:
            stall += max(0.0, t - last_t)
            since = since if since is not None else last_t
        last_t = t
        if stall > worst[0]:
            worst = (stall, since, t)
        if is_mark == 1:
            out += what
        elif is_mark == 0:
            ev = what["event"]
            if ev == "start":
                quorum = False
            elif ev == "quorum":
                quorum = not what.get("below_min_workers", True)
            elif ev == "apply":
                stall, since = 0.0, None
    return {"max_stall_s": worst[0], "stall_from": worst[1], "stall_to": worst[2], "round_s": round_s,
            "stall_bound_s": bound}


def rejoined(who: str, how: str, back: float | None, since: float, event: str, end_t: float,
             violations: list[str], notes: list[str]) -> None:
    """Check 9 and 10: a worker let go (``how``) must re-join (``back``) within 60 s of ``since``."""
    if back is not None and back - since <= 60:
        notes.append(f"{who}: {how}, re-joined {back - since:.1f} s after {event}, same process")
    elif since + 60 <= end_t:
        violations.append(f"{who} ({how}) did not re-join within 60 s of {event}")


def check_workers(soak: "Soak", events: list[dict]) -> tuple[list[str], list[str]]:
    """Worker exits (only exit 3 after an outage of the whole coordinator timeout) and check 9 (re-joins)."""
    violations, notes = [], []
    spans = outage_spans(soak.outages, events, math.inf)
    for wall, wid, rc, last in soak.worker_exits:
        limit = 600 if wid == MEASURED else soak.args.coordinator_timeout
        # It gave up at some moment g up to EXIT_S before its exit was seen (a checkpoint to write, an
        # interpreter to end): the coordinator must have been out of its reach from g - limit (3 s spare) to
        # g: out by this script's doing, or behind a fault of the worker's own link (any kind: through a
        # delayed link a new connection's handshake alone takes several round trips), one after the other;
        # the worker's own freezes count too (the time it did not run is not its silence, W11).
        reach = merged(spans + [(b, e) for w, _, _, b, e, _ in soak.partitions if w == wid]
                       + [(b, e) for w, _, b, e, _ in soak.frozen_workers if w == wid])
        covered = any(max(b + limit - 3, wall - EXIT_S) <= min(e, wall) for b, e in reach)
        if rc == 3 and covered:
            continue
        why = "gave up (exit 3) on a coordinator that was not out for its --coordinator-timeout" if rc == 3 \
            else f"exited by itself (exit {rc})"
        violations.append(f"worker {wid} {why} at {time.strftime('%H:%M:%S', time.localtime(wall))}: {last}")
    joins = [(e["t"], e.get("worker_id")) for e in events if e.get("event") == "join"]
    gone = [(e["t"], e.get("worker_id"), e.get("event") + (f" ({e['cause']})" if e.get("cause") else ""))
            for e in events if e.get("event") in ("dead", "left")]
    end_t = events[-1]["t"] if events else 0.0
    restarted = [(t, w) for t, w, _, _ in soak.worker_exits] + soak.kill_log
    for wid, pid, frozen, thawed, seconds in soak.frozen_workers:
        if seconds <= soak.args.heartbeat_timeout + 1:
            continue
        how = next((what for t, w, what in gone if w == wid and frozen <= t <= thawed + 5), None)
        if how is None:
            notes.append(f"worker {wid} (pid {pid}) frozen {seconds:.1f} s was not declared gone (the "
                         f"coordinator was out too)")
            continue
        back = next((t for t, w in joins if w == wid and t >= thawed - 1), None)
        if any(w == wid and thawed - 1 <= t <= (back or thawed + 60) for t, w in restarted):
            continue  # killed, or exited (a violation above if it should not have), before it re-joined
        rejoined(f"worker {wid} (pid {pid}) frozen {seconds:.1f} s", how, back, thawed, "its thaw", end_t,
                 violations, notes)
    hb = soak.args.heartbeat_timeout
    membership = sorted([(t, w, True) for t, w in joins] + [(t, w, False) for t, w, _ in gone])
    starts = [e["t"] for e in events if e.get("event") == "start"]
    for wid, pid, mode, started, healed, seconds in soak.partitions:
        back = next((t for t, w in joins if w == wid and t >= healed - 1), None)
        if any(w == wid and started - 1 <= t <= (back or healed + 60) for t, w in restarted):
            continue  # killed, or exited (a violation above if it should not have), before it re-joined
        # A worker still joining when its link was cut (restarted moments before, or its coordinator
        # was: a restarted coordinator counts nobody a member until they join it) has nothing to be
        # let go of.
        since = max((t for t in starts if t <= started), default=-math.inf)
        member = next((joined for t, w, joined in reversed(membership) if w == wid and since <= t < started),
                      False)
        if not member:  # it joins once the link lets it: through a slow or half-open one, even before the heal
            joined = next((t for t, w in joins if w == wid and t >= started), None)
            rejoined(f"worker {wid} (pid {pid}) {mode} for {seconds:.1f} s", "not yet a member when cut off",
                     joined if joined is None or joined >= healed else healed, healed, "the heal", end_t,
                     violations, notes)
            continue
        coordinator_out = any(b <= healed and started <= e for b, e in spans)
        # Let go during the partition or just after the heal, but not by a kill after the heal.
        killed_after = min((t for t, w in restarted if w == wid and t >= healed - 1), default=math.inf)
        how = next((what for t, w, what in gone if w == wid and started <= t <= min(healed + 5, killed_after)),
                   None)
        kind = mode if mode.startswith("cut") else mode.split()[0]
        if kind in SEVERING and seconds > hb + 1:
            # The coordinator heard nothing for longer than the heartbeat timeout (or lost the connection).
            if how is None:
                if not coordinator_out:
                    violations.append(f"worker {wid} (pid {pid}) {mode} for {seconds:.1f} s, past the heartbeat "
                                      f"timeout, was never let go: the coordinator counted a worker it could "
                                      f"not hear")
                continue
        elif how is None:
            notes.append(f"worker {wid} (pid {pid}) {mode} for {seconds:.1f} s: stayed a member")
            continue
        elif kind in ("delay", "cut down") and not coordinator_out:
            # A slow link, or a half-open one whose heartbeats still arrive: nothing but time may change.
            violations.append(f"worker {wid} (pid {pid}) was let go ({how}) during a {mode} partition of "
                              f"{seconds:.1f} s, which must change nothing but time")
            continue
        rejoined(f"worker {wid} (pid {pid}) {mode} for {seconds:.1f} s", how, back, healed, "the heal", end_t,
                 violations, notes)
    return violations, notes


def collective_params(out: Path) -> tuple[list[str], dict | None, str]:
    """Check 6 and the newest committed params among the workers' checkpoints (collective plane)."""
    import torch

    from diloco.ckptio import CheckpointError
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


def counts_text(counts: dict[str, tuple[int, int]]) -> str:
    """``kind done of asked, ...`` for the ``--at-least`` lines."""
    return ", ".join(f"{kind} {done} of {asked}" for kind, (done, asked) in counts.items())


def at_least_counts(text: str) -> dict[str, int]:
    """``--at-least KIND=N,KIND=N,...`` as {kind: N}; anything else is an argparse error that says what is wrong."""
    counts: dict[str, int] = {}
    for item in text.split(","):
        kind, eq, n = (part.strip() for part in item.partition("="))
        if not kind and not eq:
            raise argparse.ArgumentTypeError(f"an empty item in {text!r}: write KIND=N,KIND=N,...")
        if kind not in COUNTED:
            raise argparse.ArgumentTypeError(f"unknown kind {kind!r} in {text!r}: the kinds are {', '.join(COUNTED)}")
        if not eq:
            raise argparse.ArgumentTypeError(f"{kind!r} has no count: write {kind}=N")
        if re.fullmatch(r"-\s*[0-9]+", n):
            raise argparse.ArgumentTypeError(f"{kind}={n}: a count cannot be negative")
        if not re.fullmatch(r"[0-9]+", n):
            raise argparse.ArgumentTypeError(f"{kind}={n!r}: the count must be a whole number (0, 1, 2, ...)")
        if kind in counts:
            raise argparse.ArgumentTypeError(f"{kind} is given twice in {text!r}")
        counts[kind] = int(n)
    return counts


def pct(rate: float | None) -> str:
    return "n/a" if rate is None else f"{rate:+.1%}"


def check_at_least(ap: argparse.ArgumentParser, args) -> None:
    """``--at-least`` and ``--max-minutes`` go together, and ask only for counts the run can reach."""
    if (args.at_least is None) != (args.max_minutes is None):
        ap.error("--at-least and --max-minutes go together: the counts to reach, and the bound on the time to "
                 "reach them")
    if args.at_least is None:
        return
    if args.max_minutes < args.minutes:
        ap.error(f"--max-minutes {args.max_minutes:g} is less than --minutes {args.minutes:g}: the fault phase "
                 f"lasts at least --minutes")
    for kind, n in args.at_least.items():
        if kind not in FAULT_EVERY:
            continue  # rounds_applied: no schedule, the run trains on
        every = getattr(args, FAULT_EVERY[kind])
        if n > 0 and every <= 0:
            ap.error(f"--at-least {kind}={n} cannot be reached with --{FAULT_EVERY[kind].replace('_', '-')} "
                     f"{every:g} (none of them)")
        if n > 0 and kind in WORKER_FAULTS and args.workers < 2:
            ap.error(f"--at-least {kind}={n} needs --workers >= 2 ({MEASURED} is never faulted)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0,
                    help="how long to inject faults (default 30; with --at-least, at least this long)")
    ap.add_argument("--workers", type=int, default=4, help="worker processes (default 4)")
    ap.add_argument("--seed", type=int, default=1, help="seeds every fault's moment and target (default 1)")
    ap.add_argument("--min-workers", type=int, default=2, help="the quorum at the start (default 2)")
    ap.add_argument("--heartbeat-timeout", type=float, default=10.0, help="server --heartbeat-timeout (default 10)")
    ap.add_argument("--sync-every", type=int, default=10, help="inner steps per round (default 10)")
    ap.add_argument("--worker-kill-every", type=float, default=15.0, help="mean seconds between worker kills")
    ap.add_argument("--coordinator-kill-every", type=float, default=120.0,
                    help="mean seconds between coordinator kills")
    ap.add_argument("--min-workers-every", type=float, default=60.0, help="mean seconds between quorum changes")
    ap.add_argument("--worker-freeze-every", type=float, default=40.0,
                    help="mean seconds between worker freezes (SIGSTOP, then SIGCONT; 0: none; default 40)")
    ap.add_argument("--coordinator-freeze-every", type=float, default=90.0,
                    help="mean seconds between coordinator freezes (0: none; default 90)")
    ap.add_argument("--partition-every", type=float, default=45.0,
                    help="mean seconds between partitions of a random worker's link (scripts/faultlink.py: "
                         "black-hole, drop, cut up, cut down, delay, in turn; 0: none, and workers connect "
                         "directly; default 45)")
    ap.add_argument("--coordinator-timeout", type=float, default=None,
                    help="the workers' --coordinator-timeout (default twice the heartbeat timeout; w1 keeps 600)")
    ap.add_argument("--worker-restart-max-s", type=float, default=5.0)
    ap.add_argument("--coordinator-restart-max-s", type=float, default=3.0)
    ap.add_argument("--out", default=None, help="folder for logs and checkpoints (default: a new temporary one)")
    ap.add_argument("--data-plane", choices=("hub", "collective"), default="hub",
                    help="the server's --data-plane (collective: workers also checkpoint every commit)")
    ap.add_argument("--at-least", type=at_least_counts, default=None, metavar="KIND=N,...",
                    help="inject at least N faults of each kind named (kinds: " + ", ".join(FAULT_EVERY) +
                         "; min_worker_changes counts the changes that went through), and go on until at least "
                         "rounds_applied=N rounds applied (the audit log's). While a kind is short of "
                         "its count, a fault of it that comes due when it cannot be done (no free worker, the "
                         "coordinator not steady) stays due and is done as soon as it can, instead of being "
                         "skipped. A kind that has its count keeps its ordinary schedule until --minutes and "
                         "stops past it; the kinds still short go on, each due at once and then at most its "
                         "mean interval apart, until every count is reached. A count not reached by "
                         "--max-minutes is a violation (exit 1). Needs --max-minutes")
    ap.add_argument("--max-minutes", type=float, default=None, metavar="B",
                    help="with --at-least: the fault phase never lasts longer than this (>= --minutes)")
    args = ap.parse_args(argv)
    if args.workers < 1 or not 1 <= args.min_workers <= args.workers or args.minutes <= 0:
        ap.error("need --workers >= 1, 1 <= --min-workers <= --workers, --minutes > 0")
    check_at_least(ap, args)
    if args.coordinator_timeout is None:
        args.coordinator_timeout = 2 * args.heartbeat_timeout
    if min(args.worker_freeze_every, args.coordinator_freeze_every, args.partition_every) < 0 \
            or args.coordinator_timeout <= 0:
        ap.error("need --worker-freeze-every, --coordinator-freeze-every, --partition-every >= 0 and "
                 "--coordinator-timeout > 0")
    out = Path(args.out or tempfile.mkdtemp(prefix="diloco-chaos-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"chaos: seed {args.seed}, {args.minutes:g} min, {args.workers} workers, min_workers {args.min_workers}, "
          f"data plane {args.data_plane}, heartbeat timeout {args.heartbeat_timeout:g} s, workers' coordinator "
          f"timeout {args.coordinator_timeout:g} s ({MEASURED}: 600 s), link timeout {LINK_TIMEOUT_S:g} s, "
          f"logs and checkpoints in {out}", flush=True)
    soak = Soak(args, out)
    try:
        soak.run()
    finally:
        soak.close()
    violations, log_stats = check_audit_log(out / "ckpt" / "events.jsonl")
    violations += soak.server_failures
    if soak.unreached:  # the system could not take the faults asked for (the run had its --max-minutes)
        violations.append(f"--at-least not reached by --max-minutes {args.max_minutes:g}: "
                          f"{counts_text(soak.unreached)} (the run could not take the faults asked for)")
    events = read_events(out / "ckpt" / "events.jsonl")
    (out / "faults.json").write_text(json.dumps({  # what the supervisor did, for a post-mortem
        "coordinator_outages": soak.outages, "worker_kills": soak.kill_log, "worker_exits": soak.worker_exits,
        "worker_freezes": soak.frozen_workers, "partitions": soak.partitions}, indent=1))
    worker_violations, worker_notes = check_workers(soak, events)
    violations += worker_violations
    for note in worker_notes:
        print(f"faults: {note}", flush=True)
    live = liveness(events, soak.outages, soak.heal_wall, args.heartbeat_timeout)
    span = lambda t: time.strftime("%H:%M:%S", time.localtime(t)) if t else "-"  # noqa: E731
    print(f"liveness: longest stretch with the quorum held and no round applied {live['max_stall_s']:.1f} s "
          f"({span(live['stall_from'])} to {span(live['stall_to'])}); bound 2 x {args.heartbeat_timeout:g} s "
          f"heartbeat timeout + 4 x {live['round_s']:.2f} s median round + 10 s = {live['stall_bound_s']:.1f} s",
          flush=True)
    if live["max_stall_s"] > live["stall_bound_s"]:
        violations.append(f"liveness: no round applied for {live['max_stall_s']:.1f} s with the quorum held "
                          f"({span(live['stall_from'])} to {span(live['stall_to'])}), over the bound "
                          f"{live['stall_bound_s']:.1f} s")
    growth = soak.growth(soak.measured_until)
    worst = {"rss": None, "fds": None}
    for who in ("coordinator", MEASURED):
        g = growth.get(who)
        if g is None:
            violations.append(f"growth: {who} was not measured (no sample after its warm-up and before the end)")
            continue
        figures = []
        for key, label in (("rss", "RSS"), ("fds", "open fds (but connections)")):
            a, b = g[key]
            rate = b / a - 1 if a else math.inf
            worst[key] = rate if worst[key] is None else max(worst[key], rate)
            figures.append(f"{label} {a / 1024:.1f} -> {b / 1024:.1f} MB ({rate:+.1%})" if key == "rss"
                           else f"{label} {a} -> {b} ({rate:+.1%})")
            if rate >= 0.05:
                violations.append(f"growth: {who} ({g['name']}, pid {g['pid']}) {key} grew {rate:+.1%} "
                                  f"({a} -> {b}) over {(g['to'] - g['from']) / 60:.1f} min")
        print(f"growth: {who} ({g['name']}, pid {g['pid']}, over {(g['to'] - g['from']) / 60:.1f} min from its "
              f"warm-up{'; ' + g['note'] if 'note' in g else ''}): {', '.join(figures)}", flush=True)
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
    minutes = f"{args.minutes:g}" if args.at_least is None else f"{soak.fault_minutes:.2f}"
    print(f"RESULT chaos data_plane={args.data_plane} minutes={minutes} worker_kills={soak.worker_kills} "
          f"coordinator_kills={soak.coordinator_kills} worker_freezes={soak.worker_freezes} "
          f"coordinator_freezes={soak.coordinator_freezes} partitions={len(soak.partitions)} "
          f"workers_gave_up={soak.workers_gave_up} "
          f"rounds_applied={log_stats['rounds_applied']} "
          f"violations={len(violations)} max_lost_rounds={log_stats['max_lost_rounds']} "
          f"trace_inputs={trace.inputs} trace_divergences={0 if trace.divergence is None else 1} "
          f"max_stall_s={live['max_stall_s']:.1f} stall_bound_s={live['stall_bound_s']:.1f} "
          f"rss_growth={pct(worst['rss'])} fd_growth={pct(worst['fds'])}", flush=True)
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
