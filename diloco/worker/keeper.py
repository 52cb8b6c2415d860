"""What a worker keeps per parameter beside its model, and the model operations on it.

A worker keeps, beside the model's params, its fp32 copy of the global params (the base of every
pseudo-gradient) and, with error feedback, the residual the wire left out. Two keepers, one face:

* ``ReplicaKeeper``: a member that holds the whole model on this rank. The copy lives on the CPU
  (fp32, the master for checkpoints and deltas), mirrored on the model's device when it has one
  (``DeviceGlobal``), where the pseudo-gradient is computed.
* ``ShardedKeeper``: a member whose model FSDP2 shards across its ranks: every operation runs on
  all its ranks, each on its own shard (``diloco.worker.shards``); on the collective plane each
  rank's data plane holds its committed shards, which an install takes from there.

The driver (``diloco.worker.worker``) checks what comes in and posts what goes out; what the
operations do to the params is here.
"""

from __future__ import annotations

import logging
import pathlib
from typing import Mapping

import torch

from diloco.collective.endpoint import CollectiveEndpoint
from diloco.collective.reduce import tensors_norm
from diloco.collective.sharded_endpoint import ShardedCollectiveEndpoint
from diloco.wire import compression, sparse
from diloco.wire.sparse import SparseWire
from diloco.worker import checkpoint, sharded_checkpoint
from diloco.worker.device import DeviceGlobal
from diloco.worker.residuals import Residuals
from diloco.worker.errors import DilocoWorkerError
from diloco.worker.shards import ShardedParams, is_sharded

log = logging.getLogger("diloco.worker")
Tensors = dict[str, torch.Tensor]


