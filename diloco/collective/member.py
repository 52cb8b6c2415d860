"""``MemberMachine``: a collective member's protocol as a pure machine (SPEC.md section 7c, M1-M8).

A worker on the collective plane keeps its session exactly as on the hub; what lies between
the session and the coordinator -- which messages pass, which wait, which become work on the
data plane, what the session is told -- is decided here, and only here. Two drivers carry the
decisions out: ``diloco.collective.endpoint.CollectiveEndpoint`` (a data-plane thread, real
gloo groups) and ``diloco.sim.collective.SimEndpoint`` (simulated gloo in simulated time).

Inputs are three kinds of event: what the session sends (``session_sends``), what the
coordinator sends (``received``) and what a job on the data plane came to (``completed``).
Each returns the actions to carry out, in order:

* ``ToCoordinator(message)`` and ``ToSession(item)`` (a message, or a ``PlaneEvent``);
* ``RunJob(job)``: work on the data plane (reduce and propose, commit, roll back, start, heal,
  serve a heal), at most one at a time, each answered by one completion.

The machine holds no tensors of its own: a Submit's pseudo-gradient and the params a start
uses pass through it as opaque references, and it follows the replica's committed state by
its round ids and digests, which the completions report. No clock, randomness, threads or
I/O (``tests/test_layering.py`` checks the imports), so the same events give the same actions
in a thread and in the simulator, and a test can drive it message by message.

Why one file of about 770 lines: the machine's rules share one small state (the open orders,
the proposals, the queue, the held state), and about half the file is the plain records of its
inputs and outputs (jobs, completions, actions), which both drivers import from here.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import math
from typing import Any, Callable, Sequence, Union

from diloco.wire.messages import (
    Error,
    ErrorCode,
    HealOrder,
    Join,
    Leave,
    Message,
    ReduceAbort,
    ReduceOrder,
    ReduceReport,
    Result,
    Submit,
    Welcome,
)

#: M6: heals a joiner tries (each from a source the coordinator picks anew) before it gives up.
MAX_HEAL_ATTEMPTS = 5
#: A heal waits for its source, which serves it only after the verdict of any attempt it is in
#: (up to the core's reduce timeout, 4 collective timeouts): so a heal is bounded by this many.
HEAL_TIMEOUTS = 6
#: Longest failure detail a report carries.
MAX_DETAIL = 1000
#: Relative slack of a check against a declared norm: members measure the same bytes, but a sum
#: over another number of threads rounds differently. Nothing honest is off by more.
NORM_SLACK = 1e-3


# --------------------------------------------------------------------------- the checks


def judge_contributions(order: ReduceOrder, norms: Sequence[float]) -> tuple[str, ...]:
    """The group members whose contribution, as every member decoded it (``norms``, rank order),
    fails the checks: not finite, or beyond the norm its sender declared, which the coordinator
    held against the run's bounds before the order. Every member measures the same bytes, so
    every honest member blames the same members (the sender itself included)."""
    blamed = []
    for rank, wid in enumerate(order.group):
        declared = order.norms[rank] if rank < len(order.norms) else math.inf
        if _beyond(norms[rank], declared):
            blamed.append(wid)
    return tuple(blamed)


def judge_mean(order: ReduceOrder, mean_norm: float) -> bool:
    """True if an fp32 all-reduce's mean fails the checks: not finite, or beyond the mean of the
    declared norms, which bounds it (the norm of a mean is at most the mean of the norms)."""
    return _beyond(mean_norm, _declared_mean(order))


def judge_reduce(order: ReduceOrder, norms: Sequence[float], mean_norm: Callable[[], float]) -> "Reduced | None":
    """The checks on what this member saw of a reduce, as the report of a refused attempt (None:
    it passed): every rank's contribution where it saw them (``norms``: blame, M8), else the fp32
    mean (``mean_norm``, measured only then: refused, and an attempt that gathers follows, M9)."""
    if norms:
        blamed = judge_contributions(order, norms)
        if not blamed:
            return None
        shown = ", ".join(f"{w} ({n:.4g} > {d:.4g})" for w, n, d in zip(order.group, norms, order.norms)
                          if w in blamed)
        return Reduced("", f"contributions failing the checks (norm as decoded > declared): {shown}",
                       blame=blamed)
    measured = mean_norm()
    if judge_mean(order, measured):
        return Reduced("", f"the all-reduced mean's norm {measured:.4g} fails the checks (the declared norms "
                           f"bound it by {_declared_mean(order):.4g})", mean_refused=True)
    return None


def mean_bound(order: ReduceOrder) -> float:
    """What the checks bound the norm of the order's mean pseudo-gradient by, once they passed:
    the bound of its outer step starts from it (M11)."""
    return _declared_mean(order) * (1 + NORM_SLACK) + 1e-12


def _declared_mean(order: ReduceOrder) -> float:
    return sum(order.norms) / len(order.norms) if order.norms else math.inf


def _beyond(norm: float, declared: float) -> bool:
    return not math.isfinite(norm) or norm > declared * (1 + NORM_SLACK) + 1e-12


# --------------------------------------------------------------------------- what the session hears


class PlaneEventKind(str, enum.Enum):
    #: A commit this member did not propose for (or proposed something else): it cannot know the
    #: params; the session joins again and heals (M3).
    LOST_TRACK = "lost_track"
    #: No source could hand over the run's state in ``MAX_HEAL_ATTEMPTS`` tries: the worker stops
    #: with this code; a supervisor may start it again (M6).
    HEAL_FAILED = "heal_failed"
    #: The coordinator welcomed this worker as the run's start, but it holds nothing to start from.
    NO_START_STATE = "no_start_state"
    #: A job on the data plane failed in a way no rule foresaw (a bug, a broken device): the
    #: session logs it and goes on; the coordinator's timeout ends the attempt it was part of.
    JOB_FAILED = "job_failed"


@dataclasses.dataclass(frozen=True)
class PlaneEvent:
    """Something the collective plane tells the session that is not a coordinator's message."""

    kind: PlaneEventKind
    detail: str


