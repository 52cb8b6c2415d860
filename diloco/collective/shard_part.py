"""One rank's part of a sharded member's collective data plane (SPEC.md section 15, S7-S10).

A member whose model FSDP2 shards across W ranks is still one member of the collective plane:
one contribution, one vote, one death. Its leader (rank 0) runs the member machine
(``diloco.collective.member``); every job the machine starts runs on all W ranks, each on its
own shard (``ShardedCollectiveEndpoint`` fans it out; ``serve_plane`` runs it on the others):

* rank r reduces its shard of the pseudo-gradient with rank r of the other members, in a group
  of its own (the order's prefix plus ``/r<r>``, on the coordinator's store);
* each rank keeps a replica of its shard (committed params, outer optimizer state, the
  proposal's backup; ``diloco.collective.replica``) and proposes the outer step on it;
* the checks (M9, M11) see whole norms: the ranks' shard norms are combined in the member
  (a norm's square is the sum of its shards' squares), over the member's own plane group;
* the member's digest is the digest of its ranks' shard digests in rank order;
* heals go rank to rank: rank r of the joiner from rank r of the source.

Every request has one reply from every rank, gathered by the leader in rank order, so the
ranks never disagree on what they are doing. The replies are small (norms, digests, errors).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import math
import pickle
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist

from diloco.collective import heal
from diloco.collective.groups import CollectiveError, GroupCache, connect_store, local_address_towards
from diloco.collective.member import HEAL_TIMEOUTS
from diloco.collective.reduce import bytes_on_link, mean_pseudo_gradient, reduce_buffer, tensors_norm
from diloco.collective.replica import Replica, StepRefused
from diloco.collective.store import ABANDONED_KEY, rank_prefix
from diloco.wire import compression

Tensors = dict[str, torch.Tensor]


def combined_digest(rank_digests: list[str]) -> str:
    """The member's digest of a fragment: its ranks' shard digests, in rank order."""
    return hashlib.sha256("|".join(rank_digests).encode()).hexdigest()


def combined_norm(shard_norms: list[float]) -> float:
    """The norm of a whole tensor set from the norms of its disjoint shards."""
    return math.sqrt(sum(n * n for n in shard_norms))


@dataclasses.dataclass(frozen=True)
class ReducePart:
    """One rank's reduce of its shard: its shard's part of each member's contribution norm (rank
    order of the group; empty where the fp32 all-reduce shows none) and of the mean's norm."""

    error: str = ""
    norms: tuple[float, ...] = ()
    mean_norm: float = math.nan
    bytes_sent: int = 0


