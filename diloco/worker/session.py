"""``WorkerSession``: the worker's side of the protocol, pure and deterministic.

(One state machine in one file, as ``diloco/core/round_fsm.py`` is: its rules
W1-W20 share one small state, and splitting them across files would make a
reader chase that state; hence over 400 lines: about 1,070 lines.)

How to read it. ``WorkerSession.__init__`` is the inventory of that state: every
field, grouped by the rule it serves, with its W-labels. Then come the queries,
``restore`` and the events, the public methods (one per event of SPEC.md section
14); ``on_message``, ``tick`` and ``step_done`` end in ``_settle``, which applies
what must follow any of them. The private methods sit in sections named by their
rules: W1 joining and W2 the Welcome; the schedule (W2's placement, W19's DyLU);
messages once welcomed; after every event (W4-W7) and the W9 resync; W11 outages;
W12, every part of the stop rule; W14, the one failure path; overlap (W15-W18);
plumbing, where ``_go`` is the one place the state moves, and so the one place
the fields a state owns (``OWNED_FIELDS``) are reset.

The coordinator has ``RoundFSM``; a worker has this. Events come in as data --
a decoded coordinator message, a clock reading, "finished an inner step", a
local stop request -- and each call returns the ``actions`` (``diloco.worker.actions``)
the driver must carry out, in order. No torch, sockets, clocks or threads
(import-linter contracts in pyproject.toml): tensors only pass through, as
opaque values inside messages and ``InstallParams``. The same session runs in
``DilocoWorker`` (real time, real model) and in the simulator (simulated time,
seeded tensors). SPEC.md section 14 is its contract: states, events, rules W1-W20.

Overlap (``overlap_steps`` T >= 1, Streaming DiLoCo's tau; W15-W18): a fragment
submitted at schedule step s does not stop training; its Result is merged at
step s + T (``MergeParams``: local <- alpha * local + (1 - alpha) * global, and
the global copy becomes the Result's params), or as soon as it arrives if the
worker already waits for it there. ``DEFAULT_OVERLAP_ALPHA`` = 0.5 is the
mixing factor of Douillard et al. 2025, "Streaming DiLoCo with overlapping
communication: Towards a Distributed Free Lunch" (arXiv:2501.18512), section
2.3. With T = 0 (the default) every rule is exactly as before.

DyLU (W19): a coordinator run with ``--dylu`` names in its ``Welcome`` and heartbeat
replies how many inner steps per round this worker should take (``sync_every``, H_w);
the session adopts it only at a period boundary (nothing outstanding, right after the
last fragment's close) by placing itself on the schedule again with H_w.

Time is whatever the caller says it is (``now``, seconds, never decreasing).
"""

from __future__ import annotations

import enum
import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Mapping, Sequence, TypeVar, cast

from diloco.collective.member import PlaneEvent, PlaneEventKind
from diloco.core.config import Mode
from diloco.core.reasons import ReleaseOutcome
from diloco.wire.messages import (
    PROTOCOL_VERSION,
    Accepted,
    Command,
    Error,
    ErrorCode,
    Heartbeat,
    HeartbeatReply,
    Join,
    Leave,
    Message,
    Result,
    Submit,
    TensorSpec,
    Welcome,
)
from diloco.worker import schedule
from diloco.worker.actions import (
    Action,
    Fail,
    InstallParams,
    MergeParams,
    Note,
    OutageReport,
    Send,
    SendJoinWithParams,
    StateChanged,
    Stop,
    SubmitFragment,
)
from diloco.worker.states import WorkerState

S = WorkerState

#: W10: error codes answered by joining again (the coordinator forgot us, or we fell behind; on the
#: collective plane, ``evicted``: the group found our contribution failing the checks, section 7c).
REJOIN_CODES = frozenset({ErrorCode.STALE_ROUND, ErrorCode.FUTURE_ROUND, ErrorCode.UNKNOWN_WORKER,
                          ErrorCode.EVICTED})
#: W8: error codes answered by submitting again a heartbeat interval later: ``held_limit`` (async,
#: the fragment's buffer is full) and, on the collective plane, ``reducing`` (a group without us
#: reduces the round: after its abort our ready is wanted for the next attempt; after its commit
#: the retry is ``stale_round``, and W10 joins again and heals). Joining again at once would
#: make every ready of a joiner meet the attempt its own heal delays: a loop of heals.
RETRY_CODES = frozenset({ErrorCode.HELD_LIMIT, ErrorCode.REDUCING})
#: W20: the collective plane's events that end the run for this worker.
PLANE_FAILURES = frozenset({PlaneEventKind.HEAL_FAILED, PlaneEventKind.NO_START_STATE})
#: W1, W12: error codes that end the run for this worker: the run is over.
STOP_CODES = frozenset({ErrorCode.STOPPED, ErrorCode.SHUTTING_DOWN})
#: W9: heartbeat intervals of unpaused waiting before a worker suspects a lost Result (doubles each time).
RESYNC_INTERVALS = 16
#: ... up to this many: a worker that waited out a long straggler must not then take hours to
#: notice a Result lost later (at the default 7.5 s interval, 256 intervals are 32 minutes).
RESYNC_MAX_INTERVALS = 256
#: W1: retries of a join answered ``already_member`` (Leave, then Join again).
ALREADY_MEMBER_RETRIES = 3
#: W11: default ``coordinator_timeout_s``, how long a silent coordinator is waited for (10 minutes).
DEFAULT_COORDINATOR_TIMEOUT_S = 600.0
#: W11: seconds of coordinator silence before the first "waiting" outage report ...
OUTAGE_NOTICE_S = 5.0
#: ... and between further reports while the silence lasts.
OUTAGE_REPORT_EVERY_S = 10.0
#: W1: a silent join is sent again after this long, then twice as long, ... (at most ``JOIN_RESEND_MAX_S``).
JOIN_RESEND_S = 2.5
JOIN_RESEND_MAX_S = 30.0
#: W3: heartbeat interval assumed before the first Welcome says the run's.
DEFAULT_HEARTBEAT_INTERVAL_S = 1.0
#: W12: how long a stop of unknown kind waits for the heartbeat reply that tells whether to save
#: (at most 4 heartbeat intervals).
ASK_SAVE_MAX_S = 1.0
#: W7: how many (inner_step, fragment, round, outcome) entries ``history`` keeps.
HISTORY_LIMIT = 10_000
#: Overlap (W15): local <- alpha * local + (1 - alpha) * global at a merge. 0.5 as in
#: Streaming DiLoCo (Douillard et al. 2025, arXiv:2501.18512, section 2.3).
DEFAULT_OVERLAP_ALPHA = 0.5

