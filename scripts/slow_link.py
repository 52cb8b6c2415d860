"""slow_link: big messages on a slow link make progress and keep their worker alive; none is dropped for its age.

Needs root, ``ip`` and ``tc`` (iproute2). It builds two network namespaces,
``<tag>c`` and ``<tag>w``, joined by one veth pair whose two ends are created
inside them (nothing appears in the host's namespace), each end
rate-limited with ``tc qdisc add dev eth0 root tbf rate R burst 32kbit
latency 400ms`` (the link is R each way). ``<tag>c`` holds ``diloco server``
(``10.78.0.1``, ``--mode async``: one outer step per contribution) and a
*fast* worker on that namespace's loopback (no limit); ``<tag>w`` holds the
*slow* worker behind the link. Every process is the real one
(``python -m diloco server|worker``); the workers train ``make_setup`` below:
``--tensors`` tensors of ``--tensor-params`` fp32 parameters (the server's
``--wire-dtype fp32``), so each of the slow worker's Welcome (down), Submit
(up) and Result (down) carries that many bytes over the link, in parts of
one tensor each.

The sizes make each of those three transfers take longer than

* the coordinator's limit on an incomplete message (``partial_timeout_s``:
  120 s, or ``$DILOCO_PARTIAL_TIMEOUT_S``), were it a limit on the message's
  age: the fast worker's contributions keep starting new messages at the
  coordinator throughout, and each start expires the incomplete messages
  that are past the limit -- one silent that long, not one that old;
* the server's ``--heartbeat-timeout``: the slow worker must stay a member,
  its heartbeats passing between its Submit's parts (and sent while its
  Welcome arrives);
* the slow worker's ``--coordinator-timeout``: arriving parts and heartbeat
  replies are not silence;

and the slow worker's whole wait for its Result longer than W9's resync
delay (16 heartbeat intervals): a Result on its way is not a lost one.

It checks, from the server's metrics log and event lines and each worker's
step trace: the slow worker's contribution applies; Welcome, Submit and
Result each took longer than every limit above; at least one message start
came while the Submit was older than the partial limit; no death, no
re-join, no resync, no incomplete message dropped, no message dropped for a
full queue, no connection cut. Then it stops the server (``SIGSTOP``) while
the slow worker goes on (its next Submit going out into the silence): the
worker must give up after its ``--coordinator-timeout`` (exit 3) -- the
timeout still works while a message is in flight.

Usage (as root, from the repository root)::

    python scripts/slow_link.py --quick   # CI: 3 s partial limit, 4 s heartbeat timeout, 6 s coordinator
                                          # timeout, ~10 s transfers (about 40 s)
    python scripts/slow_link.py           # the real 120 s limit and 30 s heartbeat timeout, a 60 s
                                          # coordinator timeout, ~200 s transfers (about 12 minutes)

The last line::

    RESULT slow_link ok=1 welcome_s=X submit_s=X result_s=X partial_limit_s=X heartbeat_timeout_s=X
        coordinator_timeout_s=X expiry_runs_past_limit=N gave_up_after_s=X ...

``tests/zmq/test_slow_link.py`` runs ``--quick``. Every namespace made is
deleted at the end (also on an error) and every process started is killed by
its pid.

About 550 lines in one script: building and removing the namespaces, running
the coordinator and the worker inside them, and checking what crossed the link
belong to one experiment that is run and read as a whole.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
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
from typing import Optional

REPO = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------------------------------
# The workers' training setup (``diloco worker --entry scripts/slow_link.py:make_setup``).
# Only this part runs inside the worker processes; settings come from the environment.
# ---------------------------------------------------------------------------------------------

ENV_TENSORS = "SLOW_LINK_TENSORS"
ENV_TENSOR_PARAMS = "SLOW_LINK_TENSOR_PARAMS"
ENV_STEP_S = "SLOW_LINK_STEP_S"
ENV_TRACE = "SLOW_LINK_TRACE"


def make_setup(worker_id: str = "w"):
    """$SLOW_LINK_TENSORS tensors of $SLOW_LINK_TENSOR_PARAMS params; each step sleeps $SLOW_LINK_STEP_S and
    appends its start (wall clock) to $SLOW_LINK_TRACE/<worker_id>.steps; with $SLOW_LINK_TRACE set it
    returns only once $SLOW_LINK_TRACE/<worker_id>.go exists (the script lets the workers join in order)."""
    import torch

    from diloco.testing import PlainSGD  # torch.optim would import torch._dynamo: seconds per process
    from diloco.worker import TrainingSetup

    n = int(os.environ.get(ENV_TENSORS, "16"))
    size = int(os.environ.get(ENV_TENSOR_PARAMS, "65536"))
    step_s = float(os.environ.get(ENV_STEP_S, "0.05"))
    trace_dir = os.environ.get(ENV_TRACE)
    torch.manual_seed(0)  # every worker starts from the same params
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(size) * 0.1) for _ in range(n)])

    def batches():
        while True:
            yield None

    trace = open(os.path.join(trace_dir, f"{worker_id}.steps"), "a", buffering=1) if trace_dir else None

    def loss_fn(m, _batch):
        if trace is not None:
            trace.write(f"{time.time():.6f}\n")
        if step_s:
            time.sleep(step_s)
        return sum(p.square().mean() for p in m)

    if trace_dir:
        while not os.path.exists(os.path.join(trace_dir, f"{worker_id}.go")):
            time.sleep(0.05)
    return TrainingSetup(model=model, optimizer=PlainSGD(model.parameters(), lr=0.01), batches=batches(),
                         loss_fn=loss_fn)


# ---------------------------------------------------------------------------------------------
# The network: two namespaces, one rate-limited veth pair.
# ---------------------------------------------------------------------------------------------

COORD_IP = "10.78.0.1"
SLOW_IP = "10.78.0.2"
PORT = 5555


def _run(cmd: list, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip() or r.stdout.strip()}")
    return r


def preflight() -> Optional[str]:
    """None if this machine can build the network, else why not (a namespace, a veth pair, tbf are tried)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth pairs, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found (apt-get install -y iproute2)"
    probe = f"dslprobe{os.getpid()}"
    r = _run(["ip", "netns", "add", probe], check=False)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    try:
        for what, cmd in (("a veth pair", ["ip", "-n", probe, "link", "add", "p0", "type", "veth", "peer", "name",
                                           "p1"]),
                          ("a tbf qdisc", ["tc", "-n", probe, "qdisc", "add", "dev", "p0", "root", "tbf", "rate",
                                           "4mbit", "burst", "32kbit", "latency", "400ms"])):
            r = _run(cmd, check=False)
            if r.returncode != 0:
                return f"cannot create {what}: {r.stderr.strip()}"
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    return None


