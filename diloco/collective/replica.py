"""The outer step every member runs on its own replica, and the digest it votes with.

On the collective plane each member holds the committed params of every fragment
(fp32) and one outer optimizer per fragment, exactly as the hub's coordinator does
(``diloco.outer``). A reduce *proposes*: the outer step runs in place
on the committed tensors after a backup (params and optimizer state) is taken;
the commit drops the backup, an abort restores it. So nothing a member adopts
differs from what it voted for, and nothing is adopted without a commit
(SPEC.md C3, C4).

bf16 and int8 runs round the step the way the hub does (``quantized_update``:
params = old + decode(encode(new - old))), so the planes follow the same
trajectory whatever the wire dtype.

The digest (``digest``) is of the params' bits, independent of the order a kernel
adds in: every replica that holds the same bits votes the same.

A round must not cost more than the reduce it follows, so the proposal's backup
(params and optimizer state) is copied into buffers the replica keeps from round
to round rather than into fresh ones: fresh 100M-parameter tensors on the
data-plane thread cost more in page faults than the copy itself. An fp32 Nesterov
step is the hub's blocked one (``blocked_step``: the same bits as ``opt.step()``,
one cache-sized block at a time, no model-sized temporary), and each block is
backed up, stepped, measured (the step's norm, M11) and summed for the digest
while it is in the cache (``digest.StepWatch``); any other step is taken whole, then
measured and digested in one more pass (``digest_and_step_norm``).
"""

from __future__ import annotations

import copy
import math
import threading
from dataclasses import dataclass
from typing import Mapping

import torch

from diloco.blocked_step import sgd_step_in_blocks, step_in_blocks
from diloco.collective.digest import StepWatch, digest, digest_and_step_norm
from diloco.collective.reduce import tensors_norm
from diloco.outer import OptimizerBackup, OuterConfig, build_outer_optimizer, params_of
from diloco.step_bound import state_keys, step_bound
from diloco.wire import compression
from diloco.wire.sparse import SparseFormat, SparseWire

Tensors = dict[str, torch.Tensor]

#: Elements of the scratch buffer a step's norm is measured through (1 MB: a chunk of the params, its
#: backup and its difference stay in the L2 cache; larger chunks measured slower, smaller ones pay
#: torch's per-call cost).
_SCRATCH = 1 << 18


class StepRefused(FloatingPointError):
    """The outer step was not finite, or moved the params further than its bound allows (M11)."""


@dataclass
class _Backup:
    round_id: int
    params: Tensors  # the fragment's buffers (``Replica._buffers``), valid while the proposal is open
    optimizer: OptimizerBackup
    digest: str
    #: The carried bounds (``Replica._bounds``) once this proposal is committed.
    bounds: "_Bounds | None" = None


@dataclass(frozen=True)
class _Bounds:
    """What a fragment's next step is bounded with (``step_bound``): bounds on the norms of its
    committed params and of its optimizer state, carried from commit to commit and measured
    afresh only when the replica is built from a state."""
    params: float
    state: dict[str, float]


