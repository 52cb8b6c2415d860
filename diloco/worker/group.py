"""A worker that is a group of ranks: data parallel inside, one DiLoCo member outside.

Started by ``torchrun`` (``torchrun --nproc-per-node 4 -m diloco worker ...``),
every rank trains the same model on its own shard of the data and the group
averages gradients after each backward pass (what DDP does; done here with a
plain all-reduce so that any ``loss_fn`` works, including one that calls a
model method DDP's wrapper would hide). Only rank 0, the *leader*, talks to
the coordinator, through an ordinary ``DilocoWorker``; the other ranks,
*followers*, hold no endpoint.

Every decision that comes from the coordinator reaches all ranks at the same
inner step: after each step the leader broadcasts one small header (go on or
stop; did the params change) and, when they changed (a Welcome, a Result, a
restore), the full model state, so the ranks hold bit-identical params after
every sync and stop together. While the leader waits at a sync point (waiting
for a Result, or paused below quorum) the followers wait in that broadcast.

A rank that dies takes the whole worker down: ``torchrun`` stops the other
ranks when one fails, the leader's connection closes, and the coordinator
sees one death (SPEC.md section 14, "Multi-rank workers").
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist

from diloco.worker.errors import DilocoWorkerError

#: How long a follower waits in a broadcast for the leader. The leader may be paused at a
#: sync point for as long as the run is below quorum, so this is long; a dead leader is
#: noticed sooner by ``torchrun``, which stops the whole group.
GROUP_TIMEOUT = datetime.timedelta(days=7)

@dataclass(frozen=True)
class RankInfo:
    """Where this process sits in its worker's group (from ``torchrun``'s environment)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> "RankInfo":
        """``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` as ``torchrun`` sets them; a single rank without them."""
        env = os.environ if environ is None else environ
        try:
            info = cls(int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0)))
        except ValueError:
            raise ValueError(f"RANK={env.get('RANK')!r} WORLD_SIZE={env.get('WORLD_SIZE')!r} "
                             f"LOCAL_RANK={env.get('LOCAL_RANK')!r}: expected integers (as torchrun sets them)")
        if info.world_size < 1 or not 0 <= info.rank < info.world_size or info.local_rank < 0:
            raise ValueError(f"RANK={info.rank} WORLD_SIZE={info.world_size} LOCAL_RANK={info.local_rank}: "
                             f"expected 0 <= RANK < WORLD_SIZE")
        return info


#: An ``init_method`` for launchers other than torchrun (for example ``file:///mnt/nfs/diloco/group``:
#: a file store, so no rendezvous server listens anywhere); torchrun's ``env://`` by default.
INIT_METHOD_ENV = "DILOCO_GROUP_INIT"


def init_group(info: RankInfo, device: torch.device) -> bool:
    """Join the ranks' process group: NCCL for CUDA devices, gloo otherwise (idempotent). True when
    this call created it (the caller then destroys it).

    A launcher's world of one rank gets its group too (an FSDP2 model needs one to shard over)."""
    launched = bool(os.environ.get(INIT_METHOD_ENV) or os.environ.get("MASTER_ADDR"))
    if (info.world_size > 1 or launched) and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=os.environ.get(INIT_METHOD_ENV) or "env://",
                                rank=info.rank, world_size=info.world_size, timeout=GROUP_TIMEOUT)
        return True
    return False


@contextlib.contextmanager
def _collective(what: str) -> Iterator[None]:
    """A failed collective means a rank is gone: say so as the worker's error, which ends this rank's run."""
    try:
        yield
    except RuntimeError as exc:  # DistBackendError and gloo's "connection closed by peer" are RuntimeErrors
        raise DilocoWorkerError(f"this worker's group broke while {what} (a rank died or left): {exc}",
                                "group_failed") from exc


