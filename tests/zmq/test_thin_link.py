"""Thin links: a big Submit crosses a 50 KB/s or a 10 Mbit/s uplink and applies, every limit at its default.

Runs ``scripts/thin_link.py`` (see its docstring): real ``diloco server`` and ``diloco worker``
processes in network namespaces joined by a tbf-limited veth pair, both cases side by side
(about 100 s). A 2 MiB Submit at 50 KB/s (about 44 s) and a 100 MB one at 10 Mbit/s (about
84 s) each take longer than the heartbeat and link timeouts (30 s): each applies only because
the worker cuts its frames into parts sized to its link and the coordinator counts arriving
parts as proof of life (SPEC.md section 11, "Parts on thin links").
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")),
                       reason="needs root, ip and tc (network namespaces)"),
]


def _script():
    sys.path.insert(0, str(REPO / "scripts"))
    spec = importlib.util.spec_from_file_location("thin_link", REPO / "scripts" / "thin_link.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being made
    spec.loader.exec_module(module)
    return module


def test_a_big_submit_over_a_thin_uplink_applies_with_the_default_limits(tmp_path):
    thin_link = _script()
    why = thin_link.slow_link.preflight()
    if why:  # no namespaces, veth or tbf in this kernel: an environment limit
        pytest.skip(why)
    before = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    lines: list[str] = []
    outcomes = thin_link.run_cases(["thin", "big"], tmp_path, log=lines.append)
    report = "\n".join([*lines, *(f"[{o.case.name}] {f}" for o in outcomes for f in o.failures),
                        *(thin_link.result_line(o) for o in outcomes)])
    for o in outcomes:
        if not o.ok and o.run_dir:
            for name in ("server", "slow"):
                log = Path(o.run_dir) / f"{name}.log"
                if log.exists():
                    report += f"\n===== {o.case.name} {name}\n{log.read_text(errors='replace')[-3000:]}"
    assert all(o.ok for o in outcomes), report
    thin, big = outcomes
    assert thin.case.submit_bytes >= 2 << 20 and big.case.submit_bytes >= 100_000_000, report
    for o in outcomes:
        assert o.submit_s > thin_link.HEARTBEAT_TIMEOUT_S, report  # longer than the heartbeat and link timeouts
        assert o.transport["incomplete_dropped"] == 0 and o.transport["disconnects"] == 0, report
    # At 50 KB/s the parts are the smallest (64 KiB, about 1.3 s each): never a 2 MiB frame whole.
    assert thin.transport["part_bytes_in"] <= 128 << 10, report
    after = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert after == before, "the test left network namespaces behind"
