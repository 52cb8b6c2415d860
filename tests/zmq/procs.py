"""Helpers for the process tests. Real processes on loopback: ``python -m diloco server`` / ``worker``, always killed afterwards.

Every socket binds or connects 127.0.0.1 only. A server binds port 0 and
prints the port it got (``listening on tcp://127.0.0.1:PORT``), which is how
tests find it. Workers train ``tiny_entry.py`` (an 8->16->1 MLP). Every wait
has a deadline; every process a test starts is SIGKILLed in teardown if it is
still running, and its output is printed when the test fails.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable


from diloco.wire.messages import AdminRequest
from diloco.wire.zmq import CoordinatorUnreachable, admin_request

REPO = Path(__file__).resolve().parents[2]
ENTRY = f"{Path(__file__).with_name('tiny_entry.py')}:make_setup"
#: Start-up of a Python process that imports torch takes seconds on a loaded 2-core machine.
START_TIMEOUT_S = 90.0


def wait_until(pred: Callable[[], object], timeout_s: float, what: str, interval_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)


class Proc:
    def __init__(self, name: str, args: list[str], log_dir: Path, env: dict,
                 program: tuple[str, ...] = ("-m", "diloco")) -> None:
        self.name = name
        self.args = args
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")
        self.popen = subprocess.Popen([sys.executable, *program, *args], cwd=log_dir, env=env,
                                      stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait_for(self, pattern: str, timeout_s: float = START_TIMEOUT_S) -> re.Match:
        rx = re.compile(pattern, re.M)
        deadline = time.monotonic() + timeout_s
        while True:
            m = rx.search(self.output())
            if m:
                return m
            if not self.alive():
                raise AssertionError(f"{self.name} exited ({self.popen.returncode}) before printing {pattern!r}:\n"
                                     f"{self.output()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: no {pattern!r} within {timeout_s:g} s:\n{self.output()}")
            time.sleep(0.05)

    def wait_exit(self, timeout_s: float) -> int:
        try:
            return self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} still running after {timeout_s:g} s:\n{self.output()}") from None

    def kill9(self) -> None:
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
        self.popen.wait(10)

    def close(self) -> None:
        try:
            self.kill9()
        finally:
            self._log.close()


class Cluster:
    """Starts servers and workers for one test; ``close`` kills whatever is left."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[Proc] = []
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TINY_STEP_S": "0.01",
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        self.address: str | None = None
        self._n = 0
        #: With ``make_keys``: the admin key ``status`` uses, and the key files by name.
        self.admin_auth = None
        self.keys: dict[str, tuple[Path, Path]] = {}
        self.auth_dir: Path | None = None

    def make_keys(self, workers: tuple[str, ...] = (), admins: tuple[str, ...] = ("ops",),
                  others: tuple[str, ...] = ()) -> Path:
        """An auth directory (server key, ``workers/``, ``admins/``) and client keys; ``others`` are known to nobody."""
        from diloco.transport.zmq.auth import ClientAuth, generate_keypair

        self.auth_dir = self.tmp / "auth"
        generate_keypair("server", self.auth_dir)
        for names, sub in ((workers, "workers"), (admins, "admins"), (others, None)):
            for name in names:
                public, secret = generate_keypair(name, self.tmp / "keys")
                self.keys[name] = (public, secret)
                if sub is not None:
                    (self.auth_dir / sub).mkdir(exist_ok=True)
                    (self.auth_dir / sub / public.name).write_bytes(public.read_bytes())
        if admins:
            self.admin_auth = ClientAuth.load(self.keys[admins[0]][1], self.server_key)
        return self.auth_dir

    @property
    def server_key(self) -> Path:
        assert self.auth_dir is not None, "make_keys first"
        return self.auth_dir / "server.key"

    def key_args(self, name: str) -> list[str]:
        """``--key NAME.key_secret --server-key server.key`` for a client using key ``name``."""
        return ["--key", str(self.keys[name][1]), "--server-key", str(self.server_key)]

    def start(self, name: str, args: list[str], program: tuple[str, ...] = ("-m", "diloco")) -> Proc:
        """``python -m diloco ARGS`` (or ``python PROGRAM ARGS``: a script) in the test's directory."""
        self._n += 1
        proc = Proc(f"{self._n:02d}-{name}", args, self.tmp, self.env, program)
        self.procs.append(proc)
        return proc

    def server(self, *args: str, bind: str = "tcp://127.0.0.1:0", heartbeat_timeout_s: float = 3.0) -> Proc:
        proc = self.start("server", ["server", "--bind", bind, "--heartbeat-timeout", str(heartbeat_timeout_s), *args])
        self.address = proc.wait_for(r"listening on (tcp://127\.0\.0\.1:\d+)").group(1)
        return proc

    def worker(self, worker_id: str, *args: str, sync_every: int = 5) -> Proc:
        assert self.address is not None, "start a server first"
        return self.start(worker_id, ["worker", "--connect", self.address, "--id", worker_id, "--entry", ENTRY,
                                      "--sync-every", str(sync_every), "--coordinator-timeout", "120", *args])

    def worker_ranks(self, worker_id: str, entry: str, ranks: int, trace_dir: Path, *args: str, sync_every: int = 5,
                     env: dict | None = None) -> list[Proc]:
        """The ranks of one multi-rank worker, rank 0 first, started as torchrun starts them: they meet
        through a file store (``DILOCO_GROUP_INIT``, a fresh one per call) and gloo on loopback."""
        assert self.address is not None, "start a server first"
        store = self.tmp / f"{worker_id}.{time.monotonic_ns()}.store"
        procs = []
        for rank in range(ranks):
            renv = {**self.env, "RANK": str(rank), "WORLD_SIZE": str(ranks), "LOCAL_RANK": str(rank),
                    "DILOCO_GROUP_INIT": f"file://{store}", "GLOO_SOCKET_IFNAME": "lo",
                    "RANK_TRACE_DIR": str(trace_dir),
                    "PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "zmq"), self.env["PYTHONPATH"]]),
                    **(env or {})}
            self._n += 1
            proc = Proc(f"{self._n:02d}-{worker_id}-rank{rank}",
                        ["worker", "--connect", self.address, "--id", worker_id, "--entry", entry,
                         "--sync-every", str(sync_every), "--coordinator-timeout", "120", "--device", "cpu", *args],
                        self.tmp, renv)
            self.procs.append(proc)
            procs.append(proc)
        return procs

    def status(self, timeout_s: float = 10.0) -> dict:
        reply = admin_request(self.address, AdminRequest("status"), timeout_s=timeout_s, auth=self.admin_auth)
        assert reply.ok, reply
        return reply.data

    def status_or_none(self) -> dict | None:
        try:
            return self.status(timeout_s=2.0)
        except CoordinatorUnreachable:
            return None

    def wait_status(self, pred: Callable[[dict], bool], timeout_s: float, what: str) -> dict:
        def check():
            s = self.status_or_none()
            return s if s is not None and pred(s) else None
        return wait_until(check, timeout_s, what, interval_s=0.2)

    def members(self, status: dict | None = None) -> set[str]:
        status = status or self.status()
        return {m["worker_id"] for m in status["members"]}

    def run_copies(self, code: str, copies: int, timeout_s: float) -> list[tuple[int, str]]:
        """Run ``code`` (a README block, its address already swapped) as ``copies`` scripts at once;
        (exit code, output) of each. Any still running at the deadline is killed."""
        script = self.tmp / "readme_block.py"
        script.write_text(code)
        procs = [subprocess.Popen([sys.executable, str(script)], cwd=self.tmp, env=self.env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(copies)]
        try:
            outs = [p.communicate(timeout=timeout_s)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        return [(p.returncode, out) for p, out in zip(procs, outs)]

    def close(self) -> None:
        for p in self.procs:
            p.close()

    def dump(self) -> str:
        return "\n".join(f"===== {p.name} (rc={p.popen.poll()}) {' '.join(p.args)}\n{p.output()}" for p in self.procs)
