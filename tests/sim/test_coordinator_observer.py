"""Coordinator fixes found by the simulator (tests/sim owns them; see diloco/sim/checker.py).

Observer order: the coordinator reported ``left`` *after* the quorum change,
phase change and apply that the leave caused, while ``dead`` (a DeclareDead)
came in effect order. An observer rebuilding membership from the events (the
simulator's checker, a status page, the demo's timeline) then saw a round
apply, or the quorum drop, while the departed worker still looked live:
found by the simulator as I6/I12 violations (seed 4, ``--faults light``).
"""

from __future__ import annotations

import torch

from diloco.coordinator.service import Coordinator
from diloco.testing import join_message, make_coordinator
from diloco.wire.messages import Leave, Submit

PARAMS = {"w": torch.zeros(3)}


def _coordinator(min_workers: int) -> tuple[Coordinator, list[tuple[str, dict]]]:
    events: list[tuple[str, dict]] = []
    c = make_coordinator(min_workers=min_workers, observer=lambda what, now, info: events.append((what, info)))
    for i, wid in enumerate(("w1", "w2")):
        c.handle(f"p{i}", join_message(wid, PARAMS), 1.0)
    return c, events


def test_left_is_reported_before_the_quorum_change_it_causes():
    c, events = _coordinator(min_workers=2)
    events.clear()
    c.handle("p1", Leave("w2"), 2.0)
    kinds = [what for what, _ in events]
    assert kinds == ["left", "quorum", "phase"], kinds


def test_left_is_reported_before_the_apply_it_completes():
    c, events = _coordinator(min_workers=1)
    c.handle("p0", Submit("w1", 0, 0, {"w": torch.ones(3)}), 2.0)
    events.clear()
    c.handle("p1", Leave("w2"), 3.0)  # w2 was the last one awaited: its leave completes round 0
    kinds = [what for what, _ in events]
    assert kinds == ["left", "apply"], kinds


def test_kick_and_peer_lost_report_left_first_too():
    c, events = _coordinator(min_workers=2)
    events.clear()
    c.peer_lost("p1", 2.0)
    assert [what for what, _ in events][:1] == ["left"]