class ReplicaKeeper:
    """The whole model's global copy and residual on this rank."""

    sharded = False

    def __init__(self, params: Mapping[str, torch.nn.Parameter]) -> None:
        self.params = dict(params)
        #: The fp32 copy of the global params, on the CPU ...
        self.global_: Tensors = {}
        #: ... its mirror on the model's device (pseudo-gradients are taken there).
        self._on_device = DeviceGlobal(self.params)
        #: What quantization left out of the pseudo-gradients sent so far, added to the next (per param),
        #: the rounds they are for, and the sparse wire's last payloads (round, encoded, declared and own
        #: norms), sent again if that round is submitted again.
        self.residuals = Residuals()

    @property
    def residual(self) -> Tensors:
        return self.residuals.residual

    @property
    def residual_round(self) -> dict[int, int]:
        return self.residuals.round

    def settle_residual(self, round_ids, fragments, worker_id: str = "", parked=()) -> list[str]:
        """A Welcome: keep each fragment's residual only when the run has not moved on since it was made
        (the Welcome's round for it is the one the residual was for); else drop it, so no stale mass
        reaches a later round, and say so (SPEC.md section 14, "Error feedback"). The names dropped."""
        dropped = self.residuals.settle(round_ids, fragments, parked)
        if dropped:
            log.warning("worker %s: the run moved on while this worker was away: its error-feedback residual "
                        "(%d parameters, e.g. %r) is dropped, not sent into a later round", worker_id,
                        len(dropped), dropped[0])
        return dropped

    def join_params(self, starts_collective: bool) -> Tensors:
        """The params a Join that brings the run its first params carries: the model's, fp32 on the CPU."""
        return {n: p.detach().to("cpu", torch.float32).clone() for n, p in self.params.items()}

    def resolve_delta(self, delta: compression.DeltaParams, names, what: str) -> Mapping[str, torch.Tensor]:
        """A delta Result's new params: global + delta, against this worker's copy (the round's base)."""
        return delta.resolve(self.global_, names, what)

    def install(self, names, params: Mapping[str, torch.Tensor] | None, delta: bool, keep_if_same: bool,
                collective: bool) -> str:
        """New global params for ``names`` into the model and the copy: "installed", or "kept"
        (``keep_if_same`` and the params are the copy's already: the local progress is still valid)."""
        assert params is not None
        if keep_if_same and all(n in self.global_ and torch.equal(self.global_[n], params[n]) for n in names):
            return "kept"
        with torch.no_grad():
            for n in names:
                self.params[n].copy_(params[n])
                self.set_global(n, params[n])
        return "installed"

    def merge(self, names, params: Mapping[str, torch.Tensor] | None, delta: bool, alpha: float,
              collective: bool) -> str:
        """Overlap (W16): local <- alpha * local + (1 - alpha) * global; the copy becomes the Result's."""
        assert params is not None
        with torch.no_grad():
            for n in names:
                p = self.params[n]
                p.lerp_(params[n].to(p.device, p.dtype), 1.0 - alpha)
                self.set_global(n, params[n])
        return "installed"

    def set_global(self, name: str, value: torch.Tensor) -> None:
        self.global_[name] = value.detach().to("cpu", torch.float32).clone()
        self._on_device.set(name, self.global_[name], self.params[name].device)

    # ------------------------------------------------------------------ its checkpoint

    def checkpoint_path(self, directory, worker_id: str) -> pathlib.Path:
        return checkpoint.checkpoint_path(directory, worker_id)

    def restore(self, path: pathlib.Path, worker_id: str, sync_every: int, model, optimizer,
                data_plane) -> dict | None:
        """Resume from the checkpoint at ``path`` if there is one: the model, the inner optimizer, the
        copy and the residual; a collective run's committed state offered to ``data_plane`` (C6).
        Returns the session's labels (``WorkerSession.restore``'s arguments), or None: no checkpoint."""
        if not path.exists():
            return None
        ckpt = checkpoint.restore_worker(path, worker_id, sync_every, model, optimizer)
        self.global_ = {}
        for n, t in ckpt.global_params.items():
            self.set_global(n, t)
        self.residuals.restore({n: t.to(torch.float32).clone() for n, t in ckpt.residual.items()},
                               ckpt.residual_rounds if ckpt.residual_rounds is not None else
                               dict(enumerate(int(r) for r in ckpt.round_ids)))
        if ckpt.outer_states is not None:  # a collective run's checkpoint: it holds a committed state
            # If this worker starts the run again, it does so from this state and continues its
            # outer momentum (C6).
            data_plane.restore({n: t.detach().to(torch.float32).clone() for n, t in ckpt.global_params.items()},
                               list(ckpt.round_ids), tuple(tuple(f) for f in ckpt.fragments), ckpt.outer_states)
        return {"fragments": ckpt.fragments, "round_ids": ckpt.round_ids, "next_close": ckpt.next_close,
                "sched_step": ckpt.sched_step, "inner_step": ckpt.inner_step, "rounds_synced": ckpt.rounds_synced,
                "mode": ckpt.mode}

    def snapshot(self, session, worker_id: str, sync_every: int, model, optimizer, data_plane):
        """What a checkpoint holds, taken now (under the worker's lock, with no install pending)."""
        s = session
        return checkpoint.WorkerCheckpoint(
            worker_id=worker_id, sync_every=sync_every, inner_step=s.inner_step, sched_step=s.sched_step,
            next_close=list(s.next_close), round_ids=list(s.round_ids), rounds_synced=s.rounds_synced,
            mode=s.mode, fragments=s.fragments, model_state=model.state_dict(),
            optimizer_state=optimizer.state_dict(), global_params=dict(self.global_),
            outer_states=data_plane.committed_outer_states(), residual=self.residual,
            residual_rounds=dict(self.residual_round))

    def write(self, path: pathlib.Path, snapshot) -> None:
        checkpoint.save_worker_checkpoint(path, snapshot)

    def pseudo_gradient(self, fid: int, round_id: int, names, wire_dtype: str, feedback: bool,
                        collective: bool, sparse_wire=None) -> tuple[compression.Encoded, float | None, float]:
        """The fragment's pseudo-gradient (global - local, plus the residual with error feedback: the
        sparse wire's accumulator ``beta * e + delta``), encoded in the run's wire dtype; the norm it
        declares (the collective plane: as the group decodes it, SPEC.md M9; None on the hub, or where
        the data plane measures it); its own norm."""
        again = self.residuals.resend(fid, round_id) if sparse_wire is not None else None
        if again is not None:
            return again[1:]
        if feedback and self.residuals.drop_stale(fid, names, round_id):
            log.warning("fragment %d: its error-feedback residual was made for another round than %d: dropped, "
                        "not sent", fid, round_id)
        # global - local, on the model's device when it has one, copied to the CPU for the wire.
        tensors = self._on_device.pseudo_gradients(names, self.params, self.global_)
        if feedback:
            sparse.accumulate(tensors, self.residual, sparse_wire.beta if sparse_wire is not None else 1.0)
        raw = tensors_norm(tensors)  # exact at any size (fp32's own norm drifts by percents)
        declared = raw if collective and wire_dtype == "fp32" else None
        if feedback and sparse_wire is not None:
            values, scales, sent_entries = sparse.send_from(tensors, sparse_wire.fmt, "this worker's own payload")
            enc = compression.Encoded(values, scales)
            if collective:
                declared = tensors_norm({n: p.value for n, p in sent_entries.items()})
            self.residuals.sent(fid, round_id, tensors, (round_id, enc, declared, raw))
            return enc, declared, raw
        enc = compression.encode(tensors, wire_dtype, sparse_wire)
        if feedback:
            sent = compression.decoded(enc, wire_dtype, tensors)
            if collective:
                declared = tensors_norm(sent)
            # t is this Submit's own buffer, encoded already.
            self.residuals.sent(fid, round_id, {n: t.sub_(sent[n]) for n, t in tensors.items()})
        return enc, declared, raw


