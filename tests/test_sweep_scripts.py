"""The short CI variants of the demo's long runs: ``scripts/demo_soak.py`` and ``benchmarks/bench_demo.py``.

The real soak (tens of full demos, two at a time) and the settings sweep take
many minutes (README, "The demo"; benchmarks/README.md); here each runs small
enough to keep the scripts themselves working.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def _run(args: list[str], cwd: Path, timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout_s)


def test_demo_soak_runs_demos_side_by_side_and_finds_them_all_complete_and_alike(tmp_path):
    proc = _run([str(REPO / "scripts" / "demo_soak.py"), "--runs", "2", "--parallel", "2", "--timeout", "240",
                 "--", "--steps", "40", "--no-baselines"], tmp_path, 300)
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"RESULT demo_soak completed=2 runs=2 failed=0 timed_out=0 max_wall_s=[\d.]+ "
                        r"median_wall_s=[\d.]+ distinct_results=1", last), last
    assert proc.stderr.count(": ok in ") == 2 and "paused_s=" in proc.stderr


def test_demo_soak_reports_a_failed_demo_and_exits_1(tmp_path):
    proc = _run([str(REPO / "scripts" / "demo_soak.py"), "--runs", "1", "--", "--steps", "0"], tmp_path, 120)
    assert proc.returncode == 1
    assert "run 1/1: FAILED (exit 2)" in proc.stderr
    assert "RESULT demo_soak completed=0 runs=1 failed=1 timed_out=0" in proc.stdout


def test_bench_demo_quick_trains_the_three_methods_and_names_the_best_cell(tmp_path):
    proc = _run([str(REPO / "benchmarks" / "bench_demo.py"), "--quick"], tmp_path, 300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    row = next(line for line in lines if line.startswith("| 100 | 8 | 64 |"))
    single, sync, diloco, vs_single = (float(x) for x in row.split("|")[8:12])
    assert 0 < sync < single and vs_single == pytest.approx(diloco / single, abs=1e-3)
    assert re.fullmatch(r'RESULT bench_demo best="steps=100 batch=8 seq=64 lr=0\.003 warm=50 H=10 olr=1 mom=0\.9" '
                        r"diloco_vs_single=[\d.]+ diloco_vs_sync=[\d.]+ goals_met=[01]/1", lines[-1]), lines[-1]