#: The fields each state owns, with the value each holds outside it: ``_go`` puts them back as it
#: leaves the state (the one place they are reset), so every entry into the state finds them so.
OWNED_FIELDS: Mapping[WorkerState, Mapping[str, object]] = {
    S.JOINING: {"_join_resend_s": JOIN_RESEND_S, "_already_member_retries": 0},  # W1: the join's resends
    S.WAITING: {"_waiting_since": None},  # W9: the wait's clock
    S.PAUSED: {"_paused_since": None},  # W6: when the pause began
    S.STOPPING: {"_ask_deadline": None, "_stopping_from_training": False},  # W12: the ask; W4: entered from TRAINING
}


def _valid_h(value: object) -> int | None:
    """A coordinator's H_w (W19) if it is an integer >= 1, else None (the decoder checks it on the wire)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return None
    return value


class SessionError(Exception):
    """The caller broke the session's contract (an event in a state that cannot take it)."""


E = TypeVar("E", bound=enum.Enum)


def _known(kind: type[E], value: object) -> E | None:
    """``value`` as a member of the enum ``kind`` (a command, an outcome, a code), or None for one
    this worker does not know."""
    try:
        return kind(value)
    except ValueError:
        return None


def error_code(code: object) -> ErrorCode | None:
    """``code`` as an ``ErrorCode``, or None for a code this worker does not know."""
    return _known(ErrorCode, code)


def code_value(code: object) -> str:
    """An enum member's value (an ``ErrorCode``, a ``Mode``, ...), or ``code`` as text (one not known here)."""
    return code.value if isinstance(code, enum.Enum) else str(code)


@dataclass(frozen=True, slots=True)
class StopCommand:
    """What the coordinator (or W11's giving up) said about stopping: the stop to carry out (W12).

    ``reason`` names the ``Stop`` (unless the session named one before); ``save`` is whether
    the driver writes the worker's checkpoint first, None while the stop's kind is unknown:
    the session then asks with one heartbeat. Once there is one the coordinator ended the run,
    so W13 sends no ``Leave``.
    """

    reason: str
    save: bool | None

    @property
    def kind_known(self) -> bool:
        return self.save is not None


def _check_config(worker_id: object, sync_every: object, coordinator_timeout_s: object, overlap_steps: object,
                  overlap_alpha: object) -> None:
    """``WorkerSession``'s arguments, or ``ValueError`` naming the first bad one."""
    if not isinstance(worker_id, str) or not worker_id:
        raise ValueError(f"worker_id={worker_id!r}: expected a non-empty string")
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise ValueError(f"sync_every={sync_every!r}: expected an integer >= 1 (inner steps per round)")
    if isinstance(coordinator_timeout_s, bool) or not isinstance(coordinator_timeout_s, (int, float)) \
            or not 0 < coordinator_timeout_s < math.inf:
        raise ValueError(f"coordinator_timeout_s={coordinator_timeout_s!r}: expected a finite number of "
                         f"seconds > 0")
    if isinstance(overlap_steps, bool) or not isinstance(overlap_steps, int) or overlap_steps < 0:
        raise ValueError(f"overlap_steps={overlap_steps!r}: expected an integer >= 0 (0: no overlap)")
    if overlap_steps >= sync_every:
        raise ValueError(f"overlap_steps={overlap_steps} must be less than sync_every={sync_every}: a fragment "
                         f"syncs every {sync_every} inner steps, so its Result must be merged before its next "
                         f"sync point (W15)")
    if isinstance(overlap_alpha, bool) or not isinstance(overlap_alpha, (int, float)) \
            or not 0 <= overlap_alpha < 1:
        raise ValueError(f"overlap_alpha={overlap_alpha!r}: expected a number with 0 <= alpha < 1 (the weight of "
                         f"the local params at a merge; 0 replaces them with the global ones)")