# --------------------------------------------------------------------------- jobs and completions


@dataclasses.dataclass(frozen=True)
class ReduceJob:
    """Combine the group's pseudo-gradients and propose the outer step (answered by ``Reduced``)."""

    order: ReduceOrder
    submit: Submit | None  # the session's Submit of the round, with its tensors (set when it runs)


@dataclasses.dataclass(frozen=True)
class CommitJob:
    """Adopt fragment ``fragment_id``'s open proposal (answered by ``Committed``, with a copy of
    the fragment's params for the session)."""

    fragment_id: int
    round_id: int
    digest: str


@dataclasses.dataclass(frozen=True)
class RollbackJob:
    """Drop the open proposals of these fragments (answered by ``RolledBack``)."""

    fragment_ids: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class StartJob:
    """Start the run from this member (answered by ``Started``).

    ``keep``: keep the replica, first adopting (``adopt``) or rolling back (``rollback``) its
    orphaned proposals, then relabel it to the Welcome's round ids. Otherwise build the replica
    from ``params`` (and ``outer_states``, a checkpoint's momentum, or None)."""

    welcome: Welcome
    params: Any = None
    outer_states: Any = None
    keep: bool = False
    adopt: tuple[int, ...] = ()
    rollback: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class HealJob:
    """Replace the replica (proposals and all) with the state the Welcome's source sends
    (answered by ``Healed`` or ``HealFailed``)."""

    welcome: Welcome


@dataclasses.dataclass(frozen=True)
class ServeHealJob:
    """Send this member's committed state to a joiner (answered by ``HealServed``)."""

    order: HealOrder


Job = Union[ReduceJob, CommitJob, RollbackJob, StartJob, HealJob, ServeHealJob]


