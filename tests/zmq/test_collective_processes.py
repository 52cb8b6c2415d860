"""The collective data plane with real processes: ``diloco server --data-plane collective`` and
``diloco worker`` processes on loopback, gloo between them, kill -9 and SIGSTOP.

Each wait is bounded; the cluster fixture kills what is left (by pid).
"""

from __future__ import annotations

import re
import signal
import time

import pytest

from diloco.cli import main

pytestmark = pytest.mark.slow

COLLECTIVE_ARGS = ("--data-plane", "collective", "--collective-timeout", "1.5")


def commits(server_output: str) -> list[tuple[int, int, str]]:
    """(round, contributors, digest) of every commit the server printed."""
    return [(int(m.group(1)), int(m.group(2)), m.group(3)) for m in re.finditer(
        r"applied\s+fragment 0 round (\d+) from (\d+) contributors \[[^\]]*\], digest ([0-9a-f]+)", server_output)]


def assert_rounds_in_order(server_output: str, min_workers: int) -> list[tuple[int, int, str]]:
    done = commits(server_output)
    assert [r for r, _, _ in done] == list(range(len(done))), f"rounds skipped or repeated: {done}"
    assert all(n >= min_workers for _, n, _ in done), done
    return done


def test_kill9_inside_a_collective_run_pauses_it_and_a_replacement_heals_and_resumes(cluster, capsys):
    server = cluster.server("--min-workers", "3", *COLLECTIVE_ARGS, heartbeat_timeout_s=4.0)
    assert "data plane collective" in server.output()
    workers = {w: cluster.worker(w) for w in ("w1", "w2", "w3")}
    cluster.wait_status(lambda s: s["rounds_applied"] >= 2, 120, "two rounds committed by 3 workers")

    workers["w3"].kill9()
    st = cluster.wait_status(lambda s: "w3" not in cluster.members(s) and s["below_min_workers"], 15, "w3 gone")
    assert st["phase"] == "paused" and st["data_plane"] == "collective" and st["num_params"] > 0
    frozen = st["rounds_applied"]
    for _ in range(8):
        assert cluster.status()["rounds_applied"] == frozen
        time.sleep(0.25)

    cluster.worker("w4")
    cluster.wait_status(lambda s: s["rounds_applied"] >= frozen + 2, 120, "the replacement heals and resumes")
    out = server.output()
    assert re.search(r"join\s+w4 .*heals from w[12]", out), out
    done = assert_rounds_in_order(out, 3)
    assert all(n == 3 for r, n, _ in done if r >= frozen)
    rc, text = main(["shutdown", "--connect", cluster.address]), capsys.readouterr().out
    assert rc == 0, text
    assert server.wait_exit(30) == 0
    assert_rounds_in_order(server.output(), 3)


def test_a_member_frozen_with_sigstop_times_the_attempt_out_and_the_survivors_commit(cluster, capsys):
    server = cluster.server("--min-workers", "2", *COLLECTIVE_ARGS, heartbeat_timeout_s=4.0)
    workers = {w: cluster.worker(w) for w in ("w1", "w2", "w3")}
    cluster.wait_status(lambda s: s["rounds_applied"] >= 2, 120, "two rounds committed")
    frozen_proc = workers["w3"]
    frozen_proc.popen.send_signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        st = cluster.wait_status(lambda s: "w3" not in cluster.members(s), 30, "the frozen member declared dead")
        before = st["rounds_applied"]
        cluster.wait_status(lambda s: s["rounds_applied"] >= before + 2, 60, "the survivors commit without it")
        assert time.monotonic() - t0 < 60
    finally:
        frozen_proc.popen.send_signal(signal.SIGCONT)
    out = server.output()
    assert re.search(r"dead\s+w3|left\s+w3", out), out
    assert_rounds_in_order(out, 2)
    rc = main(["shutdown", "--connect", cluster.address])
    assert rc == 0
    assert server.wait_exit(30) == 0


def test_a_non_loopback_collective_bind_needs_the_trusted_network_flag(cluster):
    proc = cluster.start("server", ["server", "--bind", "tcp://0.0.0.0:0", "--insecure", *COLLECTIVE_ARGS])
    assert proc.wait_exit(60) != 0
    assert "--trusted-data-network" in proc.output()