class WorkerSession:
    """One worker's protocol state. See the module docstring and SPEC.md section 14.

    ``__init__`` is the inventory of that state: every field the session keeps, grouped by
    the rule it serves, with its W-labels (SPEC.md section 14). Public fields are read by
    drivers, status and tests; underscored ones are the rules' own bookkeeping. No field is
    added anywhere else, and the fields a state owns (``OWNED_FIELDS``) are reset only by ``_go``.
    """

    def __init__(self, worker_id: str, sync_every: int, spec: Sequence[TensorSpec], *,
                 coordinator_timeout_s: float = DEFAULT_COORDINATOR_TIMEOUT_S, overlap_steps: int = 0,
                 overlap_alpha: float = DEFAULT_OVERLAP_ALPHA) -> None:
        _check_config(worker_id, sync_every, coordinator_timeout_s, overlap_steps, overlap_alpha)

        # -- configuration: fixed for the session's life
        #: Names this worker in Join (W1), Heartbeat (W3) and Leave (W9, W13).
        self.worker_id = worker_id
        #: The model's parameters: the Join's (W1); a Welcome must name each exactly once (W2).
        self.spec: tuple[TensorSpec, ...] = tuple(spec)
        if not self.spec:
            raise ValueError("the model has no parameters to train")
        #: W2: the parameter names a Welcome's fragments must cover.
        self._names = frozenset(s.name for s in self.spec)
        #: W11: how long a silent coordinator is waited for before giving up.
        self.coordinator_timeout_s = float(coordinator_timeout_s)
        #: W15: T, the steps a submitted fragment trains on before its Result is merged (0: no overlap).
        self.overlap_steps = overlap_steps
        #: W16: a merge's weight of the local params.
        self.overlap_alpha = float(overlap_alpha)
        #: W19: the worker's own H (``--sync-every``): in force again when the coordinator names none.
        self.own_sync_every = sync_every

        # -- where the session is (SPEC.md section 14, "States")
        #: A ``WorkerState`` of ``SESSION_STATES``; None until ``start``. Moves only through ``_go``.
        self.state: WorkerState | None = None
        #: Why the worker stopped (W12 "stop", "save_and_stop", "stop_requested", W7 "drain", W1 "run
        #: stopped before join: ...", W11 "coordinator_unreachable", W13 "left", W14 "error: CODE");
        #: the first one named stays.
        self.stop_reason: str | None = None
        #: W2: a Welcome was taken (its keep_if_same; W11 saves on giving up; W13 sends Leave).
        self.welcomed = False
        #: ``restore`` took a checkpoint's schedule (W2 keep_if_same, W11 saves on giving up).
        self.restored = False

        # -- the run, as the last Welcome (W2) or heartbeat reply (W6, W19) told it
        #: "sync" or "async" (a ``Mode`` value): how the schedule moves on (W2, W7).
        self.mode: str | None = None
        #: W2, W6: the run's quorum (read by status; the pause goes by ``below_min_workers``).
        self.min_workers: int | None = None
        #: W6: the run is below ``min_workers`` (a pause at the sync point, once fresh).
        self.below_min_workers = False
        #: W3: the run's heartbeat interval; W8's retry, W9's resync delay and W12's ask count in it.
        self.heartbeat_interval_s = DEFAULT_HEARTBEAT_INTERVAL_S
        #: W2: the parameter names of each fragment, in fragment order.
        self.fragments: tuple[tuple[str, ...], ...] = ()
        #: Data work units (SPEC.md section 12, U1-U5): units per epoch (None: the run hands out none),
        #: from the Welcome taken ...
        self.units_per_epoch: int | None = None
        #: ... and the unit held (``epoch * units + index``), from it, then each Result naming one; a
        #: Join names it, to keep its data across a re-join (U4).
        self.unit: int | None = None

        # -- the schedule (W2, W4, W7, W19; SPEC.md section 14, "Schedule")
        #: H in force: the worker's own until a DyLU coordinator's H_w is adopted (W19).
        self.sync_every = sync_every
        #: W19: the H_w the coordinator named last (None: it names none).
        self.target_sync_every: int | None = None
        #: W19: schedule step of the last period boundary (the last fragment's submission, or a
        #: placement by a Welcome); None when unknown (restored, or the period's H_w adopted).
        self._boundary_step: int | None = None
        #: W2, W7: per fragment, the round it contributes to next (sync) or its base version (async).
        self.round_ids: list[int] = []
        #: W4, W7: per fragment, the schedule step at which it closes next.
        self.next_close: list[int] = []
        #: W4: steps trained on the schedule (in TRAINING) ...
        self.sched_step = 0
        #: ... and every inner step taken (restored from a checkpoint), in any state but STOPPED.
        self.inner_step = 0
        #: W7: rounds (fragment syncs) whose Result this worker applied.
        self.rounds_synced = 0
        #: W7: (inner_step, fragment_id, round_id, outcome) per released contribution, newest last.
        self.history: deque[tuple[int, int, int, str]] = deque(maxlen=HISTORY_LIMIT)

        # -- contributions (W4, W5, W7, W8, W10)
        #: W4, W5, W7: fragment -> round of a contribution submitted or parked whose Result is awaited.
        self.waiting: dict[int, int] = {}
        #: W8: fragment -> time to submit again (answered ``held_limit``).
        self.retry_at: dict[int, float] = {}
        #: W8: fragments of the Submits not answered yet, in order (an Error names no fragment).
        self._unacked: deque[int] = deque()
        #: W6, W8: (fragment, round) of the latest Submit: its Accepted shows every earlier heartbeat
        #: and Submit answered or lost (no stale reply is skipped after it, no Submit waits for an answer).
        self._last_submit: tuple[int, int] | None = None
        #: W10: join again at the end of this event (a ``rejoin`` command, or a Submit refused so).
        self._rejoin_needed = False

        # -- overlap (W15-W18)
        #: W15, W16: fragment -> the schedule step at which its Result is merged, from its
        #: submission until the merge (awaited or held).
        self.merge_at: dict[int, int] = {}
        #: W16, W17: fragment -> the params of its applied Result, held until ``merge_at``.
        self.held: dict[int, Mapping[str, Any]] = {}

        # -- heartbeats and the quorum at the sync point (W3, W6)
        #: W3: when the last Heartbeat went out (the Welcome counts as one).
        self._last_hb_sent = -math.inf
        #: W3: heartbeats whose reply has not come (``awaiting_replies``).
        self._hb_outstanding = 0
        #: W6: replies still due to heartbeats sent before the current wait began: they say
        #: nothing about the quorum *at* the sync point, so they never pause the worker.
        self._stale_replies = 0
        #: W6: a reply (or the Welcome) has spoken of the quorum since the current wait began.
        self._quorum_fresh = False
        #: W6: when the current pause began (set exactly while PAUSED, by ``_go``) ...
        self._paused_since: float | None = None
        #: ... and the time spent PAUSED, added up when each pause ends.
        self.seconds_paused = 0.0

        # -- joining (W1)
        #: When the last Join went out.
        self._last_join = -math.inf
        #: The delay before an unanswered Join is sent again (2.5 s, doubling up to 30 s).
        self._join_resend_s = JOIN_RESEND_S
        #: ``already_member`` answers taken in this join (Leave, then Join again; at most 3).
        self._already_member_retries = 0

        # -- resync after a lost Result (W9)
        #: Start of the current unpaused wait, from its first tick; None: not waiting (or restarted).
        self._waiting_since: float | None = None
        #: How long a wait lasts before the resync: 16 intervals, doubling up to 256.
        self._resync_after_s = math.inf

        # -- a silent coordinator (W11)
        #: When the first message sent since the coordinator last spoke went out (None: nothing unanswered).
        self._unanswered_since: float | None = None
        #: "waiting" reports made in the current silence.
        self._outage_reports = 0

        # -- stopping and leaving (W4, W12, W13)
        #: W12: what the coordinator (or W11's giving up) said about stopping; W13: no Leave once set.
        self._stop_cmd: StopCommand | None = None
        #: W12: while an ask is open, when it ends without a reply (None: no ask, or its Stop emitted).
        self._ask_deadline: float | None = None
        #: W4: STOPPING was entered from TRAINING (a step that finishes now still moves the schedule).
        self._stopping_from_training = False
        #: W13: ``leave`` was called (it acts once).
        self._left = False

        #: The actions of the event being handled, in order (``_flush`` hands them over).
        self._out: list[Action] = []

    # ------------------------------------------------------------------ queries

    @property
    def may_train(self) -> bool:
        """True when the driver may run the next inner step."""
        return self.state is S.TRAINING

    @property
    def stopped(self) -> bool:
        return self.state in (S.STOPPING, S.STOPPED)

    @property
    def blocked(self) -> bool:
        """True when the worker must not train: a retry is due, or an awaited Result is past its window (W5, W16)."""
        return bool(self.retry_at) or any(self.merge_at.get(f, -1) <= self.sched_step for f in self.waiting)

    @property
    def awaiting_replies(self) -> bool:
        """True while a heartbeat's reply is due (a driver without a receive thread reads then)."""
        return self._hb_outstanding > 0

    def due(self, now: float) -> list[int]:
        """Fragments whose close the schedule has reached and that are not waiting, merging or retrying yet."""
        out = []
        for f, close in enumerate(self.next_close):
            if f in self.waiting or f in self.merge_at or self.sched_step < close:
                continue
            retry = self.retry_at.get(f)
            if retry is not None and now < retry:
                continue
            out.append(f)
        return out

    def silence(self, now: float, transport_silence_s: float | None = None) -> float:
        """Seconds the coordinator has left this worker's messages unanswered (0 when nothing is).

        ``transport_silence_s`` (ZeroMQ: time since the last message *part* arrived) caps it,
        so a large Welcome or Result still arriving does not count as silence.
        """
        if self._unanswered_since is None:
            return 0.0
        s = max(0.0, now - self._unanswered_since)
        return s if transport_silence_s is None else min(s, max(0.0, transport_silence_s))

    def waiting_for(self) -> str:
        """What the worker is waiting for from the coordinator (outage reports)."""
        if self.state is S.JOINING:
            return "a Welcome (joining)"
        if self.waiting:
            rounds = ", ".join(f"fragment {f} round {r}" for f, r in sorted(self.waiting.items()))
            paused = " (paused: the run was below quorum)" if self.state is S.PAUSED else ""
            return f"the Result for {rounds}{paused}"
        return "heartbeat replies"

    # ------------------------------------------------------------------ restore

    def restore(self, *, fragments: Sequence[Sequence[str]], round_ids: Sequence[int], next_close: Sequence[int],
                sched_step: int, inner_step: int, rounds_synced: int, mode: str | None) -> None:
        """Take the schedule saved in the worker's checkpoint (before ``start``)."""
        if self.state is not None:
            raise SessionError("restore() after start()")
        self.fragments = tuple(tuple(f) for f in fragments)
        self.round_ids = [int(r) for r in round_ids]
        self.next_close = [int(c) for c in next_close]
        self.sched_step = int(sched_step)
        self.inner_step = int(inner_step)
        self.rounds_synced = int(rounds_synced)
        self.mode = mode
        self.restored = True

    # ------------------------------------------------------------------ events

    def start(self, now: float) -> list[Action]:
        """Join the run (W1)."""
        if self.state is not None:
            raise SessionError(f"start() in state {self.state.value}")
        self._join(now)
        return self._flush()

    def on_message(self, msg: Message, now: float) -> list[Action]:
        """A decoded message from the coordinator."""
        if self.state is None or self.state is S.STOPPED:
            return []
        if isinstance(msg, PlaneEvent):
            self._on_plane_event(msg, now)
            self._settle(now)
            return self._flush()
        self._heard(now)
        if isinstance(msg, Result) and msg.unit is not None:
            self.unit = msg.unit  # the next round's data, whatever the Result is taken for
        if self.state is S.JOINING:
            self._on_message_joining(msg, now)
        elif isinstance(msg, HeartbeatReply):
            self._on_heartbeat_reply(msg, now)
        elif isinstance(msg, Result):
            self._on_result(msg, now)
        elif isinstance(msg, Accepted):
            self._on_accepted(msg)
        elif isinstance(msg, Error):
            self._on_error(msg, now)
        else:
            self._note("debug", f"ignoring an unexpected {type(msg).__name__}")
        self._settle(now)
        return self._flush()

    def tick(self, now: float, transport_silence_s: float | None = None, *, sending: bool = False,
             receiving: bool = False) -> list[Action]:
        """Time passed: join resends (W1), heartbeats (W3), held-limit retries (W8), resyncs (W9), outage
        reports (W11), the end of an unanswered ask (W12).

        ``sending`` / ``receiving``: the transport is still moving a message to / from the
        coordinator part by part (a big Submit or Result on a slow link). Meanwhile a joining
        worker heartbeats instead of sending its Join again (its Welcome may take longer than
        the heartbeat timeout to arrive), and no resync runs (W9: the Result is not lost, it
        is on its way).
        """
        state = self.state
        if state is None or state is S.STOPPED:
            return []
        if state is S.STOPPING:
            self._ask_timed_out(now)  # W12
            return self._flush()
        silence = self.silence(now, transport_silence_s)
        if state is S.JOINING:
            if not self._outage(now, silence):  # W11
                self._tick_joining(now, sending or receiving)  # W1, W3
            return self._flush()
        if now - self._last_hb_sent >= self.heartbeat_interval_s:
            self._heartbeat(now)
        if self._outage(now, silence):
            return self._flush()
        if self.state is S.WAITING:
            self._maybe_resync(now, silence, sending or receiving)
        self._settle(now)
        return self._flush()

    def step_done(self, now: float) -> list[Action]:
        """The driver finished one inner step (W4).

        Counts it; in TRAINING it advances the schedule and, at a sync point, submits
        every due fragment. A step finished in another state (a re-join arrived while it
        ran) is counted but does not move the schedule: its base is being replaced.
        """
        state = self.state
        if state is None:
            raise SessionError("step_done() before start()")
        if state is S.STOPPED:
            return []
        # A step that ran while a stop was arriving still happened: the checkpoint the
        # stop may write holds its effect, so it counts, on the schedule too if it trained.
        self.inner_step += 1
        if state is S.TRAINING or (state is S.STOPPING and self._stopping_from_training):
            self.sched_step += 1
        self._settle(now)
        return self._flush()

    def request_stop(self, now: float, save: bool = False) -> list[Action]:
        """Stop at once, from any state, breaking a pause (W12); save the checkpoint if ``save``."""
        if not self.stopped or (self.state is S.STOPPING and self._ask_deadline is not None):
            self._finish("stop_requested", save=save, now=now)  # before start too: STOPPING, then Stop
        return self._flush()

    def leave(self, now: float) -> list[Action]:
        """The driver is leaving the run (W13): Leave, unless the coordinator ended it; then STOPPED."""
        if self._left:
            return []
        self._left = True
        if self.state is not S.STOPPED:
            self._merge_all()  # W17: the model the driver keeps holds every Result it received
        if self.welcomed and self._stop_cmd is None:
            # Told nothing by the coordinator (local stop, end of data, an error): say so at
            # once rather than let the heartbeat timeout find out.
            self._out.append(Send(Leave(self.worker_id)))
        self.stop_reason = self.stop_reason or "left"
        self._go(S.STOPPED, now)
        return self._flush()

    def stopped_done(self, now: float) -> list[Action]:
        """The driver carried out ``Stop`` (checkpoint written if asked): STOPPED (W12; not during an ask)."""
        if self.state is S.STOPPING and self._ask_deadline is None:
            self._go(S.STOPPED, now)
        return self._flush()

    def fail(self, code: str, detail: str, now: float) -> list[Action]:
        """The driver hit an error it cannot go on from (transport, bad params): STOPPED (W14).

        No ``Fail`` action: the driver knows. The same path as the session's own failures (``_fail``).
        """
        if self.state is not S.STOPPED:
            self._fail(code, detail, now, tell_driver=False)
        return self._flush()

    # ------------------------------------------------------------------ W1 joining, W2 the Welcome

    def _join(self, now: float) -> None:
        """W1: join (``start``), or join again (W9 resync, W10 rejoin): JOINING, a new ``Join``.

        Held Results are merged first (W17: a Welcome of the same params then keeps the local
        model); a new join finds its resend delay at ``JOIN_RESEND_S`` and its ``already_member``
        retries at 0 (JOINING's own fields: ``OWNED_FIELDS``).
        """
        self._merge_all()
        self._go(S.JOINING, now)
        self._send_join(now)

    def _send_join(self, now: float) -> None:
        """W1: send ``Join(worker_id, PROTOCOL_VERSION, spec)``, no params, naming the data unit held (a
        re-join asks to keep it, SPEC.md U4): the one place a Join is built."""
        self._send(Join(self.worker_id, PROTOCOL_VERSION, self.spec, unit=self.unit), now)
        self._last_join = now

    def _tick_joining(self, now: float, busy: bool) -> None:
        """W1: send an unanswered Join again (2.5 s, 5, 10, 20, 30, 30, ... s), unless a message is
        still moving (``busy``): then heartbeat (W3)."""
        if busy:
            # Our Join (with params) or the Welcome is still crossing, part by part. The
            # coordinator may count us a member already: heartbeat (before it does, it answers
            # rejoin, ignored here); a Join sent again would only be answered already_member.
            if now - self._last_hb_sent >= self.heartbeat_interval_s:
                self._heartbeat(now)
        elif self._unanswered_since is not None and \
                now - max(self._last_join, self._unanswered_since) >= self._join_resend_s:
            # A Join can be lost with a connection that died under it (a duplicate is
            # answered already_member after the Welcome, and ignored).
            self._send_join(now)
            self._join_resend_s = min(2 * self._join_resend_s, JOIN_RESEND_MAX_S)

    def _on_message_joining(self, msg: Message, now: float) -> None:
        if isinstance(msg, Welcome):
            self._on_welcome(msg, now)
            return
        if isinstance(msg, Error) and msg.in_reply_to in (Join.__name__, ""):
            code = error_code(msg.code)
            if code in STOP_CODES:
                self._stop_cmd = StopCommand(code.value, save=False)
                self._finish(f"run {code.value} before join: {msg.detail}", save=False, now=now)
            elif code in (ErrorCode.PARAMS_REQUIRED, ErrorCode.START_PARAMS_REQUIRED):
                # The run has no params yet: the first joiner's become the run's (SPEC.md section 11);
                # on the collective plane they stay on this worker (C6, M5).
                self._out.append(SendJoinWithParams())
                self._unanswered_since = now
            elif code is ErrorCode.ALREADY_MEMBER and self._already_member_retries < ALREADY_MEMBER_RETRIES:
                # The coordinator still counts us on this connection (a duplicate join):
                # leave (our pending contributions stay, P1) and join again.
                self._already_member_retries += 1
                self._send(Leave(self.worker_id), now)
                self._send_join(now)
            else:
                self._fail(code_value(msg.code), f"the coordinator refused the join ({code_value(msg.code)}): "
                                                 f"{msg.detail}", now)
            return
        # Anything else answers something sent before this join: the Welcome supersedes it.
        # The Join itself is still unanswered.
        if self._unanswered_since is None:
            self._unanswered_since = now

    def _on_welcome(self, msg: Welcome, now: float) -> None:
        fragments = tuple(tuple(f) for f in msg.fragments)
        names = [n for f in fragments for n in f]
        if len(names) != len(self._names) or set(names) != self._names or len(msg.round_ids) != len(fragments):
            self._fail("bad_welcome", f"the Welcome's fragments do not cover this model's parameters exactly "
                                      f"({len(names)} names for {len(self._names)} parameters)", now)
            return
        same_layout = (self.welcomed or self.restored) and fragments == self.fragments
        ids_same = same_layout and [int(r) for r in msg.round_ids] == self.round_ids
        for fid, frag in enumerate(fragments):
            self._out.append(InstallParams(fid, frag, msg.params, same_layout, "Welcome"))
        self.fragments = fragments
        self.round_ids = [int(r) for r in msg.round_ids]
        self.mode = code_value(msg.mode)
        self.min_workers = msg.min_workers
        self.below_min_workers = bool(msg.below_min_workers)
        self.heartbeat_interval_s = float(msg.heartbeat_interval_s)
        self.target_sync_every = _valid_h(msg.sync_every)
        self.units_per_epoch, self.unit = msg.data_units, msg.unit
        self._place_on_schedule(ids_same, same_layout)
        # W2: the Welcome replaces what was in flight, which a join keeps until now (W10): no state's own.
        self.waiting = {int(f): int(r) for f, r in msg.parked}
        self.merge_at.clear()  # W18: a parked contribution has no overlap window (nothing is held: W17)
        self._unacked.clear()
        self.retry_at.clear()
        self._last_hb_sent = now
        self._hb_outstanding = 0
        self._stale_replies = 0
        self._quorum_fresh = True
        if not self.welcomed:
            self._resync_after_s = RESYNC_INTERVALS * self.heartbeat_interval_s
        self.welcomed = True
        self._note("info", f"joined: mode={self.mode} round_ids={self.round_ids} parked={sorted(self.waiting.items())}")
        # (With overlap a due fragment is submitted from TRAINING: W15.)
        self._go(S.WAITING if self.waiting or (self.due(now) and not self.overlap_steps) else S.TRAINING, now)

    # ------------------------------------------------------------------ the schedule: W2 placement, W19 DyLU

    def _place_on_schedule(self, ids_same: bool, same_layout: bool) -> None:
        """W2: place the worker on the run's schedule (sync: from the round ids; async: from its own
        start), or keep its own when the layout (and, sync, the round ids) are the ones it had."""
        F = len(self.fragments)
        if self.mode == Mode.SYNC:
            if ids_same and len(self.next_close) == F:
                return  # our own schedule is consistent with the run's rounds: keep it (W19: H_w waits)
            self.sync_every = self._wanted_sync_every()  # a placement is a period boundary (W19)
            self.next_close, self.sched_step = schedule.sync_place(self.round_ids, self.sync_every)
            self._boundary_step = self.sched_step
        elif not (same_layout and len(self.next_close) == F):
            self.sync_every = self._wanted_sync_every()
            self.next_close = schedule.async_place(self.sched_step, F, self.sync_every)
            self._boundary_step = self.sched_step

    def _wanted_sync_every(self) -> int:
        """W19: the coordinator's H_w (else the worker's own H), at least ``overlap_steps + 1`` (W15)."""
        h = self.target_sync_every if self.target_sync_every is not None else self.own_sync_every
        return max(h, self.overlap_steps + 1)

    def _adopt_sync_every(self) -> None:
        """W19: at a period boundary, take the H the coordinator names by placing the schedule again.

        A boundary: nothing waiting, held, merging or to be retried, and no step trained on
        the schedule since the last fragment's submission (with overlap, at most T: the
        window just ended). Sync: the closes follow from the round ids with the new H
        (``schedule.sync_place``), so the order in which fragments close -- by (round,
        fragment), whatever H -- is the same for every member; async: counted from the
        boundary. The steps trained since the boundary (overlap) still count.
        """
        base = self._boundary_step
        if base is None or self.waiting or self.held or self.merge_at or self.retry_at:
            return
        progress = self.sched_step - base
        if not 0 <= progress <= self.overlap_steps:
            return
        h = self._wanted_sync_every()
        if h == self.sync_every and self.target_sync_every is None:
            return  # not a DyLU run (or no longer one, and already back at the worker's own H)
        old = self.sync_every
        self.sync_every = h
        if self.mode == Mode.SYNC:
            self.next_close, placed = schedule.sync_place(self.round_ids, h)
            self.sched_step = placed + progress
        else:
            self.next_close = schedule.async_place(base, len(self.fragments), h)
        self._boundary_step = None
        if h != old:
            self._note("info", f"DyLU: {h} inner steps per round from now on (was {old})")

    # ------------------------------------------------------------------ messages once welcomed (W6-W8, W10, W12, W14)

    def _on_heartbeat_reply(self, msg: HeartbeatReply, now: float) -> None:
        self._hb_outstanding = max(0, self._hb_outstanding - 1)
        if self._stale_replies:
            self._stale_replies -= 1
        else:
            self._quorum_fresh = True
        self.below_min_workers = bool(msg.below_min_workers)
        self.min_workers = msg.min_workers
        command = _known(Command, msg.command)
        if command is Command.CONTINUE:
            self.target_sync_every = _valid_h(msg.sync_every)  # W19: adopted at a boundary
        if self.state is S.STOPPING:
            self._ask_answered(command, now)  # W12
        elif command is Command.REJOIN:
            self._rejoin_needed = True  # W10
        elif command in (Command.STOP, Command.SAVE_AND_STOP):
            self._heard_stop(command)  # W12

    def _on_accepted(self, msg: Accepted) -> None:
        """A Submit kept (W8: it is answered); the latest one's also settles W6's stale replies."""
        if msg.fragment_id in self._unacked:
            self._unacked.remove(msg.fragment_id)
        if (msg.fragment_id, msg.round_id) == self._last_submit:
            # The latest Submit's answer. On this FIFO connection every heartbeat sent before
            # that Submit has been answered by now or was lost with the link: replies still
            # counted stale will never come (W6 would ignore as many fresh ones, in every wait
            # to come), and Submits still unanswered lost their answers.
            self._hb_outstanding -= self._stale_replies
            self._stale_replies = 0
            self._unacked.clear()

    def _on_result(self, msg: Result, now: float) -> None:
        fid = msg.fragment_id
        if self.waiting.get(fid) != msg.round_id:
            self._note("debug", f"ignoring a stale Result for fragment {fid} round {msg.round_id}")
            return
        outcome = _known(ReleaseOutcome, msg.outcome)
        if outcome is None:
            self._fail(ErrorCode.BAD_MESSAGE.value, f"Result with unknown outcome {code_value(msg.outcome)!r}",
                       now)  # W14
            return
        if fid in self._unacked:
            # The Result answers its Submit too (its Accepted was lost): a later Error must not
            # be taken for this fragment's (W8: a retry while TRAINING would break W5).
            self._unacked.remove(fid)
        if outcome is not ReleaseOutcome.STOP:  # W7: applied or applied_final
            del self.waiting[fid]
            if fid in self.merge_at:
                # W16: held until its window ends (merged by _settle), at once while stopping.
                self.held[fid] = msg.params
                if self.state is S.STOPPING:
                    self._merge(fid)
            else:
                self._out.append(InstallParams(fid, self.fragments[fid], msg.params, False, "Result"))
            self.round_ids[fid] = int(msg.next_round_id)
            self.next_close[fid] = schedule.next_close_after(
                fid, int(msg.next_round_id), self.next_close[fid], len(self.fragments), self.sync_every,
                self.mode == Mode.SYNC)
            self.rounds_synced += 1
            self._waiting_since = None  # W9: a release restarts the wait's clock (WAITING may go on)
            self._resync_after_s = RESYNC_INTERVALS * self.heartbeat_interval_s
            self.history.append((self.inner_step, fid, msg.round_id, outcome.value))
            if outcome is ReleaseOutcome.APPLIED_FINAL:
                self._heard_stop(outcome)  # W7: the drain ends the run
        else:
            del self.waiting[fid]
            self.merge_at.pop(fid, None)  # W16: the window ends without a merge
            self.history.append((self.inner_step, fid, msg.round_id, outcome.value))
            self._heard_stop(outcome)  # W12

    def _on_plane_event(self, event: PlaneEvent, now: float) -> None:
        """W20: what the collective plane tells the session (``diloco.collective.member``)."""
        if event.kind is PlaneEventKind.LOST_TRACK:
            if self.state is not S.JOINING:
                self._note("info", f"{event.detail}")
                self._rejoin_needed = True
        elif event.kind in PLANE_FAILURES:
            self._fail(event.kind.value, event.detail, now)
        else:
            self._note("warning", event.detail)

    def _on_error(self, msg: Error, now: float) -> None:
        code = error_code(msg.code)
        if msg.in_reply_to == Submit.__name__:
            fid = self._unacked.popleft() if self._unacked else None
            if code in REJOIN_CODES:
                self._note("info", f"submission refused ({code.value}: {msg.detail}); joining again")
                self._rejoin_needed = True
            elif code is ErrorCode.DUPLICATE:
                pass  # it is already pending: its Result will come (P1)
            elif code in RETRY_CODES and fid is not None:
                self.waiting.pop(fid, None)
                self.merge_at.pop(fid, None)  # not submitted any more: its retry opens a new window
                self.retry_at[fid] = now + self.heartbeat_interval_s
            elif code in STOP_CODES:
                self._heard_stop(code)  # W12
            else:
                self._fail(code_value(msg.code),
                           f"submission refused ({code_value(msg.code)}): {msg.detail}", now)
        elif msg.in_reply_to == Heartbeat.__name__:
            if code in STOP_CODES:
                self._heard_stop(code)  # W12
            else:
                self._note("warning", f"heartbeat refused ({code_value(msg.code)}): {msg.detail}")
        else:
            self._note("debug", f"ignoring a stale error ({code_value(msg.code)} in reply to {msg.in_reply_to})")

    # ------------------------------------------------------------------ after every event (W4-W7), W9 resync

    def _settle(self, now: float) -> None:
        """After any event (but in STOPPING and STOPPED), in this order: carry out a stop (W12) or a
        re-join (W10); then, out of JOINING, merge the held Results whose window ended (W16), adopt
        a DyLU H at a period boundary (W19), submit what is due (W4, W15), and train (W5, W7),
        wait (W16: a window ended before its Result came) or pause and resume (W6)."""
        if self.state in (S.STOPPING, S.STOPPED, None):
            return
        if self._stop_cmd is not None:
            self._carry_out_stop(now)  # W12
            return
        if self._rejoin_needed:
            self._rejoin_needed = False
            self._join(now)  # W10
            return
        if self.state is S.JOINING:
            return
        for f in sorted(self.held):
            if self.sched_step >= self.merge_at[f]:
                self._merge(f)  # W16: its window ended (merged before anything is submitted)
        self._adopt_sync_every()  # W19: only at a period boundary
        due = self.due(now)
        if due:
            for f in due:
                self._submit(f, now)
        blocked = self.blocked
        if self.state is S.TRAINING:
            if not blocked:
                return
            self._go(S.WAITING, now)  # W16: the window ended before the Result came
        if not blocked:
            self._go(S.TRAINING, now)  # W7: nothing outstanding (a pause ends here too)
            return
        self._go(S.PAUSED if self.below_min_workers and self._quorum_fresh else S.WAITING, now)  # W6

    def _submit(self, fid: int, now: float) -> None:
        """W4: ``SubmitFragment`` then a ``Heartbeat``; wait for its Result (WAITING, or W15's window)."""
        rid = self.round_ids[fid]
        self.retry_at.pop(fid, None)
        if self.overlap_steps:
            self.merge_at[fid] = self.sched_step + self.overlap_steps  # W15: train on until then
        elif self.state is S.TRAINING:
            self._go(S.WAITING, now)
        self._out.append(SubmitFragment(fid, rid))
        if fid == len(self.fragments) - 1:
            self._boundary_step = self.sched_step  # W19: the period's last close
        self.waiting[fid] = rid
        self._unacked.append(fid)
        self._last_submit = (fid, rid)
        # Learn the quorum now rather than an interval later (a pause shows at once);
        # until that reply, what earlier replies said does not pause the worker (W6).
        self._stale_replies = self._hb_outstanding
        self._quorum_fresh = False
        self._heartbeat(now)

    def _maybe_resync(self, now: float, silence: float, busy: bool = False) -> bool:
        """A Result lost in transit: after a long unpaused wait, leave and join again (W9).

        A transport may drop a message (ZeroMQ drops what a ROUTER sends to a peer that is
        reconnecting), and nothing else would tell a worker whose Result was lost: its
        heartbeats are answered, the run is not paused, it just waits. Leaving and joining
        again is safe (SPEC.md P1: an accepted contribution stays pending and the Welcome
        parks the worker on it; if it already applied, the Welcome brings the new params).
        Waiting for slow peers is normal, so the first resync comes after
        ``RESYNC_INTERVALS`` heartbeat intervals and the delay doubles each time, up to
        ``RESYNC_MAX_INTERVALS``. ``busy``: a message still going out or coming in part by
        part (the Submit, or the Result itself, crossing a slow link) restarts the wait too.
        """
        if not self.waiting or busy or silence > 2 * self.heartbeat_interval_s:
            # Still WAITING, but no Result is lost: a retry due, a message on its way, or an outage.
            self._waiting_since = None
            return False
        if self._waiting_since is None:
            self._waiting_since = now
            return False
        if now - self._waiting_since < self._resync_after_s:
            return False
        self._note("warning", f"no Result for {dict(self.waiting)} after {now - self._waiting_since:.1f} s at the "
                              f"sync point; leaving and joining again")
        self._resync_after_s = min(2 * self._resync_after_s, RESYNC_MAX_INTERVALS * self.heartbeat_interval_s)
        self._send(Leave(self.worker_id), now)
        self._join(now)
        return True

    # ------------------------------------------------------------------ W11: a silent coordinator

    def _outage(self, now: float, silence: float) -> bool:
        """Report a silent coordinator every so often; give up at the limit (W11). True when given up."""
        if silence >= self.coordinator_timeout_s:
            what = self.waiting_for()
            save = self.welcomed or self.restored
            self._out.append(OutageReport("gave_up", silence, what, self.coordinator_timeout_s))
            self._stop_cmd = StopCommand("coordinator_unreachable", save)
            self._finish("coordinator_unreachable", save=save, now=now)
            return True
        if silence < OUTAGE_NOTICE_S:
            return False
        due = OUTAGE_NOTICE_S + self._outage_reports * OUTAGE_REPORT_EVERY_S
        if silence >= due:
            self._outage_reports = int((silence - OUTAGE_NOTICE_S) // OUTAGE_REPORT_EVERY_S) + 1
            self._out.append(OutageReport("waiting", silence, self.waiting_for(), self.coordinator_timeout_s))
        return False

    def _heard(self, now: float) -> None:
        """W11: a message arrived: the silence ends ("back" if it was reported)."""
        if self._outage_reports:
            waited = now - self._unanswered_since if self._unanswered_since is not None else 0.0
            self._out.append(OutageReport("back", waited, self.waiting_for(), self.coordinator_timeout_s))
        self._unanswered_since = None
        self._outage_reports = 0

    # ------------------------------------------------------------------ W12: stopping
    #
    # Every part of the stop rule is here. The coordinator's word about stopping, whatever
    # carries it (a heartbeat reply's command, a Result, an Error), becomes ``_stop_cmd``
    # (``_heard_stop``); after the event ``_settle`` carries it out (``_carry_out_stop``):
    # at once when its kind is known, else by asking with one heartbeat, whose reply
    # (``_ask_answered``) or a tick at the ask's deadline (``_ask_timed_out``) decides.
    # ``_finish`` emits the one ``Stop``. Elsewhere only: ``request_stop`` and
    # ``stopped_done`` (events), a refused join (W1) and giving up (W11) set a known kind.

    def _heard_stop(self, word: Command | ReleaseOutcome | ErrorCode) -> None:
        """W12: what the coordinator said about stopping becomes the stop command.

        ``save_and_stop``: save, then stop. ``stop`` (a reply sent after the stop): its kind is
        known, nothing to save; a stop of unknown kind keeps its reason. ``applied_final``
        (W7): drain, no save. A ``Result`` with outcome ``stop``, or a ``stopped`` or
        ``shutting_down`` error: a stop of unknown kind (to ask about), unless a stop was told already.
        """
        if word is Command.SAVE_AND_STOP:
            self._stop_cmd = StopCommand("save_and_stop", save=True)
        elif word is Command.STOP:
            if self._stop_cmd is None or not self._stop_cmd.kind_known:
                self._stop_cmd = StopCommand(self._stop_reason(), save=False)
        elif word is ReleaseOutcome.APPLIED_FINAL:
            self._stop_cmd = StopCommand("drain", save=False)
        elif self._stop_cmd is None:  # ReleaseOutcome.STOP, ErrorCode.STOPPED, ErrorCode.SHUTTING_DOWN
            self._stop_cmd = StopCommand(word.value, save=None)

    def _stop_reason(self) -> str:
        """W12: the reason of the stop told so far ("stop" when none was)."""
        return self._stop_cmd.reason if self._stop_cmd is not None else "stop"

    def _carry_out_stop(self, now: float) -> None:
        """W12: ``Stop`` at once if the kind is known, else STOPPING and one heartbeat asks whether to save."""
        assert self._stop_cmd is not None  # its one caller, _settle, checked
        if self._stop_cmd.kind_known:
            self._finish(self._stop_cmd.reason, save=cast(bool, self._stop_cmd.save), now=now)
            return
        self._go(S.STOPPING, now)
        self._heartbeat(now)
        self._ask_deadline = now + min(ASK_SAVE_MAX_S, 4 * self.heartbeat_interval_s)

    def _ask_answered(self, command: Command | None, now: float) -> None:
        """W12: a heartbeat reply while STOPPING. During the ask it decides: ``save_and_stop`` saves."""
        if self._ask_deadline is None:
            return  # the stop's kind is settled and its Stop emitted: a second Stop would repeat it
        if command is Command.SAVE_AND_STOP:
            self._finish("save_and_stop", save=True, now=now)
        else:
            self._finish(self._stop_reason(), save=False, now=now)

    def _ask_timed_out(self, now: float) -> None:
        """W12: no reply ``min(1 s, 4 heartbeat intervals)`` after the ask: stop without saving."""
        if self._ask_deadline is not None and now >= self._ask_deadline:
            self._finish(self._stop_reason(), save=False, now=now)

    def _finish(self, reason: str, *, save: bool, now: float) -> None:
        """W12: emit the session's one ``Stop`` (its kind now settled), merging what is held first (W17)."""
        self._ask_deadline = None  # the Stop settles an open ask, though the state stays STOPPING
        self.stop_reason = self.stop_reason or reason
        if self.state is not S.STOPPING:
            self._go(S.STOPPING, now)
        self._merge_all()  # W17: the checkpoint holds every Result received
        self._out.append(Stop(self.stop_reason, save))

    # ------------------------------------------------------------------ W14: failing

    def _fail(self, code: str, detail: str, now: float, *, tell_driver: bool = True) -> None:
        """W14, the one failure path: ``Fail(code)`` (unless the driver reported the error), then STOPPED.

        Held Results are dropped (W17): nothing is merged into a model the run refused.
        """
        if tell_driver:
            self._out.append(Fail(code, f"worker {self.worker_id!r}: {detail}"))
        self.stop_reason = self.stop_reason or f"error: {code}"
        self._drop_merges()
        self._go(S.STOPPED, now)

    # ------------------------------------------------------------------ overlap (W15-W18)

    def _merge(self, fid: int) -> None:
        params = self.held.pop(fid)
        self.merge_at.pop(fid, None)
        self._out.append(MergeParams(fid, self.fragments[fid], params, self.overlap_alpha))

    def _merge_all(self) -> None:
        """Merge every held Result now, in fragment order (W17: stop, leave, re-join)."""
        for f in sorted(self.held):
            self._merge(f)

    def _drop_merges(self) -> None:
        self.held.clear()
        self.merge_at.clear()

    # ------------------------------------------------------------------ plumbing

    def _send(self, msg: Message, now: float) -> None:
        if self._unanswered_since is None:
            self._unanswered_since = now
        self._out.append(Send(msg))

    def _heartbeat(self, now: float) -> None:
        self._send(Heartbeat(self.worker_id), now)
        self._hb_outstanding += 1
        self._last_hb_sent = now

    def _go(self, state: WorkerState, now: float | None = None) -> None:
        """Move to ``state`` (``StateChanged``): the one place the state moves, so the one place a state's
        fields are reset (``OWNED_FIELDS``) and a pause begins and ends (W6). ``now``: required for PAUSED."""
        if state is self.state:
            return
        previous, self.state = self.state, state
        if previous is S.PAUSED:
            self._end_pause(cast(float, now))  # required out of PAUSED (above)
        if previous is not None:
            for name, value in OWNED_FIELDS.get(previous, {}).items():
                setattr(self, name, value)
        if state is S.PAUSED:
            self._paused_since = now
        elif state is S.STOPPING:
            self._stopping_from_training = previous is S.TRAINING
        self._out.append(StateChanged(state, previous))

    def _end_pause(self, now: float) -> None:
        """W6: add the pause's time to ``seconds_paused`` (called by ``_go`` as it leaves PAUSED)."""
        if self._paused_since is not None:
            self.seconds_paused += max(0.0, now - self._paused_since)
            self._paused_since = None

    def _note(self, level: str, text: str) -> None:
        self._out.append(Note(level, text))

    def _flush(self) -> list[Action]:
        out, self._out = self._out, []
        return out
