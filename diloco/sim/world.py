"""What each piece of the simulator may use of the others: the simulator's named interface.

The simulation is a few objects that ``Simulation`` (``simulation.py``) builds and wires:
the clock (``scheduler.EventQueue``), the network (``network.Network``), the
coordinator's process (``coord_process.CoordinatorProcess``), the fault injector
(``faults.FaultInjector``), the gloo network of the collective plane
(``collective.SimGloo``) and the worker processes (``worker.SimWorker``, each with its
``collective.SimEndpoint`` on a collective run). None of them holds the whole
``Simulation``: each gets in its constructor what it uses, typed by one of the
Protocols below where that is more than a value or a peer object.

* ``Clock``: the time and the event queue (everyone);
* ``WorkerProcess``: what the others may use of a worker process (``SimWorker``);
* ``MemberPlane``: what a worker process may use of its collective plane (``SimEndpoint``);
* ``WorkerWorld``: what a worker process may do in its world (``SimWorker``);
* ``PlaneWorld``: what a worker's collective plane may do (``SimEndpoint``);
* ``CoordinatorPort``: how the network hands messages to the coordinator's process;
* ``FaultHost``: what the fault injector may do to the run (``Simulation``).

``Simulation`` implements ``WorkerWorld``, ``PlaneWorld`` and ``FaultHost``, mostly with
bound methods of its pieces stored as attributes: a worker's call goes straight to the
network or the injector, with no forwarding call in between (the hot path runs once per
event).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from diloco.collective.member import MemberMachine
    from diloco.coordinator.service import Coordinator
    from diloco.sim.config import SimConfig
    from diloco.wire.messages import AdminReply, ReduceOrder, TensorSpec


@dataclass(frozen=True)
class SimModel:
    """The run's model: tensors named p0, p1, ... of a few float32 elements each."""

    #: name -> the initial value every worker starts from.
    params: dict[str, torch.Tensor]
    #: Their spec, as a Join carries it.
    spec: tuple[TensorSpec, ...]
    #: name -> number of elements.
    sizes: dict[str, int]


class Clock(Protocol):
    """Simulated time (``scheduler.EventQueue``)."""

    @property
    def now(self) -> float:
        """The simulated time of the event being run, in seconds."""

    def schedule(self, t: float, fn: Callable[[Any], None], arg: Any = None) -> None:
        """Run ``fn(arg)`` at simulated time ``t`` (ties run in the order they were scheduled)."""


class WorkerProcess(Protocol):
    """A simulated worker process (``worker.SimWorker``), as its world, its plane and the fault
    injector use it: named by its id, alive or not, frozen or not, slowed by ``straggle``."""

    wid: str
    peer: str
    alive: bool
    frozen: bool
    straggle: float

    def later(self, delay_s: float, fn: Callable[[Any], None], arg: Any) -> None:
        """Run ``fn(arg)`` after ``delay_s`` of simulated time, unless this incarnation is gone by then."""

    def deliver_local(self, msg: Any, mid: int | None = None) -> None:
        """Hand ``msg`` to the worker's session, from its own plane (no link in between)."""

    def crash(self) -> None:
        """The process dies (kill -9)."""

    def leave(self) -> None:
        """The process leaves the run cleanly."""

    def freeze(self) -> None:
        """The process stops running (SIGSTOP) until ``thaw``."""

    def thaw(self) -> None:
        """The process runs again (SIGCONT)."""


class MemberPlane(Protocol):
    """A worker process's collective plane (``collective.SimEndpoint``), as the process uses it."""

    machine: MemberMachine

    @property
    def state_confirmed(self) -> bool:
        """Whether a checkpoint may label the committed state with its round ids (M10)."""

    def restore(self, params: dict[str, torch.Tensor], round_ids: list[int],
                fragments: tuple[tuple[str, ...], ...]) -> None:
        """A checkpoint's committed state, offered in the Join (C6)."""

    def send(self, message: Any) -> None:
        """The session's message, through the member machine."""

    def incoming(self, msg: Any, mid: int) -> list:
        """What the session hears of a message from the coordinator."""

    def close(self) -> None:
        """The process is gone: the plane's waits end."""


