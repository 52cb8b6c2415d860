"""The coordinator's data-plane seam (``diloco/coordinator/plane.py``): the service chooses the hub's or
the collective's half once, at startup, and no handler branches on the data plane after that."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from diloco.coordinator.collective_rounds import CollectiveRounds
from diloco.coordinator.hub_rounds import HubRounds
from diloco.coordinator.plane import DataPlaneRounds
from diloco.testing import make_coordinator

COORDINATOR = Path(__file__).resolve().parents[1] / "diloco" / "coordinator"
#: Names a test on the data plane would read: its enum, either half, or what only one half has.
PLANE_NAMES = {"DataPlane", "data_plane", "collective", "store", "checks", "HubRounds", "CollectiveRounds", "plane"}
#: Where the service may look at the plane: where it chooses it, and the hub's typed accessor.
CHOOSERS = {"__init__", "hub"}


def data_plane_branches(source: str) -> list[str]:
    """``function: line`` of each condition (if, elif, conditional expression, while, comprehension
    filter, assert) outside ``CHOOSERS`` that reads one of ``PLANE_NAMES``."""
    found = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or fn.name in CHOOSERS:
            continue
        for node in ast.walk(fn):
            tests = [node.test] if isinstance(node, (ast.If, ast.IfExp, ast.While, ast.Assert)) else \
                list(node.ifs) if isinstance(node, ast.comprehension) else []
            for test in tests:
                names = {n.id for n in ast.walk(test) if isinstance(n, ast.Name)} | \
                        {n.attr for n in ast.walk(test) if isinstance(n, ast.Attribute)}
                if names & PLANE_NAMES:
                    found.append(f"{fn.name}: {test.lineno}")
    return found


def test_the_service_branches_on_no_data_plane():
    assert data_plane_branches((COORDINATOR / "service.py").read_text(encoding="utf-8")) == []


def test_the_check_finds_a_branch_on_the_data_plane():
    source = ("class C:\n"
              "    def __init__(self, config):\n"
              "        self.plane = 1 if config.data_plane is DataPlane.COLLECTIVE else 2\n"
              "    def on_join(self, msg):\n"
              "        if self.collective is not None:\n"
              "            return\n"
              "        x = [w for w in msg if self.store]\n"
              "    def fine(self, msg):\n"
              "        if msg.ok:\n"
              "            self.plane.accept(msg)\n")
    assert data_plane_branches(source) == ["on_join: 5", "on_join: 7"]


@pytest.mark.parametrize("plane, half", [("hub", HubRounds), ("collective", CollectiveRounds)])
def test_each_data_plane_gets_its_half_and_the_half_has_the_whole_seam(plane, half):
    coordinator = make_coordinator(0.0, data_plane=plane)
    assert type(coordinator.plane) is half
    members = [name for name in dir(DataPlaneRounds) if not name.startswith("_")]
    assert len(members) >= 20
    missing = [name for name in members if not hasattr(coordinator.plane, name)]
    assert missing == []
    assert isinstance(coordinator.plane, DataPlaneRounds)


def test_the_hub_accessor_names_the_plane_a_collective_run_is_on():
    assert isinstance(make_coordinator(0.0).hub, HubRounds)
    with pytest.raises(TypeError, match="collective data plane: its coordinator holds no params"):
        make_coordinator(0.0, data_plane="collective").hub


@pytest.mark.parametrize("name", ["service.py", "hub_rounds.py", "collective_rounds.py", "plane.py"])
def test_each_side_of_the_seam_stays_under_about_600_lines(name):
    assert (COORDINATOR / name).read_text(encoding="utf-8").count("\n") <= 620
