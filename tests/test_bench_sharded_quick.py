"""Short CI variant of benchmarks/bench_sharded.py: what a sharded member's rank holds.

The real run measures a 25M-parameter member at world 1, 2 and 4 and the time per round; here a
small model at world 1 and 2 keeps the script working, and the figure the issue set a goal for is
judged: a rank of a two-rank member holds half of what a one-rank member holds (within 10%).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def test_bench_sharded_memory_a_rank_of_two_holds_half():
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_sharded.py"), "--only", "memory",
                           "--worlds", "1", "2", "--d-model", "64", "--layers", "2"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT bench_sharded "), proc.stdout
    figures = dict(re.findall(r"(\w+)=([\d.]+)", last))
    assert float(figures["held_mb_2"]) > 0
    assert 0.9 <= float(figures["held_ratio_2"]) <= 1.1, last
