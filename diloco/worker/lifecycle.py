"""A worker's lifecycle, declared once as data and driven by ``transitions``.

The table is the single source of truth for which moves are legal; the worker
never assigns its state directly, it asks ``Lifecycle.go(dest)`` and the
``transitions`` machine (``auto_transitions=False``) refuses anything the
table does not list -- an illegal move is a bug in the worker and raises.
Every change calls the observer once, which is what ``DilocoWorker``'s
``on_state(worker_id, state, t)`` hook (the demo's membership timeline)
hangs off.

States change a few times per round (submit, pause, release), never per
inner step, so the machine costs nothing measurable.
"""

from __future__ import annotations

import enum
from typing import Callable

from transitions import Machine


class WorkerState(str, enum.Enum):
    """Where a worker is in its life (the demo's timeline maps each to a lane colour)."""

    #: Sending ``Join`` and waiting for ``Welcome`` (first join, or a re-join).
    JOINING = "joining"
    #: Running inner optimizer steps between sync points.
    TRAINING = "training"
    #: Submitted a pseudo-gradient; waiting at the barrier for its ``Result``.
    SYNCING = "syncing"
    #: Waiting at the sync point while the run is below ``min_workers`` (SPEC.md R10).
    PAUSED = "paused"
    #: Told to stop (or stopping on its own); saving a checkpoint if asked to.
    STOPPING = "stopping"
    #: Terminal: ``step_done`` returns False from now on.
    STOPPED = "stopped"


S = WorkerState

#: (trigger, sources, destination, why).
TRANSITIONS: tuple[tuple[str, tuple[WorkerState, ...], WorkerState, str], ...] = (
    ("welcomed", (S.JOINING,), S.TRAINING, "a Welcome arrived: train from the global params"),
    ("welcomed_at_sync", (S.JOINING,), S.SYNCING,
     "a Welcome arrived with parked contributions, or at a sync point (resume): wait for the Result"),
    ("submitted", (S.TRAINING,), S.SYNCING, "reached a sync point and submitted a pseudo-gradient"),
    ("quorum_lost", (S.SYNCING,), S.PAUSED, "a heartbeat reply says below_min_workers"),
    ("quorum_back", (S.PAUSED,), S.SYNCING, "a heartbeat reply says the quorum is back"),
    ("released", (S.SYNCING, S.PAUSED), S.TRAINING, "the Result arrived (applied): train on"),
    ("rejoin", (S.TRAINING, S.SYNCING, S.PAUSED), S.JOINING,
     "the coordinator does not know this worker (declared dead, restarted): join again"),
    ("stop", (S.JOINING, S.TRAINING, S.SYNCING, S.PAUSED), S.STOPPING,
     "a stop (Result, heartbeat command, local request, error, end of data)"),
    ("stopped", (S.STOPPING,), S.STOPPED, "checkpoint written if asked; control returns to the caller"),
)

_TRIGGER_FOR: dict[tuple[WorkerState, WorkerState], str] = {
    (src, dest): trigger for trigger, sources, dest, _why in TRANSITIONS for src in sources
}


class Lifecycle:
    """The object the ``transitions`` machine drives."""

    state: WorkerState

    def __init__(self, on_change: Callable[[WorkerState], None]) -> None:
        self._on_change = on_change
        self._machine = Machine(
            model=self,
            states=list(WorkerState),
            transitions=[{"trigger": trig, "source": list(src), "dest": dest}
                         for trig, src, dest, _why in TRANSITIONS],
            initial=WorkerState.JOINING,
            auto_transitions=False,
            ignore_invalid_triggers=False,
            after_state_change="_changed",
        )

    def _changed(self) -> None:
        self._on_change(self.state)

    def go(self, dest: WorkerState) -> None:
        """Move to ``dest`` (no-op if already there); raises ``MachineError`` if the table forbids it."""
        if self.state is dest:
            return
        trigger = _TRIGGER_FOR.get((self.state, dest))
        if trigger is None:
            raise RuntimeError(f"worker lifecycle: no transition {self.state.value} -> {dest.value}")
        self.trigger(trigger)