@dataclass
class Net:
    rate_mbit: float
    tag: str = field(default_factory=lambda: f"dsl{os.getpid()}")
    made: list = field(default_factory=list)
    #: What the coordinator's end sends at (the slow worker's download); None: ``rate_mbit``, 0: no limit.
    coord_rate_mbit: Optional[float] = None

    @property
    def coord(self) -> str:
        return f"{self.tag}c"

    @property
    def slow(self) -> str:
        return f"{self.tag}w"

    def up(self) -> None:
        for ns in (self.coord, self.slow):
            _run(["ip", "netns", "add", ns])
            self.made.append(ns)
        _run(["ip", "link", "add", "eth0", "netns", self.coord, "type", "veth", "peer", "name", "eth0",
              "netns", self.slow])
        for ns, ip in ((self.coord, COORD_IP), (self.slow, SLOW_IP)):
            _run(["ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            # Each end limits what it sends: the link is rate_mbit each way (or coord_rate_mbit down).
            rate = self.rate_mbit if ns == self.slow or self.coord_rate_mbit is None else self.coord_rate_mbit
            if rate:
                _run(["tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", f"{rate:g}mbit",
                      "burst", "32kbit", "latency", "400ms"])

    def down(self) -> list:
        """Delete every namespace made (the veth pair and the qdiscs go with them); returns the errors."""
        errors = []
        for ns in reversed(self.made):
            r = _run(["ip", "netns", "del", ns], check=False)
            if r.returncode != 0:
                errors.append(f"ip netns del {ns}: {r.stderr.strip()}")
        self.made.clear()
        return errors


class Procs:
    """The processes started, each in a namespace, stopped by pid at the end."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.procs: dict = {}

    def start(self, name: str, ns: str, argv: list, env: dict) -> subprocess.Popen:
        with open(self.log(name), "w") as out:
            # ``ip netns exec`` execs the command: the pid is the process's own.
            p = subprocess.Popen(["ip", "netns", "exec", ns, *argv], stdout=out, stderr=subprocess.STDOUT,
                                 env=env, start_new_session=True)
        self.procs[name] = p
        return p

    def log(self, name: str) -> Path:
        return self.run_dir / f"{name}.log"

    def output(self, name: str) -> str:
        try:
            return self.log(name).read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGKILL)  # also ends a stopped (SIGSTOP) process
                except ProcessLookupError:
                    pass
        for p in self.procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass


# ---------------------------------------------------------------------------------------------
# The run.
# ---------------------------------------------------------------------------------------------

@dataclass
class Config:
    rate_mbit: float = 4.0
    tensors: int = 24
    tensor_params: int = 1 << 20
    #: None: diloco's default (120 s, no environment variable set).
    partial_timeout_s: Optional[float] = None
    #: None: the server's default (30 s).
    heartbeat_timeout_s: Optional[float] = None
    coordinator_timeout_s: float = 60.0
    #: Seconds between the fast worker's contributions (its H steps): often enough that one comes while
    #: the Submit is older than the partial limit, seldom enough that the slow worker's base stays
    #: within the async staleness bound (8 versions) over its Welcome and Submit.
    fast_period_s: float = 60.0
    fast_sync_every: int = 10
    slow_sync_every: int = 2
    slow_step_s: float = 0.05

    @property
    def payload_bytes(self) -> int:
        return self.tensors * self.tensor_params * 4

    @property
    def expected_transfer_s(self) -> float:
        """One message's time on the link: TCP/IP and Ethernet headers cost about 4.5% of a tbf link."""
        return self.payload_bytes * 8 * 1.045 / (self.rate_mbit * 1e6)

    @property
    def partial_limit_s(self) -> float:
        return 120.0 if self.partial_timeout_s is None else self.partial_timeout_s

    @property
    def heartbeat_limit_s(self) -> float:
        return 30.0 if self.heartbeat_timeout_s is None else self.heartbeat_timeout_s


QUICK = Config(rate_mbit=4.0, tensors=18, tensor_params=1 << 16, partial_timeout_s=3.0, heartbeat_timeout_s=4.0,
               coordinator_timeout_s=6.0, fast_period_s=4.0, fast_sync_every=5)


@dataclass
class Outcome:
    ok: bool = False
    failures: list = field(default_factory=list)
    welcome_s: float = math.nan
    submit_s: float = math.nan
    result_s: float = math.nan
    slow_wait_s: float = math.nan
    resync_delay_s: float = math.nan
    expected_transfer_s: float = math.nan
    partial_limit_s: float = math.nan
    heartbeat_timeout_s: float = math.nan
    coordinator_timeout_s: float = math.nan
    expiry_runs_past_limit: int = 0
    fast_rounds: int = 0
    slow_rounds: int = 0
    transport: dict = field(default_factory=dict)
    gave_up_after_s: float = math.nan
    slow_exit_code: Optional[int] = None
    run_dir: str = ""


def _read_jsonl(path: Path) -> list:
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass  # a line being written
    return out


def _steps(trace_dir: Path, worker: str) -> list:
    f = trace_dir / f"{worker}.steps"
    return [float(x) for x in f.read_text().split()] if f.exists() else []


def membership_failures(server_out: str, worker_out: str, worker: str = "slow") -> list:
    """What the server's event lines and the worker's output say went wrong with its membership: it must
    join once, and never be declared dead, leave, or join again (resync or rejoin)."""
    failures = []
    for pattern, what in ((rf"\bdead\s+{worker}\b", f"the {worker} worker was declared dead"),
                          (rf"\bleft\s+{worker}\b", f"the {worker} worker left")):
        if re.search(pattern, server_out):
            failures.append(what)
    if len(re.findall(rf"\bjoin\s+{worker}\b", server_out)) != 1:
        failures.append(f"the {worker} worker did not join exactly once")
    if re.search(r"joining again|rejoin|re-join", worker_out, re.I):
        failures.append(f"the {worker} worker joined again (resync or rejoin)")
    return failures


def _wait(pred, timeout_s: float, what: str, procs: Procs, must_live: tuple = ()) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        for name in must_live:
            p = procs.procs.get(name)
            if p is not None and p.poll() is not None:
                raise RuntimeError(f"{name} exited ({p.returncode}) while waiting for {what}:\n"
                                   f"{procs.output(name)[-3000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout_s:.0f} s")
        time.sleep(0.1)


def run(cfg: Config, workdir: Path, log=print) -> Outcome:
    """Build the network, run the scenario, check it, tear everything down. Raises on a setup failure."""
    out = Outcome(expected_transfer_s=cfg.expected_transfer_s, partial_limit_s=cfg.partial_limit_s,
                  heartbeat_timeout_s=cfg.heartbeat_limit_s, coordinator_timeout_s=cfg.coordinator_timeout_s)
    run_dir = Path(tempfile.mkdtemp(prefix="slow_link-", dir=workdir))
    out.run_dir = str(run_dir)
    log_dir, trace_dir = run_dir / "log", run_dir / "trace"
    log_dir.mkdir()
    trace_dir.mkdir()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           ENV_TENSORS: str(cfg.tensors), ENV_TENSOR_PARAMS: str(cfg.tensor_params), ENV_TRACE: str(trace_dir)}
    env.pop("DILOCO_PARTIAL_TIMEOUT_S", None)
    if cfg.partial_timeout_s is not None:
        env["DILOCO_PARTIAL_TIMEOUT_S"] = f"{cfg.partial_timeout_s:g}"
    diloco = [sys.executable, "-m", "diloco"]
    address = f"tcp://{COORD_IP}:{PORT}"
    entry = f"{Path(__file__).resolve()}:make_setup"
    hb = [] if cfg.heartbeat_timeout_s is None else ["--heartbeat-timeout", f"{cfg.heartbeat_timeout_s:g}"]
    net = Net(cfg.rate_mbit)
    procs = Procs(run_dir)
    fast_step_s = cfg.fast_period_s / cfg.fast_sync_every
    try:
        net.up()
        log(f"network: {net.coord} ({COORD_IP}: server, fast worker) <-> {net.slow} ({SLOW_IP}: slow worker), "
            f"tbf {cfg.rate_mbit:g} Mbit/s each way; {cfg.tensors} x {cfg.tensor_params} fp32 params = "
            f"{cfg.payload_bytes / 1e6:.1f} MB per message, about {cfg.expected_transfer_s:.1f} s on the link")
        procs.start("server", net.coord,
                    [*diloco, "server", "--bind", address, "--insecure", "--mode", "async", "--wire-dtype", "fp32",
                     "--log-dir", str(log_dir), *hb], env)
        procs.start("fast", net.coord,
                    [*diloco, "worker", "--connect", address, "--id", "fast", "--entry", entry,
                     "--sync-every", str(cfg.fast_sync_every), "--coordinator-timeout", "3600"],
                    {**env, ENV_STEP_S: f"{fast_step_s:g}"})
        procs.start("slow", net.slow,
                    [*diloco, "worker", "--connect", address, "--id", "slow", "--entry", entry,
                     "--sync-every", str(cfg.slow_sync_every),
                     "--coordinator-timeout", f"{cfg.coordinator_timeout_s:g}"],
                    {**env, ENV_STEP_S: f"{cfg.slow_step_s:g}"})
        live = ("server", "fast", "slow")
        _wait(lambda: "listening on" in procs.output("server"), 120, "server listening", procs, live)
        # The fast worker joins first: its params start the run over loopback.
        (trace_dir / "fast.go").touch()
        _wait(lambda: _steps(trace_dir, "fast"), 120, "the fast worker training", procs, live)
        (trace_dir / "slow.go").touch()
        t_gate = time.time()
        log("slow worker joining: its Welcome crosses the link")

        def slow_round():
            return [r for r in _read_jsonl(log_dir / "metrics.jsonl")
                    if r.get("kind") == "round" and "slow" in r.get("contributors", [])]

        budget = 4 * cfg.expected_transfer_s + 60
        _wait(lambda: slow_round(), budget, "applied contribution of the slow worker", procs, live)
        applied = slow_round()[0]
        t_apply = float(applied["t"])
        log(f"the slow worker's contribution applied (round {applied['round_id']}); its Result crosses the link")
        _wait(lambda: any(t > t_apply for t in _steps(trace_dir, "slow")), budget,
              "the slow worker training again (its Result arrived)", procs, live)
        records = _read_jsonl(log_dir / "metrics.jsonl")
        status = _run(["ip", "netns", "exec", net.coord, *diloco, "status", "--connect", address, "--json",
                       "--timeout", "20"], check=False, timeout=120)
        try:
            out.transport = json.loads(status.stdout).get("transport", {})
        except ValueError:
            out.failures.append(f"status unavailable: {status.stderr.strip()[-300:]}")

        # -- the timeout still works mid-transfer: stop the server, the slow worker goes on and gives up.
        server = procs.procs["server"]
        os.kill(server.pid, signal.SIGSTOP)
        t_stop = time.monotonic()
        log(f"server stopped (SIGSTOP); the slow worker should give up after {cfg.coordinator_timeout_s:g} s")
        slow = procs.procs["slow"]
        try:
            out.slow_exit_code = slow.wait(cfg.coordinator_timeout_s + 60)
            out.gave_up_after_s = time.monotonic() - t_stop
        except subprocess.TimeoutExpired:
            out.failures.append(f"the slow worker did not give up within {cfg.coordinator_timeout_s + 60:g} s "
                                f"of a stopped server")

        # -- measure.
        join = [r for r in records if r.get("kind") == "event" and r.get("event") == "join"
                and r.get("worker_id") == "slow"]
        slow_steps = _steps(trace_dir, "slow")
        before = [t for t in slow_steps if t < t_apply]
        after = [t for t in slow_steps if t > t_apply]
        t_join = float(join[0]["t"]) if join else t_gate
        if before and after:
            out.welcome_s = before[0] - t_join
            out.submit_s = t_apply - before[-1]  # from its last inner step (then it submits)
            out.result_s = after[0] - t_apply
            out.slow_wait_s = after[0] - before[-1]
        heartbeat_interval = cfg.heartbeat_limit_s / 4
        out.resync_delay_s = 16 * heartbeat_interval
        rounds = [r for r in records if r.get("kind") == "round"]
        out.fast_rounds = sum(1 for r in rounds if "fast" in r.get("contributors", []))
        out.slow_rounds = sum(1 for r in rounds if "slow" in r.get("contributors", []))
        if before:
            # Message starts at the coordinator while the Submit was older than the partial limit.
            first_part = before[-1] + 0.5
            out.expiry_runs_past_limit = sum(
                1 for r in rounds if "fast" in r.get("contributors", [])
                and first_part + cfg.partial_limit_s < float(r["t"]) < t_apply)

        # -- judge.
        server_out, slow_out = procs.output("server"), procs.output("slow")
        fail = out.failures.append
        for name, took in (("Welcome", out.welcome_s), ("Submit", out.submit_s), ("Result", out.result_s)):
            limits = {"the partial-message limit": cfg.partial_limit_s,
                      "the heartbeat timeout": cfg.heartbeat_limit_s,
                      "the coordinator timeout": cfg.coordinator_timeout_s}
            for what, limit in limits.items():
                if not took > limit:
                    fail(f"the {name} took {took:.1f} s, not longer than {what} ({limit:g} s): make it bigger")
        if not out.slow_wait_s > out.resync_delay_s:
            fail(f"the slow worker waited {out.slow_wait_s:.1f} s for its Result, not longer than the resync "
                 f"delay ({out.resync_delay_s:g} s)")
        if out.expiry_runs_past_limit < 1:
            fail("no message started at the coordinator while the Submit was older than the partial limit")
        out.failures += membership_failures(server_out, slow_out)
        for key in ("incomplete_dropped", "dropped_queue_full", "disconnects", "malformed_total"):
            if out.transport.get(key, 0):
                fail(f"coordinator transport {key}={out.transport.get(key)}")
        if out.slow_exit_code != 3:
            fail(f"the slow worker exited {out.slow_exit_code} after the server stopped, not 3 (unreachable)")
        elif not cfg.coordinator_timeout_s - 1 <= out.gave_up_after_s <= cfg.coordinator_timeout_s + 15:
            fail(f"the slow worker gave up {out.gave_up_after_s:.1f} s after the server stopped; its "
                 f"--coordinator-timeout is {cfg.coordinator_timeout_s:g} s")
        out.ok = not out.failures
        return out
    finally:
        procs.stop()
        for e in net.down():
            log(f"cleanup: {e}")


def result_line(o: Outcome) -> str:
    def f(x: float) -> str:
        return "nan" if isinstance(x, float) and math.isnan(x) else f"{x:.1f}"

    tr = o.transport
    return (f"RESULT slow_link ok={int(o.ok)} welcome_s={f(o.welcome_s)} submit_s={f(o.submit_s)} "
            f"result_s={f(o.result_s)} expected_transfer_s={f(o.expected_transfer_s)} "
            f"partial_limit_s={o.partial_limit_s:g} heartbeat_timeout_s={o.heartbeat_timeout_s:g} "
            f"coordinator_timeout_s={o.coordinator_timeout_s:g} slow_wait_s={f(o.slow_wait_s)} "
            f"resync_delay_s={o.resync_delay_s:g} expiry_runs_past_limit={o.expiry_runs_past_limit} "
            f"fast_rounds={o.fast_rounds} slow_rounds={o.slow_rounds} "
            f"incomplete_dropped={tr.get('incomplete_dropped')} dropped_queue_full={tr.get('dropped_queue_full')} "
            f"disconnects={tr.get('disconnects')} gave_up_after_s={f(o.gave_up_after_s)} "
            f"slow_exit={o.slow_exit_code}")


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="the CI variant: limits lowered (DILOCO_PARTIAL_TIMEOUT_S=3, --heartbeat-timeout 4, "
                        "--coordinator-timeout 6), 4 MB messages at 4 Mbit/s")
    p.add_argument("--rate-mbit", type=float, help="the link's rate each way (default 4)")
    p.add_argument("--tensors", type=int, help="tensors in the model (default 24; quick 18)")
    p.add_argument("--tensor-params", type=int, help="fp32 params per tensor (default 1M; quick 64K)")
    p.add_argument("--keep", action="store_true", help="keep the run directory (logs, traces)")
    args = p.parse_args(argv)
    cfg = dataclasses.replace(QUICK if args.quick else Config(),
                              **{k: v for k in ("rate_mbit", "tensors", "tensor_params")
                                 if (v := getattr(args, k)) is not None})
    why = preflight()
    if why:
        print(f"slow_link: cannot run: {why}", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="slow_link-"))
    keep = args.keep
    try:
        o = run(cfg, workdir, log=lambda s: print(s, flush=True))
        for failure in o.failures:
            print(f"FAILED: {failure}", flush=True)
        keep = keep or not o.ok
        print(result_line(o), flush=True)
        return 0 if o.ok else 1
    except BaseException:
        keep = True
        raise
    finally:
        if keep:
            print(f"logs in {workdir}", flush=True)
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