def average_gradients(model: torch.nn.Module, world_size: int) -> None:
    """All-reduce every gradient to the group's mean (one flat buffer per dtype and device)."""
    if world_size <= 1:
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    buckets: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        buckets.setdefault((g.dtype, g.device), []).append(g)
    for bucket in buckets.values():
        flat = torch.cat([g.reshape(-1) for g in bucket])
        with _collective("averaging gradients"):
            dist.all_reduce(flat)
        flat.div_(world_size)
        offset = 0
        for g in bucket:
            n = g.numel()
            g.copy_(flat[offset:offset + n].view_as(g))
            offset += n


def broadcast_model(model: torch.nn.Module, optimizer: Any | None = None) -> None:
    """Make every rank's params and buffers (and optimizer state) rank 0's, bit for bit."""
    with torch.no_grad(), _collective("sharing the model"):
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t.data, src=0)
    if optimizer is not None:
        box = [optimizer.state_dict() if dist.get_rank() == 0 else None]
        with _collective("sharing the inner optimizer's state"):
            dist.broadcast_object_list(box, src=0)
        if dist.get_rank() != 0:
            optimizer.load_state_dict(box[0])


#: What the leader's header announces: the end of a turn (after join or a step), an operation
#: every rank runs with it (a sharded member's, ``diloco.worker.shards``), or the leader's leave done.
TURN, COMMAND, END = 0, 1, 2


class _Header:
    """The leader's word after join and after each step: go on or stopped; params changed; counters.

    A stop also carries the leader's stop reason (a short string), so every rank reports the same.
    A sharded member's leader also announces each operation on the shards before it runs it.
    """

    @staticmethod
    def send(go_on: bool, changed: bool, inner_step: int, rounds_synced: int, reason: str | None,
             kind: int = TURN) -> None:
        with _collective("telling the other ranks what the coordinator said"):
            dist.broadcast(torch.tensor([kind, int(go_on), int(changed), inner_step, rounds_synced],
                                        dtype=torch.int64), src=0)
            if kind == TURN and not go_on:
                dist.broadcast_object_list([reason], src=0)

    @staticmethod
    def receive() -> tuple[int, bool, bool, int, int, str | None]:
        t = torch.zeros(5, dtype=torch.int64)
        reason = None
        with _collective("waiting for rank 0"):
            dist.broadcast(t, src=0)
            kind, go_on, changed, inner_step, rounds = (int(x) for x in t.tolist())
            if kind == TURN and not go_on:
                box = [None]
                dist.broadcast_object_list(box, src=0)
                reason = box[0]
        return kind, bool(go_on), bool(changed), inner_step, rounds, reason


def _from_leader(value: Any, what: str) -> Any:
    """Rank 0's ``value`` (a small picklable object), on every rank."""
    box = [value]
    with _collective(what):
        dist.broadcast_object_list(box, src=0)
    return box[0]


def share_worker_id(worker_id: str) -> str:
    """Rank 0's worker id, on every rank (the member has one name, whatever each rank guessed)."""
    return _from_leader(worker_id, "agreeing on the worker's id")


def tell_followers(op: str, kwargs: dict) -> None:
    """The leader of a sharded member: have every other rank run ``op(**kwargs)`` with it (next)."""
    _Header.send(True, False, 0, 0, None, kind=COMMAND)
    _from_leader((op, kwargs), f"telling the other ranks to run {op}")


