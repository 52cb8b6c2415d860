"""The CI variant of ``benchmarks/bench_recovery.py``: a member killed with kill -9 and a replacement
timed from its start to its first contribution in a committed round, on both planes (the collective
joiner healing from three members at once), at 1M params.
The figures are not checked against goals (timings here are noise), only that every mark comes in
order, on both planes, and that the ratio is the printed times' own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def test_bench_recovery_quick_times_a_replacement_on_both_planes(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_recovery.py"), "--quick"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [line for line in proc.stdout.splitlines() if line.startswith("RESULT bench_recovery ")]
    assert [dict(kv.split("=") for kv in r.split()[2:])["plane"] for r in results] == ["hub", "collective"]
    assert "heal_sources=3" in results[1], "the collective replacement heals from three members at once"
    for line in results:
        f = {k: v for k, v in (kv.split("=") for kv in line.split()[2:])}
        assert f["params"] == "1000000"
        marks = [float(f[k]) for k in ("started_s", "joined_s", "welcome_s", "params_s", "contributing_s")]
        assert 0 < marks[0] and marks == sorted(marks), line
        assert abs(float(f["heal_s"]) - (marks[3] - marks[2])) <= 0.002, line
        copy, ratio = float(f["copy_s"]), float(f["fetch_vs_copy"])
        assert copy > 0
        fetch = marks[3] - marks[1]  # each time is rounded to 3 decimals (differences: 2 ms), the ratio to 2
        low = (fetch - 0.001) / (copy + 0.0005) - 0.005
        high = (fetch + 0.001) / max(copy - 0.0005, 1e-9) + 0.005
        assert low <= ratio <= high, line
