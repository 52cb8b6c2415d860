"""bench_links: DiLoCo rounds over emulated, rate-limited links (network namespaces + tc tbf).

Needs root, ``ip`` and ``tc`` (iproute2). It builds a private network that
never touches the host's interfaces:

* one "switch" network namespace holding a Linux bridge;
* one namespace per host -- the coordinator (``10.77.0.1``) and ``k`` workers
  (``10.77.0.11`` ...) -- each joined to the bridge by a veth pair whose two
  ends are created directly inside the two namespaces;
* a token-bucket rate limit on both directions of every host's link:
  ``tc qdisc add dev X root tbf rate R burst 32kbit latency 400ms`` on the
  host's end (its upload) and on the switch's end (its download). Links are
  full duplex. (netem is not available in every kernel; tbf is.)

Then it runs the real processes -- ``diloco server`` in the coordinator's
namespace, ``diloco worker`` in each worker's -- on a model of ``--params``
parameters (four square ``Linear`` layers; the factory ``make_setup`` below
is the workers' ``--entry``), with a short inner step (``--step-s``, mostly a
sleep) and a small ``--sync-every`` so that a round's wall time is mostly
communication, and measures:

* **round_s**: the median time between consecutive applied rounds, from the
  server's JSONL metrics log (``--log-dir``; millisecond timestamps), after
  ``--warmup`` rounds;
* **compute_s**: the inner steps of one round, timed inside the workers (each
  step's start is traced to a file): ``H`` x the median inner step;
* **round_comm_s** = round_s - compute_s: what one sync costs.

The data planes: ``hub`` (``diloco server``'s default: each worker uploads its
pseudo-gradient to the coordinator and gets the round's update back) and
``collective`` (``--data-plane collective --trusted-data-network``: the
workers all-reduce among themselves over gloo, each on its own link; the
coordinator only orders the reduce and commits it).

Beside each measurement it prints two predictions at the link's raw rate:

* ``predicted_s``, the planner's (``diloco.planner.model.sync_bits``, what
  ``diloco plan --data-plane`` uses): ``N x bytes x 8 x c`` bits on the
  busiest link, ``c = 2k`` on the hub's coordinator link (its k uploads, then
  its k Results) and ``c = 2(1 - 1/k)`` on each worker's link in the
  collective ring;
  for the sparse wire (a gathered one) the planner adds each worker's CPU work on the sync,
  ``sparse_cpu_s`` (``N / cpu_rate + k x N x 64/4096 / entry_rate``, ``diloco plan --cpu-rate
  --entry-rate``), at each worker's rates on this machine: measured just before and just after
  the run (the mean of the two times; the machine's other load changes) by
  ``bench_sparse_cpu.py`` (a worker's real submit and receipt code, timed) run by k
  processes at once, one thread each, as the k workers here share the machine's cores (their
  encodes run at once, and so do their receipts); ``cpu_s`` on the RESULT line is that term;
* ``impl_s``, what this implementation's algorithm puts on that link (its link time alone, no CPU
  work, on every wire): the
  hub's k uploads and then k Results (a Result needs every upload), ``2k``
  copies, as the planner; on the collective plane ``bytes_on_link`` of
  ``diloco.collective.reduce`` (fp32: a ring all-reduce, 2(k-1)/k copies;
  bf16/int8: an all-gather, k-1 copies, int8 with its fp32 scales).

TCP/IP and Ethernet headers cost about 4.5% of a tbf link (1448 payload bytes
per 1514-byte frame).

Last lines, one per measured (plane, size)::

    RESULT links plane=hub params=N k=4 rate_mbit=100 wire=fp32 round_s=X compute_s=X round_comm_s=X predicted_s=X ratio=R impl_s=X impl_ratio=R part_bytes_in=N part_bytes_out=N

(a sparse run's line adds ``cpu_s``, ``cpu_rate``, ``entry_rate`` and ``cpu`` -- measured or given --
after ``predicted_s``).

``ratio`` = round_comm_s / predicted_s (the goal: within 20%). On the hub, ``part_bytes_in`` and
``part_bytes_out`` are the part sizes the coordinator saw from the workers and used towards them
(``diloco status``): each end cuts a tensor into parts of what its link moves in about a second,
up to 16 MiB (SPEC.md section 11, "Parts on thin links"). A run in which
no round is applied for a long while is reported ``stalled=1`` with the
coordinator's transport counters. Server and workers run with diloco's default
``--link-timeout`` (30 s: a 16 MiB frame must cross a worker's share of a link
within it) unless ``--link-timeout S`` says otherwise; before that option
existed, a 5 s timeout cut the hub's frames on a 100 Mbit/s link shared by 4
workers (5.4 s per frame) and its runs stalled here.

Usage (as root, from the repository root)::

    python benchmarks/bench_links.py                  # 10M params, 100 Mbit/s, hub and collective
    python benchmarks/bench_links.py --params 10M,30M
    python benchmarks/bench_links.py --quick          # 1M params, 50 Mbit/s

Every namespace it made is deleted at the end (also on Ctrl-C or an error),
and every process it started is killed by its pid.

About 700 lines: one benchmark is one file, run and read top to bottom; the
private network's setup and teardown, the processes in it and the report share
one run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

# ---------------------------------------------------------------------------------------------
# The worker's training setup (``diloco worker --entry benchmarks/bench_links.py:make_setup``).
# Only this part runs inside the processes; settings come from the environment.
# ---------------------------------------------------------------------------------------------

ENV_PARAMS = "BENCH_LINKS_PARAMS"
ENV_STEP_S = "BENCH_LINKS_STEP_S"
ENV_TRACE = "BENCH_LINKS_TRACE"
LAYERS = 4


def layer_width(params: int, layers: int = LAYERS) -> int:
    """The width d of ``layers`` square Linear(d, d) layers (with bias) holding about ``params`` params."""
    return max(1, int((-1 + math.sqrt(1 + 4 * params / layers)) / 2))


def model_params(params: int, layers: int = LAYERS) -> int:
    d = layer_width(params, layers)
    return layers * (d * d + d)


def make_setup(worker_id: str = "w"):
    """About $BENCH_LINKS_PARAMS params, trivial data, each step sleeps $BENCH_LINKS_STEP_S; every
    step's start time (wall clock) is appended to $BENCH_LINKS_TRACE/<worker_id>.steps, and with
    $BENCH_LINKS_TRACE set it returns only once $BENCH_LINKS_TRACE/<worker_id>.go exists."""
    import torch

    from diloco.testing import PlainSGD  # torch.optim would import torch._dynamo: seconds per process
    from diloco.worker import TrainingSetup

    params = int(float(os.environ.get(ENV_PARAMS, "1000000")))
    step_s = float(os.environ.get(ENV_STEP_S, "0.02"))
    trace_dir = os.environ.get(ENV_TRACE)
    trace = open(os.path.join(trace_dir, f"{worker_id}.steps"), "a", buffering=1) if trace_dir else None
    d = layer_width(params)
    torch.manual_seed(0)  # every worker starts from the same weights
    model = torch.nn.Sequential(*[torch.nn.Linear(d, d) for _ in range(LAYERS)])
    with torch.no_grad():
        for layer in model:
            layer.weight.mul_(0.5)

    def batches():
        g = torch.Generator().manual_seed(sum(map(ord, worker_id)))
        while True:
            yield torch.randn(1, d, generator=g)

    def loss_fn(m, x):
        if trace is not None:
            trace.write(f"{time.time():.6f}\n")
        if step_s:
            time.sleep(step_s)
        return m(x).pow(2).mean()

    if trace_dir:
        # The benchmark lets the workers join one at a time (it creates <worker_id>.go): every
        # process starts (imports, builds its model) at once, but joins one by one.
        while not os.path.exists(os.path.join(trace_dir, f"{worker_id}.go")):
            time.sleep(0.05)
    return TrainingSetup(model=model, optimizer=PlainSGD(model.parameters(), lr=1e-3), batches=batches(),
                         loss_fn=loss_fn)


# ---------------------------------------------------------------------------------------------
# The emulated network.
# ---------------------------------------------------------------------------------------------

SUBNET = "10.77.0"
COORD_IP = f"{SUBNET}.1"
PORT = 5555


def worker_ip(i: int) -> str:
    return f"{SUBNET}.{11 + i}"


def _run(cmd: list, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip() or r.stdout.strip()}")
    return r


def preflight() -> Optional[str]:
    """None if this machine can build the network, else why not (a namespace, veth, bridge, tbf are tried)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth pairs, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found (apt-get install -y iproute2)"
    probe = f"dlbprobe{os.getpid()}"
    r = _run(["ip", "netns", "add", probe], check=False)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    try:
        for what, cmd in (("a veth pair", ["ip", "-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1"]),
                          ("a bridge", ["ip", "-n", probe, "link", "add", "br0", "type", "bridge"]),
                          ("a tbf qdisc", ["tc", "-n", probe, "qdisc", "add", "dev", "p0", "root", "tbf", "rate",
                                           "100mbit", "burst", "32kbit", "latency", "400ms"])):
            r = _run(cmd, check=False)
            if r.returncode != 0:
                return f"cannot create {what}: {r.stderr.strip()}"
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    return None


