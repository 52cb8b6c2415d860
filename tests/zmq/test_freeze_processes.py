"""Freezes (SIGSTOP, then SIGCONT) of real ``diloco worker`` and ``diloco server`` processes (SPEC.md section 13, "Freezes").

A frozen worker is declared dead after the heartbeat timeout and, when it
thaws, re-joins as the same process; it does not count its own freeze as the
coordinator's silence. Workers of a frozen coordinator wait, reporting the
outage, and carry on when it thaws. ``scripts/chaos.py`` does the same at
random (``--worker-freeze-every``, ``--coordinator-freeze-every``). Every
process is thawed before ``Cluster`` kills it.
"""

from __future__ import annotations

import json
import os
import signal
import re
import time

import pytest

pytestmark = pytest.mark.slow

WAITING = r"coordinator unreachable for \d+ s: waiting for"


class Frozen:
    """SIGSTOP a process now; ``thaw`` (or leaving the block) sends SIGCONT."""

    def __init__(self, proc) -> None:
        self.proc = proc
        os.kill(proc.pid, signal.SIGSTOP)
        self.frozen = True

    def thaw(self) -> None:
        if self.frozen:
            self.frozen = False
            os.kill(self.proc.pid, signal.SIGCONT)

    def __enter__(self) -> Frozen:
        return self

    def __exit__(self, *exc) -> None:
        self.thaw()


def applied_after(ckpt, t: float) -> list[list[str]]:
    """Contributors of every round applied after wall-clock ``t`` (the audit log)."""
    out = []
    for line in (ckpt / "events.jsonl").read_text().splitlines():
        e = json.loads(line)
        if e["event"] == "apply" and e["t"] > t:
            out.append(e["contributors"])
    return out


def test_a_worker_frozen_past_the_heartbeat_timeout_is_declared_dead_and_rejoins_as_the_same_process(cluster):
    server = cluster.server("--min-workers", "1", "--checkpoint-dir", "ckpt")  # heartbeat timeout 3 s
    w1 = cluster.worker("w1")
    cluster.worker("w2")
    cluster.wait_status(lambda s: cluster.members(s) == {"w1", "w2"} and s["rounds_applied"] >= 3, 120,
                        "both workers training")
    pid = w1.pid
    with Frozen(w1) as frozen:
        server.wait_for(r"dead +w1 \(silent for", 30)
        st = cluster.wait_status(lambda s: cluster.members(s) == {"w2"}, 10, "w1 declared dead")
        rounds = st["rounds_applied"]
        cluster.wait_status(lambda s: s["rounds_applied"] > rounds, 30, "w2 trains on alone (min_workers 1)")
        frozen.thaw()
        thawed = time.time()
    cluster.wait_status(lambda s: "w1" in cluster.members(s), 30, "w1 re-joined after its thaw")
    w1.wait_for(r"w1 joining again", 10)
    deadline = time.monotonic() + 60
    while not any("w1" in c for c in applied_after(cluster.tmp / "ckpt", thawed)):
        assert time.monotonic() < deadline, "no round with w1 as a contributor after its thaw"
        time.sleep(0.5)
    assert w1.alive() and w1.pid == pid, "the thawed worker goes on as the same process"
    assert "giving up" not in w1.output()


def test_a_worker_does_not_count_its_own_freeze_as_the_coordinators_silence(cluster):
    """The worker froze 5 s into a coordinator freeze and thawed 1 s before it, 17 s later, past its
    12 s --coordinator-timeout: the coordinator had been silent for 6 s of the worker's running time."""
    server = cluster.server("--min-workers", "1", "--checkpoint-dir", "ckpt")
    w1 = cluster.worker("w1", "--coordinator-timeout", "12")
    cluster.wait_status(lambda s: s["rounds_applied"] >= 3, 120, "rounds applied")
    pid = w1.pid
    with Frozen(server) as coordinator:
        time.sleep(5)
        with Frozen(w1):
            time.sleep(12)
        time.sleep(1)
        assert w1.alive(), f"the worker gave up as it thawed:\n{w1.output()}"
        coordinator.thaw()
        thawed = time.time()
    w1.wait_for(r"this process did not run for 1\d\.\d s", 10)
    w1.wait_for(r"coordinator answered again after", 10)
    deadline = time.monotonic() + 60
    while not any("w1" in c for c in applied_after(cluster.tmp / "ckpt", thawed)):
        assert time.monotonic() < deadline, "no round applied after the thaws"
        time.sleep(0.5)
    assert w1.alive() and w1.pid == pid
    assert "giving up" not in w1.output()