@dataclasses.dataclass(frozen=True)
class Reduced:
    """A ``ReduceJob`` ended: ``digest`` is the proposal's ("" if it failed, with ``detail``; with
    ``blame`` or ``mean_refused`` when the contributions failed the checks, and no proposal)."""

    digest: str
    detail: str = ""
    blame: tuple[str, ...] = ()
    mean_refused: bool = False


@dataclasses.dataclass(frozen=True)
class Committed:
    params: dict  # the fragment's committed params, the session's to keep


@dataclasses.dataclass(frozen=True)
class RolledBack:
    pass


@dataclasses.dataclass(frozen=True)
class Started:
    digests: tuple[str, ...]  # each fragment's digest as now committed
    params: dict              # every param, the session's to keep


@dataclasses.dataclass(frozen=True)
class Healed:
    round_ids: tuple[int, ...]
    digests: tuple[str, ...]
    params: dict


@dataclasses.dataclass(frozen=True)
class HealFailed:
    detail: str


@dataclasses.dataclass(frozen=True)
class HealServed:
    ok: bool
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class JobFailed:
    """Any job raised what its driver did not expect (the machine goes on; M8)."""

    detail: str


Completion = Union[Reduced, Committed, RolledBack, Started, Healed, HealFailed, HealServed, JobFailed]


# --------------------------------------------------------------------------- actions


@dataclasses.dataclass(frozen=True)
class ToCoordinator:
    message: Message


@dataclasses.dataclass(frozen=True)
class ToSession:
    item: Any  # a Message or a PlaneEvent


@dataclasses.dataclass(frozen=True)
class RunJob:
    job: Job


@dataclasses.dataclass(frozen=True)
class NewStore:
    """A Welcome answers a (re)join and a restarted coordinator hosts a new store: drop the
    store client and the group; build them anew, with this timeout, on the next job."""

    port: int
    timeout_s: float


@dataclasses.dataclass(frozen=True)
class CancelJob:
    """Stop ``job`` at its next wait: the coordinator withdrew the heal it serves (its joiner is gone,
    M12), or the attempt of the reduce it runs was aborted, superseded or decided without it while
    its group was still forming (M13). Its completion still comes (a failed serve, a failed reduce);
    a job already done, or past the wait, is not affected."""

    job: Job


Action = Union[ToCoordinator, ToSession, RunJob, NewStore, CancelJob]


@dataclasses.dataclass(frozen=True)
class HeldState:
    """What the replica holds as committed: each fragment's round id and digest."""

    fragments: tuple[tuple[str, ...], ...]
    round_ids: tuple[int, ...]
    digests: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class RestoredState:
    """A checkpoint's committed state, offered in the first Join (C6). ``params`` and
    ``outer_states`` are opaque here; the driver computed ``digests`` from the params."""

    params: Any
    fragments: tuple[tuple[str, ...], ...]
    round_ids: tuple[int, ...]
    digests: tuple[str, ...]
    outer_states: Any = None


# --------------------------------------------------------------------------- the machine


