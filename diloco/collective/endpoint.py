"""``CollectiveEndpoint``: a worker's endpoint that speaks the collective plane for its session.

It wraps the worker's real endpoint and is transparent on a hub run. On a
collective run (the Welcome says so) it keeps the session exactly as on the hub:

* the session's ``Submit`` stays here (the pseudo-gradient, encoded in the run's wire
  dtype); the coordinator gets the same ``Submit`` with no tensors: "ready" (SPEC.md C2);
* a ``ReduceOrder`` runs on the data-plane thread: build or reuse the group, combine the
  group's pseudo-gradients (``reduce``), propose the outer step (``replica``), answer
  ``ReduceReport`` with the digest, and wait for the verdict;
* the commit (a ``Result`` with a digest and no params) is handed to the session as the
  hub's ``Result`` with the fragment's new params -- the ones this member proposed and
  the group voted for; a ``ReduceAbort`` rolls the proposal back and the session hears
  nothing (its pseudo-gradient stays ready, C5);
* a Welcome with a heal source is handed to the session only once the committed state has
  arrived from that member (``heal``), with the round ids that state belongs to; a
  ``HealOrder`` makes this member such a source;
* the first member of a run starts it from its own params: the coordinator asks for them
  (``start_params_required``), the session sends them in its Join as it does on the hub,
  and they stay here (``Join.holds_params``).

One thread owns the real endpoint (ZeroMQ sockets are not thread-safe): the data-plane
thread never sends; it queues its reports and wakes the owner, whose next ``recv`` sends
them.

Why one file of about 480 lines: the message handling (the owner's thread) and the jobs
(the data-plane thread) share the verdict slots, the pending pseudo-gradients, the held
Welcome and the replica, under one lock; the parts that own no such state are beside it
(``groups``, ``reduce``, ``replica``, ``heal``).
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading
import time
from typing import Any

import torch

from diloco.collective.groups import CollectiveError, GroupCache, connect_store, local_address_towards
from diloco.collective import heal
from diloco.collective.reduce import bytes_on_link, mean_pseudo_gradient
from diloco.collective.replica import Replica, digest
from diloco.outer import OuterConfig
from diloco.wire import compression
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

#: How long ``close`` waits for the data-plane thread to finish the job it is in.
CLOSE_JOIN_S = 30.0
#: Heals a joiner tries (each from a source the coordinator picks anew) before it gives up.
MAX_HEAL_ATTEMPTS = 5
#: A heal waits for its source, which serves it only after the verdict of any attempt it is in
#: (up to the core's reduce timeout, 4 collective timeouts): so a heal is bounded by this many.
HEAL_TIMEOUTS = 6


@dataclasses.dataclass
class _Verdict:
    """The coordinator's answer to one attempt, set by the owner thread, awaited by the data thread."""

    event: threading.Event = dataclasses.field(default_factory=threading.Event)
    #: "commit", "abort" or "reset" (a re-join or a close: the attempt is void).
    kind: str = ""
    result: Result | None = None


