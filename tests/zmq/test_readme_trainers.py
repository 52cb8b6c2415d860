"""The README's "Use it with the Hugging Face Trainer" and "Use it with Lightning" blocks, run as written.

Each block is read from README.md; only the address changes (the server picks a free loopback port).
Two copies run at once as two workers of one run: every round applies with both, and each prints the
optimizer steps and rounds the README's settings imply.
"""

from __future__ import annotations

import re

import pytest

from procs import REPO

README = REPO / "README.md"


def readme_block(title: str) -> str:
    section = README.read_text(encoding="utf-8").split(f"### {title}\n", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.parametrize("title, package, steps, rounds", [
    ("Use it with the Hugging Face Trainer", "transformers", 60, 3),
    ("Use it with Lightning", "lightning", 200, 4),
])
def test_the_readmes_trainer_block_runs_as_written(cluster, title, package, steps, rounds):
    pytest.importorskip(package)
    code = readme_block(title)
    assert 'connect="tcp://127.0.0.1:5555"' in code and "DilocoCallback(" in code
    cluster.server("--min-workers", "2")
    for returncode, out in cluster.run_copies(code.replace("tcp://127.0.0.1:5555", cluster.address), 2, 300):
        assert returncode == 0, out
        m = re.search(r"(\d+) optimizer steps, (\d+) rounds synced", out)
        assert m and (int(m.group(1)), int(m.group(2))) == (steps, rounds), out
    server = cluster.procs[0]
    server.wait_for(rf"applied\s+fragment 0 round {rounds - 1} from", 30)
    assert len(re.findall(r"applied\s+fragment 0 round \d+ from 2 contributors", server.output())) == rounds
