"""What a ``WorkerSession`` asks its driver to do (frozen, slotted, executed in order).

Only ``Send`` is pure messaging; the others touch the model or the outside
world, so the driver runs them on the training thread (``MODEL_ACTIONS``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from diloco.wire.messages import Message
from diloco.worker.states import WorkerState


@dataclass(frozen=True, slots=True)
class Send:
    """Send this message (Join without params, Heartbeat, Leave) to the coordinator."""

    message: Message


@dataclass(frozen=True, slots=True)
class SendJoinWithParams:
    """Send ``Join`` again carrying the model's params (fp32): the run has none yet."""


@dataclass(frozen=True, slots=True)
class SubmitFragment:
    """Compute fragment ``fragment_id``'s pseudo-gradient (global - local) and send it for ``round_id``."""

    fragment_id: int
    round_id: int


@dataclass(frozen=True, slots=True)
class InstallParams:
    """Copy ``params[name]`` for every name of fragment ``fragment_id`` into the model and the global copy.

    ``keep_if_same`` (a Welcome onto the same fragment layout): when the worker's global
    copy of the fragment is bit-identical to ``params``, keep the local model as it is --
    its progress since that base is still valid.
    """

    fragment_id: int
    names: tuple[str, ...]
    params: Mapping[str, Any]
    keep_if_same: bool
    #: "Welcome" or "Result": what delivered the params (for error messages).
    source: str


@dataclass(frozen=True, slots=True)
class MergeParams:
    """Merge a Result's ``params`` into fragment ``fragment_id`` (overlap, SPEC.md W15-W18).

    For every name of the fragment: ``local <- alpha * local + (1 - alpha) * params[name]``
    in the model (in place), and the global copy becomes ``params[name]`` -- the base the
    fragment's next pseudo-gradient is measured from. Only with ``overlap_steps >= 1``.
    """

    fragment_id: int
    names: tuple[str, ...]
    params: Mapping[str, Any]
    alpha: float


@dataclass(frozen=True, slots=True)
class StateChanged:
    """The session moved from ``previous`` to ``state`` (the driver's ``on_state`` hook)."""

    state: WorkerState
    previous: WorkerState | None


@dataclass(frozen=True, slots=True)
class OutageReport:
    """The coordinator is silent: ``kind`` is "waiting", "back" or "gave_up"."""

    kind: str
    waited_s: float
    waiting_for: str
    limit_s: float


@dataclass(frozen=True, slots=True)
class Stop:
    """Stop training; write the worker's checkpoint first when ``save`` (and it has a directory).

    The driver calls ``WorkerSession.stopped_done()`` when done.
    """

    reason: str
    save: bool


@dataclass(frozen=True, slots=True)
class Fail:
    """The run refused this worker or sent something it cannot use: raise, naming ``code``."""

    code: str
    detail: str


@dataclass(frozen=True, slots=True)
class Note:
    """A line for the log: ``level`` is "debug", "info" or "warning"."""

    level: str
    text: str


Action = (Send | SendJoinWithParams | SubmitFragment | InstallParams | MergeParams | StateChanged | OutageReport | Stop
          | Fail | Note)

#: Actions the driver must run where the model lives (the training thread).
MODEL_ACTIONS = (SendJoinWithParams, SubmitFragment, InstallParams, MergeParams, Stop)