class CollectiveEndpoint:
    """Wraps a ``WorkerEndpoint``; see the module docstring."""

    def __init__(self, inner, worker_id: str, *, store_host: str | None = None, device=None) -> None:
        self.inner = inner
        self.worker_id = worker_id
        #: The device this worker trains on: a CUDA one makes its reduces run there, over NCCL
        #: (``groups.backend_for``); heals and the replica stay on the CPU, over gloo.
        self.device = device
        self._store_host = store_host or _host_of(getattr(inner, "address", None))
        self.collective = False
        self.replica: Replica | None = None
        self._held_params: dict | None = None
        self._wants_start_params = False
        self._welcome: Welcome | None = None
        self._timeout_s = 30.0
        self._groups: GroupCache | None = None
        self._store = None
        #: fragment -> (round_id, Encoded pseudo-gradient) of the session's last Submit.
        self._pending: dict[int, tuple[int, compression.Encoded]] = {}
        self._verdicts: dict[tuple[int, int], tuple[int, _Verdict]] = {}
        self._lock = threading.Lock()
        self._inbox: collections.deque[Message] = collections.deque()
        self._outbox: collections.deque[Message] = collections.deque()
        self._jobs: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._heal_attempts = 0
        self._heal_orders: dict[str, str] = {}
        self._reduce_buffers: dict[int, torch.Tensor] = {}
        #: fragment -> two sets of buffers the committed params are handed to the session in, in
        #: turn (the next one first).
        self._result_buffers: dict[int, list[dict[str, torch.Tensor]]] = {}
        self._last_join: Join | None = None
        #: A collective Welcome is held back while this member heals or builds its replica.
        self._welcome_withheld = False
        #: The outer optimizers' state from this worker's checkpoint: used if it starts the run (C6).
        self.restored_outer: list[dict] | None = None
        #: The committed params and round ids of this worker's checkpoint (``DilocoWorker`` sets
        #: them): offered in the Join, and the run starts again from them if they are the newest (C6).
        self.restored_params: dict | None = None
        self.restored_rounds: list[int] | None = None
        self.restored_fragments: tuple[tuple[str, ...], ...] | None = None
        #: What the data plane did, for status lines and tests.
        self.stats = collections.Counter()
        #: The last commits this member adopted: (fragment, round, digest), newest last (bounded).
        self.adopted: collections.deque[tuple[int, int, str]] = collections.deque(maxlen=4096)

    # ------------------------------------------------------------------ the endpoint interface

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)  # silence_s, address, wake, ... of the real endpoint

    def send(self, message: Message) -> None:
        if isinstance(message, Join):
            if self._welcome_withheld:
                # The Welcome came; this member is healing (or starting) before it hands it on. The
                # session's resend of its Join would make the coordinator answer already_member
                # and the session leave and join again: a loop of heals. The Welcome will come.
                self.stats["join_resends_held"] += 1
                return
            if message.params and self._wants_start_params:
                # The run's first member starts it from its own params; they stay here (C6). A
                # checkpoint's committed params, not the model's (which hold local progress).
                self._held_params = self.restored_params or {n: t.detach().clone() for n, t in message.params.items()}
                message = self._offer_held_state(dataclasses.replace(message, params={}, holds_params=True))
            elif not message.params:
                message = self._offer_held_state(message)
            self._last_join = message
        elif isinstance(message, Submit) and self.collective:
            encoded = compression.Encoded(dict(message.tensors), dict(message.scales))
            with self._lock:
                self._pending[message.fragment_id] = (message.round_id, encoded)
            message = dataclasses.replace(message, tensors={}, scales={})
        self.inner.send(message)

    def _offer_held_state(self, join: Join) -> Join:
        """A Join that says which committed state this worker holds, if any (C6): its replica's
        (after a coordinator restart) or its checkpoint's (after a whole-run stop). The
        coordinator starts the run from the newest state offered before the first commit."""
        if self.replica is not None:
            return dataclasses.replace(join, holds_params=True, held_rounds=tuple(self.replica.round_ids),
                                       held_digests=tuple(self.replica.committed_digests()))
        if self.restored_params is not None and self.restored_rounds is not None:
            self._held_params = self.restored_params
            fragments = self.restored_fragments or (tuple(self.restored_params),)
            digests = tuple(digest({n: self.restored_params[n] for n in f}) for f in fragments)
            return dataclasses.replace(join, holds_params=True, held_rounds=tuple(self.restored_rounds),
                                       held_digests=digests)
        return join

    def recv(self, timeout_s: float) -> Message | None:
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            self._flush()
            with self._lock:
                if self._inbox:
                    return self._inbox.popleft()
            remaining = deadline - time.monotonic()
            msg = self.inner.recv(max(0.0, remaining))
            if msg is not None:
                msg = self._incoming(msg)
                if msg is not None:
                    return msg
                continue
            with self._lock:
                busy = bool(self._inbox or self._outbox)
            if not busy:
                # The deadline passed, or a ``wake`` ended the wait: the owner has something to
                # send, as it would without this wrapper.
                return None

    def wake(self) -> None:
        wake = getattr(self.inner, "wake", None)
        if callable(wake):
            wake()

    def close(self) -> None:
        self._closed = True
        self._void_attempts()
        self._jobs.put(None)
        self.inner.close()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            # A process that exits while this (daemon) thread is inside torch -- freeing a round's
            # buffers -- is aborted by the C++ runtime: let it finish its job first.
            thread.join(CLOSE_JOIN_S)

    # ------------------------------------------------------------------ from the coordinator

    def _incoming(self, msg: Message) -> Message | None:
        """What the session should see of ``msg`` (None: nothing, or later through the inbox)."""
        if isinstance(msg, Welcome):
            return self._on_welcome(msg)
        if isinstance(msg, Error) and msg.code is ErrorCode.START_PARAMS_REQUIRED:
            # The session answers PARAMS_REQUIRED with a Join that carries its params (as on the hub).
            self._wants_start_params = True
            return dataclasses.replace(msg, code=ErrorCode.PARAMS_REQUIRED)
        if not self.collective:
            return msg
        if isinstance(msg, Error) and msg.code is ErrorCode.REDUCING:
            # Our ready came while a group without us reduces the round: whatever it decides, our
            # pseudo-gradient's base may be gone. Join again (and heal): the session does that on a
            # stale round (C3).
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
            self._start_thread()
            self._jobs.put(("heal_source", msg))
            return None
        if isinstance(msg, Result):
            if msg.outcome == "stop" or not msg.digest:
                self._resolve(msg.fragment_id, msg.round_id, "abort")
                return msg
            if not self._resolve(msg.fragment_id, msg.round_id, "commit", result=msg):
                return self._lost_track(msg)
            return None  # the data thread hands the session the Result with params
        return msg

    def _on_welcome(self, msg: Welcome) -> Message | None:
        self._void_attempts()
        if msg.data_plane != "collective":
            self.collective = False
            return msg
        self.collective = True
        # A Welcome answers a (re)join, and a restarted coordinator hosts a new store (maybe on the
        # same port): a client of the old one never reconnects. A new client per join is cheap.
        self._groups = None
        self._welcome = msg
        self._timeout_s = float(msg.collective_timeout_s) or 30.0
        with self._lock:
            self._pending.clear()
        self._start_thread()
        if not msg.heal_source:
            if self._held_params is None and self.replica is None:
                return Error(ErrorCode.BAD_MESSAGE, "collective Welcome without a heal source, but this "
                                                    "worker sent no params to start the run from", "Join")
            # On the data thread: building the first torch.optim optimizer can take seconds, and
            # this (communication) thread must keep heartbeating meanwhile.
            self._welcome_withheld = True
            self._jobs.put(("start", msg, self._held_params))
            self._held_params = None
            return None
        self._welcome_withheld = True
        self._jobs.put(("heal_joiner", msg))
        return None

    def _on_order(self, order: ReduceOrder) -> None:
        verdict = _Verdict()
        with self._lock:
            old = self._verdicts.get((order.fragment_id, order.round_id))
            if old is not None:
                old[1].kind = old[1].kind or "abort"
                old[1].event.set()
            self._verdicts[(order.fragment_id, order.round_id)] = (order.attempt, verdict)
        self._start_thread()
        self._jobs.put(("reduce", order, verdict))

    def _resolve(self, fid: int, rid: int, kind: str, *, attempt: int | None = None,
                 result: Result | None = None) -> bool:
        with self._lock:
            entry = self._verdicts.get((fid, rid))
            if entry is None or (attempt is not None and entry[0] != attempt):
                return False
            del self._verdicts[(fid, rid)]
        entry[1].kind, entry[1].result = kind, result
        entry[1].event.set()
        return True

    def _lost_track(self, msg: Result) -> Message:
        """A commit this member did not propose for: it cannot know the params; re-join and heal."""
        self.stats["lost_track"] += 1
        return Error(ErrorCode.UNKNOWN_WORKER, f"fragment {msg.fragment_id} round {msg.round_id} committed "
                                               f"without a proposal of this worker's: joining again to heal",
                     "Submit")

    def _void_attempts(self) -> None:
        with self._lock:
            entries = list(self._verdicts.values())
            self._verdicts.clear()
        for _, verdict in entries:
            verdict.kind = verdict.kind or "reset"
            verdict.event.set()

    # ------------------------------------------------------------------ the data-plane thread

    def _start_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name=f"diloco-collective-{self.worker_id}",
                                            daemon=True)
            self._thread.start()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None or self._closed:
                return
            try:
                {"reduce": self._reduce, "heal_source": self._serve_heal,
                 "heal_joiner": self._heal, "start": self._start}[job[0]](*job[1:])
            except Exception as exc:  # never let the thread die: report and go on
                self.stats["internal_errors"] += 1
                self._welcome_withheld = False
                self._post(Error(ErrorCode.BAD_MESSAGE, f"collective data plane: {type(exc).__name__}: {exc}",
                                 "collective"), to_session=True)

    def _reduce(self, order: ReduceOrder, verdict: _Verdict) -> None:
        fid, rid = order.fragment_id, order.round_id
        if verdict.event.is_set():
            return  # aborted (or superseded) before it started: no collective on a broken group
        with self._lock:
            pending = self._pending.get(fid)
        replica = self.replica
        ok, vote, detail = False, "", ""
        if replica is None or pending is None or pending[0] != rid or self.worker_id not in order.group:
            detail = f"no pseudo-gradient of fragment {fid} round {rid} on this worker"
        else:
            try:
                cache = self._group_cache()
                group = cache.get(order.prefix, order.group.index(self.worker_id), len(order.group))
                shapes = {n: replica.params[n].shape for n in replica.fragments[fid]}
                mean = mean_pseudo_gradient(group, pending[1], replica.wire_dtype, shapes, self._timeout_s,
                                            self._reduce_buffer(fid, shapes), cache.device)
                vote = replica.propose(fid, rid, mean)
                ok = True
                self.stats["bytes_sent"] += bytes_on_link(pending[1], replica.wire_dtype, len(order.group))
            except (CollectiveError, FloatingPointError, RuntimeError) as exc:
                self._group_cache().drop()
                # A timed-out collective may still write into its buffer: never reuse that one.
                self._reduce_buffers.pop(fid, None)
                detail = str(exc)
                self.stats["reduce_failed"] += 1
        self._post(ReduceReport(self.worker_id, fid, rid, order.attempt, ok, vote, detail[:1000]))
        # Wait for the verdict: a heal or the next order must see committed state only.
        while not verdict.event.wait(0.5):
            if self._closed:
                break
        if not ok:
            return
        if verdict.kind == "commit" and verdict.result is not None and replica.commit(
                fid, rid, verdict.result.digest):
            self._adopted(fid, rid, verdict.result.digest)
            result = dataclasses.replace(verdict.result, params=self._result_params(fid, replica.fragment(fid)),
                                         delta=False, wire_dtype="fp32", scales={}, digest="")
            self._post(result, to_session=True)
        elif verdict.kind == "commit":
            self._post(self._lost_track(verdict.result), to_session=True)
        elif verdict.kind == "abort":
            replica.rollback(fid)
            self.stats["aborted"] += 1
        # "reset": the connection to the coordinator was lost with the verdict; the proposal stays
        # until the next Welcome says whether it was committed (``_settle_orphans``).

    def _adopted(self, fid: int, rid: int, digest: str) -> None:
        with self._lock:
            if self._pending.get(fid, (None,))[0] == rid:
                del self._pending[fid]
        self.stats["committed"] += 1
        self.adopted.append((fid, rid, digest))

    def _settle_orphans(self, welcome: Welcome) -> None:
        """Proposals whose verdict a lost connection swallowed: adopt those the coordinator durably
        committed (its Welcome names each fragment's last commit), roll back the rest (C4)."""
        replica = self.replica
        if replica is None:
            return
        for fid in range(len(replica.fragments)):
            proposal = replica.proposal(fid)
            if proposal is None:
                continue
            committed = welcome.committed[fid] if fid < len(welcome.committed) else (-1, "")
            if tuple(committed) == (proposal.round_id, proposal.digest) and replica.commit(fid, *committed):
                self._adopted(fid, proposal.round_id, proposal.digest)
                self.stats["adopted_after_reconnect"] += 1
            else:
                replica.rollback(fid)

    def _start(self, welcome: Welcome, params) -> None:
        """C6: this member starts the run from its own params (and, restored, its outer momentum)."""
        states, self.restored_outer = self.restored_outer, None
        if self.replica is not None and self.replica.fragments == tuple(tuple(f) for f in welcome.fragments):
            # The coordinator restarted and this member re-joins first: it holds the committed
            # state in memory (and adopts a proposal whose commit Result the crash swallowed).
            self._settle_orphans(welcome)
            if self.replica.round_ids != list(welcome.round_ids):
                self.stats["relabelled"] += 1
                self.replica.round_ids = list(welcome.round_ids)
        else:
            if states is not None and len(states) != len(welcome.fragments):
                states = None  # another fragment layout: fresh momentum
            self.replica = self._new_replica(welcome, params, list(welcome.round_ids), states)
        self._heal_attempts = 0
        self._welcome_withheld = False
        self._post(dataclasses.replace(welcome, params=self._session_params()), to_session=True)

    def _serve_heal(self, order: HealOrder) -> None:
        replica = self.replica
        if replica is None or self._heal_orders.get(order.joiner) != order.prefix:
            return  # superseded by a newer order for the same joiner (it re-joined)
        # Committed state only: a proposal whose verdict a lost connection swallowed is still
        # applied in place until the next Welcome settles it (C6: a heal sends what was committed).
        round_ids, params, states = replica.committed_state()
        try:
            heal.send_state(self._group_cache().store, order.prefix, self._group_cache().interface,
                            HEAL_TIMEOUTS * self._timeout_s, round_ids, params, states)
            self.stats["heals_served"] += 1
            self.stats["bytes_sent"] += compression.tensor_nbytes(replica.params) * 2  # params and momentum
        except CollectiveError:
            self.stats["heals_failed"] += 1

    def _heal(self, welcome: Welcome) -> None:
        if self.replica is not None:
            self.replica.rollback_all()  # the healed state replaces whatever this member proposed
        try:
            round_ids, params, states = heal.recv_state(self._group_cache().store, welcome.heal_prefix,
                                                        self._group_cache().interface,
                                                        HEAL_TIMEOUTS * self._timeout_s)
            self.replica = self._new_replica(welcome, params, round_ids, states)
        except (CollectiveError, KeyError, ValueError, RuntimeError) as exc:
            self._heal_attempts += 1
            self.stats["heals_failed"] += 1
            if self._heal_attempts >= MAX_HEAL_ATTEMPTS or self._last_join is None:
                self._welcome_withheld = False
                self._post(Error(ErrorCode.BAD_MESSAGE, f"could not copy the run's state from "
                                                        f"{welcome.heal_source!r}: {exc}", "Join"), to_session=True)
                return
            # Join again: the coordinator names another source (or the same one, recovered). It may
            # start the run from this member only if it holds state to start from (C6).
            self._post(Leave(self.worker_id))
            self._post(dataclasses.replace(self._last_join, holds_params=self.replica is not None))
            return
        self._heal_attempts = 0
        self._welcome_withheld = False
        self.stats["healed"] += 1
        self._post(dataclasses.replace(welcome, round_ids=tuple(round_ids), parked=(),
                                       params=self._session_params()), to_session=True)

    # ------------------------------------------------------------------ helpers

    def _new_replica(self, welcome: Welcome, params, round_ids, states) -> Replica:
        outer = OuterConfig(**welcome.outer) if welcome.outer else OuterConfig()
        return Replica(params, tuple(tuple(f) for f in welcome.fragments), round_ids, outer, welcome.wire_dtype,
                       welcome.min_workers, states)

    def committed_outer_states(self) -> list[dict] | None:
        """The outer optimizers' committed state (for the worker's checkpoint); None on the hub."""
        replica = self.replica
        if not self.collective or replica is None:
            return None
        return replica.committed_optimizer_states()

    def _reduce_buffer(self, fid: int, shapes: dict) -> torch.Tensor:
        """Fragment ``fid``'s flat fp32 reduce buffer, kept from round to round. A round reuses it
        only after the previous round's verdict: its mean was stepped into the replica by then."""
        numel = sum(s.numel() for s in shapes.values())
        buf = self._reduce_buffers.get(fid)
        if buf is None or buf.numel() != numel:
            buf = self._reduce_buffers[fid] = torch.empty(numel, dtype=torch.float32)
        return buf

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

    def _session_params(self) -> dict:
        assert self.replica is not None
        return {n: t.clone() for n, t in self.replica.params.items()}

    def _group_cache(self) -> GroupCache:
        if self._groups is None or self._groups.timeout_s != self._timeout_s:
            port = self._welcome.store_port if self._welcome is not None else 0
            host = self._store_host
            self._groups = GroupCache(lambda: connect_store(host, port, self._timeout_s),
                                      local_address_towards(host), self._timeout_s, self.device)
        return self._groups

    def _post(self, message: Message, to_session: bool = False) -> None:
        with self._lock:
            (self._inbox if to_session else self._outbox).append(message)
        self.wake()

    def _flush(self) -> None:
        while True:
            with self._lock:
                if not self._outbox:
                    return
                message = self._outbox.popleft()
            self.inner.send(message)


def _host_of(address: str | None) -> str:
    """The host of a ZeroMQ address (``tcp://10.0.0.5:5555`` -> ``10.0.0.5``); loopback otherwise."""
    if not address or "://" not in address:
        return "127.0.0.1"
    rest = address.split("://", 1)[1]
    host = rest.rsplit(":", 1)[0].strip("[]")
    return "127.0.0.1" if host in ("*", "0.0.0.0", "localhost", "") else host  # a wildcard bind: dial loopback
