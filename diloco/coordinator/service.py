"""The coordinator, sans-IO: (peer, message, clock reading) in, (peer, message) pairs out.

Data flows one way: a decoded message is checked here for what only the
coordinator can check (protocol version, membership, access), turned into an
event, stepped through ``RoundFSM``, and the effects are executed in order
(SPEC.md section 5) into outgoing messages. This class never reads a clock,
sleeps or touches a socket: the runner (real time, real transport) and the
simulator (simulated time, simulated network) drive the very same code.

What the coordinator owns, on either data plane: the core, the map from worker
ids to transport peers, access (keys and bans), metrics and DyLU speeds, data
work units, the token budget, the admin commands and the pause clock. What a
contribution *is* belongs to the data plane's half (``plane.py``), chosen once
at startup: ``HubRounds`` (``hub_rounds.py``: the params, running sums, outer
optimizers and Results) or ``CollectiveRounds`` (``collective_rounds.py``:
reduce orders, commits, blame and heals). No handler here branches on the
data plane.

Why one file of about 600 lines: every handler and effect executor below reads
the same maps (peers, members, access), and the core's effects are carried out
in the one order SPEC.md section 5 fixes, in one loop (``step``).
"""

from __future__ import annotations

import math
from typing import Callable

from diloco.coordinator.access import AccessList
from diloco.coordinator.budget import TokenBudget, check_budget
from diloco.coordinator.collective import CollectivePlane
from diloco.coordinator.collective_rounds import CollectiveRounds
from diloco.coordinator.config import CoordinatorConfig
from diloco.coordinator.dylu import SpeedTable
from diloco.coordinator.hub_rounds import HubRounds
from diloco.coordinator.metrics import MetricsHistory
from diloco.coordinator.outliers import OutlierGuard
from diloco.coordinator.params import ParamStore
from diloco.coordinator.plane import DataPlaneRounds, Outgoing
from diloco.coordinator.stats import CoordinatorStats
from diloco.coordinator.stop_notice import StopNotice
from diloco.coordinator.units import NO_UNIT, UnitLedger
from diloco.core import (
    AbortReduce,
    AcceptContribution,
    AcceptJoin,
    ApplyRound,
    DataPlane,
    DeclareDead,
    DiscardContribution,
    HeartbeatSeen,
    LeaveCause,
    MinWorkersChanged,
    OrderReduce,
    Phase,
    PhaseChanged,
    QuorumChanged,
    Reject,
    RejectReason,
    ReleaseOutcome,
    ReleaseWorker,
    RoundFSM,
    ShutdownKind,
    ShutdownRequested,
    StopRun,
    Ticked,
    WorkerJoined,
    WorkerLeft,
    trace,
)
from diloco.wire.messages import (
    PROTOCOL_VERSION,
    Accepted,
    AdminReply,
    AdminRequest,
    Command,
    Error,
    ErrorCode,
    Heartbeat,
    HeartbeatReply,
    Join,
    Leave,
    Message,
    ReduceReport,
    Result,
    Submit,
    Tensors,
    Welcome,
)

#: Observer hook: called as ``on_event(kind, now_s, info_dict)`` for applied rounds,
#: quorum and phase changes, joins, deaths and the stop. The demo's timeline and
#: the simulator's trace listen here; it must not raise.
Observer = Callable[[str, float, dict], None]


def _closes_round(effects: list, i: int) -> bool:
    """Whether the contribution ``effects[i]`` accepts is its round's last: an ApplyRound of the same
    fragment and round that lists its worker follows it among the effects of the same step."""
    accept = effects[i]
    return any(type(e) is ApplyRound and e.fragment_id == accept.fragment_id and e.round_id == accept.round_id
               and accept.worker_id in e.contributors for e in effects[i + 1:])