def test_workers_of_a_frozen_coordinator_wait_report_the_outage_and_carry_on(cluster):
    server = cluster.server("--min-workers", "2", "--checkpoint-dir", "ckpt")
    workers = [cluster.worker(w, "--coordinator-timeout", "30") for w in ("w1", "w2")]
    cluster.wait_status(lambda s: s["rounds_applied"] >= 3, 120, "rounds applied")
    pids = [w.pid for w in workers]
    with Frozen(server) as frozen:
        for w in workers:
            w.wait_for(WAITING, 15)  # past the 3 s heartbeat timeout, within the 30 s coordinator timeout
        time.sleep(3)
        frozen.thaw()
        thawed = time.time()
    for w in workers:
        w.wait_for(r"coordinator answered again after \d+ s", 15)
    # R9: the time it did not run is not its members' silence; it reads their heartbeats first.
    server.wait_for(r"did not run for [\d.]+ s \(stopped or starved\)", 10)
    deadline = time.monotonic() + 60
    while not any(set(c) == {"w1", "w2"} for c in applied_after(cluster.tmp / "ckpt", thawed)):
        assert time.monotonic() < deadline, "no round with both workers after the thaw"
        time.sleep(0.5)
    assert [w.pid for w in workers] == pids and all(w.alive() for w in workers)
    assert not any("giving up" in w.output() for w in workers)
    assert not re.search(r"dead +w\d \(silent for", server.output()), "a member declared dead for the freeze"


def test_a_coordinator_frozen_past_a_workers_coordinator_timeout_goes_on_and_the_worker_restarts(cluster):
    """The worker whose --coordinator-timeout passes writes its checkpoint and exits 3, closing its connection
    while the coordinator is stopped; the thawed coordinator goes on with the worker that waited, and the other,
    restarted as a supervisor would, resumes from its checkpoint.

    With a receive limit on the coordinator's socket, libzmq 4.3.5 aborted the thawed coordinator here
    ("Assertion failed: !_io_error (src/stream_engine_base.cpp:310)"): the quitter's heartbeats queued past the
    limit paused its connection, and the connection closed while paused."""
    server = cluster.server("--min-workers", "1", "--checkpoint-dir", "ckpt")
    patient = cluster.worker("w1", "--coordinator-timeout", "600")
    quitter = cluster.worker("w2", "--coordinator-timeout", "8", "--checkpoint-dir", "ck2")
    cluster.wait_status(lambda s: cluster.members(s) == {"w1", "w2"} and s["rounds_applied"] >= 3, 120,
                        "both workers training")
    with Frozen(server):
        assert quitter.wait_exit(30) == 3, quitter.output()
        assert "exit 3" in quitter.output() and list((cluster.tmp / "ck2").glob("worker-w2*"))
        time.sleep(2)
    thawed = time.time()
    time.sleep(3)
    assert server.alive(), server.output()[-3000:]
    patient.wait_for(r"coordinator answered again after \d+ s", 15)
    restarted = cluster.worker("w2", "--coordinator-timeout", "8", "--checkpoint-dir", "ck2")
    restarted.wait_for(r"restored from its checkpoint", 60)
    deadline = time.monotonic() + 90
    while not any(set(c) == {"w1", "w2"} for c in applied_after(cluster.tmp / "ckpt", thawed)):
        assert time.monotonic() < deadline, "no round with both workers after the thaw"
        time.sleep(0.5)
    assert server.alive() and patient.alive() and restarted.alive()
    assert "giving up" not in patient.output()
