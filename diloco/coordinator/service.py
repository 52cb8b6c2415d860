"""The coordinator, sans-IO: (peer, message, clock reading) in, (peer, message) pairs out.

Data flows one way: a decoded message is checked here
for what only the coordinator can check (protocol version, model shape,
tensor shapes, finiteness), turned into an event, stepped through
``RoundFSM``, and the effects are executed in order (SPEC.md section 5) into
outgoing messages. This class never reads a clock, sleeps or touches a
socket: the runner (real time, real transport) and the simulator (simulated
time, simulated network) drive the very same code.

What the coordinator owns: the global fp32 params and their fragments
(``ParamStore``), one outer ``torch.optim`` optimizer per fragment, the
running sums of open rounds, async contributions held below quorum, and the
map from worker ids to transport peers.

Why one class of about 1,220 lines: every handler and effect executor below
reads and writes the same few maps (peers, held contributions, running
sums), in the order SPEC.md section 5 fixes, and the hub's and the
collective plane's halves both live here, branching on the data plane (most
of the private maps are the hub's alone).
The parts that own no coordinator state are elsewhere: the params, their
fragments and the checks on incoming tensors (``params.py``), the outer
step (``outer.py``), the wire dtypes (``diloco.wire.compression``), checkpoints, the
audit log and the runner.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from diloco.core import (
    AbortReduce,
    AcceptContribution,
    AcceptJoin,
    ApplyRound,
    ContributionSubmitted,
    DataPlane,
    DeclareDead,
    DiscardContribution,
    HeartbeatSeen,
    LeaveCause,
    MinWorkersChanged,
    Mode,
    OrderReduce,
    Phase,
    PhaseChanged,
    QuorumChanged,
    ReduceReported,
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
)
from diloco.coordinator.access import AccessList
from diloco.coordinator.budget import TokenBudget, check_budget
from diloco.coordinator.units import NO_UNIT, UnitLedger
from diloco.coordinator.config import CoordinatorConfig
from diloco.coordinator.blame import ContributionChecks
from diloco.coordinator.collective import CollectivePlane
from diloco.coordinator.dylu import SpeedTable
from diloco.coordinator.metrics import MetricsHistory
from diloco.core import trace
from diloco.coordinator.outliers import OutlierGuard
from diloco.outer import OptimizerBackup, build_outer_optimizer
from diloco.blocked_step import GradBlocks, Magnitudes, blocked_step_applies, step_in_blocks
from diloco.coordinator.params import (
    describe_mismatch,
    NonFinite,
    ParamMismatch,
    ParamStore,
    all_finite,
    check_tensors,
    first_non_finite,
    l2_norm,
)
from diloco.wire import compression
from diloco.wire.messages import (
    PROTOCOL_VERSION,
    Accepted,
    AdminReply,
    AdminRequest,
    Command,
    Error,
    ErrorCode,
    HealOrder,
    Heartbeat,
    HeartbeatReply,
    Join,
    Leave,
    Message,
    ReduceAbort,
    ReduceOrder,
    ReduceReport,
    Result,
    Submit,
    Tensors,
    Welcome,
)

Outgoing = list[tuple[str, Message]]

#: Observer hook: called as ``on_event(kind, now_s, info_dict)`` for applied rounds,
#: quorum and phase changes, joins, deaths and the stop. The demo's timeline and
#: the simulator's trace listen here; it must not raise.
Observer = Callable[[str, float, dict], None]


@dataclass
class CoordinatorStats:
    rounds_applied: int = 0
    contributions_accepted: int = 0
    bytes_received: int = 0
    bytes_sent: int = 0
    #: Total seconds spent below quorum after the run first formed.
    paused_s: float = 0.0
    paused_since_s: float | None = None
    messages_refused: int = 0
    #: Outer steps undone because they made a parameter non-finite (SPEC.md section 12).
    steps_refused: int = 0
    #: Workers that presented a round this coordinator has not opened (they are ahead of its
    #: durable state, e.g. after a resume from an older checkpoint) and were told to re-join
    #: (SPEC.md section 12, "Reconciliation").
    reconciled: int = 0
    #: Durable checkpoints written by the runner (one per step that applied a round), and their seconds.
    checkpoints_written: int = 0
    checkpoint_write_s: float = 0.0
    #: Journal commits (``persist.py``), and the seconds the loop waited for them before announcing.
    journal_records: int = 0
    journal_wait_s: float = 0.0


class StepRecorder(Protocol):
    """What a write-ahead journal hears from the hub coordinator (``persist.py``)."""

    def contribution(self, fragment_id: int, round_id: int, worker_id: str, submit: Submit) -> None:
        """An accepted contribution, as it came (encoded in the run's wire dtype)."""

    def step(self, fragment_id: int, inputs: list[tuple[int, str]], grad: Tensors) -> None:
        """An outer step is about to run on ``grad``, made of ``inputs`` ((round, worker) in the order
        they were summed; async: the one held contribution). ``grad`` is not changed by the step."""


def _closes_round(effects: list, i: int) -> bool:
    """Whether the contribution ``effects[i]`` accepts is its round's last: an ApplyRound of the same
    fragment and round that lists its worker follows it among the effects of the same step."""
    accept = effects[i]
    return any(type(e) is ApplyRound and e.fragment_id == accept.fragment_id and e.round_id == accept.round_id
               and accept.worker_id in e.contributors for e in effects[i + 1:])


def _receive_buffers(tensors: Tensors, measured) -> bool:
    """Whether every tensor is memory the receiver measured as it arrived (``diloco.wire.measure``): the
    Submit's own receive buffers, fp32 and contiguous, which only this Submit holds."""
    return measured is not None and all(not t.numel() or measured.square(t) is not None for t in tensors.values())


def held_tensors(tensors: Tensors) -> Tensors:
    """An async contribution as it is held until it applies: fp32 copies (a replay makes the same)."""
    return {n: t.detach().to(torch.float32).clone() for n, t in tensors.items()}


@dataclass
class _Held:
    """An async contribution's tensors, kept until it applies or is discarded."""

    tensors: Tensors
    base: int
    #: What the Submit said it trained on (the token budget; a token-weighted merged step weighs it).
    tokens: int | None = None


class Coordinator:
    """Drives one run's ``RoundFSM``. See the module docstring and SPEC.md."""

    def __init__(self, config: CoordinatorConfig, now_s: float = 0.0, *,
                 fsm: RoundFSM | None = None, observer: Observer | None = None) -> None:
        self.config = config
        self.fsm = fsm if fsm is not None else RoundFSM(config.fsm, now_s)
        self.store: ParamStore | None = None
        self._optimizers: list[torch.optim.Optimizer] = []
        #: Per fragment: where ``outer_step`` backs its optimizer's state up (buffers kept from step to step).
        self._optimizer_backups: list[OptimizerBackup] = []
        self._peers: dict[str, str] = {}
        #: worker id -> when its arriving bytes last counted as a heartbeat (``peer_arriving``).
        self._arriving_seen: dict[str, float] = {}
        self._held: dict[tuple[int, str], _Held] = {}
        self._stop_kind: ShutdownKind | None = None
        self.stats = CoordinatorStats()
        self._observer = observer
        #: 1 for a fresh run; a resumed coordinator is its checkpoint's incarnation + 1.
        self.incarnation = 1
        self._sync = config.fsm.mode is Mode.SYNC
        #: fragment -> (next round id / version, what its Results carry right after its last
        #: ApplyRound in this step: params or an encoded delta). Results carry these copies,
        #: never the live tensors (see ``_release``).
        self._released: dict[int, tuple[int, compression.Encoded]] = {}
        #: fragment -> weak references to the views of its params its last Results carry: while one is
        #: alive (a transport still sending, a driver holding the message), the params' memory must keep
        #: its values, and the next outer step writes fresh memory (``outer.step_in_blocks``).
        self._handed_out: dict[int, list[weakref.ref]] = {}
        #: fragment -> bounds on its params and momentum after its last blocked step (``outer.Magnitudes``).
        self._magnitudes: dict[int, Magnitudes | None] = {}
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
        #: Collective plane (SPEC.md C1-C7): who holds the committed state, group prefixes, heals.
        #: The model never reaches this process then: ``store`` stays None.
        self.collective = (CollectivePlane(config.fsm.num_fragments)
                           if config.fsm.data_plane is DataPlane.COLLECTIVE else None)
        self.started_s = now_s
        self.last_applied_s: float | None = None
        #: Hub plane: hears each accepted contribution and each outer step's input, so that a
        #: write-ahead journal can write them while the round goes on (``persist.py``).
        self.recorder: StepRecorder | None = None
        #: Sync rounds: the contributions in each fragment's running sum, in the order they were
        #: added (a replay adds them in the same order: the same bits).
        self._summed: dict[int, list[tuple[int, str]]] = {}
        #: Sync rounds: the tokens the contributions in each fragment's running sum trained on.
        self._round_tokens: dict[int, int] = {}
        #: The tokens applied rounds trained on, against ``--token-budget`` (``budget.py``).
        self.budget = TokenBudget(config.token_budget)
        #: Data work units: who holds which, what is in flight, what finished (``units.py``).
        self.units = UnitLedger(config.data_units)
        #: Observers hear every event fed to the machine and its effects (``"input"``): the audit
        #: log sets it, for trace validation (``tracecheck.py``).
        self.trace_inputs = False
        #: The bound on contributions far out of line with the recent ones (``outliers.py``).
        self.outliers = OutlierGuard(config.fsm.num_fragments, config.outlier_factor)
        #: Collective plane: declared norms against the same bounds, blame, evictions, failures in a
        #: row (``blame.py``; SPEC.md section 7c).
        self.checks = (ContributionChecks(self.outliers, config.max_update_norm, config.max_failed_attempts)
                       if self.collective is not None else None)
        #: Why the run stops at the end of the current step (a round that cannot commit), if it must.
        self._stop_for: str | None = None
        #: The reason the run stopped on its own, for the log and ``diloco status``.
        self.stop_reason: str | None = None
        #: Steps made durable so far (``persist.py``); a checkpoint holds the steps up to it.
        self.journal_seq = 0
        #: Restored from a checkpoint (``restore_coordinator``), not started fresh.
        self.resumed = False
        #: Per fragment: its next outer step's preparation, made while the loop was idle
        #: (``tick``, ``_prepare_steps``): the params moved to fresh memory (``begin_step``'s
        #: undo values) with the optimizer's state backed up, and what proves both still current.
        self._prepared: dict[int, tuple[Tensors, tuple]] = {}
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
    def delta_results(self) -> bool:
        """Sync rounds of a bf16 or int8 run: Results carry the encoded delta, and the params
        become old + decode(delta) (SPEC.md section 11, "Wire dtypes"). Async: full fp32."""
        return self._sync and self.config.wire_dtype != "fp32"

    @property
    def stopped(self) -> bool:
        return self._stop_kind is not None

    @property
    def stop_kind(self) -> ShutdownKind | None:
        return self._stop_kind

    @property
    def has_state(self) -> bool:
        """Something to checkpoint: the params (hub), or the run's layout and commits (collective)."""
        if self.collective is not None:
            return self.collective.spec is not None
        return self.store is not None

    def install_params(self, params: Tensors, optimizer_states: list[dict] | None = None) -> None:
        """Set the global params (first joiner, or a checkpoint) and build the outer optimizers."""
        self.store = ParamStore(params, self.config.fsm.num_fragments)
        self._prepared = {}
        self._optimizers = []
        self._optimizer_backups = [OptimizerBackup() for _ in range(self.config.fsm.num_fragments)]
        for fid in range(self.config.fsm.num_fragments):
            tensors = list(self.store.fragment_params(fid).values())
            self._optimizers.append(build_outer_optimizer(tensors, self.config.outer, self.fsm.min_workers))
        if optimizer_states is not None:
            for opt, state in zip(self._optimizers, optimizer_states):
                opt.load_state_dict(state)

    def optimizer_states(self) -> list[dict]:
        return [opt.state_dict() for opt in self._optimizers]

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
            paused_s=self._paused_total(self.fsm.now_s),
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
            num_params=self._num_params(),
            data_plane=self.config.fsm.data_plane.value,
            collective=({**self.collective.status(), "checks": self.checks.status()}
                        if self.collective is not None else None),
            outer_optimizer=self.config.outer.name,
            wire_dtype=self.config.wire_dtype,
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

    def _num_params(self) -> int:
        if self.store is not None:
            return sum(t.numel() for t in self.store.params.values())
        spec = self.collective.spec if self.collective is not None else None
        return sum(math.prod(s.shape) for s in spec) if spec else 0

    def sync_every_of(self, worker_id: str) -> int | None:
        """DyLU: the H_w this worker is told (None when the run does not use DyLU)."""
        if not self.config.dylu:
            return None
        return self.speeds.sync_every(worker_id, self.config.sync_every)

    # ----------------------------------------------------------------- inputs

    def tick(self, now_s: float) -> Outgoing:
        """The clock moved and nothing came (the runner calls this when its transport was idle for a
        tick): time-driven effects, then one fragment's next outer step prepared (``_prepare_steps``)."""
        out: Outgoing = []
        self._tick(now_s, out)
        self._prepare_steps()
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
                self._refuse(peer, out, *refusal, message)
                return out
        if isinstance(message, Heartbeat):
            self._on_heartbeat(peer, message, out)
        elif isinstance(message, Submit):
            self._on_submit(peer, message, out, measured)
            if self.budget.reached and not self.stopped:
                self._notify("budget", now_s, **self.budget.status())
                self._step(ShutdownRequested(ShutdownKind.SAVE_AND_STOP), out)
        elif isinstance(message, Join):
            self._on_join(peer, message, out)
            if identity is not None and self._peers.get(message.worker_id) == peer:
                self.access.bind(message.worker_id, identity, self.fsm.is_member)
        elif isinstance(message, Leave):
            if self._peers.get(message.worker_id) == peer:
                self._step(WorkerLeft(message.worker_id, LeaveCause.LEFT), out)
        elif isinstance(message, ReduceReport) and self.collective is not None:
            self._on_report(peer, message, out)
        else:
            self._refuse(peer, out, ErrorCode.BAD_MESSAGE,
                         f"a coordinator does not accept {type(message).__name__} messages", message)
        return out

    def peer_lost(self, peer: str, now_s: float) -> Outgoing:
        """The transport saw ``peer`` disconnect: report its worker gone (R7)."""
        out: Outgoing = []
        self._tick(now_s, out)
        for wid, p in list(self._peers.items()):
            if p == peer and not self.stopped and self.fsm.is_member(wid):
                self._step(WorkerLeft(wid, LeaveCause.CRASHED), out)
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
                self._step(HeartbeatSeen(wid), out)
        return out

    # --------------------------------------------------------------- handlers

    def _tick(self, now_s: float, out: Outgoing) -> None:
        if self.stopped or now_s <= self.fsm.now_s:
            return
        self._step(Ticked(now_s), out)

    def _on_heartbeat(self, peer: str, msg: Heartbeat, out: Outgoing) -> None:
        wid = msg.worker_id
        command = Command.CONTINUE
        if self._peers.get(wid) != peer or not self.fsm.is_member(wid):
            command = Command.REJOIN
        else:
            self._step(HeartbeatSeen(wid), out)
            if msg.metrics:
                self.metrics.record(wid, self.fsm.now_s, msg.metrics)
                if self.config.dylu:
                    self.speeds.report(wid, msg.metrics.get("train_steps_per_s"))
        out.append((peer, self._heartbeat_reply(command, sync_every=self.sync_every_of(wid)
                                                if command is Command.CONTINUE else None)))

    def _on_join(self, peer: str, msg: Join, out: Outgoing) -> None:
        if msg.protocol_version != PROTOCOL_VERSION:
            self._refuse(peer, out, ErrorCode.PROTOCOL_VERSION,
                         f"worker speaks protocol version {msg.protocol_version}; this coordinator speaks "
                         f"version {PROTOCOL_VERSION}", msg)
            return
        if self.collective is not None:
            refusal = self.collective.check_join(msg, self.fsm.is_member)
            if refusal is not None:
                self._refuse(peer, out, *refusal, msg)
                return
        elif self.store is None:
            if not msg.spec:
                self._refuse(peer, out, ErrorCode.BAD_MESSAGE, "the join's spec lists no tensors: a model "
                             "needs at least one parameter", msg)
                return
            # The run keeps fp32 params and every later join is compared with their spec:
            # a first join in another dtype would be welcomed and then lock out every
            # later worker with the very same model (Join: "initial fp32 params").
            not_fp32 = [s for s in msg.spec if s.dtype != "float32"]
            if not_fp32:
                self._refuse(peer, out, ErrorCode.BAD_MESSAGE,
                             f"initial params must be float32: tensor {not_fp32[0].name!r} is "
                             f"{not_fp32[0].dtype} (send fp32 copies; workers may train in any dtype)", msg)
                return
            if not msg.params:
                # Joins carry only the spec; the first one is asked for the params (SPEC.md section 11).
                self._refuse(peer, out, ErrorCode.PARAMS_REQUIRED,
                             "the run has no params yet: join again with your initial fp32 params", msg)
                return
            try:
                check_tensors(msg.params, msg.spec, "initial params of the first worker")
            except ParamMismatch as exc:
                self._refuse(peer, out, ErrorCode.BAD_MESSAGE, str(exc), msg)
                return
            bad = first_non_finite(msg.params)
            if bad is not None:
                self._refuse(peer, out, ErrorCode.NON_FINITE,
                             f"initial params of the first worker: tensor {bad!r} has non-finite values "
                             f"(NaN or infinity); the run cannot start from them", msg)
                return
        else:
            if msg.params:
                # Only the first join's params are used: drop these at once, keep no reference.
                msg = dataclasses.replace(msg, params={})
            if tuple(msg.spec) != self.store.spec:
                self._refuse(peer, out, ErrorCode.MODEL_MISMATCH, describe_mismatch(msg.spec, self.store.spec),
                             msg)
                return
        wid = msg.worker_id
        if isinstance(wid, str) and self.fsm.is_member(wid) and self._peers.get(wid) != peer:
            # R6: a join for a live id from a new connection is that worker restarted.
            self._step(WorkerLeft(wid, LeaveCause.CRASHED), out)
            if self.stopped:
                self._answer_after_stop(peer, msg, out)
                return
        if self.collective is not None:
            self._reseed(msg, out)
            if self.stopped:
                self._answer_after_stop(peer, msg, out)
                return
        self._step(WorkerJoined(wid), out, peer=peer, join=msg)

    def _reseed(self, join: Join, out: Outgoing) -> None:
        """C6: when the joiner starts the run again from a newer state, the members holding (or
        healing to) the older one leave first -- so the joiner's Welcome tells the quorum as it
        is -- and are told to join again, to heal from it."""
        held, digests = _held_state(join)
        for wid in self.collective.reseed_for(join.worker_id, held, digests):
            peer = self._peers.get(wid)
            self.collective.forget(wid)
            self._withdraw_heals(out)
            if self.fsm.is_member(wid):
                self._step(WorkerLeft(wid, LeaveCause.RESEEDED), out)
            if peer is not None:
                out.append((peer, self._heartbeat_reply(Command.REJOIN)))
            self._notify("reseed", self.fsm.now_s, worker_id=wid, starter=join.worker_id, held_rounds=list(held))

    def _on_submit(self, peer: str, msg: Submit, out: Outgoing, measured=None) -> None:
        wid = msg.worker_id
        if self._peers.get(wid) != peer or not self.fsm.is_member(wid):
            opened = self.fsm.open_round_ids()
            if (type(msg.fragment_id) is int and 0 <= msg.fragment_id < len(opened)
                    and type(msg.round_id) is int and msg.round_id > opened[msg.fragment_id]):
                self._reconciled(msg, self.fsm.now_s, "unknown_worker")
            self._refuse(peer, out, ErrorCode.UNKNOWN_WORKER,
                         f"worker {wid!r} is not a live member on this connection (join first)", msg)
            return
        fid = msg.fragment_id
        tensors = None
        if self.collective is not None:
            if msg.tensors or msg.scales:
                self._refuse(peer, out, ErrorCode.BAD_MESSAGE, "this run is on the collective data plane: a Submit "
                             "says 'ready' and carries no tensors (they stay on the workers)", msg)
                return
            if self.fsm.phase is not Phase.STOPPED and type(fid) is int and 0 <= fid < self.config.fsm.num_fragments:
                refusal = self.checks.check_ready(fid, msg.norm)
                if refusal is not None:
                    self._refuse(peer, out, refusal[0], refusal[1], msg)
                    if refusal[0] is not ErrorCode.BAD_MESSAGE:
                        self._notify("outlier", self.fsm.now_s, worker_id=wid, fragment_id=fid,
                                     norm=str(msg.norm), detail=refusal[1])
                    return
            self._step(ContributionSubmitted(wid, fid, msg.round_id), out, peer=peer, submit=msg, tensors={})
            return
        if self.store is not None and type(fid) is int and 0 <= fid < self.config.fsm.num_fragments:
            # Decoded to fp32 first (SPEC.md section 11, "Wire dtypes"); then the checks of any submission.
            tensors = self._decode_submission(peer, msg, out)
            if tensors is None:
                return
            try:
                # The outlier bound needs the norm: the same pass proves the tensors finite.
                checked_norm = self.store.check_submission(fid, tensors, norm=self.outliers.factor > 0,
                                                           measured=measured)
            except NonFinite as exc:
                self._refuse(peer, out, ErrorCode.NON_FINITE, str(exc), msg)
                return
            except ParamMismatch as exc:
                self._refuse(peer, out, ErrorCode.TENSOR_MISMATCH, str(exc), msg)
                return
            limit = self.config.max_update_norm
            norm = None
            if limit is not None:
                norm = l2_norm(tensors)
                if norm > limit:
                    self._refuse(peer, out, ErrorCode.UPDATE_TOO_LARGE,
                                 f"fragment {fid} submission: L2 norm {norm:.6g} exceeds the coordinator's "
                                 f"--max-update-norm {limit:g}", msg)
                    return
            if self.outliers.factor > 0:
                norm = checked_norm if norm is None else norm
                why = self.outliers.check(fid, norm, self.store.fragment_params(fid))
                if why is not None:
                    self._refuse(peer, out, ErrorCode.UPDATE_TOO_LARGE, f"fragment {fid} submission: {why}", msg)
                    self._notify("outlier", self.fsm.now_s, worker_id=wid, fragment_id=fid,
                                 norm=norm if math.isfinite(norm) else str(norm), detail=why)
                    return
            effects = self._step(ContributionSubmitted(wid, fid, msg.round_id), out, peer=peer, submit=msg,
                                 tensors=tensors, norm=checked_norm if checked_norm is not None else norm,
                                 owned=_receive_buffers(tensors, measured))
            if norm is not None and any(type(e) is AcceptContribution for e in effects):
                self.outliers.accepted(fid, norm)
            return
        self._step(ContributionSubmitted(wid, fid, msg.round_id), out, peer=peer, submit=msg, tensors=tensors)

    def _on_report(self, peer: str, msg: ReduceReport, out: Outgoing) -> None:
        wid = msg.worker_id
        if self._peers.get(wid) != peer or not self.fsm.is_member(wid):
            self._refuse(peer, out, ErrorCode.UNKNOWN_WORKER,
                         f"worker {wid!r} is not a live member on this connection (join first)", msg)
            return
        if not msg.ok:
            self._notify("reduce_failed", self.fsm.now_s, worker_id=wid, fragment_id=msg.fragment_id,
                         round_id=msg.round_id, attempt=msg.attempt, detail=msg.detail, blame=list(msg.blame))
        # Blame counts even for an attempt the core already ended (its first failure report did).
        evict = self.checks.reported(msg)
        self._step(ReduceReported(wid, msg.fragment_id, msg.round_id, msg.attempt, msg.ok, msg.digest), out,
                   peer=peer, report=msg)
        for blamed in evict:
            self._evict(blamed, msg, out)

    def _evict(self, worker_id: str, report: ReduceReport, out: Outgoing) -> None:
        """Every member of an attempt's group blamed ``worker_id``: it leaves the round (it joins again
        and heals), and past ``MAX_STRIKES`` the run (SPEC.md section 7c)."""
        if not self.fsm.is_member(worker_id):
            return
        eviction = self.checks.evicted(worker_id, report.fragment_id, report.round_id, report.attempt)
        peer = self._peers.get(worker_id)
        self._notify("evicted", self.fsm.now_s, worker_id=worker_id, fragment_id=report.fragment_id,
                     round_id=report.round_id, attempt=report.attempt, detail=eviction.detail,
                     banned=eviction.banned)
        if eviction.banned:
            self.access.ban(worker_id)
        self._step(WorkerLeft(worker_id, LeaveCause.EVICTED), out)
        if peer is not None:
            self._refuse(peer, out, ErrorCode.BANNED if eviction.banned else ErrorCode.EVICTED, eviction.detail,
                         Submit(worker_id, report.fragment_id, report.round_id, {}))

    def _decode_submission(self, peer: str, msg: Submit, out: Outgoing) -> Tensors | None:
        """The submission's tensors as fp32, or None after refusing it (bad_message, tensor_mismatch)."""
        fid, wire_dtype = msg.fragment_id, self.config.wire_dtype
        what = f"fragment {fid} submission"
        if msg.wire_dtype != wire_dtype:
            self._refuse(peer, out, ErrorCode.BAD_MESSAGE,
                         f"{what} is encoded as {msg.wire_dtype}; this run's wire dtype is {wire_dtype} (the "
                         f"Welcome says so: join again)", msg)
            return None
        if msg.tokens is None and self.config.token_weighted:
            self._refuse(peer, out, ErrorCode.BAD_MESSAGE,
                         f"{what} does not say how many tokens it trained on; this run merges contributions "
                         f"weighted by their tokens (--merge {self.config.merge})", msg)
            return None
        spec = [(s.name, s.shape) for s in self.store.fragment_spec(fid)]
        try:
            return compression.decode(msg.tensors, msg.scales, wire_dtype, spec, what)
        except compression.EncodedMismatch as exc:
            self._refuse(peer, out, ErrorCode.TENSOR_MISMATCH, str(exc), msg)
        except compression.NonFiniteScale as exc:  # the pseudo-gradient was not finite before encoding
            self._refuse(peer, out, ErrorCode.NON_FINITE, str(exc), msg)
            self._notify("outlier", self.fsm.now_s, worker_id=msg.worker_id, fragment_id=fid, norm="nan",
                         detail=str(exc))
        except compression.EncodingError as exc:
            self._refuse(peer, out, ErrorCode.BAD_MESSAGE, str(exc), msg)
        return None

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
            effects = self._step(ShutdownRequested(kind), sink)
        elif cmd == "set_min_workers":
            effects = self._step(MinWorkersChanged(args.get("min_workers")), sink)
        elif cmd == "set_token_budget":
            try:
                self.budget.budget = check_budget(args.get("budget"))
            except ValueError as exc:
                return AdminReply(False, {}, str(exc))
            if self.budget.reached:
                self._notify("budget", self.fsm.now_s, **self.budget.status())
                self._step(ShutdownRequested(ShutdownKind.SAVE_AND_STOP), sink)
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
            effects = self._step(WorkerLeft(wid, LeaveCause.KICKED), sink)
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
            out.append((peer, self._heartbeat_reply(command, phase=Phase.STOPPED)))
        elif not isinstance(msg, Leave):
            self._refuse(peer, out, ErrorCode.STOPPED,
                         f"the run has stopped ({self._stop_kind.value}); nothing more is accepted", msg)

    def _heartbeat_reply(self, command: Command, *, phase: Phase | None = None,
                         sync_every: int | None = None) -> HeartbeatReply:
        """The quorum as it stands and ``command``; ``phase`` defaults to the machine's."""
        return HeartbeatReply(self.fsm.below_min_workers, self.fsm.min_workers,
                              (phase if phase is not None else self.fsm.phase).value, command, sync_every)

    def _refuse(self, peer: str, out: Outgoing, code: ErrorCode, detail: str, msg: Message) -> None:
        self.stats.messages_refused += 1
        out.append((peer, Error(code, detail, type(msg).__name__)))

    # ---------------------------------------------------------------- effects

    def _step(self, event, out: Outgoing, *, peer: str | None = None, join: Join | None = None,
              submit: Submit | None = None, tensors: Tensors | None = None, norm: float | None = None,
              report: ReduceReport | None = None, owned: bool = False) -> list:
        effects = self.fsm.step(event)
        now = self.fsm.now_s
        if self.trace_inputs:
            # Trace validation (``diloco check-log``): the machine's input and its answer, first.
            self._notify("input", now, **{"in": trace.event_record(event), "out": trace.effect_records(effects)})
        if type(event) is WorkerLeft and not (effects and type(effects[0]) is Reject):
            # Observers hear of the leave before what it caused (quorum and phase changes,
            # an apply, a stop), as they hear of a DeclareDead: in effect order (SPEC.md 5.3).
            self._notify("left", now, worker_id=event.worker_id, cause=event.cause.value)
        for i, effect in enumerate(effects):
            kind = type(effect)
            if kind is AcceptContribution:
                self._accept(effect, submit, tensors, peer, out, norm, _closes_round(effects, i), owned)
            elif kind is ReleaseWorker:
                self._release(effect, out)
            elif kind is ApplyRound:
                self._apply(effect, now)
            elif kind is Reject:
                if effect.reason is RejectReason.FUTURE_ROUND and submit is not None:
                    self._reconciled(submit, now, "future_round")
                target = peer if peer is not None else self._peers.get(effect.worker_id)
                if target is not None:
                    self._refuse(target, out, ErrorCode(effect.reason.value), effect.detail,
                                 submit or join or report or event)
            elif kind is AcceptJoin:
                self._welcome(effect, peer, join, out, now)
            elif kind is DeclareDead:
                self._forget(effect.worker_id, out)
                self._notify("dead", now, worker_id=effect.worker_id, last_seen_s=effect.last_seen_s)
                self._give_back_unit(effect.worker_id, now)
            elif kind is DiscardContribution:
                self._discard(effect)
                self._notify("discard", now, worker_id=effect.worker_id, fragment_id=effect.fragment_id,
                             round_id=effect.round_id, reason=effect.reason.value)
            elif kind is QuorumChanged:
                self._quorum_changed(effect, now)
            elif kind is PhaseChanged:
                self._notify("phase", now, old=effect.old.value, new=effect.new.value)
            elif kind is OrderReduce:
                self._order(effect, out, now)
            elif kind is AbortReduce:
                self._abort(effect, out, now)
            elif kind is StopRun:
                self._stop_kind = effect.kind
                self._quorum_changed(None, now)
                self._notify("stop", now, kind=effect.kind.value)
        if type(event) is WorkerLeft:
            self._forget(event.worker_id, out)
            if not self.fsm.is_member(event.worker_id):
                self._give_back_unit(event.worker_id, now)
        self._released.clear()
        stop_for, self._stop_for = self._stop_for, None
        if stop_for is not None and not self.stopped:
            # A round that cannot commit: stop with a checkpoint and the reason (SPEC.md section 7c).
            self.stop_reason = stop_for
            self._notify("stuck", now, detail=stop_for)
            self._step(ShutdownRequested(ShutdownKind.SAVE_AND_STOP), out)
        return effects

    def _forget(self, worker_id: str, out: Outgoing) -> None:
        """A worker that died or left: its connection and its speed; on the collective plane also its
        place among the holders of the committed state, once it is no longer a member (a refused
        leave keeps it; a dead worker never is one), and the heal a member serves it (M12)."""
        if self.collective is not None and not self.fsm.is_member(worker_id):
            self.collective.forget(worker_id)
            self.checks.forget(worker_id)
            self._withdraw_heals(out)
        self._peers.pop(worker_id, None)
        self.speeds.forget(worker_id)

    def _withdraw_heals(self, out: Outgoing) -> None:
        """M12: tell each source whose joiner left or re-joined that the heal it serves is off (an
        order with no prefix), so it does not hold itself out of the groups until the heal times out."""
        withdrawn = self.collective.withdrawn
        while withdrawn:
            source, joiner = withdrawn.popleft()
            peer = self._peers.get(source)
            if peer is not None:
                out.append((peer, HealOrder(joiner, "")))
                self.collective.stats["heals_withdrawn"] += 1

    def _welcome(self, effect: AcceptJoin, peer: str | None, join: Join | None, out: Outgoing, now: float) -> None:
        assert peer is not None and join is not None
        if self.collective is not None:
            self._welcome_collective(effect, peer, join, out, now)
            return
        if self.store is None:
            self.install_params(join.params)
        self._peers[effect.worker_id] = peer
        store = self.store
        out.append((peer, Welcome(
            worker_id=effect.worker_id,
            round_ids=effect.round_ids,
            parked=effect.parked,
            mode=self.config.fsm.mode.value,
            fragments=store.fragments,
            min_workers=self.fsm.min_workers,
            below_min_workers=self.fsm.below_min_workers,
            heartbeat_interval_s=self.config.heartbeat_interval_s,
            # A copy: the message must keep the values of *now* however long the driver
            # holds it (the store's tensors change in place at every outer step). Always fp32.
            params={n: t.clone() for n, t in store.params.items()},
            wire_dtype=self.config.wire_dtype,
            sync_every=self.sync_every_of(effect.worker_id),
            data_units=self.units.units or None,
            unit=self._hand_out(effect.worker_id, join.unit),
        )))
        self.stats.bytes_sent += compression.tensor_nbytes(store.params)
        self._notify("join", now, worker_id=effect.worker_id, parked=list(effect.parked))

    def _welcome_collective(self, effect: AcceptJoin, peer: str, join: Join, out: Outgoing, now: float) -> None:
        """C6: no params; the joiner heals from a member that holds the committed state, or starts the run."""
        plane = self.collective
        self._peers[effect.worker_id] = peer
        source, prefix = plane.heal_source_for(effect.worker_id, *_held_state(join))
        self._withdraw_heals(out)  # an older heal of this joiner's: before the new order (M12)
        if source is not None:
            out.append((self._peers[source], HealOrder(effect.worker_id, prefix)))
        out.append((peer, Welcome(
            worker_id=effect.worker_id, round_ids=effect.round_ids, parked=effect.parked,
            mode=self.config.fsm.mode.value, fragments=plane.fragments, min_workers=self.fsm.min_workers,
            below_min_workers=self.fsm.below_min_workers, heartbeat_interval_s=self.config.heartbeat_interval_s,
            params={}, wire_dtype=self.config.wire_dtype, sync_every=self.sync_every_of(effect.worker_id),
            data_plane=DataPlane.COLLECTIVE.value, store_port=plane.store_port, heal_source=source or "",
            heal_prefix=prefix, outer=self.config.outer.to_dict(),
            collective_timeout_s=self.config.collective_timeout_s, committed=tuple(plane.last_commit),
            layout=plane.layout)))
        self._notify("join", now, worker_id=effect.worker_id, parked=list(effect.parked), heal_source=source or "")

    def _order(self, effect: OrderReduce, out: Outgoing, now: float) -> None:
        prefix = self.collective.group_prefix(effect.group)
        norms, gather = self.checks.order_fields(effect.fragment_id, effect.round_id, effect.attempt, effect.group)
        message = ReduceOrder(effect.fragment_id, effect.round_id, effect.attempt, effect.group, prefix, norms, gather)
        for wid in effect.group:
            peer = self._peers.get(wid)
            if peer is not None:
                out.append((peer, message))
        self._notify("reduce", now, fragment_id=effect.fragment_id, round_id=effect.round_id,
                     attempt=effect.attempt, group=list(effect.group))

    def _abort(self, effect: AbortReduce, out: Outgoing, now: float) -> None:
        # A failed group may be broken (a dead or wedged peer): the next order builds a new one.
        self.collective.retire_group()
        message = ReduceAbort(effect.fragment_id, effect.round_id, effect.attempt, effect.reason.value)
        for wid in effect.group:
            peer = self._peers.get(wid)
            if peer is not None and self.fsm.is_member(wid):
                out.append((peer, message))
        self.collective.stats["aborts"] += 1
        self._notify("abort", now, fragment_id=effect.fragment_id, round_id=effect.round_id,
                     attempt=effect.attempt, reason=effect.reason.value)
        stuck = self.checks.aborted(effect.fragment_id, effect.round_id, effect.group, effect.reason.value)
        if stuck is not None and self._stop_for is None:
            self._stop_for = stuck  # after this step's effects: a stop is a step of its own

    def _accept(self, effect: AcceptContribution, submit: Submit | None, tensors: Tensors | None,
                peer: str | None, out: Outgoing, norm: float | None = None, closes: bool = False,
                owned: bool = False) -> None:
        assert submit is not None and tensors is not None and peer is not None
        self.stats.contributions_accepted += 1
        if self.collective is not None:
            # C2: "ready"; the pseudo-gradient stays on the worker. Having been ready proves it
            # holds the committed state (it healed, or was in the last group): a heal source.
            self.collective.holds_state(effect.worker_id)
            # Before the order this ready may complete (the next effect): it carries the norm.
            self.checks.accepted(effect.fragment_id, effect.worker_id, float(submit.norm))
            out.append((peer, Accepted(effect.fragment_id, effect.round_id)))
            return
        assert self.store is not None
        nbytes = compression.tensor_nbytes
        self.stats.bytes_received += nbytes(submit.tensors) + nbytes(submit.scales)
        fid = effect.fragment_id
        if self._sync:
            # ``closes``: this round's outer step follows, whose mean makes the addition in its own pass.
            # ``owned``: the tensors are the receiver's buffers, which nothing else reads (a journal
            # writes the Submit as it came: then they are not), so the round's sum may start in them.
            self.store.accumulate(fid, tensors, submit.tokens if self.config.token_weighted else None, norm,
                                  last=closes, owned=owned and self.recorder is None)
            self._summed.setdefault(fid, []).append((effect.round_id, effect.worker_id))
            self._round_tokens[fid] = self._round_tokens.get(fid, 0) + (submit.tokens or 0)
        else:
            self._held[(fid, effect.worker_id)] = _Held(held_tensors(tensors), effect.round_id, submit.tokens)
        if self.units.enabled:
            why = self.units.submitted(effect.worker_id, fid, NO_UNIT if submit.unit is None else submit.unit)
            if why is not None:  # the contribution counts; its data is not marked trained
                self._notify("unit_mismatch", self.fsm.now_s, worker_id=effect.worker_id, fragment_id=fid,
                             round_id=effect.round_id, detail=why)
        if self.recorder is not None:
            self.recorder.contribution(effect.fragment_id, effect.round_id, effect.worker_id, submit)
        out.append((peer, Accepted(effect.fragment_id, effect.round_id)))

    def _apply(self, effect: ApplyRound, now: float) -> None:
        if self.collective is not None:
            # C4: the commit. The group computed the step; what is durable here is the decision.
            self.collective.committed(effect.fragment_id, effect.round_id, effect.digest)
            self.checks.committed(effect.fragment_id)
            self.stats.rounds_applied += 1
            self.last_applied_s = now
            self.metrics.round_applied(now, effect.fragment_id, effect.round_id, effect.contributors)
            self._notify("apply", now, fragment_id=effect.fragment_id, round_id=effect.round_id,
                         contributors=list(effect.contributors), digest=effect.digest)
            return
        store = self.store
        assert store is not None
        fid = effect.fragment_id
        grad_bound = None
        mean = None
        if self._sync:
            # The mean is made in the outer step's own pass when it can be (``outer.step_in_blocks``).
            mean = store.open_mean(fid, len(effect.contributors))
            grad = mean.tensors
            grad_bound = store.mean_bound(fid)
            inputs = self._summed.pop(fid, [])
            tokens = self._round_tokens.pop(fid, 0)
        elif len(effect.contributors) == 1:
            (wid,) = effect.contributors
            held = self._held.pop((fid, wid))
            grad, inputs, tokens = held.tensors, [(held.base, wid)], held.tokens or 0
        else:
            # A grace window's merged step (SPEC.md P5): the mean of its contributions, summed in
            # the order the core lists them through the sync rounds' running sum (the same bits).
            inputs, tokens = [], 0
            for wid in effect.contributors:
                held = self._held.pop((fid, wid))
                store.accumulate(fid, held.tensors, held.tokens if self.config.token_weighted else None)
                inputs.append((held.base, wid))
                tokens += held.tokens or 0
            grad = store.take_mean(fid, len(inputs))
        if self.recorder is not None:
            if mean is not None:
                mean.finish()  # the journal writes the mean while the step runs
            self.recorder.step(fid, inputs, grad)
            mean = None
        bad, delta = self.outer_step(fid, grad, grad_bound, mean)
        if bad is not None:
            self.stats.steps_refused += 1
            self._notify("step_refused", now, fragment_id=fid, round_id=effect.round_id,
                         contributors=list(effect.contributors), tensor=bad)
        else:
            self.budget.add(tokens, now)
        if self.units.enabled:
            self._units_of_step(fid, effect.round_id, effect.contributors, bad is None, now)
        # What the Results of this apply carry (SPEC.md section 5, rule 1: they follow it),
        # shared by all its contributors: views of the params, which no later step writes
        # (each moves them to fresh memory first, ``ParamStore.begin_step``), so a Result still
        # queued or held keeps these values; a later apply of the same fragment in the same
        # step (async, held contributions) releases its own.
        if not self.delta_results:
            released = compression.Encoded(store.released(fid), {})
            self._handed_out[fid] = [weakref.ref(t) for t in released.values.values()]
        elif bad is not None or delta is None:  # params unchanged: a zero delta
            released = compression.encode({n: torch.zeros_like(t) for n, t in store.fragment_params(fid).items()},
                                          self.config.wire_dtype)
        else:
            released = delta
        self._released[fid] = (effect.round_id + 1, released)
        self.stats.rounds_applied += 1
        self.last_applied_s = now
        self.metrics.round_applied(now, fid, effect.round_id, effect.contributors)
        self._notify("apply", now, fragment_id=fid, round_id=effect.round_id,
                     contributors=list(effect.contributors))

    def _prepare_steps(self) -> None:
        """Make the part of one fragment's next outer step that does not depend on its input, ahead,
        when that step goes to ``opt.step()`` or needs the params' old values (a bf16/int8 run's delta;
        otherwise ``step_in_blocks`` needs nothing made ahead): move its
        params to fresh memory holding the same values (``begin_step``) and back its optimizer's state
        up. Two model-sized copies that ``outer_step`` would otherwise make after the round's last
        contribution, on the round's critical path. Values and bits are unchanged: the params keep
        their values, and ``outer_step`` uses the preparation only while nothing has changed the
        params or the optimizer's state since (``_step_key``); else it makes them itself, as a journal
        replay does. One fragment per call, so that an idle tick stays short."""
        store = self.store
        if store is None or self.collective is not None or self.stopped:
            return
        for fid in range(len(self._optimizers)):
            if fid in self._prepared or (blocked_step_applies(self._optimizers[fid]) and not self.delta_results):
                continue  # a blocked step into fresh memory or in place needs nothing made ahead
            before = store.begin_step(fid)
            self._optimizer_backups[fid].take(self._optimizers[fid])
            self._prepared[fid] = (before, self._step_key(fid))
            return

    def _step_key(self, fid: int) -> tuple:
        """What identifies fragment ``fid``'s params and optimizer state as they are now: each tensor's
        memory and version counter (an in-place change bumps it)."""
        opt = self._optimizers[fid]
        params = [(p.data_ptr(), p._version) for p in self.store.fragment_params(fid).values()]
        state = [(k, v.data_ptr(), v._version) if isinstance(v, torch.Tensor) else (k, repr(v))
                 for st in opt.state.values() for k, v in st.items()]
        groups = [repr(sorted((k, v) for k, v in g.items() if k != "params")) for g in opt.param_groups]
        return tuple(params), tuple(state), tuple(groups)

    def outer_step(self, fid: int, grad: Tensors, grad_bound: float | None = None,
                   grad_blocks: GradBlocks | None = None) -> tuple[str | None, compression.Encoded | None]:
        """Step fragment ``fid``'s outer optimizer on ``grad``: (the first non-finite tensor or None, the
        encoded delta the Results carry on a bf16/int8 run, else None). ``grad_bound``: at least every
        element's magnitude, when known (``ParamStore.mean_bound``), for a step made in place.
        ``grad_blocks``: ``grad`` is still to be made (``ParamStore.open_mean``); made by the step.

        Deterministic: the same params, optimizer state and ``grad`` give the same bits, which
        is what lets a write-ahead log replay a round (``journal.py``).
        """
        params = self.store.fragment_params(fid)
        opt = self._optimizers[fid]
        # Finite contributions can still step to an infinity (a huge mean times lr and momentum):
        # the step must be undone exactly, and the params' memory, which the last Results may still
        # be sent from, must keep its values. A plain Nesterov step is made block by block
        # (``outer.step_in_blocks``, the same bits): in place when no Result holds the params' memory
        # any more and bounds prove it finite, else into fresh memory, leaving the old as the undo.
        # Any other step changes a fresh copy of the params (``begin_step``) with the optimizer's
        # state backed up.
        opt_before = self._optimizer_backups[fid]
        prepared = self._prepared.pop(fid, None)
        # Made while idle (``_prepare_steps``) and still current: the same values, bit for bit.
        kept = prepared[0] if prepared is not None and prepared[1] == self._step_key(fid) else None
        overwrite = not self.delta_results and all(ref() is None for ref in self._handed_out.get(fid, ()))
        blocked = step_in_blocks(opt, params, grad, grad_bound=None if self.delta_results else grad_bound,
                                 magnitudes=self._magnitudes.get(fid), overwrite=overwrite,
                                 undo_kept=kept is not None, grad_blocks=grad_blocks)
        self._magnitudes[fid] = None if blocked is None else blocked.magnitudes
        if blocked is not None and kept is None:
            before, bad, undo = blocked.before, blocked.bad, blocked.undo
        else:
            if kept is not None:
                before = kept
            else:
                before = self.store.begin_step(fid)
                opt_before.take(opt)
            if blocked is not None:
                bad = blocked.bad
            else:
                for name, p in params.items():
                    p.grad = grad[name]
                opt.step()
                for p in params.values():
                    p.grad = None
                bad = next((n for n, p in params.items() if not all_finite(p)), None)

            def undo() -> None:
                self.store.undo_step(fid, before)
                opt_before.restore(opt)
        delta = None
        if self.delta_results and bad is None:
            # The params every worker will hold: old + decode(encode(delta)), bit for bit.
            delta, new = compression.quantized_update(before, params, self.config.wire_dtype)
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(new[n])
            bad = next((n for n, p in params.items() if not all_finite(p)), None)
        if bad is not None:
            # SPEC.md section 12, "Non-finite steps": undo the step exactly; the round still
            # counts as applied (the core emitted ApplyRound) and its contributions are
            # discarded; the Results carry the unchanged params.
            undo()
        return bad, delta

    def _release(self, effect: ReleaseWorker, out: Outgoing) -> None:
        peer = self._peers.get(effect.worker_id)
        if peer is None:
            return
        if effect.outcome is ReleaseOutcome.STOP:
            next_round = self.fsm.open_round_ids()[effect.fragment_id]
            out.append((peer, Result(effect.fragment_id, effect.round_id, effect.outcome.value, next_round)))
            return
        if self.collective is not None:
            # C4: adopt what you proposed; the digest says which proposal was committed.
            fid = effect.fragment_id
            out.append((peer, Result(fid, effect.round_id, effect.outcome.value, effect.round_id + 1,
                                     digest=self.collective.last_commit[fid][1])))
            return
        # The values right after the ApplyRound that released this worker, not the live
        # tensors: a driver may hold the message while later steps apply more rounds
        # (the simulator delays delivery), and in async mode several held contributions
        # apply in one step, each releasing its worker at its own version.
        next_round, released = self._released[effect.fragment_id]
        self.stats.bytes_sent += released.nbytes
        delta = self.delta_results
        unit = (self._hand_out(effect.worker_id)
                if self.units.enabled and effect.outcome is ReleaseOutcome.APPLIED else None)
        out.append((peer, Result(effect.fragment_id, effect.round_id, effect.outcome.value, next_round,
                                 released.values, delta, self.config.wire_dtype if delta else "fp32",
                                 released.scales, unit=unit)))

    # -- data work units (``units.py``): handed out with Welcomes and Results, finished by applies

    def _hand_out(self, worker_id: str, claim: int | None = None) -> int | None:
        if not self.units.enabled:
            return None
        unit = self.units.hand_out(worker_id, NO_UNIT if claim is None else claim)
        self._notify("unit", self.fsm.now_s, worker_id=worker_id, unit=unit)
        return unit

    def _give_back_unit(self, worker_id: str, now: float) -> None:
        unit = self.units.released(worker_id)
        if unit is not None:
            self._notify("unit_back", now, worker_id=worker_id, unit=unit)

    def _units_of_step(self, fid: int, round_id: int, contributors, applied: bool, now: float) -> None:
        """An outer step's contributions: their units finish when it applied; else they go back."""
        if applied:
            done = self.units.applied(fid, contributors)
            if done:
                self._notify("units_finished", now, fragment_id=fid, round_id=round_id, units=done)
        else:
            for wid in contributors:
                self.units.not_applied(fid, wid)

    def _reconciled(self, submit: Submit, now: float, answer: str) -> None:
        """A submission for a round this coordinator never opened: the worker is ahead of its durable
        state (it got a Result a lost checkpoint held). SPEC.md section 12, "Reconciliation": the
        durable state wins; the answer (future_round or unknown_worker) makes the worker re-join and
        adopt the Welcome's params and round ids."""
        self.stats.reconciled += 1
        self._notify("reconciled", now, worker_id=submit.worker_id, fragment_id=submit.fragment_id,
                     round_id=submit.round_id, open_round=self.fsm.open_round_ids()[submit.fragment_id],
                     answer=answer)

    def _discard(self, effect: DiscardContribution) -> None:
        if self.collective is not None:
            return  # nothing of the pseudo-gradient is here
        self.units.not_applied(effect.fragment_id, effect.worker_id)
        if self._sync:
            # Discards happen only at a stop (P1), which discards the whole round.
            if self.store is not None:
                self.store.reset_sum(effect.fragment_id)
            self._summed.pop(effect.fragment_id, None)
            self._round_tokens.pop(effect.fragment_id, None)
        else:
            self._held.pop((effect.fragment_id, effect.worker_id), None)

    def _quorum_changed(self, effect: QuorumChanged | None, now: float) -> None:
        below = self.fsm.below_min_workers and not self.stopped
        formed = self.fsm.phase is not Phase.FORMING
        if below and formed and self.stats.paused_since_s is None:
            self.stats.paused_since_s = now
        elif (not below or self.stopped) and self.stats.paused_since_s is not None:
            self.stats.paused_s += now - self.stats.paused_since_s
            self.stats.paused_since_s = None
        if effect is not None:
            self._notify("quorum", now, below_min_workers=effect.below_min_workers,
                         live_workers=effect.live_workers, min_workers=effect.min_workers, reason=effect.reason)

    def _paused_total(self, now: float) -> float:
        extra = now - self.stats.paused_since_s if self.stats.paused_since_s is not None else 0.0
        return self.stats.paused_s + extra

    def _notify(self, what: str, now: float, **info) -> None:
        if self._observer is not None:
            self._observer(what, now, info)


def _held_state(join: Join) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The rounds and digests of the committed state a collective joiner offers (C6); () for none
    or initial params."""
    if not join.holds_params:
        return (), ()
    return tuple(join.held_rounds), tuple(join.held_digests)
