"""The collective data plane in the simulator: the workers' side of SPEC.md C1-C7.

On a collective run the coordinator never holds the model: each member keeps a replica,
the group all-reduces its pseudo-gradients over gloo, every member proposes the outer
step and votes with a digest, and adopts it only on the coordinator's commit. The real
worker does this in ``diloco.collective.endpoint.CollectiveEndpoint``, a wrapper of its
endpoint with a data-plane thread and real gloo groups. The simulator cannot run threads
or sockets, so this module models the same logic in simulated time:

* ``SimGloo``, the data network: gloo groups formed on the coordinator's rendezvous store
  (``SimGloo.gen``: the store lives in the coordinator's process, which tells it when it
  dies and restarts, so a crashed and restarted coordinator is a new store; a worker's
  store client does not reconnect -- torch's ``TCPStore`` client fails with "Broken
  pipe" after its server restarted, and ``GroupCache`` keeps the client), and the
  collectives on a formed group: every rank must arrive (in each rank's own order of
  operations, as gloo matches them), a dead rank breaks the group, a timeout on one rank
  tears it down for all;
* ``SimEndpoint``, one per worker incarnation, drives the worker's real ``MemberMachine``
  (``diloco.collective.member``, the same machine ``CollectiveEndpoint`` drives): the machine
  decides what the session and the coordinator see and which job runs next; this carries the
  jobs out in simulated time, each a generator that waits for simulated events (a sleep, a
  rendezvous, a collective) exactly where the real data-plane thread blocks. The replica is
  the real ``diloco.collective.replica.Replica`` (the outer step, the digest, commit and
  rollback).

``SimGloo`` needs only the clock; a ``SimEndpoint`` uses the rest of the simulation only
through its ``world.PlaneWorld`` (the clock, the trace, its worker's link, the reduce
faults) and talks to its own worker (``SimWorker.later``, ``deliver_local``).

Faults of this plane (``diloco.sim.config.REDUCE_FAULT_KINDS``) are this driver's behaviour,
never the machine's: drawn per reduce job by the fault injector (``PlaneWorld.reduce_fault``) while the safety phase lasts: a member dies
inside the reduce (before the collective or after it, before its report), its report is
lost, it proposes from a different mean (another digest), its collective fails (it reports
failure), or its data plane wedges after the collective for longer than the reduce timeout
(it keeps heartbeating; only the core's timeout ends the attempt). A heal fails when its
source is dead, frozen, busy past the timeout or its store client is broken.

Every replica change is traced as an ``adopt`` record (``src``: ``commit``, ``heal`` or
``start``), the only place a worker takes an outer step: the checker holds each against the
coordinator's commits.

Why one file of about 650 lines: it is the simulated counterpart of one worker's collective
data plane (its data thread, its group and heal transfers) and of the gloo groups they meet
in; every part reads the same simulated worker and group state.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import TYPE_CHECKING, Generator

import torch

from diloco.collective.member import (
    HEAL_TIMEOUTS,
    CancelJob,
    judge_reduce,
    mean_bound,
    CommitJob,
    Committed,
    Completion,
    HealFailed,
    HealJob,
    HealServed,
    Healed,
    MemberMachine,
    NewStore,
    Reduced,
    ReduceJob,
    RestoredState,
    RollbackJob,
    RolledBack,
    RunJob,
    ServeHealJob,
    Started,
    StartJob,
    ToCoordinator,
    ToSession,
)
from diloco.collective.reduce import tensors_norm
from diloco.collective.replica import Replica, StepRefused, digest
from diloco.sim.trace import hash_values
from diloco.wire.messages import Join, ReduceReport, Submit, Welcome

if TYPE_CHECKING:  # pragma: no cover
    from diloco.sim.world import Clock, PlaneWorld, WorkerProcess

#: While a party of a rendezvous is frozen (SIGSTOP), its peers' transfer waits; checked this often.
_FROZEN_POLL_S = 0.05
#: What a member adds to one element of its mean for an injected digest mismatch (a
#: nondeterministic kernel, a flipped bit): its proposal, and so its digest, differ.
_MISMATCH_EPS = 1e-3


class SimCollectiveError(RuntimeError):
    """A group creation, a collective or a heal transfer failed (``CollectiveError`` in the real one)."""


class Waiter:
    """Something a job waits for; resolved at most once, with a value or an error."""

    __slots__ = ("done", "value", "error", "_callbacks")

    def __init__(self) -> None:
        self.done = False
        self.value = None
        self.error: Exception | None = None
        self._callbacks: list = []

    def resolve(self, value=None, error: Exception | None = None) -> None:
        if self.done:
            return
        self.done, self.value, self.error = True, value, error
        callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb()

    def on_done(self, cb) -> None:
        if self.done:
            cb()
        else:
            self._callbacks.append(cb)


# --------------------------------------------------------------------------- the data network


@dataclasses.dataclass(eq=False)
class _Meeting:
    """A rendezvous of ``size`` ranks: a group's creation (store and barrier) or one collective."""

    size: int
    kind: str                      # "form", "allreduce", "allgather", "broadcast"
    delay_s: float
    group: "SimGroup | None" = None
    #: rank -> (endpoint, payload, waiter)
    parties: dict = dataclasses.field(default_factory=dict)
    broken: bool = False
    completing: bool = False


