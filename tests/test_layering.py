"""The layering rules hold: the core is pure, transport knows nothing about rounds.

The layers (pyproject.toml): cli > deploy, demo, sim > coordinator, worker >
wire > transport > core; the coordinator and the worker never import each
other; transport imports neither the wire format nor the core.

Two independent checks (SPEC.md section 2: the core is pure):

* import-linter runs the contracts in pyproject.toml. It follows indirect
  imports too (core -> helper -> os), but it needs every module a contract
  names to exist.
* An AST scan of every file under diloco/core for a direct import of a
  forbidden module, in every spelling (``import os.path``, ``from os import
  path``, an import inside a function, ``__import__("os")``). It reads the
  source and imports nothing, so it works even when the package is broken.
  The same scan covers the worker's pure modules (SPEC.md section 14:
  ``diloco/worker/session.py``, ``schedule.py``, ``actions.py``,
  ``states.py``), which sit in a package whose driver does use torch and
  threads, so only those files are scanned.

Each check is also run against a deliberately bad tree, to prove it can fail.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

REPO = Path(__file__).resolve().parents[1]
CORE = REPO / "diloco" / "core"

#: What the core must never import: I/O, clock, randomness, threads, torch, zmq, msgpack.
FORBIDDEN_IN_CORE = frozenset({
    "time", "random", "threading", "asyncio", "os", "socket", "subprocess",
    "multiprocessing", "zmq", "torch", "msgpack",
})

WORKER = REPO / "diloco" / "worker"
#: The worker's pure modules (SPEC.md section 14); the rest of diloco/worker drives them with torch and threads.
WORKER_PURE_FILES = ("session.py", "schedule.py", "actions.py", "states.py")
WORKER_PURE_MODULES = tuple(f"diloco.worker.{f[:-3]}" for f in WORKER_PURE_FILES)
COLLECTIVE = REPO / "diloco" / "collective"
#: What they must never import: the core's list, and the phase-machine library (the session is plain code).
FORBIDDEN_IN_WORKER_SESSION = FORBIDDEN_IN_CORE | {"transitions"}

# The console script ``lint-imports`` without relying on PATH: under
# ``.venv/bin/python -m pytest`` the venv's bin directory need not be on PATH.
_LINT_IMPORTS = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"


def run_lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    """Run import-linter on the config found in ``cwd``; no cache is written."""
    pytest.importorskip("importlinter")
    return subprocess.run(
        [sys.executable, "-c", _LINT_IMPORTS, "--no-cache", "--no-logo"],
        cwd=cwd, capture_output=True, text=True, timeout=300,
    )


def forbidden_imports(root: Path, forbidden: frozenset[str] = FORBIDDEN_IN_CORE,
                      only: tuple[str, ...] | None = None) -> list[str]:
    """Every import of a forbidden top-level module in the .py files under ``root`` (or just the ``only`` names).

    Returns ``"path:line: module"`` strings, sorted. Relative imports
    (``from . import x``) are local and never forbidden.
    """
    found = []
    paths = sorted(root.rglob("*.py")) if only is None else [root / name for name in only]
    for path in paths:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level == 0 and node.module:
                    names = [node.module]
            elif isinstance(node, ast.Call) and _is_dynamic_import(node.func):
                if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                    names = [node.args[0].value]
            for name in names:
                top = name.split(".")[0]
                if top in forbidden:
                    found.append(f"{path.relative_to(root)}:{node.lineno}: {name}")
    return sorted(found)


def _is_dynamic_import(func: ast.expr) -> bool:
    """``__import__(...)`` or ``importlib.import_module(...)``."""
    if isinstance(func, ast.Name):
        return func.id in ("__import__", "import_module")
    return isinstance(func, ast.Attribute) and func.attr == "import_module"


def _contracts() -> tuple[dict, list[dict]]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["importlinter"]
    return config, config["contracts"]


# --------------------------------------------------------------- the real repo


def test_import_linter_contracts_pass():
    result = run_lint_imports(REPO)
    assert result.returncode == 0, (
        "import-linter contracts in pyproject.toml are broken (or name a module that does not "
        f"exist yet):\n{result.stdout}\n{result.stderr}"
    )
    assert " 0 broken" in result.stdout, result.stdout


def test_core_imports_nothing_impure():
    scanned = sorted(p.name for p in CORE.rglob("*.py"))
    assert "round_fsm.py" in scanned, f"the scan found no core files under {CORE}"
    assert forbidden_imports(CORE) == []


def test_ast_list_matches_the_import_linter_contract():
    """The two checks guard the same list; a module added to one must be added to the other."""
    config, contracts = _contracts()
    root = config["root_package"]
    external = set()
    for c in contracts:
        if c["type"] == "forbidden" and f"{root}.core" in c["source_modules"]:
            external |= {m for m in c["forbidden_modules"] if m != root and not m.startswith(root + ".")}
    assert external == set(FORBIDDEN_IN_CORE)


def test_worker_session_imports_nothing_impure():
    """SPEC.md section 14: the session, its schedule, actions and states are pure like the core."""
    assert all((WORKER / name).is_file() for name in WORKER_PURE_FILES), f"missing under {WORKER}"
    assert forbidden_imports(WORKER, FORBIDDEN_IN_WORKER_SESSION, WORKER_PURE_FILES) == []


def test_collective_member_imports_nothing_impure():
    """SPEC.md section 7c, M1: the member's machine is pure like the core and the session."""
    assert (COLLECTIVE / "member.py").is_file(), f"missing under {COLLECTIVE}"
    assert forbidden_imports(COLLECTIVE, FORBIDDEN_IN_WORKER_SESSION, ("member.py",)) == []