class ShardPart:
    """What one rank keeps and does for its member on the collective plane."""

    def __init__(self, worker_id: str, rank: int, store_host: str, device=None) -> None:
        self.worker_id = worker_id
        self.rank = rank
        self.store_host = store_host
        self.device = device
        self.replica: Replica | None = None
        self.store_port = 0
        self.timeout_s = 30.0
        self._groups: GroupCache | None = None
        self._lock = threading.Lock()
        #: fragment -> (round id, this rank's encoded shard of its pseudo-gradient): the training
        #: thread's, from the member's submit, until the data plane reduces it.
        self._outbox: dict[int, tuple[int, compression.Encoded]] = {}
        #: This rank's shards as the member joined with them (the run may start from them, C6).
        self.start_params: Tensors | None = None
        #: The committed params the session will install next, per name (copies).
        self._handed: Tensors = {}
        self._means: dict[int, Tensors] = {}
        self._reduce_buffers: dict[int, torch.Tensor] = {}

    # ------------------------------------------------------------------ the training thread's side

    def post(self, fid: int, round_id: int, encoded: compression.Encoded) -> None:
        with self._lock:
            self._outbox[fid] = (round_id, encoded)

    def snapshot_start(self, shards: Tensors) -> None:
        self.start_params = {n: t.detach().to("cpu", torch.float32).clone() for n, t in shards.items()}

    def handed(self, names: list[str]) -> Tensors:
        """Copies of the committed shards of ``names``: the caller's to keep (the global copy)."""
        with self._lock:
            missing = [n for n in names if n not in self._handed]
            if missing:
                raise RuntimeError(f"no committed shard of {missing[:3]} on rank {self.rank} to install")
            return {n: self._handed[n].clone() for n in names}

    def _hand(self, params: Tensors) -> None:
        with self._lock:
            for n, t in params.items():
                self._handed[n] = t.detach().clone()

    # ------------------------------------------------------------------ requests (every rank)

    def handle(self, request: tuple, stop: heal.StopCheck) -> Any:
        kind = request[0]
        if kind in ("reduce", "heal", "serve"):
            self._configure(*request[-3:])
        if kind == "reduce":
            return self._reduce(request[1], stop)
        if kind == "propose":
            return self._propose(*request[1:])
        if kind == "discard":
            self._means.pop(request[1], None)
            return None
        if kind == "commit":
            return self._commit(*request[1:])
        if kind == "rollback":
            if self.replica is not None:
                for fid in request[1]:
                    self.replica.rollback(fid)
            return None
        if kind == "start":
            return self._start(*request[1:])
        if kind == "heal":
            return self._heal(request[1], stop)
        if kind == "serve":
            return self._serve(request[1], stop)
        raise ValueError(f"unknown request {kind!r} on rank {self.rank}")

    def _configure(self, host: str, port: int, timeout_s: float) -> None:
        if self._groups is not None and (host, port, timeout_s) != (self.store_host, self.store_port, self.timeout_s):
            self._groups = None  # a restarted coordinator's store: a new client
        self.store_host, self.store_port, self.timeout_s = host, port, timeout_s

    def groups(self) -> GroupCache:
        if self._groups is None:
            host, port, timeout_s = self.store_host, self.store_port, self.timeout_s
            self._groups = GroupCache(lambda: connect_store(host, port, timeout_s), local_address_towards(host),
                                      timeout_s, self.device)
        return self._groups

    def follower_stop(self, prefix_of: Callable[[], str | None]) -> heal.StopCheck:
        """A follower's stop for its reduce: the leader marked the attempt's prefix abandoned."""
        def why() -> str:
            prefix = prefix_of()
            if prefix is None:
                return ""
            try:
                if self.groups().store.check([f"{prefix}/{ABANDONED_KEY}"]):
                    return "the member's leader abandoned the attempt"
            except Exception:
                return ""
            return ""
        return why

    def mark_abandoned(self, prefix: str) -> None:
        """The leader: tell the member's other ranks the attempt at ``prefix`` is over (M13)."""
        try:
            self.groups().store.set(f"{prefix}/{ABANDONED_KEY}", b"1")
        except Exception:
            pass  # their formation ends within gloo's bounds anyway

    def _reduce(self, order, stop: heal.StopCheck) -> ReducePart:
        fid, rid = order.fragment_id, order.round_id
        replica = self.replica
        with self._lock:
            posted = self._outbox.get(fid)
        if replica is None:
            return ReducePart(error=f"rank {self.rank} holds no replica")
        if posted is None or posted[0] != rid:
            return ReducePart(error=f"rank {self.rank} has no pseudo-gradient of fragment {fid} round {rid}")
        encoded = posted[1]
        shapes = {n: replica.params[n].shape for n in replica.fragments[fid]}
        cache = self.groups()
        try:
            group = cache.get(rank_prefix(order.prefix, self.rank), order.group.index(self.worker_id), len(order.group),
                              stop)
            mean, norms, mean_norm = mean_pseudo_gradient(group, encoded, replica.wire_dtype, shapes, self.timeout_s,
                                                          reduce_buffer(self._reduce_buffers, fid, shapes), cache.device,
                                                          order.gather)
        except (CollectiveError, FloatingPointError, RuntimeError) as exc:
            cache.drop()
            self._reduce_buffers.pop(fid, None)
            return ReducePart(error=f"rank {self.rank}: {exc}")
        self._means[fid] = mean
        measured = tensors_norm(mean) if mean_norm is None else mean_norm
        return ReducePart(norms=tuple(norms), mean_norm=measured,
                          bytes_sent=bytes_on_link(encoded, replica.wire_dtype, len(order.group), order.gather))

    def _propose(self, fid: int, round_id: int, bound: float) -> tuple[str, str]:
        """(digest, "") or ("", why not)."""
        mean = self._means.pop(fid, None)
        replica = self.replica
        if mean is None or replica is None:
            return "", f"rank {self.rank} has no mean of fragment {fid} to step with"
        try:
            return replica.propose(fid, round_id, mean, bound), ""
        except (StepRefused, RuntimeError) as exc:
            return "", f"rank {self.rank}: {exc}"

    def _commit(self, fid: int, round_id: int, digests: list[str]) -> bool:
        replica = self.replica
        if replica is None or not replica.commit(fid, round_id, digests[self.rank]):
            return False
        self._hand(replica.fragment(fid))
        return True

    def _start(self, welcome, keep: bool, adopt: tuple[int, ...], rollback: tuple[int, ...]) -> list[str]:
        if keep:
            assert self.replica is not None
            self.replica.settle(adopt, rollback, welcome.round_ids)
        else:
            if self.start_params is None:
                raise RuntimeError(f"rank {self.rank} took no snapshot of its shards to start the run from")
            self.replica = Replica.for_welcome(welcome, self.start_params, list(welcome.round_ids), None)
        self._hand(self.replica.params)
        return self.replica.committed_digests()

    def _heal(self, welcome, stop: heal.StopCheck) -> tuple[str, list[int], list[str]]:
        if self.replica is not None:
            self.replica.rollback_all()
        cache = self.groups()
        try:
            round_ids, params, states = heal.recv_state(cache.store, rank_prefix(welcome.heal_prefix, self.rank),
                                                        cache.interface, HEAL_TIMEOUTS * self.timeout_s, stop,
                                                        rendezvous_s=self.timeout_s)
            self.replica = Replica.for_welcome(welcome, params, round_ids, states)
        except (CollectiveError, KeyError, ValueError, RuntimeError) as exc:
            return f"rank {self.rank}: {exc}", [], []
        self._hand(self.replica.params)
        return "", list(round_ids), self.replica.committed_digests()

    def _serve(self, order, stop: heal.StopCheck) -> str:
        replica = self.replica
        if replica is None:
            return f"rank {self.rank} holds no replica to serve"
        round_ids, params, states = replica.committed_state()
        cache = self.groups()
        try:
            heal.send_state(cache.store, rank_prefix(order.prefix, self.rank), cache.interface,
                            HEAL_TIMEOUTS * self.timeout_s, round_ids, params, states, stop,
                            rendezvous_s=self.timeout_s)
        except CollectiveError as exc:
            return f"rank {self.rank}: {exc}"
        return ""