@dataclasses.dataclass(eq=False)
class SimGroup:
    """A formed gloo group: its ranks' endpoints, and the collectives in flight (by sequence number)."""

    gid: int
    prefix: str
    members: tuple            # endpoints, by rank
    ops: dict = dataclasses.field(default_factory=dict)
    broken: bool = False

    @property
    def size(self) -> int:
        return len(self.members)


class SimGloo:
    """The workers' data network and the coordinator's rendezvous store (see the module doc)."""

    def __init__(self, clock: Clock, group_build_s: float) -> None:
        self._clock = clock
        self._group_build_s = group_build_s
        #: The store's generation: a new one whenever the coordinator's process is gone.
        self.gen = 0
        #: Whether the coordinator's process, and so its store, is up.
        self.store_up = True
        self._forming: dict[tuple[int, str], _Meeting] = {}
        self._groups_of: dict[int, list[SimGroup]] = collections.defaultdict(list)
        self._gid = 0

    def store_lost(self) -> None:
        """The coordinator's process is gone, and its store with it: rendezvous in progress fail."""
        self.store_up = False
        self.gen += 1
        forming, self._forming = self._forming, {}
        for meeting in forming.values():
            self._break(meeting, SimCollectiveError("the store's connection was reset"))

    def store_restarted(self) -> None:
        """A restarted coordinator's process serves a new store (clients of the old one stay broken)."""
        self.store_up = True

    # -- meetings

    def form(self, ep: "SimEndpoint", prefix: str, rank: int, size: int) -> tuple[_Meeting, Waiter]:
        """Join the creation of group ``prefix`` as ``rank`` of ``size`` (store keys, then a barrier)."""
        key = (self.gen, prefix)
        meeting = self._forming.get(key)
        if meeting is None or meeting.broken:
            meeting = _Meeting(size, "form", self._group_build_s)
            self._forming[key] = meeting
        waiter = Waiter()
        if meeting.size != size or rank in meeting.parties or not 0 <= rank < size:
            # Two ranks under one key, or a group of another size: it never forms (each times out).
            meeting.broken = True
            return meeting, waiter
        meeting.parties[rank] = (ep, None, waiter)
        if len(meeting.parties) == size:
            del self._forming[key]
            self._ready(meeting)
        return meeting, waiter

    def collective(self, ep: "SimEndpoint", group: SimGroup, seq: int, kind: str, payload,
                   delay_s: float) -> tuple[_Meeting, Waiter]:
        """This rank's ``seq``-th collective on ``group`` (gloo pairs them by order, not by content)."""
        waiter = Waiter()
        meeting = group.ops.get(seq)
        if meeting is None:
            meeting = _Meeting(group.size, kind, delay_s, group)
            group.ops[seq] = meeting
        if group.broken:
            waiter.resolve(error=SimCollectiveError(f"{kind} on a closed group: connection closed by peer"))
            return meeting, waiter
        rank = group.members.index(ep)
        meeting.parties[rank] = (ep, payload, waiter)
        if len(meeting.parties) == group.size:
            del group.ops[seq]
            self._ready(meeting)
        return meeting, waiter

    def _ready(self, meeting: _Meeting) -> None:
        meeting.completing = True
        self._clock.schedule(self._clock.now + meeting.delay_s, self._complete, meeting)

    def _complete(self, meeting: _Meeting) -> None:
        if meeting.broken:
            return
        eps = [ep for ep, _p, _w in meeting.parties.values()]
        if any(not ep.alive for ep in eps):
            if meeting.kind == "form":
                meeting.broken = True  # the barrier never completes: each survivor times out
            else:
                self._break(meeting, SimCollectiveError(f"{meeting.kind}: connection reset by peer"))
            return
        if any(ep.w.frozen for ep in eps):
            # A stopped process neither sends nor receives: the transfer resumes when it thaws.
            self._clock.schedule(self._clock.now + _FROZEN_POLL_S, self._complete, meeting)
            return
        if meeting.kind == "form":
            self._gid += 1
            members = tuple(meeting.parties[r][0] for r in range(meeting.size))
            group = SimGroup(self._gid, "", members)
            for ep in members:
                self._groups_of[id(ep)].append(group)
            result, error = group, None
        elif meeting.kind == "broadcast":
            result, error = meeting.parties[0][1], None
        elif meeting.kind == "allgather":
            flats = [meeting.parties[r][1] for r in range(meeting.size)]
            if any(f.shape != flats[0].shape for f in flats):
                result, error = None, SimCollectiveError("the all-gather failed: ranks sent buffers of different sizes")
            else:
                result, error = [f.clone() for f in flats], None
        else:
            flats = [meeting.parties[r][1] for r in range(meeting.size)]
            if any(f.shape != flats[0].shape for f in flats):
                result, error = None, SimCollectiveError("the all-reduce failed: ranks sent buffers of different sizes")
            else:
                total = flats[0].clone()
                for f in flats[1:]:
                    total += f
                result, error = total, None
        for _ep, _payload, waiter in meeting.parties.values():
            waiter.resolve(result, error)

    def abandon(self, meeting: _Meeting, ep: "SimEndpoint") -> None:
        """``ep`` timed out in ``meeting``: it tears its connections down, so the others fail too."""
        if meeting.kind == "form":
            meeting.broken = True
            return
        self._break(meeting, SimCollectiveError(f"{meeting.kind}: connection closed by peer (a rank timed out)"))

    def peer_died(self, ep: "SimEndpoint") -> None:
        """A worker process is gone: its groups break (its peers see their connections reset)."""
        for group in self._groups_of.pop(id(ep), []):
            self._break_group(group, SimCollectiveError("connection reset by peer (a rank died)"))
        for meeting in self._forming.values():
            if any(p[0] is ep for p in meeting.parties.values()):
                meeting.broken = True

    def drop(self, ep: "SimEndpoint", group: SimGroup) -> None:
        """``ep`` forgets ``group`` (``GroupCache.drop``): its peers' collectives on it fail."""
        groups = self._groups_of.get(id(ep))
        if groups and group in groups:
            groups.remove(group)
        self._break_group(group, SimCollectiveError("connection closed by peer (the group was dropped)"))

    def _break(self, meeting: _Meeting, error: Exception) -> None:
        meeting.broken = True
        if meeting.group is not None:
            self._break_group(meeting.group, error)
        for _ep, _payload, waiter in meeting.parties.values():
            waiter.resolve(error=error)

    def _break_group(self, group: SimGroup, error: Exception) -> None:
        if group.broken:
            return
        group.broken = True
        ops, group.ops = group.ops, {}
        for meeting in ops.values():
            meeting.broken = True
            for _ep, _payload, waiter in meeting.parties.values():
                waiter.resolve(error=error)


