"""SPEC.md R9, the runner's side: time the coordinator's process did not run is not its workers' silence.

A coordinator stopped for longer than the heartbeat timeout (SIGSTOP, a stalled host) comes back
to sockets full of its workers' heartbeats. Counted as their silence, its first turn declared
every worker dead before it read one of them, and each re-joined and healed.
"""

from __future__ import annotations

import pytest
import torch

from diloco.coordinator.runner import STALL_S, RunningClock, serve
from diloco.testing import join_message, make_coordinator
from diloco.transport import Arrival
from diloco.wire.messages import Heartbeat


def test_a_gap_longer_than_a_stall_counts_as_one_turn():
    readings = iter([100.0, 100.05, 100.10, 130.10, 130.15, 130.15 + STALL_S * 0.9])
    clock = RunningClock(lambda: next(readings), tick_s=0.05)
    seen = [clock() for _ in range(6)]
    assert seen[:3] == pytest.approx([100.0, 100.05, 100.10])
    assert seen[3] == pytest.approx(100.15)  # 30 s stopped: one turn
    assert seen[4] == pytest.approx(100.20)
    assert seen[5] == pytest.approx(100.20 + STALL_S * 0.9)  # a slow turn under the bound counts whole
    assert clock.skipped == pytest.approx(29.95)


class _Script:
    """An endpoint whose clock is the script's: each turn reads one (time, arrival or None)."""

    def __init__(self, turns) -> None:
        self.turns = list(turns)
        self.now = 0.0

    def recv(self, timeout_s):
        self.now, arrival = self.turns.pop(0)
        return arrival

    def lost_peers(self):
        return []

    def arriving_peers(self):
        return []

    def send(self, peer, message) -> None:
        pass


class _Until:
    def __init__(self, script: _Script) -> None:
        self.script = script

    def is_set(self) -> bool:
        return not self.script.turns


def run_script(turns):
    c = make_coordinator(0.0, min_workers=2, heartbeat_timeout_s=10.0)
    params = {"w": torch.zeros(3)}
    script = _Script(turns(params))
    serve(script, c, clock=lambda: script.now, stop_event=_Until(script))
    return c


def test_a_coordinator_stopped_past_the_heartbeat_timeout_reads_its_workers_before_judging_them():
    def turns(params):
        return [(1.0, Arrival("p1", join_message("w1", params))), (1.1, Arrival("p2", join_message("w2", params))),
                (1.2, None),
                # Stopped for 30 s; the heartbeats sent meanwhile are the first things it reads.
                (31.2, Arrival("p1", Heartbeat("w1"))), (31.3, Arrival("p2", Heartbeat("w2"))), (31.4, None)]

    c = run_script(turns)
    assert c.fsm.is_member("w1") and c.fsm.is_member("w2")
    assert c.fsm.live_workers == 2


def test_a_worker_silent_while_the_coordinator_ran_is_still_declared_dead():
    def turns(params):
        ticks = [(1.2 + 0.5 * i, Arrival("p1", Heartbeat("w1"))) for i in range(1, 25)]  # 12 s of w1 only
        return [(1.0, Arrival("p1", join_message("w1", params))), (1.1, Arrival("p2", join_message("w2", params)))] \
            + ticks + [(14.0, None)]

    c = run_script(turns)
    assert c.fsm.is_member("w1") and not c.fsm.is_member("w2")