class ShardedKeeper:
    """The global copy and residual kept per shard on every rank of a sharded member."""

    sharded = True

    def __init__(self, shards: ShardedParams) -> None:
        self.shards = shards  # its residual too, per shard on every rank

    @property
    def global_(self) -> Tensors:
        return {}  # per shard on every rank; ``diloco export`` joins a checkpoint's

    def join_params(self, starts_collective: bool) -> Tensors:
        if starts_collective:
            return self.shards.snapshot_start()  # every rank keeps its own; none leaves the member
        return self.shards.full_params()

    def resolve_delta(self, delta: compression.DeltaParams, names, what: str) -> Mapping[str, torch.Tensor]:
        """Decoded whole here; each rank adds its shard of it to its shard of the global copy."""
        return compression.decode(dict(delta), delta.scales, delta.wire_dtype,
                                  [(n, tuple(self.shards.params[n].shape)) for n in names], what)

    def install(self, names, params, delta: bool, keep_if_same: bool, collective: bool) -> str:
        """As ``ReplicaKeeper.install``, on every rank; also "non_finite": a delta that makes a param
        non-finite on any rank changes nothing on any rank."""
        if collective:  # each rank's data plane holds its committed shards
            return self.shards.install_handed(list(names), keep_if_same)
        return self.shards.install(list(names), params, delta, keep_if_same)

    def merge(self, names, params, delta: bool, alpha: float, collective: bool) -> str:
        if collective:
            return self.shards.merge_handed(list(names), alpha)
        return self.shards.merge(list(names), params, delta, alpha)

    # ------------------------------------------------------------------ its checkpoint (DCP, every rank)

    def checkpoint_path(self, directory, worker_id: str) -> pathlib.Path:
        return sharded_checkpoint.sharded_checkpoint_path(directory, worker_id)

    def restore(self, path: pathlib.Path, worker_id: str, sync_every: int, model, optimizer,
                data_plane) -> dict | None:
        """Every rank reads its shards from the sealed checkpoint for ``path``, if there is one; the
        session's labels (None: none). It offers no committed state (S9)."""
        found = sharded_checkpoint.sealed(path)
        if found is None:
            return None
        meta = sharded_checkpoint.restore_member(found, self.shards, worker_id, sync_every)
        return {"fragments": tuple(tuple(str(n) for n in f) for f in meta["fragments"]),
                "round_ids": [int(r) for r in meta["round_ids"]],
                "next_close": [int(c) for c in meta["next_close"]], "sched_step": meta["sched_step"],
                "inner_step": meta["inner_step"], "rounds_synced": meta["rounds_synced"], "mode": meta.get("mode")}

    def snapshot(self, session, worker_id: str, sync_every: int, model, optimizer, data_plane) -> dict:
        return sharded_checkpoint.seal_of(session, worker_id, sync_every, model)

    def write(self, path: pathlib.Path, snapshot: dict) -> None:
        sharded_checkpoint.save_sharded(path, self.shards, snapshot)

    def settle_residual(self, round_ids, fragments, worker_id: str = "", parked=()) -> list[str]:
        return []  # a sharded member's residual lives per shard on its ranks, saved and restored with them

    def pseudo_gradient(self, fid: int, round_id: int, names, wire_dtype: str, feedback: bool,
                        collective: bool, sparse_wire=None) -> tuple[compression.Encoded, float | None, float]:
        if sparse_wire is not None:  # the Welcome refused it already (``DilocoWorker._adopt_wire``)
            raise ValueError("a sharded member does not send on the sparse wire")
        if collective:
            # Every rank keeps its encoded shard for its own reduce; this one is rank 0's, and the
            # norm declared is the whole contribution's (M9).
            return self.shards.submit_shards(fid, round_id, list(names), wire_dtype, feedback)
        # Per shard on every rank (residual included), whole here.
        tensors = self.shards.pseudo_gradients(list(names), with_residual=feedback)
        raw = tensors_norm(tensors)
        enc = compression.encode(tensors, wire_dtype)
        if feedback:
            sent = compression.decoded(enc, wire_dtype, tensors)
            self.shards.set_residual(list(tensors), {n: t.sub_(sent[n]) for n, t in tensors.items()})
        return enc, None, raw