@dataclass
class Net:
    """Namespaces ``<tag>sw`` (the bridge), ``<tag>c`` (coordinator), ``<tag>w0``... (workers)."""

    workers: int
    rate_mbit: float
    tag: str = field(default_factory=lambda: f"dlb{os.getpid()}")
    made: list = field(default_factory=list)

    @property
    def switch(self) -> str:
        return f"{self.tag}sw"

    @property
    def coord(self) -> str:
        return f"{self.tag}c"

    def worker(self, i: int) -> str:
        return f"{self.tag}w{i}"

    def hosts(self) -> list:
        return [(self.coord, COORD_IP)] + [(self.worker(i), worker_ip(i)) for i in range(self.workers)]

    def _tbf(self, ns: str, dev: str) -> None:
        _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{self.rate_mbit:g}mbit",
              "burst", "32kbit", "latency", "400ms"])

    def up(self) -> None:
        _run(["ip", "netns", "add", self.switch])
        self.made.append(self.switch)
        _run(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", self.switch, "link", "set", "br0", "up"])
        for n, (ns, ip) in enumerate(self.hosts()):
            _run(["ip", "netns", "add", ns])
            self.made.append(ns)
            port = f"p{n}"
            # Both ends are created inside their namespaces: nothing appears in the host's.
            _run(["ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port,
                  "netns", self.switch])
            _run(["ip", "-n", self.switch, "link", "set", port, "master", "br0"])
            _run(["ip", "-n", self.switch, "link", "set", port, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            self._tbf(ns, "eth0")            # the host's upload
            self._tbf(self.switch, port)     # the host's download

    def down(self) -> list:
        """Delete every namespace made (their veths and qdiscs go with them); returns the errors."""
        errors = []
        for ns in reversed(self.made):
            r = _run(["ip", "netns", "del", ns], check=False)
            if r.returncode != 0:
                errors.append(f"ip netns del {ns}: {r.stderr.strip()}")
        self.made.clear()
        return errors

    def tx_bytes(self, ns: str, dev: str = "eth0") -> int:
        r = _run(["ip", "-n", ns, "-j", "-s", "link", "show", "dev", dev])
        return int(json.loads(r.stdout)[0]["stats64"]["tx"]["bytes"])


# ---------------------------------------------------------------------------------------------
# One measured run.
# ---------------------------------------------------------------------------------------------

@dataclass
class Measure:
    plane: str
    params: int
    workers: int
    rate_mbit: float
    wire: str
    sync_every: int
    link_timeout_s: Optional[float]
    round_s: float = math.nan
    compute_s: float = math.nan
    worker_gap_s: float = math.nan
    rounds: int = 0
    coord_tx_mb: float = math.nan
    worker_tx_mb: float = math.nan
    #: No round applied for a long while: what was seen then (else "").
    stalled: str = ""
    applied_before_stall: int = 0
    #: The part sizes the coordinator saw (``diloco status``: SPEC.md section 11, "Parts on thin links"):
    #: the biggest part of the workers' latest uploads (median), and its part size towards them.
    part_bytes_in: Optional[int] = None
    part_bytes_out: Optional[int] = None
    #: The sparse wire's CPU rates the planner's figure takes (measured just before this run).
    cpu: Optional[Cpu] = None

    @property
    def comm_s(self) -> float:
        return self.round_s - self.compute_s


class Procs:
    """The processes this benchmark started, stopped by pid at the end (SIGTERM, then SIGKILL)."""

    def __init__(self) -> None:
        self.procs: list = []

    def start(self, name: str, ns: str, argv: list, log: Path, env: dict) -> subprocess.Popen:
        with open(log, "w") as out:
            p = subprocess.Popen(["ip", "netns", "exec", ns, *argv], stdout=out, stderr=subprocess.STDOUT,
                                 env=env, start_new_session=True)
        self.procs.append((name, p))
        return p

    def dead(self) -> list:
        return [(name, p.returncode) for name, p in self.procs if p.poll() is not None]

    def stop(self) -> None:
        for _, p in self.procs:
            if p.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 10
        for _, p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        self.procs.clear()


class Stalled(Exception):
    pass


def _wait_for(procs: Procs, pred, timeout_s: float, what: str, run_dir: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        dead = procs.dead()
        if dead:
            raise RuntimeError(f"process(es) exited early {dead} while waiting for {what}; logs in {run_dir}")
        if time.monotonic() > deadline:
            raise Stalled(f"no {what} after {timeout_s:.0f} s")
        time.sleep(0.2)


def _round_times(log_dir: Path) -> list:
    path = log_dir / "metrics.jsonl"
    if not path.exists():
        return []
    times = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line being written
        if rec.get("kind") == "round":
            times.append(float(rec["t"]))
    return times


def _worker_steps(trace_dir: Path) -> dict:
    return {f.stem: [float(x) for x in f.read_text().split()] for f in sorted(trace_dir.glob("*.steps"))}


def _step_and_gap(steps: dict, t_from: float, t_to: float):
    """The median inner step (s) and the median sync gap a worker sees (its last step of a round to its
    first of the next, less a step), over the steps started in [t_from, t_to]."""
    step_dts, gaps = [], []
    for ts in steps.values():
        ts = [t for t in ts if t_from <= t <= t_to]
        dts = [b - a for a, b in zip(ts, ts[1:])]
        if not dts:
            continue
        med = statistics.median(dts)
        step_dts += [d for d in dts if d < 3 * med]
        gaps += [d for d in dts if d >= 3 * med]
    step = statistics.median(step_dts) if step_dts else math.nan
    return step, (statistics.median(gaps) - step if gaps else math.nan)


def _status_json(net: Net, env: dict) -> dict:
    """``diloco status --json`` of the coordinator; raises ValueError when it does not answer."""
    r = subprocess.run(["ip", "netns", "exec", net.coord, sys.executable, "-m", "diloco", "status", "--connect",
                        f"tcp://{COORD_IP}:{PORT}", "--json", "--timeout", "10"],
                       capture_output=True, text=True, env=env)
    try:
        return json.loads(r.stdout)
    except ValueError:
        raise ValueError(r.stderr.strip()[-200:]) from None


def _status(net: Net, env: dict) -> str:
    """The coordinator's transport counters and members, for a stall report."""
    try:
        st = _status_json(net, env)
    except ValueError as exc:
        return f"status unavailable ({exc})"
    tr = st.get("transport", {})
    keys = ("disconnects", "peers_lost", "incomplete_dropped", "dropped_queue_full")
    return (f"coordinator transport {', '.join(f'{k}={tr.get(k)}' for k in keys)}; "
            f"parked {st.get('parked_workers')}, live {len(st.get('members', []))}")


def measure(net: Net, plane: str, params: int, wire: str, sync_every: int, step_s: float, rounds: int,
            warmup: int, workdir: Path, stall_s: float, collective_timeout_s: float,
            link_timeout_s: Optional[float]) -> Measure:
    m = Measure(plane, params, net.workers, net.rate_mbit, wire, sync_every, link_timeout_s)
    procs = Procs()
    run_dir = Path(tempfile.mkdtemp(prefix=f"{plane}-{params}-", dir=workdir))
    log_dir, trace_dir = run_dir / "log", run_dir / "trace"
    log_dir.mkdir()
    trace_dir.mkdir()
    env = {**os.environ, ENV_PARAMS: str(params), ENV_STEP_S: str(step_s), ENV_TRACE: str(trace_dir),
           "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    diloco = [sys.executable, "-m", "diloco"]
    link = [] if link_timeout_s is None else ["--link-timeout", f"{link_timeout_s:g}"]
    # A hub sync saturates the coordinator's link and a worker's heartbeats queue behind its
    # upload on the same connection: a long heartbeat timeout keeps big syncs from looking like deaths.
    hb = max(900.0, 4 * collective_timeout_s)
    server = [*diloco, "server", "--bind", f"tcp://{COORD_IP}:{PORT}", "--insecure",
              "--min-workers", str(net.workers), "--heartbeat-timeout", f"{hb:g}", "--wire-dtype", wire,
              "--log-dir", str(log_dir), "--max-message-mb", "4096", *link]
    if plane == "collective":
        server += ["--data-plane", "collective", "--trusted-data-network",
                   "--collective-timeout", f"{collective_timeout_s:g}"]
    entry = f"{Path(__file__).resolve()}:make_setup"
    times: list = []
    try:
        procs.start("server", net.coord, server, run_dir / "server.log", env)
        _wait_for(procs, lambda: "listening on" in (run_dir / "server.log").read_text(), 120,
                  "server listening", run_dir)
        for i in range(net.workers):
            procs.start(f"w{i}", net.worker(i),
                        [*diloco, "worker", "--connect", f"tcp://{COORD_IP}:{PORT}", "--id", f"w{i}",
                         "--entry", entry, "--sync-every", str(sync_every), "--coordinator-timeout", f"{hb:g}", *link],
                        run_dir / f"w{i}.log", env)
        for i in range(net.workers):
            # Joins one at a time, each once the previous trains (welcomed; on the collective plane,
            # healed from a member): a join resent to a coordinator slow to answer (k joiners' params
            # through its link) can stall a collective joiner's heal (README).
            (trace_dir / f"w{i}.go").touch()
            steps = trace_dir / f"w{i}.steps"
            _wait_for(procs, lambda: steps.exists() and steps.stat().st_size > 0, stall_s + 120,
                      f"w{i} training", run_dir)
        tx0 = None
        while len(times) < warmup + rounds:
            n = len(times)

            def progressed() -> bool:
                nonlocal times, tx0
                times = _round_times(log_dir)
                if tx0 is None and len(times) >= warmup:
                    tx0 = (net.tx_bytes(net.coord), [net.tx_bytes(net.worker(i)) for i in range(net.workers)],
                           len(times))
                return len(times) > n

            _wait_for(procs, progressed, stall_s, f"applied round {n + 1}", run_dir)
        tx1 = (net.tx_bytes(net.coord), [net.tx_bytes(net.worker(i)) for i in range(net.workers)], len(times))
        if plane == "hub":  # the collective plane's tensors go over gloo, not in parts
            try:
                tr = _status_json(net, env).get("transport", {})
                m.part_bytes_in, m.part_bytes_out = tr.get("part_bytes_in"), tr.get("part_bytes_out")
            except ValueError as exc:
                print(f"   (part sizes unavailable: {exc})", flush=True)
    except Stalled as exc:
        m.stalled = f"{exc} ({_status(net, env)})"
        m.applied_before_stall = len(times)
        print(f"   STALLED: {m.stalled}; logs in {run_dir} (kept with --keep)", flush=True)
        return m
    finally:
        procs.stop()
    measured = times[max(0, warmup - 1):warmup + rounds]
    intervals = [b - a for a, b in zip(measured, measured[1:])]
    m.round_s = statistics.median(intervals)
    m.rounds = len(intervals)
    step, m.worker_gap_s = _step_and_gap(_worker_steps(trace_dir), measured[0], measured[-1])
    m.compute_s = sync_every * step
    n_rounds = max(1, tx1[2] - tx0[2])
    m.coord_tx_mb = (tx1[0] - tx0[0]) / n_rounds / 1e6
    m.worker_tx_mb = statistics.mean(b - a for a, b in zip(tx0[1], tx1[1])) / n_rounds / 1e6
    return m


# ---------------------------------------------------------------------------------------------
# Predictions.
# ---------------------------------------------------------------------------------------------

#: The server's wire dtypes this benchmark runs (``--wire-dtype``, a comma list).
WIRES = ("fp32", "bf16", "int8", "int4", "sparse")


def wire_bytes_exact(wire: str) -> float:
    """Bytes per parameter the codec really sends: int8 adds one fp32 scale per 256 values, int4 one per
    64; sparse sends 64 two-byte entries and a 4-byte scale per chunk of 4096 (its defaults)."""
    return {"fp32": 4.0, "bf16": 2.0, "int8": 1.0 + 4.0 / 256, "int4": 0.5 + 4.0 / 64,
            "sparse": (2 * 64 + 4) / 4096}[wire]


@dataclass(frozen=True)
class Cpu:
    """The planner's CPU rates for a sparse sync as each worker here has them (module docstring)."""

    cpu_rate: float
    entry_rate: float
    #: "measured": by k processes at once here; "given": --cpu-rate and --entry-rate.
    how: str


def predicted_s(plane: str, params: int, workers: int, wire: str, rate_mbit: float,
                cpu: Optional[Cpu] = None) -> float:
    """The planner's figure: ``sync_s`` (diloco plan's: the payload's bits over the link's rate, and for the
    sparse wire each worker's CPU work on the sync at ``cpu``'s rates)."""
    from diloco.planner.model import GATHERED_WIRES, WIRE_DTYPES, sync_s

    rates = {} if cpu is None else dict(cpu_rate=cpu.cpu_rate, entry_rate=cpu.entry_rate)
    return sync_s(params, WIRE_DTYPES[wire], workers, rate_mbit * 1e6, plane, wire in GATHERED_WIRES, **rates)


def cpu_term_s(params: int, workers: int, wire: str, cpu: Optional[Cpu]) -> float:
    from diloco.planner.model import GATHERED_WIRES, sparse_cpu_s

    if wire not in GATHERED_WIRES or cpu is None:
        return 0.0
    return sparse_cpu_s(params, workers, cpu.cpu_rate, cpu.entry_rate)


def planner_cpu(workers: int, cpu_rate: Optional[float], entry_rate: Optional[float]) -> Cpu:
    """Each worker's rates: given, or measured by ``workers`` processes at once on this machine, one thread
    each, as the workers run (``bench_sparse_cpu.measure_concurrently``)."""
    if cpu_rate is not None and entry_rate is not None:
        return Cpu(cpu_rate, entry_rate, "given")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_sparse_cpu import measure_concurrently

    rates = measure_concurrently(workers)
    print(f"cpu: a sparse round's own work measured by {workers} processes at once, one thread each "
          f"({rates.params:,} params; medians): {rates.cpu_rate:.3g} params/s (submit {rates.submit_s:.3f} s, "
          f"one-payload receipt {rates.receive_one_s:.3f} s), {rates.entry_rate:.3g} entries/s (receipt of "
          f"{rates.workers} payloads {rates.receive_all_s:.3f} s)", flush=True)
    return Cpu(rates.cpu_rate if cpu_rate is None else cpu_rate,
               rates.entry_rate if entry_rate is None else entry_rate, "measured")


def impl_s(plane: str, params: int, workers: int, wire: str, rate_mbit: float) -> float:
    """What this implementation puts on the busiest link, at the raw rate (module docstring)."""
    payload = params * wire_bytes_exact(wire)
    if wire == "sparse":  # every payload reaches every worker whole (the hub's Results carry all k)
        copies = float(workers + workers * workers) if plane == "hub" else float(workers - 1)
    elif plane == "hub":
        copies = 2.0 * workers
    else:
        copies = 2.0 * (workers - 1) / workers if wire == "fp32" else float(workers - 1)
    return payload * copies * 8 / (rate_mbit * 1e6)


def result_line(m: Measure) -> str:
    cpu = m.cpu
    pred = predicted_s(m.plane, m.params, m.workers, m.wire, m.rate_mbit, cpu)
    imp = impl_s(m.plane, m.params, m.workers, m.wire, m.rate_mbit)
    cpu_s = cpu_term_s(m.params, m.workers, m.wire, cpu)
    cpu_part = (f" cpu_s={cpu_s:.3f} cpu_rate={cpu.cpu_rate:.3g} entry_rate={cpu.entry_rate:.3g} cpu={cpu.how}"
                if cpu_s and cpu is not None else "")
    head = (f"RESULT links plane={m.plane} params={m.params} k={m.workers} rate_mbit={m.rate_mbit:g} wire={m.wire} "
            f"H={m.sync_every} link_timeout_s={m.link_timeout_s if m.link_timeout_s is not None else 'default'}")
    if m.stalled:
        return f"{head} stalled=1 applied_before_stall={m.applied_before_stall} predicted_s={pred:.3f} impl_s={imp:.3f}"
    return (f"{head} round_s={m.round_s:.3f} compute_s={m.compute_s:.3f} round_comm_s={m.comm_s:.3f} "
            f"predicted_s={pred:.3f}{cpu_part} ratio={m.comm_s / pred:.3f} impl_s={imp:.3f} impl_ratio={m.comm_s / imp:.3f}"
            + (f" part_bytes_in={m.part_bytes_in} part_bytes_out={m.part_bytes_out}" if m.plane == "hub" else ""))


# ---------------------------------------------------------------------------------------------

def parse_count(text: str) -> int:
    t = text.strip().upper()
    mult = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9}.get(t[-1:], 1)
    return int(float(t[:-1] if mult != 1 else t) * mult)


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", default=None, help="model sizes, comma separated: 10M,30M (default 10M; quick 1M)")
    p.add_argument("--planes", default="hub,collective", help="data planes to measure (default hub,collective)")
    p.add_argument("--workers", type=int, default=4, help="k workers (default 4)")
    p.add_argument("--rate-mbit", type=float, default=None, help="every host link's rate, each way (default 100; "
                                                                 "quick 50)")
    p.add_argument("--wire-dtype", default="fp32", metavar="DTYPES",
                   help=f"the server's --wire-dtype, or a comma list of them measured in turn ({', '.join(WIRES)}; "
                        f"default fp32: 4 bytes per param, simple arithmetic; int4 and sparse: the hub and, for "
                        f"sparse, the collective plane)")
    p.add_argument("--sync-every", type=int, default=5, help="inner steps per round (default 5)")
    p.add_argument("--step-s", type=float, default=0.02, help="sleep per inner step (default 0.02)")
    p.add_argument("--rounds", type=int, default=None, help="round intervals measured (default 3; quick 2)")
    p.add_argument("--warmup", type=int, default=2, help="applied rounds before the first measured one (default 2)")
    p.add_argument("--stall-s", type=float, default=None,
                   help="report a stall after this long without an applied round (default 60 s + 4x impl_s)")
    p.add_argument("--link-timeout", type=float, default=None, metavar="S",
                   help="server's and workers' --link-timeout (default: diloco's, 30 s)")
    p.add_argument("--cpu-rate", type=float, default=None, metavar="PARAMS_PER_S",
                   help="the sparse wire's planner --cpu-rate, each worker's (default: measured here first, by "
                        "k processes at once)")
    p.add_argument("--entry-rate", type=float, default=None, metavar="ENTRIES_PER_S",
                   help="the sparse wire's planner --entry-rate, each worker's (default: measured with --cpu-rate)")
    p.add_argument("--keep", action="store_true", help="keep the run directories (logs, traces)")
    p.add_argument("--quick", action="store_true", help="1M params at 50 Mbit/s, 2 measured rounds")
    args = p.parse_args(argv)
    sizes = [parse_count(s) for s in (args.params or ("1M" if args.quick else "10M")).split(",")]
    rate = args.rate_mbit or (50.0 if args.quick else 100.0)
    rounds = args.rounds or (2 if args.quick else 3)
    planes = [s.strip() for s in args.planes.split(",") if s.strip()]
    wires = [w.strip() for w in args.wire_dtype.split(",") if w.strip()]
    if not wires or any(w not in WIRES for w in wires):
        p.error(f"--wire-dtype {args.wire_dtype!r}: a comma list of {', '.join(WIRES)}")
    why = preflight()
    if why:
        print(f"bench_links: cannot run: {why}", file=sys.stderr)
        return 2
    from diloco.planner.model import GATHERED_WIRES

    workdir = Path(tempfile.mkdtemp(prefix="bench_links-"))
    net = Net(workers=args.workers, rate_mbit=rate)
    results = []
    interrupted = False
    try:
        net.up()
        print(f"network: namespaces {', '.join(net.made)}; bridge br0 in {net.switch}; coordinator {COORD_IP}, "
              f"workers {worker_ip(0)}..{worker_ip(args.workers - 1)}; every link tbf {rate:g} Mbit/s each way",
              flush=True)
        runs = [(n, plane, wire) for n in sizes for wire in wires for plane in planes
                if not (wire == "int4" and plane == "collective")]  # the collective plane knows no int4
        for n, plane, wire in runs:
            actual = model_params(n)
            # Measured just before the run and again just after it (the machine's other load changes),
            # with none of its processes running: the two times' mean.
            cpu = planner_cpu(args.workers, args.cpu_rate, args.entry_rate) if wire in GATHERED_WIRES else None
            pred = predicted_s(plane, actual, args.workers, wire, rate, cpu)
            imp = impl_s(plane, actual, args.workers, wire, rate)
            print(f"-- {plane}: {actual:,} params ({LAYERS} x Linear({layer_width(n)})), k={args.workers}, "
                  f"{rate:g} Mbit/s, wire {wire}, H={args.sync_every}, step {args.step_s:g} s"
                  f"{f', --link-timeout {args.link_timeout:g}' if args.link_timeout else ''} ...",
                  flush=True)
            m = measure(net, plane, actual, wire, args.sync_every, args.step_s, rounds, args.warmup,
                        workdir, args.stall_s or 60 + 4 * imp, max(60.0, 10 * imp), args.link_timeout)
            if cpu is not None and cpu.how == "measured":
                after = planner_cpu(args.workers, None, None)
                cpu = Cpu(2 / (1 / cpu.cpu_rate + 1 / after.cpu_rate), 2 / (1 / cpu.entry_rate + 1 / after.entry_rate),
                          "measured")
                pred = predicted_s(plane, actual, args.workers, wire, rate, cpu)
            m.cpu = cpu
            results.append(m)
            if not m.stalled:
                print(f"   round {m.round_s:.2f} s (median of {m.rounds}), compute {m.compute_s:.2f} s, "
                      f"comm {m.comm_s:.2f} s (a worker's own view: {m.worker_gap_s:.2f} s between its rounds); "
                      f"sent per round: coordinator {m.coord_tx_mb:.1f} MB, each worker {m.worker_tx_mb:.1f} MB",
                      flush=True)
                print(f"   planner {pred:.2f} s (ratio {m.comm_s / pred:.2f}"
                      f"{f'; of it CPU work {cpu_term_s(actual, args.workers, wire, cpu):.2f} s' if cpu_term_s(actual, args.workers, wire, cpu) else ''}); "
                      f"implementation-aware {imp:.2f} s (ratio {m.comm_s / imp:.2f})", flush=True)
    except KeyboardInterrupt:
        interrupted = True
        print("interrupted", file=sys.stderr)
    finally:
        for e in net.down():
            print(f"cleanup: {e}", file=sys.stderr)
        if args.keep:
            print(f"run directories kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    for m in results:
        print(result_line(m))
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
