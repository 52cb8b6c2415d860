"""``CollectiveEndpoint``: the real driver of a worker's ``MemberMachine`` (SPEC.md section 7c).

It wraps the worker's real endpoint and is transparent on a hub run. On a collective run the
machine (``diloco.collective.member``) decides what the session and the coordinator see of each
other's messages and what work the data plane does; this file only carries that out:

* the owner thread (the one that calls ``send`` and ``recv``; ZeroMQ sockets are not
  thread-safe) feeds the machine the session's messages, the coordinator's, and the
  completions of the data plane's jobs, and does what it answers: sends to the coordinator,
  hands to the session, queues a job;
* the data-plane thread runs one job at a time -- a reduce (``reduce``) and the proposal of the
  outer step (``replica``), a commit or a rollback, a start, a heal (``heal``), serving a heal --
  and puts its completion on one queue, waking the owner. The machine's state is touched by the
  owner thread only; the replica by the data-plane thread (and, under its own lock, by a
  checkpoint read).

Why one file of about 350 lines: the jobs and the buffers they keep from round to round (the
reduce's, the Results') share the replica and the group cache; the decisions are in
``member``, the parts that own no state beside it (``groups``, ``reduce``, ``replica``, ``heal``).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import queue
import threading
import time
from typing import Any

import torch

from diloco.collective import heal
from diloco.collective.groups import CollectiveError, GroupCache, connect_store, local_address_towards
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
    JobFailed,
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
from diloco.collective.reduce import (
    bytes_on_link,
    contribution_norm,
    mean_pseudo_gradient,
    reduce_buffer,
    tensors_norm,
)
from diloco.collective.replica import Replica, StepRefused, digest
from diloco.transport.zmq.address import address_host
from diloco.wire import compression
from diloco.wire.messages import Join, Message, ReduceOrder, Submit

#: How long ``close`` waits for the data-plane thread to finish the job it is in.
CLOSE_JOIN_S = 30.0

log = logging.getLogger("diloco.collective")


class CollectiveEndpoint:
    """Wraps a ``WorkerEndpoint``; see the module docstring."""

    def __init__(self, inner, worker_id: str, *, store_host: str | None = None, device=None) -> None:
        self.inner = inner
        self.worker_id = worker_id
        #: The device this worker trains on: a CUDA one makes its reduces run there, over NCCL
        #: (``groups.backend_for``); heals and the replica stay on the CPU, over gloo.
        self.device = device
        self._store_host = store_host or _host_of(getattr(inner, "address", None))
        self.machine = MemberMachine(worker_id)
        #: The replica: built, replaced and stepped by the data-plane thread only.
        self.replica: Replica | None = None
        self._store_port = 0
        self._timeout_s = 30.0
        self._groups: GroupCache | None = None
        self._inbox: collections.deque[Any] = collections.deque()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._completions: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False
        #: The job the machine withdrew (M12), read by the data-plane thread at each of its heal's
        #: waits: a heal or a serve stops there. One reference, written by the owner thread only.
        self._cancelled: Any = None
        self._reduce_buffers: dict[int, torch.Tensor] = {}
        #: fragment -> two sets of buffers the committed params are handed to the session in, in
        #: turn (the next one first).
        self._result_buffers: dict[int, list[dict[str, torch.Tensor]]] = {}
        #: What the data-plane thread counted (bytes, failed collectives); the machine counts the rest.
        self._job_stats: collections.Counter = collections.Counter()

    # ------------------------------------------------------------------ what the worker reads

    @property
    def collective(self) -> bool:
        return self.machine.collective

    @property
    def stats(self) -> collections.Counter:
        """What the data plane did, for status lines and tests."""
        return self.machine.stats + self._job_stats

    @property
    def state_confirmed(self) -> bool:
        """Whether a checkpoint may label the committed state with its round ids (M10)."""
        return self.machine.state_confirmed

    @property
    def adopted(self) -> collections.deque:
        """The last commits this member adopted: (fragment, round, digest), newest last."""
        return self.machine.adopted

    def restore(self, params: dict[str, torch.Tensor], round_ids: list[int],
                fragments: tuple[tuple[str, ...], ...], outer_states: list[dict] | None) -> None:
        """A checkpoint's committed state (C6): offered in the Join; the run starts again from it if
        it is the newest, with its outer momentum."""
        digests = tuple(digest({n: params[n] for n in f}) for f in fragments)
        self.machine.restored = RestoredState(params, tuple(tuple(f) for f in fragments), tuple(round_ids),
                                              digests, outer_states)

    def committed_outer_states(self) -> list[dict] | None:
        """The outer optimizers' committed state (for the worker's checkpoint); None on the hub."""
        replica = self.replica
        if not self.collective or replica is None:
            return None
        return replica.committed_optimizer_states()

    # ------------------------------------------------------------------ the endpoint interface

    def send(self, message: Message) -> None:
        if isinstance(message, Join) and message.params:
            # The machine keeps a start's params: copies the session will not change.
            message = dataclasses.replace(message, params={n: t.detach().clone() for n, t in message.params.items()})
        elif isinstance(message, Submit) and self.machine.collective and message.norm is None:
            message = dataclasses.replace(message, norm=self._declared_norm(message))
        self._carry_out(self.machine.session_sends(message))

    def _declared_norm(self, submit: Submit) -> float:
        """The norm of ``submit``'s pseudo-gradient as the group will decode it (SPEC.md section 7c)."""
        replica = self.replica
        if replica is None or not 0 <= submit.fragment_id < len(replica.fragments):
            return math.nan  # no state to have trained from: refused (the machine never reduces it)
        shapes = {n: replica.params[n].shape for n in replica.fragments[submit.fragment_id]}
        try:
            return contribution_norm(compression.Encoded(dict(submit.tensors), dict(submit.scales)),
                                     submit.wire_dtype, shapes, replica.sparse_fmt)
        except (compression.EncodingError, KeyError):
            return math.nan  # the coordinator refuses it (non_finite); the group never sees it

    def recv(self, timeout_s: float) -> Message | None:
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            self._drain_completions()
            if self._inbox:
                return self._inbox.popleft()
            msg = self.inner.recv(max(0.0, deadline - time.monotonic()))
            if msg is not None:
                self._carry_out(self.machine.received(msg))
                continue
            if self._inbox or not self._completions.empty():
                continue
            # The deadline passed, or a ``wake`` ended the wait: the owner has something to send.
            return None

    def wake(self) -> None:
        wake = getattr(self.inner, "wake", None)
        if callable(wake):
            wake()

    def silence_s(self) -> float:
        # M5: a withheld Welcome is the coordinator's answer, its state still on its way (a start
        # or heal, bounded by M6): no outage, however long the heal takes.
        return 0.0 if self.machine.welcome_withheld else self.inner.silence_s()

    def sending(self) -> bool:
        return self.inner.sending()

    def receiving(self) -> bool:
        # M5: a withheld Welcome is on its way: the session heartbeats rather than resending its
        # Join, so the coordinator, which counts it a member since the Welcome, hears it alive
        # through a heal longer than the heartbeat timeout.
        return self.machine.welcome_withheld or self.inner.receiving()

    @property
    def address(self) -> str | None:
        return getattr(self.inner, "address", None)

    def close(self) -> None:
        self._closed = True  # a heal or a serve in progress stops at its next wait
        self.machine.close()
        self._jobs.put(None)
        self.inner.close()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            # A process that exits while this (daemon) thread is inside torch -- freeing a round's
            # buffers -- is aborted by the C++ runtime: let it finish its job first.
            thread.join(CLOSE_JOIN_S)

    # ------------------------------------------------------------------ the owner thread

    def _carry_out(self, actions) -> None:
        for action in actions:
            if isinstance(action, ToCoordinator):
                self.inner.send(action.message)
            elif isinstance(action, ToSession):
                self._inbox.append(action.item)
            elif isinstance(action, RunJob):
                self._start_thread()
                self._jobs.put(action.job)
            elif isinstance(action, CancelJob):
                self._cancelled = action.job
            elif isinstance(action, NewStore):
                # A client of a restarted coordinator's old store never reconnects: a new one per join.
                self._groups = None
                self._store_port, self._timeout_s = action.port, action.timeout_s

    def _drain_completions(self) -> None:
        while True:
            try:
                done = self._completions.get_nowait()
            except queue.Empty:
                return
            self._carry_out(self.machine.completed(done))

    def _start_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name=f"diloco-collective-{self.worker_id}",
                                            daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ the data-plane thread

    def _work(self) -> None:
        run = {ReduceJob: self._reduce, CommitJob: self._commit, RollbackJob: self._rollback,
               StartJob: self._start, HealJob: self._heal, ServeHealJob: self._serve_heal}
        while True:
            job = self._jobs.get()
            if job is None or self._closed:
                return
            began = time.monotonic()
            try:
                done: Completion = run[type(job)](job)
            except Exception as exc:  # never let the thread die: the machine hears of it
                done = JobFailed(f"{type(exc).__name__}: {exc}")
            self._say_if_slow_or_failed(job, done, time.monotonic() - began)
            self._completions.put(done)
            self.wake()

    def _reduce(self, job: ReduceJob) -> Completion:
        order, replica = job.order, self.replica
        fid, rid = order.fragment_id, order.round_id
        assert replica is not None and job.submit is not None  # the machine checked (M2)
        encoded = compression.Encoded(dict(job.submit.tensors), dict(job.submit.scales))
        try:
            cache = self._group_cache()
            group = cache.get(order.prefix, order.group.index(self.worker_id), len(order.group), self._stop_for(job))
            shapes = {n: replica.params[n].shape for n in replica.fragments[fid]}
            mean, norms, mean_norm = mean_pseudo_gradient(group, encoded, replica.wire_dtype, shapes, self._timeout_s,
                                               reduce_buffer(self._reduce_buffers, fid, shapes), cache.device,
                                               order.gather, replica.sparse_fmt)
            self._job_stats["bytes_sent"] += bytes_on_link(encoded, replica.wire_dtype, len(order.group),
                                                           order.gather)
            refused = judge_reduce(order, norms, lambda: tensors_norm(mean) if mean_norm is None else mean_norm)
            if refused is not None:
                return refused
            vote = replica.propose(fid, rid, mean, mean_bound(order))
        except StepRefused as exc:
            return Reduced("", str(exc))  # this member's own state, not the group's: keep the group
        except (CollectiveError, FloatingPointError, RuntimeError) as exc:
            self._group_cache().drop()
            # A timed-out collective may still write into its buffer: never reuse that one.
            self._reduce_buffers.pop(fid, None)
            return Reduced("", str(exc))
        return Reduced(vote)

    def _commit(self, job: CommitJob) -> Completion:
        replica = self.replica
        assert replica is not None
        if not replica.commit(job.fragment_id, job.round_id, job.digest):
            raise RuntimeError(f"fragment {job.fragment_id}: the replica's proposal is not round "
                               f"{job.round_id} with digest {job.digest[:12]}")
        return Committed(self._result_params(job.fragment_id, replica.fragment(job.fragment_id)))

    def _rollback(self, job: RollbackJob) -> Completion:
        if self.replica is not None:
            for fid in job.fragment_ids:
                self.replica.rollback(fid)
        return RolledBack()

    def _start(self, job: StartJob) -> Completion:
        """C6: this member starts the run from its own params (and, restored, its outer momentum),
        or, holding the run's state already, keeps it."""
        welcome = job.welcome
        if job.keep:
            assert self.replica is not None
            self.replica.settle(job.adopt, job.rollback, welcome.round_ids)
        else:
            self.replica = Replica.for_welcome(welcome, job.params, list(welcome.round_ids), job.outer_states)
        return Started(tuple(self.replica.committed_digests()), self.replica.params_copy())

    def _heal(self, job: HealJob) -> Completion:
        welcome = job.welcome
        if self.replica is not None:
            self.replica.rollback_all()  # the healed state replaces whatever this member proposed
        prefixes = [welcome.heal_prefix, *welcome.more_heal_prefixes]
        if len(welcome.more_heal_prefixes) != len(welcome.more_heal_sources):
            return HealFailed(f"the Welcome names {len(welcome.more_heal_sources)} more heal sources but "
                              f"{len(welcome.more_heal_prefixes)} prefixes for them")
        try:
            round_ids, params, states = heal.recv_state(self._group_cache().store, prefixes,
                                                        self._group_cache().interface,
                                                        HEAL_TIMEOUTS * self._timeout_s, self._stop_for(job),
                                                        rendezvous_s=self._timeout_s)
            self.replica = Replica.for_welcome(welcome, params, round_ids, states)
        except (CollectiveError, KeyError, ValueError, RuntimeError) as exc:
            return HealFailed(str(exc))
        return Healed(tuple(round_ids), tuple(self.replica.committed_digests()), self.replica.params_copy())

    def _serve_heal(self, job: ServeHealJob) -> Completion:
        replica = self.replica
        assert replica is not None
        # Committed state only: a proposal whose verdict a lost connection swallowed is still
        # applied in place until the next Welcome settles it (C6: a heal sends what was committed).
        round_ids, params, states = replica.committed_state()
        try:
            sent = heal.send_state(self._group_cache().store, job.order.prefix, self._group_cache().interface,
                                   HEAL_TIMEOUTS * self._timeout_s, round_ids, params, states, self._stop_for(job),
                                   rendezvous_s=self._timeout_s)
        except CollectiveError as exc:
            return HealServed(False, str(exc))
        self._job_stats["bytes_sent"] += sent  # its part of the params and momentum (and any share asked)
        return HealServed(True)

    # ------------------------------------------------------------------ helpers

    def _say_if_slow_or_failed(self, job, done: Completion, seconds: float) -> None:
        """A heal or serve that failed, and any job that held the data plane for longer than a
        collective timeout, in the worker's log: what a stalled round is read from."""
        failed = (isinstance(done, (HealFailed, JobFailed)) or (isinstance(done, HealServed) and not done.ok)
                  or (isinstance(done, Reduced) and not done.digest))
        if failed or seconds > self._timeout_s:
            what = type(job).__name__
            if isinstance(job, ServeHealJob):
                what += f" to {job.order.joiner}"
            elif isinstance(job, HealJob):
                what += f" from {', '.join([job.welcome.heal_source, *job.welcome.more_heal_sources])}"
            detail = getattr(done, "detail", "")
            log.warning("worker %s: %s %s after %.1f s%s", self.worker_id, what, "failed" if failed else "ended",
                        seconds, f": {detail[:300]}" if detail else "")

    def _stop_for(self, job) -> heal.StopCheck:
        """Why ``job`` must stop at its wait now, or "": the worker closes, or the machine withdrew it
        (a heal or serve whose joiner is gone, M12; a reduce whose attempt is over, M13)."""
        withdrawn = ("the attempt is over (aborted, superseded or decided)" if isinstance(job, ReduceJob)
                     else "the coordinator withdrew it (the joiner is gone)")

        def why() -> str:
            if self._closed:
                return "the worker is stopping"
            return withdrawn if self._cancelled is job else ""
        return why

    def _result_params(self, fid: int, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A copy of fragment ``fid``'s committed params for the session's Result, in one of two sets
        of buffers kept from round to round (fresh model-sized tensors cost more in page faults than
        the copy). Two suffice: the set of round r is written again at the commit of round r + 2,
        which needs the session's Submit of round r + 2, which it makes only after it has taken the
        Result of round r + 1 (its round id comes with it) and so let go of round r's."""
        sets = self._result_buffers.get(fid)
        if sets is None or any(n not in sets[0] or sets[0][n].shape != t.shape for n, t in params.items()):
            sets = self._result_buffers[fid] = [{n: torch.empty_like(t) for n, t in params.items()} for _ in range(2)]
        out = sets.pop(0)
        sets.append(out)
        for n, t in params.items():
            out[n].copy_(t)
        return dict(out)


    def _group_cache(self) -> GroupCache:
        if self._groups is None or self._groups.timeout_s != self._timeout_s:
            port, host = self._store_port, self._store_host
            self._groups = GroupCache(lambda: connect_store(host, port, self._timeout_s),
                                      local_address_towards(host), self._timeout_s, self.device)
        return self._groups


def _host_of(address: str | None) -> str:
    """The host the store is dialled at for the coordinator's ZeroMQ address (``tcp://10.0.0.5:5555`` ->
    ``10.0.0.5``); loopback for none, ``ipc://``, or a wildcard."""
    if not address or "://" not in address:
        return "127.0.0.1"
    host = address_host(address)
    return "127.0.0.1" if host in ("*", "0.0.0.0", "localhost", "") else host  # a wildcard bind: dial loopback
