"""Shared fixtures for the simulator tests."""

from __future__ import annotations

import pytest

from diloco.core import round_fsm
from diloco.core.quorum import QuorumDecision


@pytest.fixture
def broken_membership_gate(monkeypatch):
    """A deliberately broken core: the quorum gate is skipped on the membership path.

    After every join, leave, death and min_workers change, whatever is complete is
    applied *without* asking quorum_decision: a gate on the submit path alone, the
    bug the quorum rule exists to prevent (a death releases a round below quorum). Test-only:
    the core itself is never edited.
    """
    original = round_fsm.RoundFSM._after_membership_change

    def broken(self, effects, announce=False):
        original(self, effects, announce)
        if self.phase.value == "stopped":
            return
        saved = self._quorum
        self._quorum = QuorumDecision(False, "broken on purpose: the membership path skips the gate")
        try:
            self._apply_ready(effects, range(self.config.num_fragments))
        finally:
            self._quorum = saved

    monkeypatch.setattr(round_fsm.RoundFSM, "_after_membership_change", broken)
    yield
