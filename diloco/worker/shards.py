"""A member whose model FSDP2 shards across its ranks: what the worker keeps, kept per shard.

With ``fully_shard`` (FSDP2) every parameter is a DTensor and rank r holds only
its shard. A sharded member keeps everything per parameter the same way: each
rank holds, next to its shard of the model, its shard of the fp32 copy of the
global params (the base of the next pseudo-gradient) and of the
error-feedback residual. No rank ever holds the whole model.

Only the wire sees whole tensors, one parameter at a time:

* a pseudo-gradient: each rank computes its shard (``global - local``, plus its
  residual) and the shards are all-gathered, one parameter at a time, into the
  leader's ``Submit`` (every rank holds one whole parameter for a moment; the
  leader holds the fragment's pseudo-gradient on its host while it encodes it);
* a Welcome's or Result's params (or a delta Result, decoded): the leader
  scatters each parameter to the ranks, which keep their shard.

Every operation here runs on all ranks of the member together (they are
collectives). The leader's ``DilocoWorker`` calls it with the whole tensors;
before it does, ``tell`` sends the operation's name and plain arguments to the
other ranks (``diloco.worker.group``), which run the same method without them.
"""

from __future__ import annotations

import math
import sys
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.distributed as dist

from diloco.collective.reduce import contribution_norm, tensors_norm
from diloco.wire import compression
from diloco.wire.compression import apply_delta

#: ``tell(op, kwargs)``: the leader's word to the other ranks before it runs ``op`` (None: no others).
Tell = Callable[[str, dict], None]

#: What the other ranks may be told to run (``ShardedParams.run``).
COMMANDS = ("full_params", "install", "merge", "pseudo_gradients", "set_residual", "save", "load",
            "submit_shards", "install_handed", "merge_handed", "snapshot_start")


def is_sharded(model: torch.nn.Module) -> bool:
    """True when the model's parameters are DTensors (FSDP2's ``fully_shard``, or any DTensor model)."""
    if "torch.distributed.tensor" not in sys.modules:  # no DTensor exists (and its import is slow)
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def layout_of(model: torch.nn.Module) -> dict:
    """What a sharded checkpoint or peer must share with this member: the world and the placements."""
    from torch.distributed.tensor import DTensor

    first = next(p for p in model.parameters() if isinstance(p, DTensor))
    return {"world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "mesh": list(first.device_mesh.shape),
            "placements": [str(pl) for pl in first.placements]}


def layout_text(model: torch.nn.Module) -> str:
    """``layout_of`` as one line, what a collective member's Join carries and a refusal names."""
    layout = layout_of(model)
    return (f"sharded over {layout['world_size']} ranks (mesh {layout['mesh']}, "
            f"placements {', '.join(layout['placements'])})")


