"""The simulator must catch a broken worker, as it catches a broken core (test_broken_core.py).

The simulated workers run the real ``WorkerSession``; each test patches a
deliberately broken subclass into the simulator (``diloco.sim.worker``) for
the test only -- ``diloco/worker/session.py`` is never edited -- and the
checker's worker rules (SPEC.md W5, W6, W8) must report it for a known seed
of the CI swarm:

* ignoring ``below_min_workers``: training on instead of pausing while a
  contribution waits below quorum (W5; seeds 8 sync, 17 async), or waiting
  without pausing (W6; seed 8). Each trips 124 of the 200 CI seeds;
* ``held_limit`` without its retry (W8, async): never sending the contribution
  again (it waits for a Result that cannot come; 4 of the 200 CI seeds, 11 of
  200 seeds run as async), or sending it again at once instead of a heartbeat
  interval later (a busy retry; 5 of 200, 12 of 200 as async). Seed 135 trips both.

Before these rules the swarm caught none of the four (0 of the 200 CI seeds for the
first two, 0 of 200 async seeds for the held_limit ones): no coordinator-side invariant
depends on them, and the resync recovers a stuck worker in time.
"""

from __future__ import annotations

import pytest

import diloco.sim.worker as sim_worker
from diloco.cli import main
from diloco.sim import run_seed
from diloco.wire.messages import ErrorCode
from diloco.worker.session import WorkerSession, error_code
from diloco.worker.states import WorkerState


class TrainsWhilePaused(WorkerSession):
    """Below quorum, it releases itself to TRAINING instead of pausing."""

    def _settle(self, now):
        super()._settle(now)
        if self.state is WorkerState.PAUSED:
            self._end_pause(now)
            self._go(WorkerState.TRAINING)


class NeverPauses(WorkerSession):
    """It ignores below_min_workers: it waits, never paused."""

    def _settle(self, now):
        below, self.below_min_workers = self.below_min_workers, False
        try:
            super()._settle(now)
        finally:
            self.below_min_workers = below


class NeverRetries(WorkerSession):
    """A Submit answered held_limit is taken as pending (as for duplicate): no retry."""

    def _on_error(self, msg, now):
        if msg.in_reply_to == "Submit" and error_code(msg.code) is ErrorCode.HELD_LIMIT:
            if self._unacked:
                self._unacked.popleft()
            return
        super()._on_error(msg, now)


class RetriesAtOnce(WorkerSession):
    """held_limit drops the contribution but not its retry timer: it is simply due again."""

    def _on_error(self, msg, now):
        if msg.in_reply_to == "Submit" and error_code(msg.code) is ErrorCode.HELD_LIMIT:
            fid = self._unacked.popleft() if self._unacked else None
            if fid is not None:
                self.waiting.pop(fid, None)
            return
        super()._on_error(msg, now)


@pytest.mark.parametrize("broken, seed, words", [
    (TrainsWhilePaused, 8, "trains while its contribution"),
    (TrainsWhilePaused, 17, "trains while its contribution"),
    (NeverPauses, 8, "it must pause"),
    (NeverRetries, 135, "has not sent it again"),
    (RetriesAtOnce, 135, "a retry waits one heartbeat interval"),
])
def test_the_checker_reports_a_broken_worker_for_a_known_seed(broken, seed, words, monkeypatch):
    clean = run_seed(seed)
    assert clean.ok, clean.violations[:3]
    monkeypatch.setattr(sim_worker, "WorkerSession", broken)
    r = run_seed(seed)
    worker = [v for v in r.violations if v.rule in ("W5", "W6", "W8")]
    assert worker, f"seed {seed}: the simulator did not notice {broken.__name__}"
    assert words in worker[0].detail, worker[0]


def test_cli_swarm_names_the_seed_of_a_busy_retry(monkeypatch, capsys):
    monkeypatch.setattr(sim_worker, "WorkerSession", RetriesAtOnce)
    assert main(["sim", "--swarm", "3", "--seed", "134"]) == 1
    out = capsys.readouterr().out
    assert "[W8]" in out and "re-run: diloco sim --seed 135" in out
    assert out.splitlines()[-1] == "RESULT sim_swarm seeds=3 failed=1 failing_seeds=135"
