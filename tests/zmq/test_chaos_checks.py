"""The chaos soak's checks on made-up histories: each flags what it must, and only that.

``scripts/chaos.py`` judges a run from its audit log and what it did; these feed its worker
check (``check_workers``) short histories directly, without processes.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[2]


def chaos():
    spec = importlib.util.spec_from_file_location("chaos_script", REPO / "scripts" / "chaos.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("chaos_script", module)
    spec.loader.exec_module(module)
    return module


def soak(partitions):
    return SimpleNamespace(outages=[], partitions=partitions, frozen_workers=[], worker_exits=[], kill_log=[],
                           args=SimpleNamespace(heartbeat_timeout=10.0, coordinator_timeout=20.0))


def test_a_worker_let_go_during_a_cut_down_partition_is_flagged():
    events = [{"t": 0.0, "event": "start"}, {"t": 1.0, "event": "join", "worker_id": "w4"},
              {"t": 16.0, "event": "left", "worker_id": "w4", "cause": "left"},
              {"t": 18.0, "event": "join", "worker_id": "w4"}, {"t": 100.0, "event": "apply"}]
    partitions = [("w4", 42, "cut down", 10.0, 16.0, 6.0)]
    violations, _ = chaos().check_workers(soak(partitions), events)
    assert any("cut down partition" in v for v in violations), violations


def test_a_worker_joining_a_restarted_coordinator_when_cut_off_was_not_yet_a_member():
    # w4 was a member of the coordinator's last incarnation; the coordinator restarted (a new
    # "start": it counts nobody a member until they join it), w4's join and its Welcome cross
    # the cut-down link, and it joins again once the link heals.
    events = [{"t": 0.0, "event": "start"}, {"t": 1.0, "event": "join", "worker_id": "w4"},
              {"t": 8.0, "event": "start"}, {"t": 12.0, "event": "join", "worker_id": "w4"},
              {"t": 16.0, "event": "left", "worker_id": "w4", "cause": "left"},
              {"t": 18.0, "event": "join", "worker_id": "w4"}, {"t": 100.0, "event": "apply"}]
    partitions = [("w4", 42, "cut down", 10.0, 16.0, 6.0)]
    violations, notes = chaos().check_workers(soak(partitions), events)
    assert violations == []
    assert any("not yet a member when cut off" in n for n in notes), notes