class WorkerWorld(Protocol):
    """What a simulated worker process (``worker.SimWorker``) may use of its world."""

    @property
    def cfg(self) -> SimConfig:
        """The run's configuration (read only)."""

    @property
    def clock(self) -> Clock:
        """Simulated time: read ``now``, schedule the process's timers."""

    @property
    def model(self) -> SimModel:
        """The model the process joins with and submits updates of."""

    def emit(self, record: dict, line: str | None = None) -> None:
        """Append a record to the trace (``line``: its JSON, when the caller formatted it)."""

    def send(self, w: WorkerProcess, msg: Any) -> None:
        """Put a message of ``w`` on its link to the coordinator."""

    def open_connection(self, w: WorkerProcess) -> None:
        """Connect a new incarnation to the coordinator (sets ``w.peer``)."""

    def close_connection(self, w: WorkerProcess, *, notice: bool) -> None:
        """Close ``w``'s connection (``notice``: the coordinator may be told ``peer_lost``)."""

    def record_recv(self, mid: int, src: str, dst: str, msg: Any) -> None:
        """Trace the delivery of a message a frozen process held until it thawed."""

    def record_drop(self, mid: int, src: str, dst: str, msg: Any, why: str) -> None:
        """Trace the loss of a message a frozen process held, whose connection is gone."""

    def segment_time(self, w: WorkerProcess) -> float:
        """How long ``w``'s next inner step takes (seeded; its speed and straggling)."""

    def exited(self, w: WorkerProcess, why: str) -> None:
        """``w`` exited with a status its supervisor restarts it on."""

    def endpoint(self, w: WorkerProcess) -> MemberPlane | None:
        """The collective plane of a new incarnation ``w``; None on a hub run."""


class PlaneWorld(Protocol):
    """What one worker's collective plane (``collective.SimEndpoint``) may use of its world."""

    @property
    def cfg(self) -> SimConfig:
        """The run's configuration (read only): the plane's timings."""

    @property
    def clock(self) -> Clock:
        """Simulated time: read ``now``, schedule the plane's waits."""

    def emit(self, record: dict, line: str | None = None) -> None:
        """Append a record to the trace."""

    def send(self, w: WorkerProcess, msg: Any, lose: str = "") -> None:
        """Put a message of ``w`` on its link (``lose``: an injected fault loses it; the drop's why)."""

    def reduce_fault(self, w: WorkerProcess, order: ReduceOrder) -> str | None:
        """Draw the fault, if any, that hits ``w``'s reduce for ``order`` (counted and traced)."""

    def crash_before_collective(self) -> bool:
        """Where a ``reduce_crash`` strikes a member holding its pseudo-gradient: before the collective?"""

    def crash_in_reduce(self, w: WorkerProcess, where: str) -> None:
        """``w``'s process dies inside a reduce (the ``reduce_crash`` fault)."""


class CoordinatorPort(Protocol):
    """What the network may use of the coordinator's process (``coord_process.CoordinatorProcess``)."""

    @property
    def coord(self) -> Coordinator | None:
        """The coordinator; None while its process is down."""

    def step(self, header: dict | None, call: Callable[..., list], *args: Any, line: str | None = None) -> None:
        """Run one coordinator step ``call(*args)``: its trace header, its observer records, then its sends."""


class FaultHost(Protocol):
    """What the fault injector (``faults.FaultInjector``) may do to the run (``Simulation``)."""

    @property
    def phase(self) -> str:
        """The run's phase: "safety", "liveness", "liveness_ok" or "shutdown"."""

    def alive_workers(self) -> list[WorkerProcess]:
        """The worker processes alive now, in the order they were started."""

    def is_alive(self, wid: str) -> bool:
        """Whether the latest incarnation of worker ``wid`` is alive."""

    def new_worker_id(self) -> str:
        """A worker id never used in this run."""

    def start_worker(self, wid: str) -> None:
        """Start a new incarnation of worker ``wid`` (a restart, a replacement, a join)."""

    def admin(self, command: str, **args: Any) -> AdminReply | None:
        """Send an admin command to the coordinator (traced; nothing if it is down)."""

    def coordinator_crashable(self) -> bool:
        """Whether the coordinator is up and has a snapshot to restart from."""

    def crash_coordinator(self) -> None:
        """Kill the coordinator's process (and its rendezvous store)."""

    def restart_coordinator(self, _arg: Any = None) -> None:
        """Restart the coordinator from its last snapshot, if it is down."""