class GroupLeader:
    """Rank 0: a ``DilocoWorker`` that tells the other ranks what it decided.

    Has the face ``run_training`` uses (``join``, ``step_done``, ``leave`` and the
    counters); everything else is the wrapped worker's (``leader.worker``).
    """

    def __init__(self, worker, info: RankInfo) -> None:
        self.worker = worker
        self.info = info
        self._written = worker.params_written

    def __getattr__(self, name: str) -> Any:
        return getattr(self.worker, name)

    def join(self) -> None:
        try:
            self.worker.join()
        finally:
            # Followers start from the leader's state: the Welcome's params, or a restored checkpoint
            # (params and inner optimizer state), whatever happened, and learn whether to train at all.
            self._tell(changed=True, full=True)

    def step_done(self, tokens: int | None = None) -> bool:
        go_on = False
        try:
            go_on = self.worker.step_done(tokens)
        finally:
            self._tell(changed=self.worker.params_written != self._written, go_on=go_on)
        return go_on

    def _tell(self, changed: bool, go_on: bool | None = None, full: bool = False) -> None:
        w = self.worker
        if go_on is None:
            go_on = not w.stopped
        self._written = w.params_written
        # A sharded member's ranks took their shards of every change already, as it happened.
        changed = changed and not w.sharded
        _Header.send(go_on, changed, w.inner_step, w.rounds_synced, w.stop_reason)
        if changed:
            broadcast_model(w.model, w.inner_optimizer if full else None)

    def leave(self) -> None:
        try:
            self.worker.leave()  # may merge a held Result into the shards: the other ranks listen
        finally:
            if self.worker.sharded:
                _Header.send(False, False, 0, 0, None, kind=END)


class GroupFollower:
    """Rank > 0: trains in step with the leader and does what it was told; never talks to the coordinator."""

    def __init__(self, model: torch.nn.Module, inner_optimizer: Any, worker_id: str, info: RankInfo) -> None:
        from diloco.worker.shards import ShardedParams, is_sharded

        #: A sharded member's keeping of this rank's shards, which the leader's operations run on;
        #: and its part of the member's collective data plane, run on a thread of its own that
        #: serves the leader's data plane's requests until it says stop (on the hub it never asks).
        self.shards = ShardedParams(model, inner_optimizer, worker_id=worker_id) if is_sharded(model) else None
        if self.shards is not None and self.shards.plane is not None:
            import threading

            from diloco.collective.shard_part import serve_plane

            threading.Thread(target=serve_plane, args=(self.shards.part, self.shards.plane),
                             name=f"diloco-plane-{worker_id}-rank{info.rank}", daemon=True).start()
        self.model = model
        self.inner_optimizer = inner_optimizer
        self.worker_id = worker_id
        self.info = info
        self.inner_step = 0
        self.rounds_synced = 0
        self.stop_reason: str | None = None
        self.stopped = False
        self.seconds_paused = 0.0
        self.bytes_sent = 0
        self.bytes_received = 0
        self._left = False

    def join(self) -> None:
        self._hear(full=True)

    def step_done(self, tokens: int | None = None) -> bool:
        return self._hear(full=False)

    def _hear(self, full: bool) -> bool:
        while True:
            kind, go_on, changed, inner_step, rounds, reason = _Header.receive()
            if kind == COMMAND:
                self._run_command()
                continue
            if kind == END:  # the leader left before this rank's turn ended: it stops too
                self.stopped, self._left = True, True
                return False
            break
        self.inner_step, self.rounds_synced = inner_step, rounds
        if changed:
            broadcast_model(self.model, self.inner_optimizer if full else None)
        if not go_on:
            self.stopped = True
            self.stop_reason = reason
        return go_on

    def request_stop(self, save: bool = False) -> None:
        """A follower stops when the leader does (``torchrun`` forwards a SIGTERM to every rank)."""

    def _run_command(self) -> None:
        op, kwargs = _from_leader(None, "hearing the leader's operation")
        if self.shards is None:
            raise DilocoWorkerError(f"rank 0 runs {op} on a sharded model; this rank's model is not sharded",
                                    "group_failed")
        self.shards.run(op, kwargs)

    def abandon(self) -> None:
        """This rank fails on its own: it leaves without waiting for the leader (torchrun stops the others)."""
        self._left = True

    def leave(self) -> None:
        """Only the leader leaves the run; a sharded member's other ranks take part in what its leave
        does to the shards (a held Result merged) until the leader says it is done."""
        if self.shards is None or self._left:
            return
        self._left = True
        while True:
            kind, *_ = _Header.receive()
            if kind == END:
                return
            if kind == COMMAND:
                self._run_command()
