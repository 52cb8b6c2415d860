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
* ``SimEndpoint``, one per worker incarnation, the ``CollectiveEndpoint``'s logic: the
  session's ``Submit`` keeps the pseudo-gradient here and goes out without tensors; a
  ``ReduceOrder``, a ``HealOrder``, a heal from the ``Welcome``'s source and the start of
  a run are *jobs* of one data-plane thread, run in order; each job is a generator that
  waits for simulated events (a sleep, a rendezvous, a collective, the verdict) exactly
  where the real thread blocks. The replica is the real ``diloco.collective.replica.Replica``
  (the outer step, the digest, commit and rollback).

``SimGloo`` needs only the clock; a ``SimEndpoint`` uses the rest of the simulation only
through its ``world.PlaneWorld`` (the clock, the trace, its worker's link, the reduce
faults) and talks to its own worker (``SimWorker.later``, ``deliver_local``).

Faults of this plane (``diloco.sim.config.REDUCE_FAULT_KINDS``), drawn per reduce job by the
fault injector (``PlaneWorld.reduce_fault``) while the safety phase lasts: a member dies
inside the reduce (before the collective or after it, before its report), its report is
lost, it proposes from a different mean (another digest), its collective fails (it reports
failure), or its data plane wedges after the collective for longer than the reduce timeout
(it keeps heartbeating; only the core's timeout ends the attempt). A heal fails when its
source is dead, frozen, busy past the timeout or its store client is broken.

Every replica change is traced as an ``adopt`` record (``src``: ``commit``, ``heal`` or
``start``), the only place a worker takes an outer step: the checker holds each against the
coordinator's commits.

Why one file of about 750 lines: it is the simulated counterpart of one worker's collective
data plane (its endpoint, its data thread, its group and heal transfers) and of the gloo
groups they meet in; every part reads the same simulated worker and group state.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import TYPE_CHECKING, Generator

import torch

from diloco.collective.replica import Replica
from diloco.outer import OuterConfig
from diloco.sim.config import COLLECTIVE_HEAL_ATTEMPTS, COLLECTIVE_HEAL_TIMEOUTS
from diloco.sim.trace import hash_values
from diloco.wire.messages import (
    Error,
    ErrorCode,
    HealOrder,
    Join,
    Leave,
    ReduceAbort,
    ReduceOrder,
    ReduceReport,
    Result,
    Submit,
    Welcome,
)

if TYPE_CHECKING:  # pragma: no cover
    from diloco.sim.worker import SimWorker
    from diloco.sim.world import Clock, PlaneWorld

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
    kind: str                      # "form", "allreduce", "broadcast"
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


@dataclasses.dataclass(eq=False)
class _Verdict:
    """The coordinator's answer to one attempt (``commit``, ``abort``, or ``reset`` by a Welcome)."""

    waiter: Waiter = dataclasses.field(default_factory=Waiter)
    kind: str = ""
    result: Result | None = None

    def set(self, kind: str, result: Result | None = None) -> None:
        if not self.kind:
            self.kind, self.result = kind, result
        self.waiter.resolve()


Job = Generator[tuple, object, None]


class SimEndpoint:
    """One worker incarnation's collective plane: ``CollectiveEndpoint``'s logic in simulated time."""

    def __init__(self, worker: SimWorker, world: PlaneWorld, gloo: SimGloo) -> None:
        self.w = worker
        self.world = world
        self.clock = world.clock
        self.gloo = gloo
        self.cfg = world.cfg
        self.alive = True
        self.collective = False
        self.replica: Replica | None = None
        self._held_params: dict | None = None
        self._wants_start_params = False
        self._welcome: Welcome | None = None
        self._timeout_s = self.cfg.collective_timeout_s
        #: fragment -> (round_id, pseudo-gradient) of the session's last Submit.
        self._pending: dict[int, tuple[int, dict]] = {}
        self._verdicts: dict[tuple[int, int], tuple[int, _Verdict]] = {}
        self._jobs: collections.deque = collections.deque()
        self._job: Job | None = None
        self._starting = False
        self._token = 0
        self._heal_attempts = 0
        #: joiner -> the prefix of its newest heal order (older ones are not served).
        self._heal_orders: dict[str, str] = {}
        self._last_join: Join | None = None
        #: A collective Welcome is held back while this member heals or builds its replica.
        self._welcome_withheld = False
        #: The store client (``GroupCache.store``): the store generation it connected to, or None.
        self._store_gen: int | None = None
        #: The cached group (``GroupCache``): its prefix, the group, and this rank's next op number.
        self._prefix: str | None = None
        self._group: SimGroup | None = None
        self._seq = 0
        #: The message id that started what the session sees next (adopt records name it).
        self._cause_mid = 0

    # ------------------------------------------------------------------ the session's side

    def send(self, message) -> None:
        """A message of the session (``CollectiveEndpoint.send``)."""
        if isinstance(message, Join):
            if self._welcome_withheld:
                return  # a resend while healing or starting: the Welcome will come
            if message.params and self._wants_start_params:
                # The run's first member starts it from its own params; they stay here (C6).
                self._held_params = {n: t.detach().clone() for n, t in message.params.items()}
                message = dataclasses.replace(message, params={}, holds_params=True)
            elif not message.params and self.replica is not None:
                # It offers the committed state it holds (``CollectiveEndpoint._offer_held_state``).
                message = dataclasses.replace(message, holds_params=True, held_rounds=tuple(self.replica.round_ids),
                                              held_digests=tuple(self.replica.committed_digests()))
            self._last_join = message
        elif isinstance(message, Submit) and self.collective:
            self._pending[message.fragment_id] = (message.round_id, dict(message.tensors))
            message = dataclasses.replace(message, tensors={}, scales={})
        self.world.send(self.w, message)

    def incoming(self, msg, mid: int):
        """What the session should see of ``msg`` (None: nothing, or later).

        ``CollectiveEndpoint._incoming``, with the verdicts handled at once where the real
        data thread is woken to handle them.
        """
        self._cause_mid = mid
        if isinstance(msg, Welcome):
            return self._on_welcome(msg)
        if isinstance(msg, Error) and msg.code is ErrorCode.START_PARAMS_REQUIRED:
            self._wants_start_params = True
            return dataclasses.replace(msg, code=ErrorCode.PARAMS_REQUIRED)
        if not self.collective:
            return msg
        if isinstance(msg, Error) and msg.code is ErrorCode.REDUCING:
            # As ``CollectiveEndpoint``: join again (and heal), as on a stale round (C3).
            return dataclasses.replace(msg, code=ErrorCode.STALE_ROUND, detail=f"{msg.detail} (joining again)")
        if isinstance(msg, ReduceOrder):
            self._on_order(msg)
            return None
        if isinstance(msg, ReduceAbort):
            self._resolve(msg.fragment_id, msg.round_id, "abort", attempt=msg.attempt)
            return None
        if isinstance(msg, HealOrder):
            # A joiner that re-joined got a new order: serve only the newest one per joiner.
            self._heal_orders[msg.joiner] = msg.prefix
            self._queue(self._serve_heal(msg))
            return None
        if isinstance(msg, Result):
            if msg.outcome == "stop" or not msg.digest:
                self._resolve(msg.fragment_id, msg.round_id, "abort")
                return msg
            if not self._resolve(msg.fragment_id, msg.round_id, "commit", result=msg):
                return self._lost_track(msg)
            return None  # the data thread hands the session the Result with params
        return msg

    def close(self) -> None:
        """The process exits or dies: its attempts end, its groups break."""
        if not self.alive:
            return
        self.alive = False
        self._void_attempts()
        self._jobs.clear()
        self._job = None
        self._token += 1
        self.gloo.peer_died(self)

    # ------------------------------------------------------------------ from the coordinator

    def _on_welcome(self, msg: Welcome):
        self._void_attempts()
        if msg.data_plane != "collective":
            self.collective = False
            return msg
        self.collective = True
        # As ``CollectiveEndpoint``: a new store client (and group) after every (re)join.
        self._drop_group()
        self._store_gen = None
        self._welcome = msg
        self._timeout_s = float(msg.collective_timeout_s) or 30.0
        self._pending.clear()
        if not msg.heal_source:
            if self._held_params is None and self.replica is None:
                return Error(ErrorCode.BAD_MESSAGE, "collective Welcome without a heal source, but this "
                                                    "worker sent no params to start the run from", "Join")
            self._welcome_withheld = True
            self._queue(self._start(msg, self._held_params, self._cause_mid))
            self._held_params = None
            return None
        self._welcome_withheld = True
        self._queue(self._heal(msg, self._cause_mid))
        return None

    def _on_order(self, order: ReduceOrder) -> None:
        verdict = _Verdict()
        old = self._verdicts.get((order.fragment_id, order.round_id))
        if old is not None:
            old[1].set("abort")
        self._verdicts[(order.fragment_id, order.round_id)] = (order.attempt, verdict)
        self._queue(self._reduce(order, verdict))

    def _resolve(self, fid: int, rid: int, kind: str, *, attempt: int | None = None,
                 result: Result | None = None) -> bool:
        entry = self._verdicts.get((fid, rid))
        if entry is None or (attempt is not None and entry[0] != attempt):
            return False
        del self._verdicts[(fid, rid)]
        entry[1].set(kind, result)
        return True

    def _lost_track(self, msg: Result):
        return Error(ErrorCode.UNKNOWN_WORKER, f"fragment {msg.fragment_id} round {msg.round_id} committed "
                                               f"without a proposal of this worker's: joining again to heal",
                     "Submit")

    def _void_attempts(self) -> None:
        entries = list(self._verdicts.values())
        self._verdicts.clear()
        for _attempt, verdict in entries:
            verdict.set("reset")

    # ------------------------------------------------------------------ the data-plane thread

    def _queue(self, job: Job) -> None:
        self._jobs.append(job)
        if self._job is None:
            self._next_job()

    def _next_job(self) -> None:
        # A loop, not recursion: many queued jobs may end at once (orders aborted before they ran).
        if self._starting:
            return
        self._starting = True
        try:
            while self._job is None and self._jobs and self.alive:
                self._job = self._jobs.popleft()
                self._advance(None, None)
        finally:
            self._starting = False

    def _advance(self, value, error: Exception | None) -> None:
        """Run the current job until it waits (or ends)."""
        job = self._job
        self._token += 1
        try:
            request = job.throw(error) if error is not None else job.send(value)
        except StopIteration:
            if self._job is job:
                self._job = None
                self._next_job()
            return
        if not self.alive or self._job is not job:
            return  # the job ended the process (a crash inside the reduce)
        token = self._token
        kind = request[0]
        if kind == "sleep":
            self.w.later(request[1], self._resume, (token, None, None))
        else:  # ("wait", waiter, timeout_s, meeting or None)
            _kind, waiter, timeout_s, meeting = request
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

    def _timed_out(self, arg) -> None:
        token, waiter, meeting = arg
        if token != self._token or self._job is None or not self.alive or waiter.done:
            return
        if meeting is not None:
            self.gloo.abandon(meeting, self)
        self._advance(None, SimCollectiveError(f"timed out after {self._timeout_s:.3f} s"))

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
        group = yield from self._build(prefix, rank, size)
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

    def _reduce(self, order: ReduceOrder, verdict: _Verdict) -> Job:
        """``CollectiveEndpoint._reduce``: combine, propose, report, then wait for the verdict."""
        fid, rid, wid = order.fragment_id, order.round_id, self.w.wid
        if verdict.waiter.done:
            return  # aborted (or superseded) before it started: no collective on a broken group
        pending = self._pending.get(fid)
        replica = self.replica
        fault = self.world.reduce_fault(self.w, order)
        ok, vote, detail = False, "", ""
        if replica is None or pending is None or pending[0] != rid or wid not in order.group:
            detail = f"no pseudo-gradient of fragment {fid} round {rid} on this worker"
        else:
            if fault == "reduce_crash" and self.world.crash_before_collective():
                self.world.crash_in_reduce(self.w, "before the collective")
                return
            try:
                group = yield from self._get_group(order.prefix, order.group.index(wid), len(order.group))
                names = replica.fragments[fid]
                flat = torch.cat([pending[1][n].detach().reshape(-1).to(torch.float32) for n in names]).clone()
                if fault == "report_fail":
                    raise SimCollectiveError("the all-reduce failed: injected fault")
                total = yield from self._collective(group, "allreduce", flat, self.cfg.reduce_s)
                total = total / group.size
                mean, offset = {}, 0
                for n in names:
                    k = replica.params[n].numel()
                    mean[n] = total[offset:offset + k].view(replica.params[n].shape).clone()
                    offset += k
                if fault == "digest_mismatch":
                    first = mean[names[0]].view(-1)
                    first[0] += _MISMATCH_EPS
                vote = replica.propose(fid, rid, mean)
                ok = True
            except (SimCollectiveError, FloatingPointError, RuntimeError) as exc:
                self._drop_group()
                detail = str(exc)
            if fault == "reduce_crash":
                self.world.crash_in_reduce(self.w, "after the collective, before the report")
                return
            if fault == "wedge":
                yield ("sleep", self.cfg.wedge_factor * self.cfg.reduce_timeout_s)
        report = ReduceReport(wid, fid, rid, order.attempt, ok, vote, detail[:1000])
        self.world.send(self.w, report, lose="fault" if fault == "report_lost" else "")
        yield ("wait", verdict.waiter, None, None)
        if not ok:
            return
        if verdict.kind == "commit" and verdict.result is not None and replica.commit(fid, rid, verdict.result.digest):
            self._commit_adopted(fid, rid, verdict.result.digest)
            params = {n: t.clone() for n, t in replica.fragment(fid).items()}
            result = dataclasses.replace(verdict.result, params=params, delta=False, wire_dtype="fp32", scales={},
                                         digest="")
            self.w.deliver_local(result)
        elif verdict.kind == "commit":
            self.w.deliver_local(self._lost_track(verdict.result))
        elif verdict.kind == "abort":
            replica.rollback(fid)
        # "reset": a Welcome voided the attempt; the proposal stays until a start settles it
        # against the Welcome's last commits (``_settle_orphans``), or a heal replaces it.

    def _commit_adopted(self, fid: int, rid: int, digest: str, via: str = "") -> None:
        if self._pending.get(fid, (None,))[0] == rid:
            del self._pending[fid]
        self._adopted(fid, "commit", digest, via=via)

    def _settle_orphans(self, welcome: Welcome) -> None:
        """``CollectiveEndpoint._settle_orphans``: adopt a proposal the coordinator durably committed
        (the Welcome names each fragment's last commit), roll back the rest (C4)."""
        replica = self.replica
        for fid in range(len(replica.fragments)):
            proposal = replica.proposal(fid)
            if proposal is None:
                continue
            committed = welcome.committed[fid] if fid < len(welcome.committed) else (-1, "")
            if tuple(committed) == (proposal.round_id, proposal.digest) and replica.commit(fid, *committed):
                self._commit_adopted(fid, proposal.round_id, proposal.digest, via="welcome")
            else:
                replica.rollback(fid)

    def _serve_heal(self, order: HealOrder) -> Job:
        """``CollectiveEndpoint._serve_heal``: send the committed state to the joiner (rank 0 of 2)."""
        replica = self.replica
        if replica is None or self._heal_orders.get(order.joiner) != order.prefix:
            return  # superseded by a newer order for the same joiner (it re-joined)
        # Committed state only, as ``CollectiveEndpoint._serve_heal``: a proposal whose verdict a lost
        # connection swallowed is still applied in place until a Welcome settles it (C6).
        state = replica.committed_state()
        try:
            group = yield from self._build(order.prefix, 0, 2, COLLECTIVE_HEAL_TIMEOUTS * self._timeout_s)
            yield from self._heal_transfer(group, state)
        except SimCollectiveError as exc:
            self.world.emit({"k": "fault", "t": self.clock.now, "what": "heal_failed", "w": self.w.wid,
                           "to": order.joiner, "why": str(exc)})

    def _heal_transfer(self, group: SimGroup, state) -> Generator:
        meeting, waiter = self.gloo.collective(self, group, 0, "broadcast", state, self.cfg.heal_s)
        try:
            result = yield ("wait", waiter, COLLECTIVE_HEAL_TIMEOUTS * self._timeout_s, meeting)
        except SimCollectiveError:
            self.gloo.drop(self, group)
            raise
        self.gloo.drop(self, group)  # a heal's group serves once
        return result

    def _heal(self, welcome: Welcome, mid: int) -> Job:
        """``CollectiveEndpoint._heal``: copy the committed state from the Welcome's source (rank 1 of 2)."""
        if self.replica is not None:
            self.replica.rollback_all()  # the healed state replaces whatever this member proposed
        try:
            group = yield from self._build(welcome.heal_prefix, 1, 2, COLLECTIVE_HEAL_TIMEOUTS * self._timeout_s)
            round_ids, params, states = yield from self._heal_transfer(group, None)
            self.replica = self._new_replica(welcome, params, round_ids, states)
        except SimCollectiveError as exc:
            self._heal_attempts += 1
            self.world.emit({"k": "fault", "t": self.clock.now, "what": "heal_failed", "w": self.w.wid,
                           "from": welcome.heal_source, "attempt": self._heal_attempts, "why": str(exc)})
            if self._heal_attempts >= COLLECTIVE_HEAL_ATTEMPTS or self._last_join is None:
                self._welcome_withheld = False
                self.w.deliver_local(Error(ErrorCode.BAD_MESSAGE, f"could not copy the run's state from "
                                                                  f"{welcome.heal_source!r}: {exc}", "Join"))
                return
            # Join again: the coordinator names another source (or the same one, recovered).
            self.world.send(self.w, Leave(self.w.wid))
            self.world.send(self.w, self._last_join)
            return
        self._heal_attempts = 0
        self._welcome_withheld = False
        for fid in range(len(self.replica.fragments)):
            self._adopted(fid, "heal", source=welcome.heal_source, mid=mid)
        self.w.deliver_local(dataclasses.replace(welcome, round_ids=tuple(round_ids), parked=(),
                                                 params=self._session_params()), mid)

    def _start(self, welcome: Welcome, params: dict, mid: int) -> Job:
        """C6: this member starts the run from its own params (``CollectiveEndpoint._start``)."""
        if self.replica is not None and self.replica.fragments == tuple(tuple(f) for f in welcome.fragments):
            # The coordinator restarted (or forgot every holder) and this member re-joins first: it
            # keeps the committed state in memory, and adopts a proposal the Welcome says committed.
            self._settle_orphans(welcome)
            if self.replica.round_ids != list(welcome.round_ids):
                self.replica.round_ids = list(welcome.round_ids)
        else:
            # (A real worker restored from its checkpoint starts with its committed outer momentum;
            # the simulated one starts without: its checkpoint holds no outer state.)
            self.replica = self._new_replica(welcome, params, list(welcome.round_ids), None)
        self._heal_attempts = 0
        self._welcome_withheld = False
        for fid in range(len(self.replica.fragments)):
            self._adopted(fid, "start", mid=mid)
        self.w.deliver_local(dataclasses.replace(welcome, params=self._session_params()), mid)
        return
        yield  # a job (a generator) like the others

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

    def _new_replica(self, welcome: Welcome, params, round_ids, states) -> Replica:
        outer = OuterConfig(**welcome.outer) if welcome.outer else OuterConfig()
        return Replica(params, tuple(tuple(f) for f in welcome.fragments), round_ids, outer, welcome.wire_dtype,
                       welcome.min_workers, states)

    def _session_params(self) -> dict:
        return {n: t.clone() for n, t in self.replica.params.items()}
