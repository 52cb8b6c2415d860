"""The README's "Use it in your own loop" example, run as written against a real server.

The code block is read from README.md; only the address changes (the server
picks a free loopback port). Two copies run at once as two workers.
"""

from __future__ import annotations

import re

from procs import REPO

README = REPO / "README.md"


def readme_own_loop_code() -> str:
    text = README.read_text(encoding="utf-8")
    section = text.split("## Use it in your own loop", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_the_readmes_own_loop_example_runs_as_written(cluster):
    code = readme_own_loop_code()
    assert 'connect="tcp://127.0.0.1:5555"' in code and "diloco.Worker(" in code
    cluster.server("--min-workers", "2")
    for returncode, out in cluster.run_copies(code.replace("tcp://127.0.0.1:5555", cluster.address), 2, 240):
        assert returncode == 0, out
        m = re.search(r"(\d+) inner steps, (\d+) rounds synced, loss ([\d.]+)", out)
        assert m, out
        assert (int(m.group(1)), int(m.group(2))) == (200, 4), out
    server = cluster.procs[0].output()
    assert len(re.findall(r"applied\s+fragment 0 round \d+ from 2 contributors", server)) == 4, server
