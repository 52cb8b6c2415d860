"""The one vocabulary for where a worker is: session, driver, simulator, plots and status.

The first six are the states of ``WorkerSession`` (SPEC.md section 14). The
last two are never a session's own state: they are what an observer sees from
outside (a process that died, or one frozen by SIGSTOP in the simulator), and
they share the enum so a timeline has one set of lanes.
"""

from __future__ import annotations

import enum


class WorkerState(str, enum.Enum):
    #: Sent ``Join``; waiting for the ``Welcome`` (first join, a re-join, a resync).
    JOINING = "joining"
    #: Running inner optimizer steps between sync points.
    TRAINING = "training"
    #: Submitted (or parked on) a contribution; waiting at the sync point for its ``Result``.
    WAITING = "waiting"
    #: Waiting at the sync point while the run is below ``min_workers`` (SPEC.md R10).
    PAUSED = "paused"
    #: Stopping: asking whether the stop is save-and-stop, or writing its checkpoint.
    STOPPING = "stopping"
    #: Terminal: the worker trains no more.
    STOPPED = "stopped"
    #: Observed only: the process is frozen (simulator faults).
    FROZEN = "frozen"
    #: Observed only: the process died.
    DEAD = "dead"


#: The states a session can be in (the observed-only ones excluded).
SESSION_STATES: tuple[WorkerState, ...] = (
    WorkerState.JOINING, WorkerState.TRAINING, WorkerState.WAITING,
    WorkerState.PAUSED, WorkerState.STOPPING, WorkerState.STOPPED,
)