class Replica:
    """Committed params and outer optimizers of every fragment, with at most one proposal each."""

    def __init__(self, params: Mapping[str, torch.Tensor], fragments: tuple[tuple[str, ...], ...],
                 round_ids: list[int], outer: OuterConfig, wire_dtype: str, min_workers: int,
                 optimizer_states: list[dict] | None = None) -> None:
        self.fragments = fragments
        self.round_ids = list(round_ids)
        self.outer = outer
        self.wire_dtype = wire_dtype
        #: The sparse wire's format (``Welcome.wire_options``), which the reduce decodes payloads with.
        self.sparse_fmt: SparseFormat | None = None
        self.params: Tensors = {n: params[n].detach().to("cpu", torch.float32).clone()
                                for f in fragments for n in f}
        self.optimizers = [build_outer_optimizer([self.params[n] for n in f], outer, min_workers)
                           for f in fragments]
        if optimizer_states is not None:
            for opt, state in zip(self.optimizers, optimizer_states):
                opt.load_state_dict(state)
        self._proposals: dict[int, _Backup] = {}
        #: Per fragment: the backup buffers a proposal copies the committed state into.
        self._buffers: list[Tensors] = [{} for _ in fragments]
        self._optimizer_backups = [OptimizerBackup() for _ in fragments]
        #: Per fragment: what its next step is bounded with; None until measured.
        self._bounds: list[_Bounds | None] = [None for _ in fragments]
        self._scratch = torch.empty(_SCRATCH, dtype=torch.float32)
        #: Guards proposals against a checkpoint read from the training thread.
        self._lock = threading.Lock()

    @classmethod
    def for_welcome(cls, welcome, params: Mapping[str, torch.Tensor], round_ids, states) -> "Replica":
        """The replica a collective ``Welcome`` describes (its fragments, outer optimizer, wire dtype and
        quorum), holding ``params`` at ``round_ids`` with outer-optimizer ``states`` (None: fresh)."""
        outer = OuterConfig(**welcome.outer) if welcome.outer else OuterConfig()
        replica = cls(params, tuple(tuple(f) for f in welcome.fragments), list(round_ids), outer,
                      welcome.wire_dtype, welcome.min_workers, states)
        if welcome.wire_dtype == "sparse":
            replica.sparse_fmt = SparseWire.from_dict(welcome.wire_options).fmt
        return replica

    @property
    def requantizes(self) -> bool:
        """bf16 and int8 round each step's delta to the wire (as the hub's Results do); fp32 and sparse
        step on the group's exact mean (sparse: the decoded payloads' sum, the same on every member)."""
        return self.wire_dtype in ("bf16", "int8")

    def params_copy(self) -> Tensors:
        """Every param, copied: what a session is handed with a start's or heal's Welcome."""
        return {n: t.clone() for n, t in self.params.items()}

    def fragment(self, fid: int) -> Tensors:
        return {n: self.params[n] for n in self.fragments[fid]}

    def has_proposal(self, fid: int) -> bool:
        return fid in self._proposals

    def proposal(self, fid: int) -> "_Backup | None":
        """The open proposal of ``fid`` (its round and digest), or None."""
        return self._proposals.get(fid)

    def propose(self, fid: int, round_id: int, mean: Mapping[str, torch.Tensor],
                mean_bound: float = math.inf) -> str:
        """Step fragment ``fid`` with the group's mean pseudo-gradient, whose norm the checks bound by
        ``mean_bound``; return the digest to vote with. ``StepRefused`` (and the fragment as it was)
        if the step is not finite or beyond its bound (SPEC.md M11)."""
        if fid in self._proposals:
            raise RuntimeError(f"fragment {fid} already has a proposal (round {self._proposals[fid].round_id})")
        if round_id != self.round_ids[fid]:
            raise RuntimeError(f"fragment {fid}: asked to reduce round {round_id}, this replica is at "
                               f"round {self.round_ids[fid]}")
        params = self.fragment(fid)
        opt = self.optimizers[fid]
        before = self._buffers[fid]
        for n, p in params.items():
            if n not in before:
                before[n] = torch.empty_like(p)
        opt_before = self._optimizer_backups[fid]
        if self._bounds[fid] is None:
            self._bounds[fid] = self._measure(fid)
        # From here a checkpoint reads the backup, not the state being stepped; the backup may be
        # taken during the step (``StepWatch``), so a read waits for the step's end.
        with self._lock:
            opt_before.take(opt)
            self._proposals[fid] = _Backup(round_id, before, opt_before, "")
            try:
                measured = self._step(opt, params, mean, before)
            except BaseException:
                opt_before.restore(opt)
                del self._proposals[fid]
                raise
        vote, step_norm = measured or digest_and_step_norm(params, before, self._scratch)
        refused = self._check_step(fid, step_norm, mean_bound)
        if refused is not None:
            self._restore(fid, before, opt_before)
            with self._lock:
                del self._proposals[fid]
            raise StepRefused(refused)
        self._proposals[fid].digest = vote
        return vote

    def _step(self, opt: torch.optim.Optimizer, params: Tensors, mean: Mapping[str, torch.Tensor],
              before: Tensors) -> tuple[str, float] | None:
        """Step ``params`` (and ``opt``'s state) with ``mean``, leaving their old values in ``before``;
        the digest and the step's norm when the step measured them on the way, else None. On an
        exception the params are as they were (the caller restores the optimizer)."""
        if self.wire_dtype == "fp32":
            watch = StepWatch(params, before, self._scratch)
            try:
                # In place: the watch's backup is the undo.
                blocked = step_in_blocks(opt, params, {n: mean[n] for n in params}, undo_kept=True, watch=watch)
            except BaseException:
                watch.undo()
                raise
            if blocked is not None:
                return watch.result()
        elif self.wire_dtype == "sparse":
            # The method's step (SGD, momentum 0), block by block with the backup, the step's norm
            # and the digest: one pass over the model, not a copy, a step and a measuring pass.
            watch = StepWatch(params, before, self._scratch)
            try:
                if sgd_step_in_blocks(opt, params, {n: mean[n] for n in params}, watch):
                    return watch.result()
            except BaseException:
                watch.undo()
                raise
        for n, p in params.items():
            before[n].copy_(p.detach())
        try:
            for n, p in params.items():
                p.grad = mean[n]
            opt.step()
            if self.requantizes:
                # As the hub: params = old + decode(encode(new - old)).
                _, new = compression.quantized_update(before, params, self.wire_dtype)
                with torch.no_grad():
                    for n, p in params.items():
                        p.copy_(new[n])
        except BaseException:
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(before[n])
            raise
        finally:
            for p in params.values():
                p.grad = None
        return None

    def _check_step(self, fid: int, norm: float, mean_bound: float) -> str | None:
        """Why the step fragment ``fid`` just took must not be voted for, or None (M11); on None the
        proposal carries the optimizer state's bounds its commit will keep."""
        params = self.fragment(fid)
        if not math.isfinite(norm):
            bad = next((n for n, p in params.items() if not math.isfinite(tensors_norm({n: p}))), None)
            return (f"fragment {fid}: the outer step made {bad!r} non-finite" if bad is not None
                    else f"fragment {fid}: the outer step overflows fp32")
        opt, carried = self.optimizers[fid], self._bounds[fid]
        assert carried is not None
        bound = step_bound(self.outer.name, opt.param_groups[0], mean_bound, carried.state, _steps_taken(opt),
                           sum(p.numel() for p in params.values()), self.requantizes, carried.params)
        if norm > bound.step:
            return (f"fragment {fid}: the outer step's norm {norm:.4g} is beyond its bound {bound.step:.4g} "
                    f"(mean pseudo-gradient within {mean_bound:.4g}; the optimizer state is not what its "
                    f"history allows)")
        # The triangle inequality carries the params' bound; 1e-5 covers the measurement's rounding.
        self._proposals[fid].bounds = _Bounds(carried.params + norm * (1 + 1e-5), bound.state)
        return None

    def _measure(self, fid: int) -> _Bounds:
        """The norms of fragment ``fid``'s params and of the optimizer state ``step_bound`` carries."""
        opt = self.optimizers[fid]
        state = {bound: tensors_norm({str(i): opt.state[p][key] for i, p in enumerate(params_of(opt))
                                      if key in opt.state.get(p, {})})
                 for bound, key in state_keys(self.outer.name).items()}
        return _Bounds(tensors_norm(self.fragment(fid)) * (1 + 1e-5), state)

    def commit(self, fid: int, round_id: int, committed_digest: str) -> bool:
        """Adopt the proposal if it is the one committed; False (and rolled back) if not."""
        backup = self._proposals.get(fid)
        if backup is None:
            return False
        if backup.round_id != round_id or backup.digest != committed_digest:
            self.rollback(fid)
            return False
        with self._lock:
            del self._proposals[fid]
            self.round_ids[fid] = round_id + 1
        self._bounds[fid] = backup.bounds
        return True

    def rollback(self, fid: int) -> None:
        """Restore the committed state, then drop the backup (a checkpoint reads the backup until then)."""
        backup = self._proposals.get(fid)
        if backup is None:
            return
        self._restore(fid, backup.params, backup.optimizer)
        with self._lock:
            del self._proposals[fid]

    def settle(self, adopt, rollback, round_ids) -> None:
        """Keep this replica for a run (re)started from it (C6): adopt the open proposals of ``adopt``
        (their commits happened), roll back those of ``rollback``, then take the run's ``round_ids``."""
        for fid in adopt:
            proposal = self._proposals.get(fid)
            if proposal is not None:
                self.commit(fid, proposal.round_id, proposal.digest)
        for fid in rollback:
            self.rollback(fid)
        self.round_ids = list(round_ids)

    def rollback_all(self) -> None:
        for fid in list(self._proposals):
            self.rollback(fid)

    def optimizer_states(self) -> list[dict]:
        return [opt.state_dict() for opt in self.optimizers]

    def committed_state(self) -> tuple[list[int], Tensors, list[dict]]:
        """(round ids, params, optimizer states) as committed: a proposal's backup where one is open."""
        with self._lock:
            params = {n: t.detach().clone() for n, t in self.params.items()}
            states = []
            for fid, opt in enumerate(self.optimizers):
                backup = self._proposals.get(fid)
                if backup is not None:
                    params.update({n: t.clone() for n, t in backup.params.items()})
                states.append(backup.optimizer.state_dict(opt) if backup is not None
                              else copy.deepcopy(opt.state_dict()))
            return list(self.round_ids), params, states

    def committed_digests(self) -> list[str]:
        """Each fragment's digest as committed (a proposal's backup where one is open): what the
        commit that made this state voted for, if it was one of this run's (C6)."""
        with self._lock:
            return [digest(self._proposals[fid].params if fid in self._proposals else self.fragment(fid))
                    for fid in range(len(self.fragments))]

    def committed_optimizer_states(self) -> list[dict]:
        """Copies of each fragment's committed optimizer state (a proposal's backup where one is open)."""
        with self._lock:
            return [self._proposals[fid].optimizer.state_dict(opt) if fid in self._proposals
                    else copy.deepcopy(opt.state_dict()) for fid, opt in enumerate(self.optimizers)]

    def held_bytes(self) -> int:
        """Bytes this replica keeps: committed params, outer optimizer state, and the backup buffers
        (params and optimizer state) its proposals are taken into."""
        tensors = list(self.params.values()) + [b for f in self._buffers for b in f.values()]
        for opt, backup in zip(self.optimizers, self._optimizer_backups):
            tensors += [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
            tensors += backup.tensors()
        return sum(t.numel() * t.element_size() for t in tensors)

    def _restore(self, fid: int, params: Tensors, optimizer: OptimizerBackup) -> None:
        with torch.no_grad():
            for n, p in self.fragment(fid).items():
                p.copy_(params[n])
        optimizer.restore(self.optimizers[fid])


def _steps_taken(opt: torch.optim.Optimizer) -> int:
    """The optimizer's own step count (Adam's, Delayed Nesterov's; 0 for SGD, which keeps none)."""
    for p in params_of(opt):
        step = opt.state.get(p, {}).get("step")
        if step is not None:
            return int(step)
    return 0
