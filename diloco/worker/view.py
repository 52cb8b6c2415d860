"""What a ``DilocoWorker`` shows of its session: read-only properties users and drivers read.

The session (``diloco.worker.session``) owns every one of these values; the worker shows them
under stable names (counters, round ids, the run as the last Welcome told it) so that callers
never reach into the session. Kept apart from the driver, which only drives.
"""

from __future__ import annotations

import collections

from diloco.worker.session import WorkerSession
from diloco.worker.states import WorkerState


class SessionView:
    """Read-only properties over ``self.session`` (a ``WorkerSession``), mixed into ``DilocoWorker``."""

    session: WorkerSession

    @property
    def state(self) -> str:
        """The session's state (a ``WorkerState`` value); "joining" before ``join``."""
        return (self.session.state or WorkerState.JOINING).value

    @property
    def overlap_steps(self) -> int:
        """Inner steps a worker trains on after submitting a fragment before merging its Result (0: none)."""
        return self.session.overlap_steps

    @property
    def overlap_alpha(self) -> float:
        return self.session.overlap_alpha

    @property
    def coordinator_timeout_s(self) -> float:
        """How long a silent coordinator is waited for before the worker gives up (W11)."""
        return self.session.coordinator_timeout_s

    @property
    def effective_sync_every(self) -> int:
        """Inner steps per round in force: ``sync_every``, or the H_w a DyLU coordinator named (W19)."""
        return self.session.sync_every

    @property
    def inner_step(self) -> int:
        """Inner steps this worker has taken (restored from its checkpoint)."""
        return self.session.inner_step

    @property
    def rounds_synced(self) -> int:
        return self.session.rounds_synced

    @property
    def stop_reason(self) -> str | None:
        return self.session.stop_reason

    @property
    def seconds_paused(self) -> float:
        return self.session.seconds_paused

    @property
    def mode(self) -> str | None:
        return self.session.mode

    @property
    def min_workers(self) -> int | None:
        return self.session.min_workers

    @property
    def below_min_workers(self) -> bool:
        return self.session.below_min_workers

    @property
    def heartbeat_interval_s(self) -> float | None:
        return self.session.heartbeat_interval_s if self.session.welcomed else None

    @property
    def sync_history(self) -> collections.deque:
        """(inner_step, fragment_id, round_id, outcome) per released contribution, newest last."""
        return self.session.history

    @property
    def restored(self) -> bool:
        return self.session.restored

    @property
    def round_ids(self) -> tuple[int, ...]:
        """Per fragment: the round this worker contributes to next (sync) or its base version (async)."""
        return tuple(self.session.round_ids)

    @property
    def fragments(self) -> tuple[tuple[str, ...], ...]:
        return self.session.fragments

    @property
    def units_per_epoch(self) -> int | None:
        """Data work units per epoch of the run (``diloco server --data-units``), or None: it hands out none."""
        return self.session.units_per_epoch

    @property
    def data_unit(self) -> tuple[int, int] | None:
        """Data work units: ``(epoch, index)`` of the unit to train on now (``index`` in 0..N-1 names the
        data); None when the run hands out none (``diloco server --data-units``). It changes only at a
        sync point: read it after each ``step_done``."""
        unit, units = self.session.unit, self.session.units_per_epoch
        if unit is None or not units:
            return None
        return divmod(unit, units)

    @property
    def stopped(self) -> bool:
        return self.session.stopped
