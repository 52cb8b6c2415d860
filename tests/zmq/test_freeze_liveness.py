"""The chaos checker's liveness figure (``scripts/chaos.py``, check 7) on made-up audit logs.

The clock runs while the last ``quorum`` line says the run is not below
``min_workers`` and the coordinator is not out by the soak's doing (a freeze
until its thaw, a kill until the next ``start`` line), stops otherwise (and
goes on from there: a quorum that comes and goes does not hide a run that
never applies), and an ``apply`` resets it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def chaos():
    spec = importlib.util.spec_from_file_location("chaos_script", REPO / "scripts" / "chaos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def start(t):
    return {"t": t, "event": "start"}


def quorum(t, ok):
    return {"t": t, "event": "quorum", "below_min_workers": not ok}


def apply(t):
    return {"t": t, "event": "apply"}


def test_the_longest_stretch_with_the_quorum_held_and_no_round_applied(chaos):
    events = [start(0), quorum(1, True), apply(2), apply(3), apply(4), apply(24), apply(25)]
    live = chaos.liveness(events, [], end_wall=26, heartbeat_timeout=10)
    assert live["max_stall_s"] == pytest.approx(20) and (live["stall_from"], live["stall_to"]) == (4, 24)
    assert live["round_s"] == 1 and live["stall_bound_s"] == pytest.approx(2 * 10 + 4 * 1 + 10)


def test_time_below_the_quorum_does_not_count(chaos):
    events = [start(0), quorum(1, True), apply(2), apply(3), quorum(5, False), quorum(20, True), apply(24)]
    # The clock stops below the quorum, and goes on where it stopped: 3 -> 5, then 20 -> 24.
    assert chaos.liveness(events, [], 26, 10)["max_stall_s"] == pytest.approx(6)


def test_a_coordinator_freeze_does_not_count_until_its_thaw(chaos):
    events = [start(0), quorum(1, True), apply(2), apply(3), apply(20)]
    live = chaos.liveness(events, [["freeze", 5.0, 15.0]], 21, 10)
    assert live["max_stall_s"] == pytest.approx(17 - 10)


def test_a_coordinator_kill_lasts_until_the_next_start_and_the_new_quorum(chaos):
    events = [start(0), quorum(1, True), apply(2), apply(3),
              start(8), quorum(12, True), apply(13), apply(14)]
    live = chaos.liveness(events, [["kill", 5.0, None]], 15, 10)
    # 3 -> 5 before the kill; 8 -> 12 is below the quorum (a new incarnation); 12 -> 13 after.
    assert live["max_stall_s"] == pytest.approx(3) and (live["stall_from"], live["stall_to"]) == (3, 13)


def test_faults_less_than_a_second_apart_are_one_outage(chaos):
    events = [start(0), start(6)]
    spans = chaos.outage_spans([["kill", 2.0, None], ["freeze", 6.5, 12.0], ["freeze", 20.0, 22.0]], events, 30)
    assert spans == [(2.0, 12.0), (20.0, 22.0)]