class Coordinator:
    """Drives one run's ``RoundFSM``. See the module docstring and SPEC.md."""

    def __init__(self, config: CoordinatorConfig, now_s: float = 0.0, *,
                 fsm: RoundFSM | None = None, observer: Observer | None = None) -> None:
        self.config = config
        self.fsm = fsm if fsm is not None else RoundFSM(config.fsm, now_s)
        #: What every Welcome tells of the wire dtype's settings (the sparse wire's; else nothing).
        sparse_wire = config.sparse_wire
        self._wire_options = sparse_wire.to_dict() if sparse_wire is not None else {}
        self._peers: dict[str, str] = {}
        #: worker id -> when its arriving bytes last counted as a heartbeat (``peer_arriving``).
        self._arriving_seen: dict[str, float] = {}
        self._stop_kind: ShutdownKind | None = None
        self.stats = CoordinatorStats()
        self._observer = observer
        #: 1 for a fresh run; a resumed coordinator is its checkpoint's incarnation + 1.
        self.incarnation = 1
        #: Key bindings and bans (``access.py``); checkpoints save and restore them.
        self.access = AccessList()
        #: Workers' training figures from their heartbeats and per applied round (bounded; never the core's).
        self.metrics = MetricsHistory()
        #: DyLU: each member's smoothed training speed, for its H_w (``dylu.py``; never the core's).
        self.speeds = SpeedTable()
        #: The run's id (``diloco server`` sets it: new at a fresh start, kept across resumes), and clocks.
        self.run_id: str | None = None
        #: Set by ``diloco server``: the release serving the run and its transport's counters
        #: (traffic, malformed input, drops), for the status (``version``, ``transport``).
        self.version: str | None = None
        self.transport_stats: Callable[[], dict] | None = None
        self.started_s = now_s
        self.last_applied_s: float | None = None
        #: The tokens applied rounds trained on, against ``--token-budget`` (``budget.py``).
        self.budget = TokenBudget(config.token_budget)
        #: Data work units: who holds which, what is in flight, what finished (``units.py``).
        self.units = UnitLedger(config.data_units)
        #: Observers hear every event fed to the machine and its effects (``"input"``): the audit
        #: log sets it, for trace validation (``tracecheck.py``).
        self.trace_inputs = False
        #: The bound on contributions far out of line with the recent ones (``outliers.py``).
        self.outliers = OutlierGuard(config.fsm.num_fragments, config.outlier_factor)
        #: Who has heard that the run stopped (the runner lets go once all have; ``stop_notice.py``).
        self.stop_notice = StopNotice()
        #: The reason the run stopped on its own, for the log and ``diloco status``.
        self.stop_reason: str | None = None
        #: Steps made durable so far (``persist.py``); a checkpoint holds the steps up to it.
        self.journal_seq = 0
        #: Restored from a checkpoint (``restore_coordinator``), not started fresh.
        self.resumed = False
        #: The data plane's half (``plane.py``), chosen once: the hub's params, sums and outer
        #: optimizers, or the collective's orders, commits and heals.
        self.plane: DataPlaneRounds = (CollectiveRounds(self) if config.fsm.data_plane is DataPlane.COLLECTIVE
                                       else HubRounds(self))
        #: (rounds_applied, ban_changes) when ``take_durable_change`` last looked.
        self._durable_seen = self._durable_marks()

    # ------------------------------------------------------------------ state

    def _durable_marks(self) -> tuple[int, int]:
        return self.fsm.rounds_applied, self.access.ban_changes

    def take_durable_change(self) -> bool:
        """Whether, since the last call, something happened that a restart must keep.

        That is an outer step applied or refused (``fsm.rounds_applied`` moved) or a ban or
        an unban (``access.ban_changes`` moved). The runner asks after every step and makes
        such a step durable before it sends any of the step's messages (SPEC.md section 5).
        """
        marks = self._durable_marks()
        changed = marks != self._durable_seen
        self._durable_seen = marks
        return changed

    @property
    def stopped(self) -> bool:
        return self._stop_kind is not None

    @property
    def stop_kind(self) -> ShutdownKind | None:
        return self._stop_kind

    @property
    def has_state(self) -> bool:
        """Something to checkpoint: the params (hub), or the run's layout and commits (collective)."""
        return self.plane.has_state

    @property
    def store(self) -> ParamStore | None:
        """The global params and their fragments (hub plane; None until the first join, and on the
        collective plane, where the model never reaches this process)."""
        return self.plane.store

    @property
    def collective(self) -> CollectivePlane | None:
        """Who holds the committed state, group prefixes, heals (collective plane; None on the hub)."""
        return self.plane.collective

    @property
    def hub(self) -> HubRounds:
        """The hub plane's half: its params, outer optimizers and journal hook."""
        if not isinstance(self.plane, HubRounds):
            raise TypeError("this run is on the collective data plane: its coordinator holds no params, "
                            "outer optimizers or journal")
        return self.plane

    def optimizer_states(self) -> list[dict]:
        """The outer optimizers' states per fragment, for a checkpoint ([] on the collective plane)."""
        return self.plane.optimizer_states()

    def peer_of(self, worker_id: str) -> str | None:
        return self._peers.get(worker_id)

    def status(self) -> dict:
        """``diloco status --json``: the core's view plus the coordinator's counters."""
        view = self.fsm.status().to_dict()
        view.update(
            rounds_applied=self.fsm.rounds_applied,
            contributions_accepted=self.stats.contributions_accepted,
            bytes_received=self.stats.bytes_received,
            bytes_sent=self.stats.bytes_sent,
            paused_s=self.stats.paused_total(self.fsm.now_s),
            messages_refused=self.stats.messages_refused,
            steps_refused=self.stats.steps_refused,
            reconciled=self.stats.reconciled,
            checkpoints_written=self.stats.checkpoints_written,
            checkpoint_write_s=round(self.stats.checkpoint_write_s, 6),
            journal_records=self.stats.journal_records,
            journal_wait_s=round(self.stats.journal_wait_s, 6),
            incarnation=self.incarnation,
            stopped=self.stopped,
            stop_kind=self._stop_kind.value if self._stop_kind else None,
            stop_reason=self.stop_reason,
            num_params=self.plane.num_params(),
            data_plane=self.config.fsm.data_plane.value,
            collective=self.plane.status(),
            outer_optimizer=self.config.outer.name,
            wire_dtype=self.config.wire_dtype,
            grace_window_s=self.fsm.grace_window_s, grace_auto=self.config.grace_auto,
            banned_workers=sorted(self.access.banned_ids),
            banned_keys=self.access.banned_key_names(),
            keys=self.access.key_summary(self.fsm.is_member),
            tokens=self.budget.status(),
            units=self.units.status() if self.units.enabled else None,
        )
        now = self.fsm.now_s
        uptime = max(0.0, now - self.started_s)
        view.update(
            run_id=self.run_id, uptime_s=round(uptime, 3), config=self.config.to_dict(),
            since_last_apply_s=None if self.last_applied_s is None else round(now - self.last_applied_s, 3),
            rounds_per_hour=round(self.stats.rounds_applied * 3600.0 / uptime, 3) if uptime > 0 else 0.0,
        )
        for m in view.get("members", []):
            m["metrics"] = self.metrics.member_view(m["worker_id"], now)
            if self.config.dylu:
                m["sync_every"] = self.sync_every_of(m["worker_id"])
        if self.transport_stats is not None:
            view["transport"] = self.transport_stats()
        if self.version is not None:
            view["version"] = self.version
        return view

    def sync_every_of(self, worker_id: str) -> int | None:
        """DyLU: the H_w this worker is told (None when the run does not use DyLU)."""
        if not self.config.dylu:
            return None
        return self.speeds.sync_every(worker_id, self.config.sync_every)

    # ----------------------------------------------------------------- inputs

    def tick(self, now_s: float) -> Outgoing:
        """The clock moved and nothing came (the runner calls this when its transport was idle for a
        tick): time-driven effects, then the data plane's work ahead (the hub prepares one fragment's next
        outer step, ``HubRounds.idle``)."""
        out: Outgoing = []
        self._tick(now_s, out)
        if not self.stopped:
            self.plane.idle()
        return out

    def handle(self, peer: str, message: Message, now_s: float, identity=None, measured=None) -> Outgoing:
        """Handle one decoded message from ``peer``; return what to send, in order.

        ``identity`` is the sender's authenticated key (``diloco.transport.zmq.auth.KeyIdentity``:
        ``public_key``, ``name``) when the transport authenticates, else None. The
        transport has already checked the key's role; here each worker id is bound to
        the key that first joined it. ``measured``: what the receiver measured of a Submit's
        tensors as they arrived (``diloco.wire.measure.SubmitSquares``), which the checks use.
        """
        out: Outgoing = []
        self._tick(now_s, out)
        if isinstance(message, AdminRequest):
            reply = self._admin(message, out)
            out.append((peer, reply))
            return out
        if self.stopped:
            self._answer_after_stop(peer, message, out)
            return out
        if isinstance(message, (Heartbeat, Submit, Join, Leave, ReduceReport)):
            refusal = self.access.refusal(message, identity, self.fsm.is_member)
            if refusal is not None:
                self.refuse(peer, out, *refusal, message)
                return out
        if isinstance(message, Heartbeat):
            self._on_heartbeat(peer, message, out)
        elif isinstance(message, Submit):
            self._on_submit(peer, message, out, measured)
            if self.budget.reached and not self.stopped:
                self.notify("budget", now_s, **self.budget.status())
                self.step(ShutdownRequested(ShutdownKind.SAVE_AND_STOP), out)
        elif isinstance(message, Join):
            self._on_join(peer, message, out)
            if identity is not None and self._peers.get(message.worker_id) == peer:
                self.access.bind(message.worker_id, identity, self.fsm.is_member)
        elif isinstance(message, Leave):
            if self._peers.get(message.worker_id) == peer:
                self.step(WorkerLeft(message.worker_id, LeaveCause.LEFT), out)
        elif isinstance(message, ReduceReport):
            self.plane.on_report(peer, message, out)
        else:
            self.refuse(peer, out, ErrorCode.BAD_MESSAGE,
                         f"a coordinator does not accept {type(message).__name__} messages", message)
        return out

    def peer_lost(self, peer: str, now_s: float) -> Outgoing:
        """The transport saw ``peer`` disconnect: report its worker gone (R7)."""
        out: Outgoing = []
        self._tick(now_s, out)
        for wid, p in list(self._peers.items()):
            if p == peer and not self.stopped and self.fsm.is_member(wid):
                self.step(WorkerLeft(wid, LeaveCause.CRASHED), out)
        self.stop_notice.gone(peer)
        return out

    def peer_arriving(self, peer: str, now_s: float) -> Outgoing:
        """A message from ``peer`` is arriving part by part: its worker lives, however long the message
        takes on its link (a heartbeat, at most one per heartbeat interval; SPEC.md section 11, "Parts
        on thin links"). A heartbeat of its own may wait behind megabytes buffered on the way."""
        out: Outgoing = []
        self._tick(now_s, out)
        for wid, p in self._peers.items():
            if p == peer and not self.stopped and self.fsm.is_member(wid) \
                    and now_s - self._arriving_seen.get(wid, -math.inf) >= self.config.heartbeat_interval_s:
                self._arriving_seen[wid] = now_s
                self.step(HeartbeatSeen(wid), out)
        return out

    # --------------------------------------------------------------- handlers

    def _tick(self, now_s: float, out: Outgoing) -> None:
        if self.stopped or now_s <= self.fsm.now_s:
            return
        self.step(Ticked(now_s), out)

    def _on_heartbeat(self, peer: str, msg: Heartbeat, out: Outgoing) -> None:
        wid = msg.worker_id
        command = Command.CONTINUE
        if self._peers.get(wid) != peer or not self.fsm.is_member(wid):
            command = Command.REJOIN
        else:
            self.step(HeartbeatSeen(wid), out)
            if msg.metrics:
                self.metrics.record(wid, self.fsm.now_s, msg.metrics)
                if self.config.dylu:
                    self.speeds.report(wid, msg.metrics.get("train_steps_per_s"))
        out.append((peer, self.heartbeat_reply(command, sync_every=self.sync_every_of(wid)
                                                if command is Command.CONTINUE else None)))

    def _on_join(self, peer: str, msg: Join, out: Outgoing) -> None:
        if msg.protocol_version != PROTOCOL_VERSION:
            self.refuse(peer, out, ErrorCode.PROTOCOL_VERSION,
                         f"worker speaks protocol version {msg.protocol_version}; this coordinator speaks "
                         f"version {PROTOCOL_VERSION}", msg)
            return
        join = self.plane.check_join(peer, msg, out)
        if join is None:
            return
        msg = join
        wid = msg.worker_id
        if isinstance(wid, str) and self.fsm.is_member(wid) and self._peers.get(wid) != peer:
            # R6: a join for a live id from a new connection is that worker restarted.
            self.step(WorkerLeft(wid, LeaveCause.CRASHED), out)
            if self.stopped:
                self._answer_after_stop(peer, msg, out)
                return
        self.plane.reseed(msg, out)  # a newer state the joiner brings may move members out first
        if self.stopped:
            self._answer_after_stop(peer, msg, out)
            return
        self.step(WorkerJoined(wid), out, peer=peer, join=msg)

    def _on_submit(self, peer: str, msg: Submit, out: Outgoing, measured=None) -> None:
        wid = msg.worker_id
        if self._peers.get(wid) != peer or not self.fsm.is_member(wid):
            opened = self.fsm.open_round_ids()
            if (type(msg.fragment_id) is int and 0 <= msg.fragment_id < len(opened)
                    and type(msg.round_id) is int and msg.round_id > opened[msg.fragment_id]):
                self.reconciled(msg, self.fsm.now_s, "unknown_worker")
            self.refuse(peer, out, ErrorCode.UNKNOWN_WORKER,
                         f"worker {wid!r} is not a live member on this connection (join first)", msg)
            return
        self.plane.on_submit(peer, msg, out, measured)

    def _admin(self, msg: AdminRequest, sink: Outgoing) -> AdminReply:
        """Run an operator command; messages it causes for workers go to ``sink``."""
        cmd, args = msg.command, msg.args if isinstance(msg.args, dict) else {}
        if cmd == "status":
            return AdminReply(True, self.status())
        if self.stopped:
            return AdminReply(False, self.status(), f"the run has stopped ({self._stop_kind.value})")
        if cmd == "shutdown":
            try:
                kind = ShutdownKind(args.get("kind", "drain"))
            except ValueError:
                return AdminReply(False, {}, f"shutdown kind {args.get('kind')!r} is unknown: expected "
                                             f"one of {[k.value for k in ShutdownKind]}")
            effects = self.step(ShutdownRequested(kind), sink)
        elif cmd == "set_min_workers":
            effects = self.step(MinWorkersChanged(args.get("min_workers")), sink)
        elif cmd == "set_token_budget":
            try:
                self.budget.budget = check_budget(args.get("budget"))
            except ValueError as exc:
                return AdminReply(False, {}, str(exc))
            if self.budget.reached:
                self.notify("budget", self.fsm.now_s, **self.budget.status())
                self.step(ShutdownRequested(ShutdownKind.SAVE_AND_STOP), sink)
            return AdminReply(True, self.status())
        elif cmd == "kick":
            wid = args.get("worker_id")
            ban = args.get("ban", False)
            if not isinstance(ban, bool):
                return AdminReply(False, {}, f"kick: 'ban' is {ban!r}, expected true or false")
            if not isinstance(wid, str) or not wid:
                return AdminReply(False, {}, f"kick: worker {wid!r} is not a worker id")
            if ban:
                self.access.ban(wid)  # also an id that is not a member now: it is kept out from now on
            if not self.fsm.is_member(wid):
                if ban:
                    return AdminReply(True, self.status())
                return AdminReply(False, {}, f"worker {wid!r} is not a live member")
            effects = self.step(WorkerLeft(wid, LeaveCause.KICKED), sink)
        elif cmd == "unban":
            wid = args.get("worker_id")
            if not isinstance(wid, str) or not self.access.unban(wid):
                return AdminReply(False, self.status(), f"worker {wid!r} is not banned")
            return AdminReply(True, self.status())
        else:
            return AdminReply(False, {}, f"unknown admin command {cmd!r}: expected status, shutdown, "
                                         f"set_min_workers, set_token_budget, kick or unban")
        rejects = [e for e in effects if isinstance(e, Reject)]
        if rejects:
            return AdminReply(False, self.status(), rejects[0].detail)
        return AdminReply(True, self.status())

    def _answer_after_stop(self, peer: str, msg: Message, out: Outgoing) -> None:
        if isinstance(msg, Heartbeat):
            command = Command.SAVE_AND_STOP if self._stop_kind is ShutdownKind.SAVE_AND_STOP else Command.STOP
            out.append((peer, self.heartbeat_reply(command, phase=Phase.STOPPED)))
        elif isinstance(msg, Leave):
            self.stop_notice.gone(peer)
        else:
            self.refuse(peer, out, ErrorCode.STOPPED,
                         f"the run has stopped ({self._stop_kind.value}); nothing more is accepted", msg)

    def heartbeat_reply(self, command: Command, *, phase: Phase | None = None,
                         sync_every: int | None = None) -> HeartbeatReply:
        """The quorum as it stands and ``command``; ``phase`` defaults to the machine's."""
        return HeartbeatReply(self.fsm.below_min_workers, self.fsm.min_workers,
                              (phase if phase is not None else self.fsm.phase).value, command, sync_every)

    def refuse(self, peer: str, out: Outgoing, code: ErrorCode, detail: str, msg: Message) -> None:
        self.stats.messages_refused += 1
        out.append((peer, Error(code, detail, type(msg).__name__)))

    # ---------------------------------------------------------------- effects

    def step(self, event, out: Outgoing, *, peer: str | None = None, join: Join | None = None,
              submit: Submit | None = None, tensors: Tensors | None = None, norm: float | None = None,
              report: ReduceReport | None = None, owned: bool = False) -> list:
        effects = self.fsm.step(event)
        now = self.fsm.now_s
        if self.trace_inputs:
            # Trace validation (``diloco check-log``): the machine's input and its answer, first.
            self.notify("input", now, **{"in": trace.event_record(event), "out": trace.effect_records(effects)})
        if type(event) is WorkerLeft and not (effects and type(effects[0]) is Reject):
            # Observers hear of the leave before what it caused (quorum and phase changes,
            # an apply, a stop), as they hear of a DeclareDead: in effect order (SPEC.md 5.3).
            self.notify("left", now, worker_id=event.worker_id, cause=event.cause.value)
        for i, effect in enumerate(effects):
            kind = type(effect)
            if kind is AcceptContribution:
                assert submit is not None and tensors is not None and peer is not None
                self.stats.contributions_accepted += 1
                self.plane.accept(effect, submit, tensors, peer, out, norm, _closes_round(effects, i), owned)
                out.append((peer, Accepted(effect.fragment_id, effect.round_id)))
            elif kind is ReleaseWorker:
                self._release(effect, out)
            elif kind is ApplyRound:
                self._apply(effect, now)
            elif kind is Reject:
                if effect.reason is RejectReason.FUTURE_ROUND and submit is not None:
                    self.reconciled(submit, now, "future_round")
                target = peer if peer is not None else self._peers.get(effect.worker_id)
                if target is not None:
                    self.refuse(target, out, ErrorCode(effect.reason.value), effect.detail,
                                 submit or join or report or event)
            elif kind is AcceptJoin:
                self._welcome(effect, peer, join, out, now)
            elif kind is DeclareDead:
                self._forget(effect.worker_id, out)
                self.notify("dead", now, worker_id=effect.worker_id, last_seen_s=effect.last_seen_s)
                self._give_back_unit(effect.worker_id, now)
            elif kind is DiscardContribution:
                self.plane.discard(effect)
                self.notify("discard", now, worker_id=effect.worker_id, fragment_id=effect.fragment_id,
                             round_id=effect.round_id, reason=effect.reason.value)
            elif kind is QuorumChanged:
                self._quorum_changed(effect, now)
            elif kind is PhaseChanged:
                self.notify("phase", now, old=effect.old.value, new=effect.new.value)
            elif kind is OrderReduce:
                self.plane.order(effect, out, now)
            elif kind is AbortReduce:
                self.plane.abort(effect, out, now)
            elif kind is StopRun:
                self._stop_kind = effect.kind
                self.stop_notice.stopped(self._peers)
                self._quorum_changed(None, now)
                self.notify("stop", now, kind=effect.kind.value)
        if type(event) is WorkerLeft:
            self._forget(event.worker_id, out)
            if not self.fsm.is_member(event.worker_id):
                self._give_back_unit(event.worker_id, now)
        stop_for = self.plane.end_step()
        if stop_for is not None and not self.stopped:
            # A round that cannot commit: stop with a checkpoint and the reason (SPEC.md section 7c).
            self.stop_reason = stop_for
            self.notify("stuck", now, detail=stop_for)
            self.step(ShutdownRequested(ShutdownKind.SAVE_AND_STOP), out)
        return effects

    def _forget(self, worker_id: str, out: Outgoing) -> None:
        """A worker that died or left: the data plane's hold on it, its connection and its speed."""
        self.plane.forget(worker_id, out)
        self._peers.pop(worker_id, None)
        self.speeds.forget(worker_id)

    def _welcome(self, effect: AcceptJoin, peer: str | None, join: Join | None, out: Outgoing, now: float) -> None:
        assert peer is not None and join is not None
        wid = effect.worker_id
        self._peers[wid] = peer
        parts = self.plane.welcome(wid, join, out)
        out.append((peer, Welcome(
            worker_id=wid, round_ids=effect.round_ids, parked=effect.parked, mode=self.config.fsm.mode.value,
            min_workers=self.fsm.min_workers, below_min_workers=self.fsm.below_min_workers,
            heartbeat_interval_s=self.config.heartbeat_interval_s, wire_dtype=self.config.wire_dtype,
            wire_options=self._wire_options, sync_every=self.sync_every_of(wid), **parts.fields)))
        self.stats.bytes_sent += parts.nbytes
        self.notify("join", now, worker_id=wid, parked=list(effect.parked), **parts.note)

    def _release(self, effect: ReleaseWorker, out: Outgoing) -> None:
        peer = self._peers.get(effect.worker_id)
        if peer is None:
            return
        if effect.outcome is ReleaseOutcome.STOP:
            next_round = self.fsm.open_round_ids()[effect.fragment_id]
            out.append((peer, Result(effect.fragment_id, effect.round_id, effect.outcome.value, next_round)))
            return
        self.plane.release(effect, peer, out)

    def _apply(self, effect: ApplyRound, now: float) -> None:
        extra = self.plane.apply(effect, now)
        self.stats.rounds_applied += 1
        self.last_applied_s = now
        self.metrics.round_applied(now, effect.fragment_id, effect.round_id, effect.contributors)
        self.notify("apply", now, fragment_id=effect.fragment_id, round_id=effect.round_id,
                    contributors=list(effect.contributors), **extra)

    # -- data work units (``units.py``): handed out with Welcomes and Results, finished by applies

    def hand_out(self, worker_id: str, claim: int | None = None) -> int | None:
        if not self.units.enabled:
            return None
        unit = self.units.hand_out(worker_id, NO_UNIT if claim is None else claim)
        self.notify("unit", self.fsm.now_s, worker_id=worker_id, unit=unit)
        return unit

    def _give_back_unit(self, worker_id: str, now: float) -> None:
        unit = self.units.released(worker_id)
        if unit is not None:
            self.notify("unit_back", now, worker_id=worker_id, unit=unit)

    def reconciled(self, submit: Submit, now: float, answer: str) -> None:
        """A submission for a round this coordinator never opened: the worker is ahead of its durable
        state (it got a Result a lost checkpoint held). SPEC.md section 12, "Reconciliation": the
        durable state wins; the answer (future_round or unknown_worker) makes the worker re-join and
        adopt the Welcome's params and round ids."""
        self.stats.reconciled += 1
        self.notify("reconciled", now, worker_id=submit.worker_id, fragment_id=submit.fragment_id,
                     round_id=submit.round_id, open_round=self.fsm.open_round_ids()[submit.fragment_id],
                     answer=answer)

    def _quorum_changed(self, effect: QuorumChanged | None, now: float) -> None:
        below = self.fsm.below_min_workers and not self.stopped
        if below and self.fsm.phase is not Phase.FORMING:
            self.stats.pause_began(now)
        elif not below:
            self.stats.pause_ended(now)
        if effect is not None:
            self.notify("quorum", now, below_min_workers=effect.below_min_workers,
                        live_workers=effect.live_workers, min_workers=effect.min_workers, reason=effect.reason)

    def notify(self, what: str, now: float, **info) -> None:
        if self._observer is not None:
            self._observer(what, now, info)