class MemberMachine:
    """One worker's side of the collective plane; see the module docstring and SPEC.md M1-M8."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        #: Whether the last Welcome put this worker on the collective plane (else: pass through).
        self.collective = False
        #: The replica's committed state, or None before a start or heal built one.
        self.held: HeldState | None = None
        #: Per fragment: whether the held state is the one its round label names in this run (the
        #: last commit made it, or no commit was ever made): M10.
        self._confirmed: list[bool] = []
        #: A checkpoint's state this worker may start or restart the run from (C6).
        self.restored: RestoredState | None = None
        #: fragment -> (round, digest) of a proposal open on the replica.
        self.proposals: dict[int, tuple[int, str]] = {}
        #: fragment -> the session's last Submit (its pseudo-gradient stays on this worker, C2).
        self._pending: dict[int, Submit] = {}
        #: (fragment, round) -> attempt of an order whose verdict has not come.
        self._orders: dict[tuple[int, int], int] = {}
        #: fragment -> (round, attempt) of the newest order since the last Welcome: an order not newer
        #: is a duplicate or stale, and ignored (each attempt is reported once, M9).
        self._newest_order: dict[int, tuple[int, int]] = {}
        #: Attempts a Welcome voided while their reduce ran: their proposal waits for a start (M4).
        self._voided: set[tuple[int, int, int]] = set()
        #: (fragment, round, attempt) reported ok: no other job runs until its verdict (M2).
        self._awaiting: tuple[int, int, int] | None = None
        self._queue: collections.deque[Job] = collections.deque()
        self._running: Job | None = None
        #: M5: the coordinator asked this worker's params to start the run with.
        self._wants_start_params = False
        #: The params the session sent to start the run with (opaque; the driver copied them).
        self._start_params: Any = None
        self._last_join: Join | None = None
        #: A collective Welcome is held from the session while this member starts or heals. The
        #: coordinator has answered meanwhile: a driver reports no silence to the session's outage
        #: clock (W11), or a heal longer than ``--coordinator-timeout`` would end the worker (M5).
        self.welcome_withheld = False
        self._heal_attempts = 0
        #: joiner -> the prefix of its newest heal order (older ones are not served).
        self._heal_orders: dict[str, str] = {}
        self.closed = False
        self.stats: collections.Counter = collections.Counter()
        #: The commits this member adopted: (fragment, round, digest), newest last (bounded).
        self.adopted: collections.deque[tuple[int, int, str]] = collections.deque(maxlen=4096)

    @property
    def state_confirmed(self) -> bool:
        """M10: whether a checkpoint may label the held state with its round ids (always, off the
        collective plane or before any state is held)."""
        return not self.collective or self.held is None or all(self._confirmed)

    def _confirm(self, welcome: Welcome) -> None:
        """M10: a start's or heal's state is confirmed per fragment when the Welcome's record of the
        run's last commit is that state (its round and digest), or the run never committed it."""
        held = self.held
        assert held is not None
        committed = tuple(welcome.committed)
        self._confirmed = [f >= len(committed) or tuple(committed[f])[0] < 0
                           or (held.round_ids[f] == committed[f][0] + 1 and held.digests[f] == committed[f][1])
                           for f in range(len(held.fragments))]

    # ------------------------------------------------------------------ what the session sends

    @property
    def wants_start_params(self) -> bool:
        """The coordinator asked this member to start the run from its own params (C6)."""
        return self._wants_start_params

    def session_sends(self, message: Message) -> list[Action]:
        """M5, C2: what goes to the coordinator of a session's message. A Join with params must
        carry copies the session will not change (the driver's job)."""
        if isinstance(message, Join):
            if self.welcome_withheld:
                # The Welcome came; this member is starting or healing before it hands it on. A
                # resend would make the coordinator answer already_member and the session leave
                # and join again: a loop of heals. The Welcome will come.
                self.stats["join_resends_held"] += 1
                return []
            if message.params and self._wants_start_params:
                # The run's first member starts it from its own params; they stay here (C6): a
                # checkpoint's committed ones if it has them, not the model's local progress.
                self._start_params = self.restored.params if self.restored is not None else message.params
                message = self._offer_held_state(dataclasses.replace(message, params={}, holds_params=True))
            elif not message.params:
                message = self._offer_held_state(message)
            self._last_join = message
            return [ToCoordinator(message)]
        if isinstance(message, Submit) and self.collective:
            if self.welcome_withheld:
                # M5: a Submit from before the (re)join. This member is not ready: a start or heal is
                # under way, and the Welcome it holds restarts the session's round. Sent now, the ready
                # would put it in a group it cannot serve until the heal is done.
                self.stats["submits_held"] += 1
                return []
            self._pending[message.fragment_id] = message
            return [ToCoordinator(dataclasses.replace(message, tensors={}, scales={}))]
        return [ToCoordinator(message)]

    def _offer_held_state(self, join: Join) -> Join:
        """C6: say which committed state this worker holds, if any: its replica's (after a
        coordinator restart) or its checkpoint's (after a whole-run stop)."""
        if self.held is not None:
            return dataclasses.replace(join, holds_params=True, held_rounds=self.held.round_ids,
                                       held_digests=self.held.digests)
        if self.restored is not None:
            self._start_params = self.restored.params
            return dataclasses.replace(join, holds_params=True, held_rounds=self.restored.round_ids,
                                       held_digests=self.restored.digests)
        return join

    # ------------------------------------------------------------------ what the coordinator sends

    def received(self, message: Message) -> list[Action]:
        out: list[Action] = []
        if isinstance(message, Welcome):
            self._on_welcome(message, out)
        elif isinstance(message, Error) and message.code is ErrorCode.START_PARAMS_REQUIRED:
            # M5: the session answers it as the hub's params_required; the params stay here.
            self._wants_start_params = True
            out.append(ToSession(message))
        elif not self.collective:
            out.append(ToSession(message))
        elif isinstance(message, ReduceOrder):
            self._on_order(message, out)
        elif isinstance(message, ReduceAbort):
            self._verdict(message.fragment_id, message.round_id, message.attempt, None, out)
        elif isinstance(message, HealOrder):
            # A joiner that re-joined got a new order: serve only the newest one per joiner. An order
            # with no prefix withdraws the last (M12): a queued serve is dropped, a running one stopped.
            self._heal_orders[message.joiner] = message.prefix
            running = self._running
            if message.prefix:
                self._queue.append(ServeHealJob(message))
            elif isinstance(running, ServeHealJob) and running.order.joiner == message.joiner:
                out.append(CancelJob(running))
        elif isinstance(message, Result):
            if message.outcome == "stop" or not message.digest:
                self._verdict(message.fragment_id, message.round_id, None, None, out)
                out.append(ToSession(message))
            elif not self._verdict(message.fragment_id, message.round_id, None, message, out):
                self._lost_track(message, out)
        else:
            out.append(ToSession(message))
        self._pump(out)
        return out

    def _on_welcome(self, welcome: Welcome, out: list[Action]) -> None:
        self._void_attempts()
        if welcome.data_plane != "collective":
            self.collective = False
            out.append(ToSession(welcome))
            return
        self.collective = True
        self._pending.clear()
        out.append(NewStore(welcome.store_port, float(welcome.collective_timeout_s) or 30.0))
        if welcome.heal_source:
            self.welcome_withheld = True
            self._queue.append(HealJob(welcome))
            return
        if self._start_params is None and self.held is None:
            out.append(ToSession(PlaneEvent(PlaneEventKind.NO_START_STATE,
                                            "the coordinator welcomed this worker as the run's start, but it "
                                            "sent no params to start from")))
            return
        # M4: the start waits in the queue behind a running reduce; what it settles is decided
        # when it runs (``_dispatch``), once that reduce's proposal is known.
        self.welcome_withheld = True
        self._queue.append(StartJob(welcome, params=self._start_params))
        self._start_params = None

    def _on_order(self, order: ReduceOrder, out: list[Action]) -> None:
        newest = self._newest_order.get(order.fragment_id)
        if newest is not None and (order.round_id, order.attempt) <= newest:
            self.stats["stale_orders"] += 1
            return
        self._newest_order[order.fragment_id] = (order.round_id, order.attempt)
        key = (order.fragment_id, order.round_id)
        if key in self._orders:
            # A newer attempt of the same round: the old one was aborted (its abort may be lost).
            self._verdict(order.fragment_id, order.round_id, self._orders[key], None, out)
        self._orders[key] = order.attempt
        self._queue.append(ReduceJob(order, None))

    def _verdict(self, fid: int, rid: int, attempt: int | None, commit: Result | None,
                 out: list[Action]) -> bool:
        """M3, M4: a commit (``commit``) or an abort of the open attempt of (fid, rid); ``attempt``
        None matches any. False if no such attempt is open here."""
        key = (fid, rid)
        open_attempt = self._orders.get(key)
        if open_attempt is None or (attempt is not None and attempt != open_attempt):
            return False
        del self._orders[key]
        if self._awaiting == (fid, rid, open_attempt):
            self._awaiting = None
            proposal = self.proposals.get(fid)
            if commit is not None and proposal == (rid, commit.digest):
                self._queue.appendleft(_Adopt(CommitJob(fid, rid, commit.digest), commit))  # type: ignore[arg-type]
                return True
            self._queue.appendleft(RollbackJob((fid,)))
            if commit is not None:
                self._lost_track(commit, out)
            return True
        # Not reported yet: still queued (dropped unrun), or running (rolled back once it ends; M13:
        # a group still forming for it is abandoned, so the next attempt finds this member free).
        running = self._running
        if isinstance(running, ReduceJob) and (running.order.fragment_id, running.order.round_id) == key:
            out.append(CancelJob(running))
        self._queue = collections.deque(
            j for j in self._queue
            if not (isinstance(j, ReduceJob) and (j.order.fragment_id, j.order.round_id) == key))
        if commit is not None:
            self._lost_track(commit, out)  # a commit before this member reported: not its proposal
        return True

    def _lost_track(self, commit: Result, out: list[Action]) -> None:
        self.stats["lost_track"] += 1
        out.append(ToSession(PlaneEvent(
            PlaneEventKind.LOST_TRACK,
            f"fragment {commit.fragment_id} round {commit.round_id} committed without a proposal of this "
            f"worker's: joining again to heal")))

    def _void_attempts(self) -> None:
        """M4: a Welcome ends every attempt this member was in (its connection was lost or renewed)."""
        running = self._running
        if isinstance(running, ReduceJob):
            # Whatever it comes to is the old connection's: no report of it (the attempt numbers
            # of a restarted coordinator start again, and would be taken for its own).
            self._voided.add((running.order.fragment_id, running.order.round_id, running.order.attempt))
        self._orders.clear()
        self._newest_order.clear()  # a restarted coordinator numbers its attempts from 0 again
        self._awaiting = None
        self._queue = collections.deque(j for j in self._queue if not isinstance(j, ReduceJob))

    def close(self) -> None:
        self.closed = True
        self._void_attempts()
        self._queue.clear()

    # ------------------------------------------------------------------ what a job came to

    def completed(self, done: Completion) -> list[Action]:
        job, self._running = self._running, None
        out: list[Action] = []
        if job is None or self.closed:
            return out
        if isinstance(done, JobFailed):
            self._job_failed(job, done, out)
        elif isinstance(job, ReduceJob) and isinstance(done, Reduced):
            self._reduced(job, done, out)
        elif isinstance(job, _Adopt) and isinstance(done, Committed):
            self._committed(job, done, out)
        elif isinstance(job, RollbackJob):
            for fid in job.fragment_ids:
                self.proposals.pop(fid, None)
            self.stats["aborted"] += 1
        elif isinstance(job, StartJob) and isinstance(done, Started):
            self._started(job, done, out)
        elif isinstance(job, HealJob) and isinstance(done, Healed):
            self._healed(job, done, out)
        elif isinstance(job, HealJob) and isinstance(done, HealFailed):
            self._heal_failed(job, done, out)
        elif isinstance(job, ServeHealJob) and isinstance(done, HealServed):
            self.stats["heals_served" if done.ok else "heals_failed"] += 1
        else:
            raise TypeError(f"{type(done).__name__} does not answer a {type(job).__name__}")
        self._pump(out)
        return out

    def _reduced(self, job: ReduceJob, done: Reduced, out: list[Action]) -> None:
        fid, rid, attempt = job.order.fragment_id, job.order.round_id, job.order.attempt
        if done.digest:
            self.proposals[fid] = (rid, done.digest)
        else:
            self.stats["reduce_failed"] += 1
        if (fid, rid, attempt) in self._voided:
            # M4: a Welcome voided the attempt meanwhile; its proposal stays until a start
            # settles it against the Welcome's last commits, or a heal replaces it.
            self._voided.discard((fid, rid, attempt))
            return
        if self._orders.get((fid, rid)) != attempt:
            if done.digest:  # aborted (or superseded) while it ran
                self._queue.appendleft(RollbackJob((fid,)))
            elif done.blame:
                # Another member's report ended the attempt first; this member's blame still counts
                # (an eviction needs every member's, section 7c).
                out.append(ToCoordinator(ReduceReport(self.worker_id, fid, rid, attempt, False, "",
                                                      done.detail[:MAX_DETAIL], tuple(done.blame))))
            return
        out.append(ToCoordinator(ReduceReport(self.worker_id, fid, rid, attempt, bool(done.digest), done.digest,
                                              done.detail[:MAX_DETAIL], tuple(done.blame), done.mean_refused)))
        if done.digest:
            self._awaiting = (fid, rid, attempt)  # M2: the verdict first
        else:
            del self._orders[(fid, rid)]  # a failed report aborts the attempt: nothing to wait for

    def _committed(self, job: "_Adopt", done: Committed, out: list[Action]) -> None:
        fid, rid, digest = job.job.fragment_id, job.job.round_id, job.job.digest
        self._adopt(fid, rid, digest)
        out.append(ToSession(dataclasses.replace(job.result, params=done.params, delta=False, wire_dtype="fp32",
                                                 scales={}, digest="")))

    def _adopt(self, fid: int, rid: int, digest: str) -> None:
        self.proposals.pop(fid, None)
        held = self.held
        assert held is not None
        self.held = dataclasses.replace(held, round_ids=_set(held.round_ids, fid, rid + 1),
                                        digests=_set(held.digests, fid, digest))
        if fid < len(self._confirmed):
            self._confirmed[fid] = True  # a commit of this run made it
        pending = self._pending.get(fid)
        if pending is not None and pending.round_id == rid:
            del self._pending[fid]
        self.stats["committed"] += 1
        self.adopted.append((fid, rid, digest))

    def _started(self, job: StartJob, done: Started, out: list[Action]) -> None:
        welcome = job.welcome
        if job.keep:
            for fid in job.adopt:
                rid, digest = self.proposals[fid]
                self._adopt(fid, rid, digest)
                self.stats["adopted_after_reconnect"] += 1
            for fid in job.rollback:
                self.proposals.pop(fid, None)
            if self.held is not None and self.held.round_ids != tuple(welcome.round_ids):
                self.stats["relabelled"] += 1
        self.held = HeldState(_fragments(welcome), tuple(welcome.round_ids), tuple(done.digests))
        self._confirm(welcome)
        self.restored = None  # its momentum was used, or another layout's was not; either way, once
        self._welcomed(dataclasses.replace(welcome, params=done.params), out)

    def _healed(self, job: HealJob, done: Healed, out: list[Action]) -> None:
        self.proposals.clear()
        self.held = HeldState(_fragments(job.welcome), tuple(done.round_ids), tuple(done.digests))
        self._confirm(job.welcome)
        self.stats["healed"] += 1
        self._welcomed(dataclasses.replace(job.welcome, round_ids=tuple(done.round_ids), parked=(),
                                           params=done.params), out)

    def _welcomed(self, welcome: Welcome, out: list[Action]) -> None:
        self._heal_attempts = 0
        self.welcome_withheld = False
        out.append(ToSession(welcome))

    def _heal_failed(self, job: HealJob, done: HealFailed, out: list[Action]) -> None:
        """M6: join again (the coordinator names another source, or the same one recovered), up
        to ``MAX_HEAL_ATTEMPTS`` tries; then the session is told."""
        self.proposals.clear()  # a heal rolls back first
        self._heal_attempts += 1
        self.stats["heals_failed"] += 1
        if self._heal_attempts >= MAX_HEAL_ATTEMPTS or self._last_join is None:
            self.welcome_withheld = False
            out.append(ToSession(PlaneEvent(PlaneEventKind.HEAL_FAILED,
                                            f"could not copy the run's state from {job.welcome.heal_source!r} "
                                            f"({self._heal_attempts} tries): {done.detail}")))
            return
        # It may start the run from this member only if it holds state to start from (C6). No
        # Welcome is withheld now: were the answer to this Join lost, the session's own resends
        # must reach the coordinator, not wait here forever.
        self.welcome_withheld = False
        out.append(ToCoordinator(Leave(self.worker_id)))
        out.append(ToCoordinator(self._offer_held_state(
            dataclasses.replace(self._last_join, holds_params=False, held_rounds=(), held_digests=()))))

    def _job_failed(self, job: Job, done: JobFailed, out: list[Action]) -> None:
        self.stats["internal_errors"] += 1
        if isinstance(job, ReduceJob):
            self._orders.pop((job.order.fragment_id, job.order.round_id), None)
        if isinstance(job, (StartJob, HealJob)):
            self.welcome_withheld = False  # the session's join resend asks again
        out.append(ToSession(PlaneEvent(PlaneEventKind.JOB_FAILED,
                                        f"collective data plane, {type(job).__name__}: {done.detail}")))

    # ------------------------------------------------------------------ the data plane's queue

    def _pump(self, out: list[Action]) -> None:
        """M2: start the next job, unless one runs or a reported proposal awaits its verdict."""
        while self._running is None and self._awaiting is None and self._queue and not self.closed:
            job = self._dispatch(self._queue.popleft(), out)
            if job is not None:
                self._running = job
                out.append(RunJob(job.job if isinstance(job, _Adopt) else job))

    def _dispatch(self, job: Job, out: list[Action]) -> Job | None:
        """The job to run now (as queued, or completed with what is known only now), or None."""
        if isinstance(job, ReduceJob):
            order = job.order
            fid, rid = order.fragment_id, order.round_id
            if self._orders.get((fid, rid)) != order.attempt:
                return None  # aborted or superseded before it started
            submit = self._pending.get(fid)
            if self.held is None or submit is None or submit.round_id != rid or self.worker_id not in order.group:
                del self._orders[(fid, rid)]
                self.stats["reduce_failed"] += 1
                out.append(ToCoordinator(ReduceReport(self.worker_id, fid, rid, order.attempt, False, "",
                                                      f"no pseudo-gradient of fragment {fid} round {rid} on "
                                                      f"this worker")))
                return None
            return ReduceJob(order, submit)
        if isinstance(job, StartJob):
            held = self.held
            if held is not None and held.fragments == _fragments(job.welcome):
                # M4: keep the replica; settle its orphaned proposals against the Welcome's last
                # commits (C4): adopt those the coordinator committed, roll back the rest.
                committed = tuple(job.welcome.committed)
                adopt = tuple(f for f, p in self.proposals.items()
                              if f < len(committed) and tuple(committed[f]) == p)
                rollback = tuple(f for f in self.proposals if f not in adopt)
                return dataclasses.replace(job, keep=True, params=None, adopt=adopt, rollback=rollback)
            if job.params is None:
                self.welcome_withheld = False
                out.append(ToSession(PlaneEvent(PlaneEventKind.NO_START_STATE,
                                                "welcomed as the run's start with another fragment layout than "
                                                "the state this worker holds, and no params to start from")))
                return None
            states = self.restored.outer_states if self.restored is not None else None
            if states is not None and len(states) != len(job.welcome.fragments):
                states = None  # another fragment layout: fresh momentum
            return dataclasses.replace(job, outer_states=states)
        if isinstance(job, ServeHealJob):
            if self.held is None or self._heal_orders.get(job.order.joiner) != job.order.prefix:
                return None  # superseded by a newer order for the same joiner (it re-joined)
        return job


@dataclasses.dataclass(frozen=True)
class _Adopt:
    """A queued ``CommitJob`` with the commit's Result, which the session gets with the params."""

    job: CommitJob
    result: Result


def _fragments(welcome: Welcome) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(f) for f in welcome.fragments)


def _set(values: tuple, index: int, value) -> tuple:
    out = list(values)
    out[index] = value
    return tuple(out)
