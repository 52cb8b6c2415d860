"""A coordinator outage seen by real ``diloco worker`` processes (SPEC.md section 13).

The server is ``kill -9``'d: a worker with a small ``--coordinator-timeout`` prints
its waiting lines, writes its checkpoint and exits 3; a worker whose server is
restarted on the same address within the timeout re-joins and the run goes on.
Every wait is bounded; ``Cluster`` kills what is left.
"""

from __future__ import annotations

import re
import time

import pytest

from diloco.cli import main

pytestmark = pytest.mark.slow

WAITING = r"coordinator unreachable for \d+ s: waiting for (.+) \(gives up after"


def test_a_worker_gives_up_after_the_coordinator_timeout_with_its_checkpoint_and_exit_3(cluster):
    server = cluster.server("--min-workers", "1")
    worker = cluster.worker("w1", "--checkpoint-dir", "ckpt", "--coordinator-timeout", "6")
    cluster.wait_status(lambda s: s["rounds_applied"] >= 2, 120, "rounds applied")
    assert not list((cluster.tmp / "ckpt").glob("worker-w1*"))
    server.kill9()
    killed = time.monotonic()
    rc = worker.wait_exit(40)
    elapsed = time.monotonic() - killed
    out = worker.output()
    assert rc == 3, out
    assert 5.0 < elapsed < 30.0, (elapsed, out)
    waiting = re.findall(WAITING, out)
    assert waiting and all(w in ("heartbeat replies", "a Welcome (joining)") or w.startswith("the Result for fragment 0")
                           for w in waiting), out
    assert re.search(r"coordinator unreachable for \d+ s \(waiting for .+\): giving up \(--coordinator-timeout 6\)",
                     out), out
    assert re.search(r"done \(coordinator_unreachable\): .*; checkpoint ckpt/worker-w1", out), out
    assert "the coordinator at tcp://127.0.0.1:" in out and "exit 3" in out
    assert list((cluster.tmp / "ckpt").glob("worker-w1*")), "the checkpoint was written before exit 3"


def test_a_coordinator_restarted_within_the_timeout_is_rejoined_and_the_run_goes_on(cluster, capsys):
    server = cluster.server("--min-workers", "1")
    worker = cluster.worker("w1", "--checkpoint-dir", "ckpt", "--coordinator-timeout", "60")
    cluster.wait_status(lambda s: s["rounds_applied"] >= 2, 120, "rounds applied")
    address = cluster.address
    server.kill9()
    worker.wait_for(WAITING, 30)  # an outage long enough to be reported (5 s)
    cluster.server("--min-workers", "1", bind=address)
    st = cluster.wait_status(lambda s: "w1" in cluster.members(s) and s["rounds_applied"] >= 2, 60,
                             "w1 re-joined the new coordinator and rounds applied")
    assert st["phase"] == "running"
    worker.wait_for(r"coordinator answered again after \d+ s", 10)
    assert worker.alive()
    assert main(["shutdown", "--connect", cluster.address]) == 0
    assert worker.wait_exit(30) == 0, worker.output()
    assert "giving up" not in worker.output()
