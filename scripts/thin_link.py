"""thin_link: a worker's big Submit crosses a thin uplink and applies, with every limit at its default.

Needs root, ``ip`` and ``tc`` (iproute2). Each *case* builds two network
namespaces joined by a veth pair (``slow_link.Net``): the coordinator's
(``diloco server``, every limit at diloco's default: 30 s heartbeat
timeout, 30 s link timeout, 120 s limit on an incomplete message) and the
worker's, whose upload is rate-limited with ``tc ... tbf`` (its download is
not: the Welcome and the Result come down at once). A first worker beside the
server starts the run (its Join brings the params over loopback) and leaves
after one step; then the slow worker joins (its Join carries only the spec)
and trains one fp32 tensor (``slow_link.make_setup``), so its Submit is one
tensor: one frame of the codec, or 16 MiB chunks of it.

A single part that takes longer than the link timeout on the wire would cut
the connection, and one that takes longer than the heartbeat timeout would
keep the worker's own heartbeats waiting behind it: so the Submit only
applies because the worker cuts its frames into parts sized to what its link
delivers (``diloco.transport.zmq.outbox.PartSizer``) and the coordinator
counts arriving parts as proof of life (SPEC.md section 11, "Parts on thin
links").

The cases (``--case``, default both, run side by side):

* ``thin``: 50 KB/s (0.4 Mbit/s), a Submit of 2 MiB (about 44 s on the link);
* ``big``: 10 Mbit/s, a Submit of 100 MB (about 84 s).

Each checks, from the server's metrics log, events and ``diloco status``: the
worker's contribution applied; its Submit took longer than the heartbeat
timeout (else the case proves nothing); the worker joined once and was never
declared dead, left or re-joined; no incomplete message was dropped, no
connection cut (the one disconnect is the first worker's, leaving); and it reports the part size the coordinator received
(``part_bytes_in``), which must be within what the link moves in a few
seconds. Usage (as root, from the repository root)::

    python scripts/thin_link.py            # both cases, about 100 s
    python scripts/thin_link.py --case thin

Last lines, one per case::

    RESULT thin_link case=thin ok=1 rate_mbit=0.4 submit_mb=2.1 submit_s=X heartbeat_timeout_s=30 part_bytes_in=N ...

``tests/zmq/test_slow_link.py`` runs both, beside ``slow_link.py --quick``. Every namespace made is deleted at
the end (also on an error) and every process started is killed by its pid.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import slow_link  # noqa: E402  (its network, processes and training setup)

REPO = Path(__file__).resolve().parents[1]
HEARTBEAT_TIMEOUT_S = 30.0  # diloco server's default
PORT = 5555


@dataclass(frozen=True)
class Case:
    name: str
    rate_mbit: float
    tensor_params: int
    tag: str

    @property
    def submit_bytes(self) -> int:
        return self.tensor_params * 4

    @property
    def expected_s(self) -> float:
        return self.submit_bytes * 8 * 1.045 / (self.rate_mbit * 1e6)


CASES = {
    "thin": Case("thin", 0.4, 512 << 10, f"dtl{os.getpid() % 100000}t"),
    "big": Case("big", 10.0, 25_000_000, f"dtl{os.getpid() % 100000}b"),
}


@dataclass
class Outcome:
    case: Case
    ok: bool = False
    failures: list = field(default_factory=list)
    submit_s: float = math.nan
    transport: dict = field(default_factory=dict)
    run_dir: str = ""


def run(case: Case, workdir: Path, log=print) -> Outcome:
    """Build the case's network, run it, check it, tear everything down."""
    out = Outcome(case)
    run_dir = Path(tempfile.mkdtemp(prefix=f"thin_link-{case.name}-", dir=workdir))
    out.run_dir = str(run_dir)
    log_dir, trace_dir = run_dir / "log", run_dir / "trace"
    log_dir.mkdir()
    trace_dir.mkdir()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           slow_link.ENV_TENSORS: "1", slow_link.ENV_TENSOR_PARAMS: str(case.tensor_params),
           slow_link.ENV_STEP_S: "0.05", slow_link.ENV_TRACE: str(trace_dir)}
    for limit in ("DILOCO_PARTIAL_TIMEOUT_S", "DILOCO_MAX_PARTIAL_MB"):
        env.pop(limit, None)  # every limit at its default
    diloco = [sys.executable, "-m", "diloco"]
    address = f"tcp://{slow_link.COORD_IP}:{PORT}"
    entry = f"{REPO / 'scripts' / 'slow_link.py'}:make_setup"
    net = slow_link.Net(case.rate_mbit, tag=case.tag, coord_rate_mbit=0)
    procs = slow_link.Procs(run_dir)
    fail = out.failures.append
    try:
        net.up()
        log(f"[{case.name}] worker's upload {case.rate_mbit:g} Mbit/s; a Submit of {case.submit_bytes / 1e6:.1f} MB, "
            f"about {case.expected_s:.0f} s on the link")
        procs.start("server", net.coord, [*diloco, "server", "--bind", address, "--insecure", "--wire-dtype", "fp32",
                                          "--log-dir", str(log_dir)], env)
        # A worker beside the server starts the run (its Join carries the params, over loopback) and
        # leaves after one step; the slow worker's Join then carries only the spec, and its Welcome comes
        # down the unlimited direction: the one thing on the thin link is its Submit.
        procs.start("init", net.coord, [*diloco, "worker", "--connect", address, "--id", "init", "--entry", entry,
                                        "--max-steps", "1"], env)
        procs.start("slow", net.slow, [*diloco, "worker", "--connect", address, "--id", "slow", "--entry", entry,
                                       "--sync-every", "2"], env)
        live = ("server", "slow")
        slow_link._wait(lambda: "listening on" in procs.output("server"), 120, "server listening", procs, live)
        (trace_dir / "init.go").touch()
        slow_link._wait(lambda: procs.procs["init"].poll() is not None, 300, "the first worker's one step and leave",
                        procs, live)
        (trace_dir / "slow.go").touch()

        def applied():
            return [r for r in slow_link._read_jsonl(log_dir / "metrics.jsonl")
                    if r.get("kind") == "round" and "slow" in r.get("contributors", [])]

        slow_link._wait(applied, 3 * case.expected_s + 120, "the worker's contribution applied", procs, live)
        t_apply = float(applied()[0]["t"])
        before = [t for t in slow_link._steps(trace_dir, "slow") if t < t_apply]
        out.submit_s = t_apply - before[-1] if before else math.nan
        status = slow_link._run(["ip", "netns", "exec", net.coord, *diloco, "status", "--connect", address,
                                 "--json", "--timeout", "20"], check=False, timeout=120)
        try:
            out.transport = json.loads(status.stdout).get("transport", {})
        except ValueError:
            fail(f"status unavailable: {status.stderr.strip()[-300:]}")
        server_out, slow_out = procs.output("server"), procs.output("slow")
        if not out.submit_s > HEARTBEAT_TIMEOUT_S:
            fail(f"the Submit took {out.submit_s:.1f} s, not longer than the heartbeat timeout "
                 f"({HEARTBEAT_TIMEOUT_S:g} s): the case proves nothing")
        out.failures += slow_link.membership_failures(server_out, slow_out)
        for key in ("incomplete_dropped", "dropped_queue_full", "malformed_total"):
            if out.transport.get(key, 0):
                fail(f"coordinator transport {key}={out.transport.get(key)}")
        if out.transport.get("disconnects") != 1:  # the first worker's, when it left; no other connection cut
            fail(f"coordinator transport disconnects={out.transport.get('disconnects')} (1 expected: the first "
                 f"worker's, when it left)")
        part = out.transport.get("part_bytes_in")
        link_bytes_s = case.rate_mbit * 1e6 / 8
        if not part:
            fail(f"the coordinator reported no part size received ({out.transport})")
        elif part > 5 * link_bytes_s and part > 64 << 10:
            fail(f"parts of {part} bytes take {part / link_bytes_s:.1f} s on this link: not sized to it")
        out.ok = not out.failures
        return out
    except (RuntimeError, TimeoutError) as exc:
        fail(str(exc))
        return out
    finally:
        procs.stop()
        for e in net.down():
            log(f"[{case.name}] cleanup: {e}")