class PlaneLink:
    """The member's own plane group: the leader's requests out, every rank's replies back.

    Objects travel pickled in uint8 tensors (a length first). The leader bounds each of its waits
    (``timeout_s``): a rank that froze or died fails the request, and the member with it (S10).
    The other ranks wait for the next request as long as the group's own timeout: the leader may
    have nothing to ask for as long as the run is paused."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def _wait(self, work, timeout_s: float | None) -> None:
        if timeout_s is None:
            work.wait()
        else:
            work.wait(datetime.timedelta(seconds=timeout_s))

    def broadcast(self, request: tuple | None, timeout_s: float | None = None) -> tuple | None:
        """The leader's ``request`` on every rank."""
        raw = pickle.dumps(request) if self.rank == 0 else b""
        length = torch.tensor([len(raw)], dtype=torch.int64)
        self._wait(dist.broadcast(length, group=self.group, group_src=0, async_op=True), timeout_s)
        data = (torch.frombuffer(bytearray(raw), dtype=torch.uint8) if self.rank == 0
                else torch.empty(int(length[0]), dtype=torch.uint8))
        self._wait(dist.broadcast(data, group=self.group, group_src=0, async_op=True), timeout_s)
        return request if self.rank == 0 else pickle.loads(data.numpy().tobytes())

    def gather(self, reply: Any, timeout_s: float | None = None) -> list[Any] | None:
        """Every rank's ``reply`` on the leader, in rank order (None elsewhere)."""
        raw = pickle.dumps(reply)
        lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        self._wait(dist.all_gather(lengths, torch.tensor([len(raw)], dtype=torch.int64), group=self.group,
                                   async_op=True), timeout_s)
        longest = max(int(t[0]) for t in lengths)
        data = torch.zeros(longest, dtype=torch.uint8)
        data[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        out = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.size)] if self.rank == 0 else None
        self._wait(dist.gather(data, out, group=self.group, group_dst=0, async_op=True), timeout_s)
        if out is None:
            return None
        return [pickle.loads(t[:int(n[0])].numpy().tobytes()) for t, n in zip(out, lengths)]


STOP = ("stop",)


def serve_plane(part: ShardPart, link: PlaneLink) -> None:
    """A follower's data plane: run the leader's requests on this rank's shard until it says stop."""
    current: list[str | None] = [None]
    stop = part.follower_stop(lambda: current[0])
    while True:
        try:
            request = link.broadcast(None)
        except Exception:
            return  # the leader is gone: the member goes with it (its training collectives fail too)
        if request is None or request[0] == STOP[0]:
            return
        current[0] = request[1].prefix if request[0] == "reduce" else None
        try:
            reply = part.handle(request, stop)
        except Exception as exc:  # never leave the leader waiting for this rank's reply
            reply = _failure(request[0], f"rank {part.rank}: {type(exc).__name__}: {exc}")
        current[0] = None
        try:
            link.gather(reply)
        except Exception:
            return


def _failure(kind: str, detail: str) -> Any:
    """A request's reply when the rank failed to carry it out."""
    return {"reduce": ReducePart(error=detail), "propose": ("", detail), "commit": False,
            "heal": (detail, [], []), "serve": detail, "start": detail}.get(kind)
