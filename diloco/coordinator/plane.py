"""The coordinator's data-plane seam: what a run's data plane does with the core's round effects.

The service (``service.py``) owns what every run has: the core, the connections, access,
metrics, units, the budget, the admin commands and the order effects are carried out in.
What a contribution *is* differs by data plane, and lives behind one interface,
``DataPlaneRounds``, chosen once when the coordinator starts:

* ``hub_rounds.HubRounds``: the hub plane. Submits carry the pseudo-gradients; the coordinator
  checks and sums them, steps the outer optimizers and sends the new params in Results.
* ``collective_rounds.CollectiveRounds``: the collective plane. Submits say "ready"; the
  coordinator orders reduces, commits the digest the group agreed on, and arranges heals. The
  model never reaches this process.

Each half reaches back into the service only through ``RoundsHost`` (no import of the service,
so no circle): sending refusals, telling observers, stepping the core for an event it causes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from diloco.core import AbortReduce, AcceptContribution, ApplyRound, DiscardContribution, OrderReduce, ReleaseWorker
from diloco.wire.messages import Command, ErrorCode, HeartbeatReply, Join, Message, ReduceReport, Submit, Tensors

if TYPE_CHECKING:
    from diloco.coordinator.access import AccessList
    from diloco.coordinator.budget import TokenBudget
    from diloco.coordinator.collective import CollectivePlane
    from diloco.coordinator.config import CoordinatorConfig
    from diloco.coordinator.outliers import OutlierGuard
    from diloco.coordinator.params import ParamStore
    from diloco.coordinator.stats import CoordinatorStats
    from diloco.coordinator.units import UnitLedger
    from diloco.core import RoundFSM

Outgoing = list[tuple[str, Message]]


class RoundsHost(Protocol):
    """What a data plane's half uses of the coordinator that drives it."""

    config: CoordinatorConfig
    fsm: RoundFSM
    stats: CoordinatorStats
    access: AccessList
    outliers: OutlierGuard
    budget: TokenBudget
    units: UnitLedger

    def peer_of(self, worker_id: str) -> str | None: ...

    def refuse(self, peer: str, out: Outgoing, code: ErrorCode, detail: str, msg: Message) -> None: ...

    def notify(self, what: str, now: float, **info) -> None: ...

    def step(self, event, out: Outgoing, *, peer: str | None = None, submit: Submit | None = None,
             tensors: Tensors | None = None, norm: float | None = None, report: ReduceReport | None = None,
             owned: bool = False) -> list:
        """Feed ``event`` to the core and carry out its effects (a Submit's checks passed: its
        tensors and what was measured of them come along)."""

    def heartbeat_reply(self, command: Command) -> HeartbeatReply: ...

    def hand_out(self, worker_id: str, claim: int | None = None) -> int | None: ...

    def reconciled(self, submit: Submit, now: float, answer: str) -> None: ...


@dataclass
class WelcomeParts:
    """A data plane's share of a Welcome: its fields, and what the ``join`` observers hear besides."""

    fields: dict[str, Any]
    note: dict[str, Any] = field(default_factory=dict)
    #: Bytes of tensors the Welcome carries (the hub's params), for ``bytes_sent``.
    nbytes: int = 0


@runtime_checkable
class DataPlaneRounds(Protocol):
    """One data plane's half of the coordinator. The service calls each method at one place: where
    the message or the core's effect it names is handled (SPEC.md section 5 fixes their order)."""

    @property
    def store(self) -> ParamStore | None:
        """The global params and their fragments (hub); None on the collective plane, which holds none."""

    @property
    def collective(self) -> CollectivePlane | None:
        """Who holds the committed state, group prefixes, heals (collective); None on the hub."""

    @property
    def has_state(self) -> bool:
        """Something to checkpoint: the params (hub), or the run's layout and commits (collective)."""

    def num_params(self) -> int: ...

    def optimizer_states(self) -> list[dict]:
        """The outer optimizers' states, per fragment (a checkpoint keeps them); [] where there are none."""

    def status(self) -> dict | None:
        """The plane's own part of ``diloco status`` (None: it adds nothing)."""

    def check_join(self, peer: str, join: Join, out: Outgoing) -> Join | None:
        """The join as the run takes it, or None after refusing it (the shared checks already passed)."""

    def reseed(self, join: Join, out: Outgoing) -> None:
        """Before the core hears of ``join``: make room for the state it brings (collective C6)."""

    def welcome(self, worker_id: str, join: Join, out: Outgoing) -> WelcomeParts:
        """The plane's Welcome fields for an accepted join; messages that must precede the Welcome go to
        ``out``."""

    def on_submit(self, peer: str, msg: Submit, out: Outgoing, measured) -> None:
        """A Submit from a live member: check it, then step the core with it (``host.step``)."""

    def on_report(self, peer: str, msg: ReduceReport, out: Outgoing) -> None: ...

    def accept(self, effect: AcceptContribution, submit: Submit, tensors: Tensors, peer: str, out: Outgoing,
               norm: float | None, closes: bool, owned: bool) -> None: ...

    def apply(self, effect: ApplyRound, now: float) -> dict:
        """Carry out an apply; returns what its ``apply`` observers hear besides the round."""

    def release(self, effect: ReleaseWorker, peer: str, out: Outgoing) -> None:
        """The Result of a contribution that applied or was refused (a stop's Result is the service's)."""

    def discard(self, effect: DiscardContribution) -> None: ...

    def order(self, effect: OrderReduce, out: Outgoing, now: float) -> None: ...

    def abort(self, effect: AbortReduce, out: Outgoing, now: float) -> None: ...

    def forget(self, worker_id: str, out: Outgoing) -> None:
        """A worker that died or left (its connection is still known here)."""

    def idle(self) -> None:
        """The loop is idle: work ahead that no message waits for."""

    def end_step(self) -> str | None:
        """The core's step is carried out: drop what it alone needed; the reason the run must stop, if
        it must (a round that cannot commit)."""