def test_collective_member_ast_list_matches_the_import_linter_contract():
    config, contracts = _contracts()
    root = config["root_package"]
    (contract,) = [c for c in contracts if c["type"] == "forbidden"
                   and c["source_modules"] == ["diloco.collective.member"]]
    external = {m for m in contract["forbidden_modules"] if m != root and not m.startswith(root + ".")}
    assert external == set(FORBIDDEN_IN_WORKER_SESSION)


def test_worker_ast_list_matches_the_import_linter_contract():
    config, contracts = _contracts()
    root = config["root_package"]
    (contract,) = [c for c in contracts
                   if c["type"] == "forbidden" and set(c["source_modules"]) & set(WORKER_PURE_MODULES)]
    assert set(contract["source_modules"]) == set(WORKER_PURE_MODULES)
    external = {m for m in contract["forbidden_modules"] if m != root and not m.startswith(root + ".")}
    assert external == set(FORBIDDEN_IN_WORKER_SESSION)


# ------------------------------------------------- the checks can fail at all


@pytest.mark.parametrize("source, expected", [
    ("import os\n", "os"),
    ("import os.path\n", "os.path"),
    ("import json, socket as s\n", "socket"),
    ("from os import path\n", "os"),
    ("from multiprocessing.pool import Pool\n", "multiprocessing.pool"),
    ("def f():\n    import time\n    return time\n", "time"),
    ("try:\n    import torch\nexcept ImportError:\n    torch = None\n", "torch"),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import zmq\n", "zmq"),
    ("rng = __import__('random')\n", "random"),
    ("import importlib\nmp = importlib.import_module('msgpack')\n", "msgpack"),
])
def test_scanner_reports_a_forbidden_import(tmp_path, source, expected):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "bad.py").write_text(source)
    found = forbidden_imports(tmp_path)
    assert len(found) == 1 and found[0].endswith(f": {expected}"), found
    assert found[0].startswith(str(Path("pkg") / "bad.py") + ":")


def test_scanner_ignores_lookalikes(tmp_path):
    (tmp_path / "ok.py").write_text(textwrap.dedent("""\
        import timeit, ossaudiodev, randomize
        from . import os
        from .time import clock
        from dataclasses import dataclass
        from diloco.core.events import Ticked
        x = "import os"
    """))
    assert forbidden_imports(tmp_path) == []


def _probe_tree(tmp_path: Path, core_source: str) -> Path:
    """A copy of the repo's layout and contracts under the package name ``layering_probe``."""
    config, contracts = _contracts()
    root = config["root_package"]
    probe = "layering_probe"

    def rename(module: str) -> str:
        return probe + module[len(root):] if module == root or module.startswith(root + ".") else module

    def modules_of(contract: dict) -> list[str]:
        """Every module a contract names (a layer may hold several, separated by "|" or ":")."""
        names = [m for key in ("source_modules", "forbidden_modules", "modules") for m in contract.get(key, [])]
        for layer in contract.get("layers", []):
            names += [m for m in layer.replace("|", " ").replace(":", " ").split()]
        return names

    def rename_all(value: str) -> str:
        return " ".join(rename(word) for word in value.split(" "))

    internal = {rename(m) for c in contracts for m in modules_of(c) if rename(m) != m}
    for module in internal | {probe, f"{probe}.core"}:
        pkg = tmp_path.joinpath(*module.split("."))
        pkg.mkdir(parents=True, exist_ok=True)
        (pkg / "__init__.py").write_text("")
    (tmp_path / probe / "core" / "mod.py").write_text(core_source)

    lines = ["[importlinter]", f"root_package = {probe}",
             f"include_external_packages = {bool(config.get('include_external_packages', False))}", ""]
    for i, c in enumerate(contracts):
        lines += [f"[importlinter:contract:c{i}]", f"name = {c['name']}", f"type = {c['type']}"]
        for key, value in c.items():
            if key in ("name", "type"):
                continue
            if isinstance(value, list):
                lines.append(f"{key} =")
                lines += [f"    {rename_all(v)}" for v in value]
            else:
                lines.append(f"{key} = {value}")
        lines.append("")
    (tmp_path / ".importlinter").write_text("\n".join(lines))
    return tmp_path