def sparse_wire_of(welcome, sharded: bool) -> SparseWire | None:
    """The sparse wire's settings a Welcome tells (None for another wire dtype); a Welcome whose
    settings are wrong, or a sparse run for a sharded member, is refused with why."""
    if welcome.wire_dtype != "sparse":
        return None
    if sharded:
        raise DilocoWorkerError("this run's wire dtype is sparse, and a sharded member does not send on it yet: "
                                "run the server with another --wire-dtype", "bad_message")
    try:
        return SparseWire.from_dict(welcome.wire_options)
    except ValueError as exc:
        raise DilocoWorkerError(f"the Welcome's sparse wire settings: {exc}", "bad_message") from None


def keeper_and_plane(model: torch.nn.Module, optimizer, worker_id: str,
                     endpoint) -> tuple[ReplicaKeeper | ShardedKeeper, CollectiveEndpoint]:
    """The keeper a model needs, and the data plane around ``endpoint`` that goes with it: a model
    FSDP2 shards across this worker's ranks gets both per shard (every data-plane job runs on all
    its ranks, ``diloco.collective.sharded_endpoint``). A model on a CUDA device reduces there, over
    NCCL; on the CPU, over gloo."""
    params = dict(model.named_parameters())
    device = next(iter(params.values())).device if params else None
    if not is_sharded(model):
        return ReplicaKeeper(params), CollectiveEndpoint(endpoint, worker_id, device=device)
    shards = ShardedParams(model, optimizer, tell=_followers_tell(), worker_id=worker_id)
    return ShardedKeeper(shards), ShardedCollectiveEndpoint(endpoint, worker_id, shards.part, shards.plane,
                                                            shards.layout, device=device)


def _followers_tell():
    """How a sharded member's leader tells its other ranks what to run (None: it has none)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    from diloco.worker.group import tell_followers

    return tell_followers