# --------------------------------------------------------------------------- a worker's side


Job = Generator[tuple, object, "Completion"]


class SimEndpoint:
    """One worker incarnation's driver of its ``MemberMachine`` in simulated time (``CollectiveEndpoint``'s
    counterpart): the machine decides, this carries it out over ``SimGloo``."""

    def __init__(self, worker: WorkerProcess, world: PlaneWorld, gloo: SimGloo) -> None:
        self.w = worker
        self.world = world
        self.clock = world.clock
        self.gloo = gloo
        self.cfg = world.cfg
        self.alive = True
        self.machine = MemberMachine(worker.wid)
        self.replica: Replica | None = None
        self._timeout_s = self.cfg.collective_timeout_s
        self._job: Job | None = None
        #: The machine's job the running generator carries out, and the wait it is in (token,
        #: waiter, meeting): what a ``CancelJob`` stops, while ``_cancellable_wait`` (a serve's or a reduce's
        #: group still forming: the real ``heal.meet`` and ``GroupCache.get``'s abandon).
        self._job_of = None
        self._wait: tuple | None = None
        self._cancellable_wait = False
        self._token = 0
        #: The store client (``GroupCache.store``): the store generation it connected to, or None.
        self._store_gen: int | None = None
        #: The cached group (``GroupCache``): its prefix, the group, and this rank's next op number.
        self._prefix: str | None = None
        self._group: SimGroup | None = None
        self._seq = 0
        #: The message id that started what the session sees next (adopt records name it).
        self._cause_mid = 0
        #: (fragment, round, attempt) whose report an injected fault loses.
        self._lose_report: tuple[int, int, int] | None = None
        #: id(Welcome) -> the message id it came in (a start or heal it asks for may run later,
        #: and its adopt records and the Welcome handed on name that message).
        self._welcome_mids: dict[int, int] = {}
        #: The message id the running job's completion is handed to the session under (None: as is).
        self._job_mid: int | None = None

    @property
    def collective(self) -> bool:
        return self.machine.collective

    @property
    def state_confirmed(self) -> bool:
        """``CollectiveEndpoint.state_confirmed``: whether a checkpoint may label the state (M10)."""
        return self.machine.state_confirmed

    def restore(self, params: dict[str, torch.Tensor], round_ids: list[int],
                fragments: tuple[tuple[str, ...], ...]) -> None:
        """``CollectiveEndpoint.restore``: a checkpoint's committed state, offered in the Join (C6).
        (A simulated checkpoint holds no outer momentum: the run goes on from fresh momentum.)"""
        digests = tuple(digest({n: params[n] for n in f}) for f in fragments)
        self.machine.restored = RestoredState(params, tuple(tuple(f) for f in fragments), tuple(round_ids), digests)

    # ------------------------------------------------------------------ the session's side

    def send(self, message) -> None:
        """A message of the session (``CollectiveEndpoint.send``)."""
        if isinstance(message, Join) and message.params:
            message = dataclasses.replace(message, params={n: t.detach().clone() for n, t in message.params.items()})
        elif isinstance(message, Submit) and self.machine.collective and message.norm is None:
            message = dataclasses.replace(message, norm=tensors_norm(message.tensors))  # fp32: as decoded
        self._carry_out(self.machine.session_sends(message), None)

    def incoming(self, msg, mid: int) -> list:
        """What the session sees of ``msg`` now (in order); more may come later (``deliver_local``)."""
        self._cause_mid = mid
        if isinstance(msg, Welcome):
            self._welcome_mids[id(msg)] = mid
            while len(self._welcome_mids) > 16:  # Welcomes whose job never ran (voided, or a hub one)
                del self._welcome_mids[next(iter(self._welcome_mids))]
        now: list = []
        self._carry_out(self.machine.received(msg), now)
        return now

    def close(self) -> None:
        """The process exits or dies: its attempts end, its groups break."""
        if not self.alive:
            return
        self.alive = False
        self.machine.close()
        self._job = None
        self._token += 1
        self.gloo.peer_died(self)

    # ------------------------------------------------------------------ the machine's actions

    def _carry_out(self, actions, to_session: list | None) -> None:
        for action in actions:
            if isinstance(action, ToCoordinator):
                msg = action.message
                lose = ""
                if isinstance(msg, ReduceReport) and self._lose_report == (msg.fragment_id, msg.round_id, msg.attempt):
                    self._lose_report, lose = None, "fault"
                self.world.send(self.w, msg, lose=lose)
            elif isinstance(action, ToSession):
                if to_session is not None:
                    to_session.append(action.item)
                else:
                    self.w.deliver_local(action.item, self._job_mid)
            elif isinstance(action, RunJob):
                welcome = getattr(action.job, "welcome", None)
                self._job_mid = self._welcome_mids.pop(id(welcome), self._cause_mid) if welcome is not None else None
                self._job, self._job_of = self._run(action.job), action.job
                self._advance(None, None)
            elif isinstance(action, CancelJob):
                self._withdraw(action.job)
            elif isinstance(action, NewStore):
                # As ``CollectiveEndpoint``: a new store client (and group) after every (re)join.
                self._drop_group()
                self._store_gen = None
                self._timeout_s = action.timeout_s
            if not self.alive:
                return

    def _completed(self, done) -> None:
        self._carry_out(self.machine.completed(done), None)

    # ------------------------------------------------------------------ the data-plane thread

    def _advance(self, value, error: Exception | None) -> None:
        """Run the current job until it waits (or ends, with its completion for the machine)."""
        job = self._job
        self._token += 1
        try:
            request = job.throw(error) if error is not None else job.send(value)
        except StopIteration as stop:
            if self._job is job and self.alive:
                self._job = None
                self._completed(stop.value)
            return
        if not self.alive or self._job is not job:
            return  # the job ended the process (a crash inside the reduce)
        token = self._token
        kind = request[0]
        if kind == "sleep":
            self.w.later(request[1], self._resume, (token, None, None))
        else:  # ("wait", waiter, timeout_s, meeting or None)
            _kind, waiter, timeout_s, meeting = request
            self._wait = (token, waiter, meeting)
            waiter.on_done(lambda: self.w.later(0.0, self._resume, (token, waiter, None)))
            if timeout_s is not None:
                self.w.later(timeout_s, self._timed_out, (token, waiter, meeting))

    def _resume(self, arg) -> None:
        token, waiter, _ = arg
        if token != self._token or self._job is None or not self.alive:
            return
        if waiter is None:
            self._advance(None, None)
        else:
            self._advance(waiter.value, waiter.error)

    def _timed_out(self, arg, why: str = "") -> None:
        token, waiter, meeting = arg
        if token != self._token or self._job is None or not self.alive or waiter.done:
            return
        if meeting is not None:
            self.gloo.abandon(meeting, self)
        self._advance(None, SimCollectiveError(why or f"timed out after {self._timeout_s:.3f} s"))

    def _withdraw(self, job) -> None:
        """``CollectiveEndpoint``'s stop check: a heal withdrawn while it waits for its peer (M12,
        ``heal.meet``; here the group's forming), or a reduce whose attempt is over while its group
        forms (M13, ``GroupCache.get``'s abandon), stops there; past the wait, the job runs on."""
        if self._job_of is job and self._cancellable_wait and self._wait is not None:
            why = ("the attempt is over (aborted, superseded or decided)" if isinstance(job, ReduceJob)
                   else "the coordinator withdrew it (the joiner is gone)")
            self.w.later(0.0, lambda arg: self._timed_out(arg, why), self._wait)

    # ------------------------------------------------------------------ gloo (GroupCache, heal)

    def _store(self) -> Generator:
        """``GroupCache.store``: connect once; a client whose server restarted stays broken."""
        if self._store_gen is None:
            if not self.gloo.store_up:
                yield ("sleep", self._timeout_s)
                raise SimCollectiveError("cannot reach the coordinator's store: connection refused")
            self._store_gen = self.gloo.gen
        if self._store_gen != self.gloo.gen or not self.gloo.store_up:
            raise SimCollectiveError("the store's connection is broken: Broken pipe")

    def _build(self, prefix: str, rank: int, size: int, timeout_s: float | None = None) -> Generator:
        yield from self._store()
        meeting, waiter = self.gloo.form(self, prefix, rank, size)
        try:
            group = yield ("wait", waiter, timeout_s or self._timeout_s, meeting)
        except SimCollectiveError as exc:
            raise SimCollectiveError(f"group {prefix!r} (rank {rank} of {size}) did not form: {exc}") from None
        return group

    def _get_group(self, prefix: str, rank: int, size: int) -> Generator:
        if self._prefix == prefix and self._group is not None:
            return self._group
        self._drop_group()
        self._cancellable_wait = True  # M13: an attempt that ends meanwhile abandons the forming group
        try:
            group = yield from self._build(prefix, rank, size)
        finally:
            self._cancellable_wait = False
        self._prefix, self._group, self._seq = prefix, group, 0
        return group

    def _drop_group(self) -> None:
        if self._group is not None:
            self.gloo.drop(self, self._group)
        self._prefix, self._group, self._seq = None, None, 0

    def _collective(self, group: SimGroup, kind: str, payload, delay_s: float) -> Generator:
        seq = self._seq
        self._seq += 1
        meeting, waiter = self.gloo.collective(self, group, seq, kind, payload, delay_s)
        result = yield ("wait", waiter, self._timeout_s, meeting)
        return result

    # ------------------------------------------------------------------ jobs

    def _run(self, job) -> Job:
        return {ReduceJob: self._reduce, CommitJob: self._commit, RollbackJob: self._rollback, StartJob: self._start,
                HealJob: self._heal, ServeHealJob: self._serve_heal}[type(job)](job)

    def _reduce(self, job: ReduceJob) -> Job:
        """``CollectiveEndpoint._reduce``: combine and propose; the faults of this plane are this
        driver's behaviour (the machine reports what it is told)."""
        order, replica = job.order, self.replica
        fid, rid, wid = order.fragment_id, order.round_id, self.w.wid
        fault = self.world.reduce_fault(self.w, order)
        if fault == "reduce_crash" and self.world.crash_before_collective():
            self.world.crash_in_reduce(self.w, "before the collective")
            return Reduced("", "crashed")
        vote, detail, refused = "", "", None
        try:
            group = yield from self._get_group(order.prefix, order.group.index(wid), len(order.group))
            names = replica.fragments[fid]
            flat = torch.cat([job.submit.tensors[n].detach().reshape(-1).to(torch.float32) for n in names]).clone()
            if fault == "report_fail":
                raise SimCollectiveError("the all-reduce failed: injected fault")
            if order.gather:
                flats = yield from self._collective(group, "allgather", flat, self.cfg.reduce_s)
                norms = tuple(tensors_norm({"flat": f}) for f in flats)
                total = torch.stack(flats).sum(dim=0)
            else:
                norms = ()
                total = yield from self._collective(group, "allreduce", flat, self.cfg.reduce_s)
            total = total / group.size
            mean, offset = {}, 0
            for n in names:
                k = replica.params[n].numel()
                mean[n] = total[offset:offset + k].view(replica.params[n].shape).clone()
                offset += k
            refused = judge_reduce(order, norms, lambda: tensors_norm(mean))
            if refused is None:
                if fault == "digest_mismatch":
                    first = mean[names[0]].view(-1)
                    first[0] += _MISMATCH_EPS
                vote = replica.propose(fid, rid, mean, mean_bound(order))
        except StepRefused as exc:
            detail = str(exc)  # this member's own state, not the group's: keep the group
        except (SimCollectiveError, FloatingPointError, RuntimeError) as exc:
            self._drop_group()
            detail = str(exc)
        if fault == "reduce_crash":
            self.world.crash_in_reduce(self.w, "after the collective, before the report")
            return Reduced("", "crashed")
        if fault == "wedge":
            yield ("sleep", self.cfg.wedge_factor * self.cfg.reduce_timeout_s)
        if fault == "report_lost":
            self._lose_report = (fid, rid, order.attempt)
        return refused or Reduced(vote, detail)

    def _commit(self, job: CommitJob) -> Job:
        replica = self.replica
        if not replica.commit(job.fragment_id, job.round_id, job.digest):
            raise RuntimeError(f"fragment {job.fragment_id}: no proposal of round {job.round_id} "
                               f"with digest {job.digest[:12]}")
        self._adopted(job.fragment_id, "commit", job.digest)
        return Committed({n: t.clone() for n, t in replica.fragment(job.fragment_id).items()})
        yield  # a job (a generator) like the others

    def _rollback(self, job: RollbackJob) -> Job:
        if self.replica is not None:
            for fid in job.fragment_ids:
                self.replica.rollback(fid)
        return RolledBack()
        yield  # a job (a generator) like the others

    def _start(self, job: StartJob) -> Job:
        """C6: this member starts the run from its own params, or keeps the state it holds."""
        welcome, mid = job.welcome, self._job_mid
        if job.keep:
            replica = self.replica
            for fid in job.adopt:
                proposal = replica.proposal(fid)
                replica.commit(fid, proposal.round_id, proposal.digest)
                self._adopted(fid, "commit", proposal.digest, via="welcome")
            for fid in job.rollback:
                replica.rollback(fid)
            replica.round_ids = list(welcome.round_ids)
        else:
            # (A real worker restored from its checkpoint starts with its committed outer momentum;
            # the simulated one starts without: its checkpoint holds no outer state.)
            self.replica = Replica.for_welcome(welcome, job.params, list(welcome.round_ids), job.outer_states)
        for fid in range(len(self.replica.fragments)):
            self._adopted(fid, "start", mid=mid)
        return Started(tuple(self.replica.committed_digests()), self.replica.params_copy())
        yield  # a job (a generator) like the others

    def _heal(self, job: HealJob) -> Job:
        """``CollectiveEndpoint._heal``: copy the committed state from the Welcome's source (rank 1 of 2)."""
        welcome, mid = job.welcome, self._job_mid
        if self.replica is not None:
            self.replica.rollback_all()  # the healed state replaces whatever this member proposed
        try:
            group = yield from self._build(welcome.heal_prefix, 1, 2, HEAL_TIMEOUTS * self._timeout_s)
            round_ids, params, states = yield from self._heal_transfer(group, None)
            self.replica = Replica.for_welcome(welcome, params, round_ids, states)
        except SimCollectiveError as exc:
            self.world.emit({"k": "fault", "t": self.clock.now, "what": "heal_failed", "w": self.w.wid,
                             "from": welcome.heal_source, "why": str(exc)})
            return HealFailed(str(exc))
        for fid in range(len(self.replica.fragments)):
            self._adopted(fid, "heal", source=welcome.heal_source, mid=mid)
        return Healed(tuple(round_ids), tuple(self.replica.committed_digests()), self.replica.params_copy())

    def _serve_heal(self, job: ServeHealJob) -> Job:
        """``CollectiveEndpoint._serve_heal``: send the committed state to the joiner (rank 0 of 2)."""
        # Committed state only: a proposal whose verdict a lost connection swallowed is still
        # applied in place until a Welcome settles it (C6).
        state = self.replica.committed_state()
        try:
            self._cancellable_wait = True
            try:
                group = yield from self._build(job.order.prefix, 0, 2, HEAL_TIMEOUTS * self._timeout_s)
            finally:
                self._cancellable_wait = False
            yield from self._heal_transfer(group, state)
        except SimCollectiveError as exc:
            self.world.emit({"k": "fault", "t": self.clock.now, "what": "heal_failed", "w": self.w.wid,
                             "to": job.order.joiner, "why": str(exc)})
            return HealServed(False, str(exc))
        return HealServed(True)

    def _heal_transfer(self, group: SimGroup, state) -> Generator:
        meeting, waiter = self.gloo.collective(self, group, 0, "broadcast", state, self.cfg.heal_s)
        try:
            result = yield ("wait", waiter, HEAL_TIMEOUTS * self._timeout_s, meeting)
        except SimCollectiveError:
            self.gloo.drop(self, group)
            raise
        self.gloo.drop(self, group)  # a heal's group serves once
        return result

    # ------------------------------------------------------------------ helpers

    def _adopted(self, fid: int, src: str, digest: str = "", source: str = "", mid: int | None = None,
                 via: str = "") -> None:
        """Trace a change of this replica's committed state of fragment ``fid`` (the checker's C4)."""
        replica = self.replica
        names = replica.fragments[fid]
        h = hash_values((n, replica.params[n].reshape(-1).tolist()) for n in names)
        rec = {"k": "adopt", "t": self.clock.now, "w": self.w.wid, "p": self.w.peer,
               "m": self._cause_mid if mid is None else mid, "f": fid, "r": replica.round_ids[fid], "h": h,
               "src": src}
        if digest:
            rec["d"] = digest
        if source:
            rec["from"] = source
        if via:
            rec["via"] = via  # an orphan proposal adopted on a Welcome's last commits
        self.world.emit(rec)
