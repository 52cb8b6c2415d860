"""Progress, not age: big messages over a slow link keep their worker alive and are never dropped for their age.

The short CI variant of ``scripts/slow_link.py`` (``--quick``): real ``diloco server`` and
``diloco worker`` processes in two network namespaces joined by a tbf-limited veth pair (4 Mbit/s
each way), the server async with a fast worker beside it, a slow worker behind the link. Limits
are lowered so that it takes seconds, not minutes: ``DILOCO_PARTIAL_TIMEOUT_S=3`` (the
coordinator's limit on an incomplete message), ``--heartbeat-timeout 4`` and the slow worker's
``--coordinator-timeout 6``, while each of its Welcome, Submit and Result takes about 10 s. The
script (see its docstring) checks that the contribution applies with no death, re-join, resync or
dropped message, that the fast worker started messages while the Submit was older than the limit,
and that the slow worker still gives up on a stopped server after its coordinator timeout. The
real 120 s limit: ``python scripts/slow_link.py`` (about 12 minutes; not run here).
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
    spec = importlib.util.spec_from_file_location("slow_link", REPO / "scripts" / "slow_link.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being made
    spec.loader.exec_module(module)
    return module


def test_a_slow_workers_welcome_submit_and_result_outlast_every_limit_and_its_round_applies(tmp_path):
    slow_link = _script()
    why = slow_link.preflight()
    if why:  # no namespaces, veth or tbf in this kernel: an environment limit
        pytest.skip(why)
    before = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    lines: list[str] = []
    outcome = slow_link.run(slow_link.QUICK, tmp_path, log=lines.append)
    report = "\n".join([*lines, *outcome.failures, slow_link.result_line(outcome)])
    if not outcome.ok:
        for name in ("server", "fast", "slow"):
            log = Path(outcome.run_dir) / f"{name}.log"
            if log.exists():
                report += f"\n===== {name}\n{log.read_text(errors='replace')[-4000:]}"
    assert outcome.ok, report
    limit = max(outcome.partial_limit_s, outcome.heartbeat_timeout_s, outcome.coordinator_timeout_s)
    for took in (outcome.welcome_s, outcome.submit_s, outcome.result_s):
        assert took > limit, report
    assert outcome.submit_s > 2 * outcome.partial_limit_s, report
    assert outcome.slow_rounds >= 1 and outcome.expiry_runs_past_limit >= 1, report
    assert outcome.transport["incomplete_dropped"] == 0 and outcome.transport["dropped_queue_full"] == 0, report
    assert outcome.slow_exit_code == 3, report
    after = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert after == before, "the test left network namespaces behind"