class ShardedParams:
    """Per-shard keeping of one rank of a sharded member. See the module docstring."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, tell: Tell | None = None,
                 worker_id: str = "") -> None:
        from torch.distributed.tensor import DTensor

        from diloco.collective.shard_part import PlaneLink, ShardPart

        self.params: dict[str, Any] = {}  # name -> its DTensor
        for name, p in model.named_parameters():
            if not isinstance(p, DTensor):
                raise ValueError(f"parameter {name!r} is not sharded (a {type(p).__name__}): shard every "
                                 f"parameter of a sharded member with fully_shard")
            self.params[name] = p
        self.model = model
        self.optimizer = optimizer
        self._tell = tell
        #: This rank's shard of the fp32 copy of the global params, and of the error-feedback residual.
        self.global_shards: dict[str, torch.Tensor] = {}
        self.residual: dict[str, torch.Tensor] = {}
        rank = dist.get_rank() if dist.is_initialized() else 0
        device = next(iter(self.params.values())).to_local().device
        #: How the model is sharded: a collective run's members must agree (SPEC.md S8).
        self.layout = layout_text(model)
        #: This rank's part of the member's collective data plane (``diloco.collective.shard_part``).
        self.part = ShardPart(worker_id, rank, "127.0.0.1", device if device.type == "cuda" else None)
        #: The member's plane group, over which the leader's data plane asks the others (gloo, so
        #: that small objects travel on the CPU whatever the model's device). Created here, on every
        #: rank at the same point: a new group is a collective of the whole member.
        self.plane: PlaneLink | None = None
        if dist.is_initialized() and dist.get_world_size() > 1:
            from diloco.worker.group import GROUP_TIMEOUT

            self.plane = PlaneLink(dist.new_group(backend="gloo", timeout=GROUP_TIMEOUT))

    @property
    def is_leader(self) -> bool:
        return not dist.is_initialized() or dist.get_rank() == 0

    def run(self, op: str, kwargs: dict) -> Any:
        """A follower runs what the leader told it (``COMMANDS`` only)."""
        if op not in COMMANDS:
            raise ValueError(f"the leader told this rank to run {op!r}; expected one of {list(COMMANDS)}")
        return getattr(self, op)(**kwargs)

    def _command(self, op: str, **kwargs) -> None:
        if self._tell is not None:
            self._tell(op, kwargs)

    # ------------------------------------------------------------------ whole tensors <-> shards

    def _gather(self, name: str, shard: torch.Tensor) -> torch.Tensor | None:
        """The whole parameter ``name`` from every rank's ``shard`` of it: on the leader (CPU fp32), else None."""
        whole = self.as_dtensor(name, shard).full_tensor()
        return whole.to("cpu", torch.float32) if self.is_leader else None

    def _scatter(self, name: str, whole: Mapping[str, torch.Tensor] | None) -> torch.Tensor:
        """This rank's shard (fp32, on the param's device) of the leader's whole tensor ``whole[name]``."""
        from torch.distributed.tensor import distribute_tensor

        p = self.params[name]
        device = p.to_local().device
        if self.is_leader:
            assert whole is not None, "the leader scatters what it holds"
            src = whole[name].to(device, torch.float32)
        else:
            src = torch.empty(tuple(p.shape), dtype=torch.float32, device=device)
        return distribute_tensor(src, p.device_mesh, p.placements, src_data_rank=0).to_local()

    def _all(self, flag: bool) -> bool:
        """``flag`` on every rank of the member."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return flag
        device = next(iter(self.params.values())).to_local().device
        t = torch.tensor([0 if flag else 1], dtype=torch.int64, device=device)
        dist.all_reduce(t)
        return int(t.item()) == 0

    # ------------------------------------------------------------------ what the worker asks

    def full_params(self, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """The model's params, whole (a Join that brings the run its first params); empty off the leader."""
        names = list(self.params) if names is None else list(names)
        self._command("full_params", names=names)
        out = {}
        with torch.no_grad():
            for n in names:
                whole = self._gather(n, self.params[n].to_local().detach().to(torch.float32))
                if whole is not None:
                    out[n] = whole
        return out

    def install(self, names: list[str], whole: Mapping[str, torch.Tensor] | None = None, delta: bool = False,
                keep_if_same: bool = False) -> str:
        """Take new global params for ``names`` into the model and the global copy.

        ``delta``: ``whole`` is a decoded delta, added to the global copy. Returns "installed",
        "kept" (``keep_if_same`` and the params are the global copy's already: the local progress
        is still valid) or "non_finite" (the delta makes a param non-finite: nothing changed)."""
        self._command("install", names=list(names), delta=delta, keep_if_same=keep_if_same)
        return self._take(names, self._new_shards(names, whole, delta), keep_if_same)

    def merge(self, names: list[str], whole: Mapping[str, torch.Tensor] | None = None, delta: bool = False,
              alpha: float = 0.5) -> str:
        """Overlap's merge: local <- alpha * local + (1 - alpha) * global, per shard; the copy becomes the global."""
        self._command("merge", names=list(names), delta=delta, alpha=alpha)
        return self._blend(names, self._new_shards(names, whole, delta), alpha)

    def _take(self, names: list[str], new: Mapping[str, torch.Tensor] | None, keep_if_same: bool) -> str:
        """``new`` (this rank's shards, or None: not finite) into the model and the global copy."""
        if new is None:
            return "non_finite"
        if keep_if_same and self._all(all(n in self.global_shards and torch.equal(self.global_shards[n].cpu(),
                                                                                  new[n].cpu()) for n in names)):
            return "kept"
        with torch.no_grad():
            for n in names:
                local = self.params[n].to_local()
                local.copy_(new[n])
                self.global_shards[n] = new[n].to(local.device, torch.float32)
        return "installed"

    def _blend(self, names: list[str], new: Mapping[str, torch.Tensor] | None, alpha: float) -> str:
        """Overlap's merge of ``new`` (this rank's shards, or None: not finite)."""
        if new is None:
            return "non_finite"
        with torch.no_grad():
            for n in names:
                local = self.params[n].to_local()
                local.lerp_(new[n].to(local.device, local.dtype), 1.0 - alpha)
                self.global_shards[n] = new[n].to(local.device, torch.float32)
        return "installed"

    def _new_shards(self, names: list[str], whole, delta: bool) -> dict[str, torch.Tensor] | None:
        new = {}
        for n in names:
            shard = self._scatter(n, whole)
            new[n] = apply_delta(self.global_shards[n], shard) if delta else shard
        if delta and not self._all(all(bool(torch.isfinite(t).all()) for t in new.values())):
            return None
        return new

    def pseudo_gradients(self, names: list[str], with_residual: bool = False) -> dict[str, torch.Tensor]:
        """``global - local`` (plus the residual) for ``names``, whole on the leader (CPU fp32); empty off it."""
        self._command("pseudo_gradients", names=list(names), with_residual=with_residual)
        out = {}
        with torch.no_grad():
            for n in names:
                shard = self.global_shards[n] - self.params[n].to_local().detach().to(torch.float32)
                r = self.residual.get(n) if with_residual else None
                if r is not None:
                    shard.add_(r)
                whole = self._gather(n, shard)
                if whole is not None:
                    out[n] = whole
        return out

    def set_residual(self, names: list[str], whole: Mapping[str, torch.Tensor] | None = None) -> None:
        """Error feedback: what the wire left out of the pseudo-gradients just sent, kept per shard."""
        self._command("set_residual", names=list(names))
        for n in names:
            self.residual[n] = self._scatter(n, whole)

    # ------------------------------------------------------------------ the collective plane

    def submit_shards(self, fid: int, round_id: int, names: list[str], wire_dtype: str,
                      feedback: bool) -> tuple[compression.Encoded, float, float]:
        """A collective run's submit: every rank encodes its own shard of the pseudo-gradient
        (error feedback per shard) and posts it for its data plane (``ShardPart.post``). Returns
        this rank's encoded shard, the norm of the whole contribution as the group will decode it
        (what the member declares, M9) and that of the whole pseudo-gradient before encoding."""
        self._command("submit_shards", fid=fid, round_id=round_id, names=list(names), wire_dtype=wire_dtype,
                      feedback=feedback)
        with torch.no_grad():
            shards = {}
            for n in names:
                shard = self.global_shards[n] - self.params[n].to_local().detach().to(torch.float32)
                r = self.residual.get(n) if feedback else None
                if r is not None:
                    shard.add_(r)
                shards[n] = shard.cpu()
            raw = tensors_norm(shards)
            enc = compression.encode(shards, wire_dtype)
            if feedback:
                sent = compression.decoded(enc, wire_dtype, shards)
                declared = tensors_norm(sent)
                for n, t in shards.items():
                    self.residual[n] = t.sub_(sent[n]).to(self.params[n].to_local().device)
            else:
                declared = contribution_norm(enc, wire_dtype, {n: t.shape for n, t in shards.items()})
        self.part.post(fid, round_id, enc)
        # On the member's default group, as every command: the plane group is the data plane's.
        device = next(iter(self.params.values())).to_local().device
        squares = torch.tensor([declared * declared, raw * raw], dtype=torch.float64, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(squares)
        return enc, math.sqrt(float(squares[0])), math.sqrt(float(squares[1]))

    def snapshot_start(self) -> dict[str, torch.Tensor]:
        """Every rank keeps its shards of the member's committed params as they are now -- its global
        copy once it has one (a restored checkpoint's), else the model's: the run may start from
        them (C6). Returns the leader's (the Join's token params; they never leave the member)."""
        self._command("snapshot_start")
        self.part.snapshot_start({n: self.global_shards.get(n, p.to_local()) for n, p in self.params.items()})
        assert self.part.start_params is not None
        return dict(self.part.start_params)

    def install_handed(self, names: list[str], keep_if_same: bool = False) -> str:
        """``install`` from what each rank's data plane committed (the collective plane)."""
        self._command("install_handed", names=list(names), keep_if_same=keep_if_same)
        return self._take(names, self.part.handed(names), keep_if_same)

    def merge_handed(self, names: list[str], alpha: float = 0.5) -> str:
        """``merge`` from what each rank's data plane committed (the collective plane)."""
        self._command("merge_handed", names=list(names), alpha=alpha)
        return self._blend(names, self.part.handed(names), alpha)

    # ------------------------------------------------------------------ checkpoints

    def save(self, directory: str) -> None:
        """Every rank writes its shards of the model, the inner optimizer, the global copy and the
        residual into ``directory`` (``torch.distributed.checkpoint``)."""
        self._command("save", directory=str(directory))
        from diloco.worker import sharded_checkpoint

        sharded_checkpoint.write_shards(self, directory)

    def load(self, directory: str) -> None:
        """Every rank reads its shards back from ``directory`` (the same layout wrote it)."""
        self._command("load", directory=str(directory))
        from diloco.worker import sharded_checkpoint

        sharded_checkpoint.read_shards(self, directory)

    def as_dtensor(self, name: str, shard: torch.Tensor):
        """``shard`` (this rank's part of a tensor shaped like param ``name``) as a DTensor of the member."""
        from torch.distributed.tensor import DTensor

        p = self.params[name]
        return DTensor.from_local(shard, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                                  run_check=False)

    def shard_bytes(self) -> int:
        """Bytes this rank holds for the worker's own keeping (global copy and residual shards)."""
        return sum(t.numel() * t.element_size() for d in (self.global_shards, self.residual) for t in d.values())