def result_line(o: Outcome) -> str:
    c, tr = o.case, o.transport
    submit = "nan" if math.isnan(o.submit_s) else f"{o.submit_s:.1f}"
    return (f"RESULT thin_link case={c.name} ok={int(o.ok)} rate_mbit={c.rate_mbit:g} "
            f"submit_mb={c.submit_bytes / 1e6:.1f} submit_s={submit} expected_s={c.expected_s:.1f} "
            f"heartbeat_timeout_s={HEARTBEAT_TIMEOUT_S:g} part_bytes_in={tr.get('part_bytes_in')} "
            f"part_bytes_out={tr.get('part_bytes_out')} incomplete_dropped={tr.get('incomplete_dropped')} "
            f"disconnects={tr.get('disconnects')}")


def run_cases(names: list, workdir: Path, log=print) -> list:
    """Run the named cases side by side (each mostly waits on its link); their outcomes in order."""
    outcomes: dict = {}

    def one(name: str) -> None:
        try:
            outcomes[name] = run(CASES[name], workdir, log)
        except BaseException as exc:  # a setup failure: reported as the case's failure
            o = outcomes[name] = Outcome(CASES[name])
            o.failures.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=one, args=(n,), name=f"thin_link-{n}") for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [outcomes[n] for n in names]


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", choices=sorted(CASES), action="append",
                   help="run only this case (repeatable; default: both, side by side)")
    p.add_argument("--keep", action="store_true", help="keep the run directories (logs, traces)")
    args = p.parse_args(argv)
    why = slow_link.preflight()
    if why:
        print(f"thin_link: cannot run: {why}", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="thin_link-"))
    outcomes = run_cases(args.case or ["thin", "big"], workdir, log=lambda s: print(s, flush=True))
    ok = all(o.ok for o in outcomes)
    for o in outcomes:
        for failure in o.failures:
            print(f"FAILED [{o.case.name}]: {failure}", flush=True)
        print(result_line(o), flush=True)
    if args.keep or not ok:
        print(f"logs in {workdir}", flush=True)
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
