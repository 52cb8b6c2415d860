"""Short CI variant of benchmarks/bench_links.py: the hub and the collective plane over emulated links.

The real run (10M-30M params at 100 Mbit/s per host) takes many minutes; ``--quick`` (1M params
at 50 Mbit/s, one warm-up and two measured rounds) keeps the script working: it builds the
namespaces, runs real server and worker processes in them, measures both planes and removes
everything. Its figures are not judged here, only that each plane applies rounds (no stall) and
the result lines say what was measured against what the planner predicts.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")),
                       reason="needs root, ip and tc (network namespaces)"),
]


def test_bench_links_quick_measures_both_planes_against_the_planner_and_cleans_up(tmp_path):
    before = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_links.py"), "--quick", "--warmup", "1"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    results = [line.split() for line in proc.stdout.splitlines() if line.startswith("RESULT links ")]
    assert [dict(kv.split("=") for kv in r[2:])["plane"] for r in results] == ["hub", "collective"], proc.stdout
    for r in results:
        fields = dict(kv.split("=") for kv in r[2:])
        assert "stalled" not in fields, proc.stdout
        assert float(fields["round_s"]) > float(fields["round_comm_s"]) > 0
        assert float(fields["predicted_s"]) > 0 and float(fields["ratio"]) > 0
        if fields["plane"] == "hub":  # the part sizes the coordinator saw, reported
            assert int(fields["part_bytes_in"]) > 0 and int(fields["part_bytes_out"]) > 0, proc.stdout
    after = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert after == before, "the benchmark left network namespaces behind"
