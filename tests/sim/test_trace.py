"""The trace format: hand-formatted hot lines are plain JSON; parsing them changes nothing."""

from __future__ import annotations

import json

from diloco.sim import derive_config, run_config
from diloco.sim.checker import check_records
from diloco.sim.simulation import Simulation
from diloco.sim.trace import TraceWriter, _dumps, read_trace


def test_every_line_is_the_json_of_its_record():
    bad = []

    def consumer(record, line):
        if _dumps(record) != line or json.loads(line) != record:
            bad.append(line)

    Simulation(derive_config(13), TraceWriter(None, [consumer])).run()
    assert bad == []


def test_checking_the_file_equals_checking_online(tmp_path):
    path = str(tmp_path / "t.jsonl")
    online = run_config(derive_config(33), trace_path=path)
    parsed = run_config(derive_config(33), parse=True)
    violations, checker = check_records(read_trace(path))
    assert online.counts == parsed.counts == checker.counts
    assert online.violation_count == parsed.violation_count == len(violations) == 0


def test_first_record_is_the_config():
    records = []
    Simulation(derive_config(2), TraceWriter(None, [lambda r, line: records.append(r)])).run()
    first = records[0]
    assert first["k"] == "config" and first["format"] == "diloco.sim.trace" and first["seed"] == 2
    assert records[-1]["k"] == "phase" and records[-1]["what"] == "end"
    kinds = {r["k"] for r in records}
    assert {"send", "recv", "obs", "worker", "adopt"} <= kinds


def test_the_checker_imports_nothing_from_diloco():
    """It judges the trace alone: no core, no coordinator, no simulator objects.

    ``checker.py`` and its families of invariants (``diloco.sim.checks``) import each other only.
    """
    import ast
    import pathlib

    import diloco.sim.checker as checker
    import diloco.sim.checks as checks

    files = [pathlib.Path(checker.__file__), *sorted(pathlib.Path(checks.__file__).parent.glob("*.py"))]
    assert len(files) > 2
    for path in files:
        tree = ast.parse(path.read_text())
        modules = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0]
        modules += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        outside = [m for m in modules if m and m.split(".")[0] in ("diloco", "torch")
                   and not m.startswith("diloco.sim.checks.")]
        assert outside == [], path.name
        assert not [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level], path.name


def test_the_checker_knows_the_worker_states():
    """The checker names the states itself (it imports nothing); they are the worker's vocabulary."""
    from diloco.sim.checker import WORKER_STATES
    from diloco.worker.states import WorkerState

    assert WORKER_STATES == tuple(s.value for s in WorkerState)