def test_import_linter_contracts_pass_on_a_clean_copy(tmp_path):
    """Control for the test below: the copied contracts pass on a clean tree."""
    result = run_lint_imports(_probe_tree(tmp_path, "from dataclasses import dataclass\n"))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("source, chain", [
    ("import os\n", "layering_probe.core.mod -> os"),
    ("from layering_probe.transport import x\n", "layering_probe.core.mod -> layering_probe.transport"),
])
def test_import_linter_contracts_catch_a_violation(tmp_path, source, chain):
    result = run_lint_imports(_probe_tree(tmp_path, source))
    assert result.returncode != 0 and "BROKEN" in result.stdout, result.stdout + result.stderr
    assert chain in result.stdout, result.stdout


def _verdict(report: str, contract: str) -> str:
    """KEPT or BROKEN, as import-linter's summary says for the contract whose name starts with ``contract``."""
    flat = " ".join(report.split())  # the summary wraps long names over lines
    summary = flat[flat.index("Contracts ---------"):]
    match = re.search(re.escape(contract) + r".*? (KEPT|BROKEN)", summary)
    assert match, f"no verdict for {contract!r} in {report}"
    return match.group(1)


@pytest.mark.parametrize("importer, imported, contract", [
    # transport must not know the wire format (messages carry rounds): the forbidden contract and the layers
    ("transport", "wire", "transport knows no rounds"),
    # a lower layer must not reach up
    ("wire", "coordinator", "layers:"),
    ("coordinator", "deploy", "layers:"),
    # siblings in one layer stay apart
    ("worker", "coordinator", "the coordinator and the worker are independent"),
    ("deploy", "sim", "layers:"),
])
def test_import_linter_layer_contracts_catch_a_violation(tmp_path, importer, imported, contract):
    probe = _probe_tree(tmp_path, "from dataclasses import dataclass\n")
    (probe / "layering_probe" / imported / "thing.py").write_text("X = 1\n")
    (probe / "layering_probe" / importer / "bad.py").write_text(f"from layering_probe.{imported}.thing import X\n")
    result = run_lint_imports(probe)
    assert result.returncode != 0, result.stdout + result.stderr
    assert _verdict(result.stdout, contract) == "BROKEN", result.stdout
    assert f"layering_probe.{importer}.bad -> layering_probe.{imported}.thing" in result.stdout, result.stdout


def _worker_tree(tmp_path: Path, session_source: str) -> Path:
    """A diloco/worker lookalike: the pure files (session.py as given) and an impure driver beside them."""
    worker = tmp_path / "worker"
    worker.mkdir()
    for name in WORKER_PURE_FILES:
        (worker / name).write_text("from dataclasses import dataclass\n")
    (worker / "session.py").write_text(session_source)
    (worker / "worker.py").write_text("import threading\nimport time\nimport torch\n")   # the driver may
    return worker


@pytest.mark.parametrize("source, expected", [
    ("import time\n", "1: time"),
    ("def now():\n    import time\n    return time.monotonic()\n", "2: time"),
    ("from random import Random\n", "1: random"),
    ("import torch.nn\n", "1: torch.nn"),
    ("from transitions import Machine\n", "1: transitions"),
    ("zmq = __import__('zmq')\n", "1: zmq"),
])
def test_worker_session_scan_reports_a_forbidden_import(tmp_path, source, expected):
    worker = _worker_tree(tmp_path, source)
    assert forbidden_imports(worker, FORBIDDEN_IN_WORKER_SESSION, WORKER_PURE_FILES) == [f"session.py:{expected}"]


def test_worker_session_scan_leaves_the_driver_alone(tmp_path):
    """Control: the driver beside the pure files may use threads, clocks and torch."""
    worker = _worker_tree(tmp_path, "from diloco.wire.messages import Join\n")
    assert forbidden_imports(worker, FORBIDDEN_IN_WORKER_SESSION, WORKER_PURE_FILES) == []
    assert len(forbidden_imports(worker, FORBIDDEN_IN_WORKER_SESSION)) == 3


def test_import_linter_contracts_catch_a_worker_session_violation(tmp_path):
    probe = _probe_tree(tmp_path, "from dataclasses import dataclass\n")
    (probe / "layering_probe" / "worker" / "session" / "__init__.py").write_text("import time\n")
    result = run_lint_imports(probe)
    assert result.returncode != 0 and "BROKEN" in result.stdout, result.stdout + result.stderr
    assert "layering_probe.worker.session -> time" in result.stdout, result.stdout
