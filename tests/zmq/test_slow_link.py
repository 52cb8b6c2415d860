"""Slow and thin links: big messages make progress, keep their worker alive, and apply; none is dropped for its age.

Two scripts, run side by side (each mostly waits on its link; about 110 s in all), each with
real ``diloco server`` and ``diloco worker`` processes in network namespaces joined by a
tbf-limited veth pair:

* ``scripts/slow_link.py --quick``: the server async with a fast worker beside it, a slow worker
  behind a 4 Mbit/s link. Limits are lowered so that it takes seconds, not minutes:
  ``DILOCO_PARTIAL_TIMEOUT_S=3`` (the coordinator's limit on an incomplete message),
  ``--heartbeat-timeout 4`` and the slow worker's ``--coordinator-timeout 6``, while each of its
  Welcome, Submit and Result takes about 10 s. The script checks that the contribution applies
  with no death, re-join, resync or dropped message, that the fast worker started messages while
  the Submit was older than the limit, and that the slow worker still gives up on a stopped server
  after its coordinator timeout. The real 120 s limit: ``python scripts/slow_link.py`` (about 12
  minutes; not run here).
* ``scripts/thin_link.py``: every limit at its default, a 2 MiB Submit over a 50 KB/s uplink
  (about 44 s) and a 100 MB one over 10 Mbit/s (about 84 s), each longer than the heartbeat and
  link timeouts (30 s): each applies only because the worker cuts its frames into parts sized to
  its link and the coordinator counts arriving parts as proof of life (SPEC.md section 11, "Parts
  on thin links").
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")),
                       reason="needs root, ip and tc (network namespaces)"),
]


def _script(name: str):
    sys.path.insert(0, str(REPO / "scripts"))  # thin_link imports slow_link
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being made
    spec.loader.exec_module(module)
    return module


def _logs(run_dir: str, names: tuple, label: str) -> str:
    text = ""
    for name in names:
        log = Path(run_dir) / f"{name}.log"
        if log.exists():
            text += f"\n===== {label} {name}\n{log.read_text(errors='replace')[-3000:]}"
    return text


def test_slow_and_thin_links_outlast_every_limit_and_their_rounds_apply(tmp_path):
    slow_link = _script("slow_link")
    thin_link = _script("thin_link")
    why = slow_link.preflight()
    if why:  # no namespaces, veth or tbf in this kernel: an environment limit
        pytest.skip(why)
    before = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    slow_lines: list[str] = []
    slow: dict = {}

    def run_slow() -> None:
        try:
            slow["outcome"] = slow_link.run(slow_link.QUICK, tmp_path, log=slow_lines.append)
        except BaseException as exc:  # reported below
            slow["error"] = exc

    slow_thread = threading.Thread(target=run_slow, name="slow_link")
    slow_thread.start()
    thin_lines: list[str] = []
    thin_outcomes = thin_link.run_cases(["thin", "big"], tmp_path, log=thin_lines.append)
    slow_thread.join()
    after = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "error" not in slow, f"slow_link: {slow.get('error')!r}\n" + "\n".join(slow_lines)

    # -- slow_link --quick: Welcome, Submit and Result each outlast the (lowered) limits.
    outcome = slow["outcome"]
    report = "\n".join([*slow_lines, *outcome.failures, slow_link.result_line(outcome)])
    if not outcome.ok:
        report += _logs(outcome.run_dir, ("server", "fast", "slow"), "slow_link")
    assert outcome.ok, report
    limit = max(outcome.partial_limit_s, outcome.heartbeat_timeout_s, outcome.coordinator_timeout_s)
    for took in (outcome.welcome_s, outcome.submit_s, outcome.result_s):
        assert took > limit, report
    assert outcome.submit_s > 2 * outcome.partial_limit_s, report
    assert outcome.slow_rounds >= 1 and outcome.expiry_runs_past_limit >= 1, report
    assert outcome.transport["incomplete_dropped"] == 0 and outcome.transport["dropped_queue_full"] == 0, report
    assert outcome.slow_exit_code == 3, report

    # -- thin_link: a big Submit over a thin uplink applies with every limit at its default.
    report = "\n".join([*thin_lines, *(f"[{o.case.name}] {f}" for o in thin_outcomes for f in o.failures),
                        *(thin_link.result_line(o) for o in thin_outcomes)])
    for o in thin_outcomes:
        if not o.ok and o.run_dir:
            report += _logs(o.run_dir, ("server", "init", "slow"), o.case.name)
    assert all(o.ok for o in thin_outcomes), report
    thin, big = thin_outcomes
    assert thin.case.submit_bytes >= 2 << 20 and big.case.submit_bytes >= 100_000_000, report
    for o in thin_outcomes:
        assert o.submit_s > thin_link.HEARTBEAT_TIMEOUT_S, report  # longer than the heartbeat and link timeouts
        assert o.transport["incomplete_dropped"] == 0, report
    # At 50 KB/s the parts are the smallest (64 KiB, about 1.3 s each): never the 2 MiB frame whole.
    assert thin.transport["part_bytes_in"] <= 128 << 10, report
    assert after == before, "the test left network namespaces behind"
