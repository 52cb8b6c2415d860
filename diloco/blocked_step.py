"""The Nesterov outer step made in cache-sized blocks, to the same bits as ``torch.optim.SGD``'s: the
hub's coordinator and every collective member take it.

``torch.optim.SGD``'s Nesterov step (its single-tensor path, which CPU tensors take) makes four passes
over each parameter and a parameter-sized temporary: ``buf.mul_(m).add_(g)``, ``t = g.add(buf,
alpha=m)``, ``p.add_(t, alpha=-lr)``. Every one of them is memory-bound, 200 ms a step at 100M
parameters here, after the round's last contribution and so on its critical path. ``step_in_blocks``
makes the very same operations on one block of each tensor at a time, so that the block's values
are still in the cache for the next operation (and the temporary is one block): each element goes
through the same kernels with the same scalars, so the result is the same bit for bit (tests
compare it with ``opt.step()`` on odd sizes, with one thread and two). It also proves the new params
finite on the way (``all_finite`` by block). It writes the new params and momentum to fresh memory
(the memory left behind is the undo of a refused step and what the last Results are still sent from,
so neither needs a copy of the model made ahead), or in place once no Result holds that memory and
bounds prove the step finite beforehand (``step_in_blocks``). Anything else (Adam, plain SGD, delayed Nesterov, the
first step, which creates the momentum, hooks) is left to ``opt.step()``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from diloco.wire.measure import all_finite
from diloco.wire import buffers

#: Elements per block: four fp32 blocks (the param, its momentum, its gradient and the temporary)
#: of 256 KiB fit the L2 cache; larger blocks gained nothing, smaller ones pay torch's per-call cost.
BLOCK = 1 << 16


def _sgd_group(opt: torch.optim.Optimizer) -> dict | None:
    """The one param group of a ``torch.optim.SGD`` without hooks, weight decay, maximize, foreach,
    fused or differentiable steps, whose lr and momentum are numbers; or None."""
    if type(opt) is not torch.optim.SGD or len(opt.param_groups) != 1:
        return None
    if opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks:
        return None
    from torch.optim import optimizer as _optimizer

    if _optimizer._global_optimizer_pre_hooks or _optimizer._global_optimizer_post_hooks:
        return None
    g = opt.param_groups[0]
    if not (g.get("weight_decay", 0) == 0 and not g.get("maximize") and not g.get("foreach")
            and not g.get("fused") and not g.get("differentiable")):
        return None
    if type(g["lr"]) not in (int, float) or type(g.get("momentum", 0)) not in (int, float):
        return None
    return g


def _nesterov_group(opt: torch.optim.Optimizer) -> dict | None:
    """The one param group of a plain Nesterov ``torch.optim.SGD`` without hooks, or None."""
    g = _sgd_group(opt)
    if g is None or not (g.get("nesterov") and g["momentum"] > 0 and g.get("dampening", 0) == 0):
        return None
    return g


def sgd_step_in_blocks(opt: torch.optim.Optimizer, params: dict[str, torch.Tensor], grad: dict[str, torch.Tensor],
                       watch: "BlockWatch") -> bool:
    """``opt.step()`` with ``grad`` as the params' gradients, for a momentum-free ``torch.optim.SGD``
    (``_sgd_group``; it keeps no state), in place, block by block, telling ``watch`` of each block
    before and after it is stepped: the caller keeps the undo (the watch's backup). False, and
    nothing touched or told, when it does not apply (step as usual).

    Each block is ``param.add_(grad, alpha=-lr)``, the call torch's single-tensor SGD makes on the
    whole tensor, with the same scalar: the same bits (a block is a whole number of vectors)."""
    group = _sgd_group(opt)
    if group is None or group.get("momentum", 0) != 0:
        return False
    ids = {id(p) for p in group["params"]}
    for name, p in params.items():
        g = grad.get(name)
        if (id(p) not in ids or g is None or g.shape != p.shape or g.dtype != p.dtype or p.dtype != torch.float32
                or p.device.type != "cpu" or g.device.type != "cpu" or not p.is_contiguous()
                or not g.is_contiguous()):
            return False
    lr = group["lr"]
    with torch.no_grad():
        for name, p in params.items():
            pf, gf = p.detach().view(-1), grad[name].view(-1)
            n = pf.numel()
            for start in range(0, n, BLOCK):
                end = min(n, start + BLOCK)
                watch.before(name, start, end)
                pf[start:end].add_(gf[start:end], alpha=-lr)
                watch.after(name, start, end)
            watch.done(name)
    return True


#: The in-place step is taken only when its bound on every new value stays under this (fp32's largest
#: value is 3.4e38): the margin covers the rounding of the few operations a value goes through.
IN_PLACE_LIMIT = 1e38
#: Each bound carried to the next step grows by this factor: every fp32 operation may round up by
#: 2^-24 of its value, and a value goes through three.
_ROUNDING = 1 + 1e-6


@dataclass(frozen=True)
class Magnitudes:
    """Bounds on the largest absolute value of a fragment's params and of its momentum, valid while
    ``key`` still identifies their tensors (their memory and version counters: anything that writes
    them, a restore, a heal, a replay, changes it)."""

    params: float
    momentum: float
    key: tuple


def _key(work: list) -> tuple:
    return tuple((p.data_ptr(), p._version, buf.data_ptr(), buf._version) for _, p, _, buf in work)


@dataclass
class BlockedStep:
    """What ``step_in_blocks`` did: the first param left non-finite (or None), how, and what to undo."""

    bad: str | None
    #: True: the params and momentum were stepped in place (proven finite beforehand: nothing to undo).
    in_place: bool
    #: The params' values before the step, on the memory they left (fresh-memory steps only; a
    #: Result may still be sent from it).
    before: dict[str, torch.Tensor]
    #: For the next step, or None when the caller asked for none or the step left a non-finite value.
    magnitudes: Magnitudes | None
    _moved: list[tuple[torch.Tensor, torch.Tensor]]  # (live tensor, the memory it left)

    def undo(self) -> None:
        """Put the params and the momentum back on the memory they left: the values before, bit for bit."""
        if self.in_place:
            raise RuntimeError("an outer step made in place has nothing to undo: its bound proved it finite")
        for live, old in self._moved:
            live.data = old


class GradBlocks(Protocol):
    """A gradient made block by block, just before the step reads each block (``ParamStore.open_mean``)."""

    def block(self, name: str, start: int, end: int) -> None:
        """Make elements ``start:end`` (flat) of tensor ``name``."""

    def made(self, name: str) -> None:
        """Tensor ``name`` was made whole by ``block`` calls."""

    def finish(self) -> None:
        """Make every tensor not yet made."""


class BlockWatch(Protocol):
    """Work of the caller's on each block of the params while the step has it in the cache (``watch``
    of an in-place step with the caller's own undo): one pass over the model rather than one more
    per job (a collective member backs each block up, then measures the step and its digest)."""

    def before(self, name: str, start: int, end: int) -> None:
        """Elements ``start:end`` (flat) of param ``name``, about to be stepped."""

    def after(self, name: str, start: int, end: int) -> None:
        """The same elements, stepped."""

    def done(self, name: str) -> None:
        """Param ``name`` was stepped whole."""


def step_in_blocks(opt: torch.optim.Optimizer, params: dict[str, torch.Tensor], grad: dict[str, torch.Tensor],
                   *, grad_bound: float | None = None, magnitudes: Magnitudes | None = None,
                   overwrite: bool = False, undo_kept: bool = False,
                   grad_blocks: GradBlocks | None = None, watch: BlockWatch | None = None) -> BlockedStep | None:
    """``opt.step()`` with ``grad`` as the params' gradients, made block by block when ``opt`` is a plain
    Nesterov SGD whose momentum exists; None when it does not apply (nothing was changed: step as usual).

    A refused step (a non-finite value) must be undone exactly, and the memory of params handed out
    in a Result must not be written while it may still be sent. So by default the new params and
    momentum are written to fresh memory (``buffers``) and the tensors moved onto it (the objects
    stay: the optimizer's state is keyed by them); the memory left behind is both the undo and what
    the last Results are sent from, with no copy made for either.

    In place, which writes two model-sized streams fewer (fresh memory is read in before it is
    written), when both hold: ``overwrite`` (the caller knows nothing else holds the params' memory),
    and the bounds prove every new value finite, so that there is nothing to undo: ``grad_bound`` at
    least every ``|grad|`` and ``magnitudes`` from the last step, still current. With ``grad_bound``
    the step returns the magnitudes for the next one: measured on a fresh-memory step, carried forward
    from the bounds on an in-place one.

    ``undo_kept``: the caller kept an exact undo of its own (the params' old values elsewhere and the
    optimizer's state backed up, ``HubRounds.idle``) and nothing else holds the params'
    memory: in place, checked for finiteness as it goes; the caller undoes a refused step.

    ``grad_blocks``: ``grad`` is not made yet. The in-place step proven finite makes each block of it
    just before reading it (one pass over the mean and the step together, not two); any other way,
    including a None return, makes all of it first.

    ``watch`` (with ``undo_kept`` only): told of each block before and after it is stepped; the caller
    checks the new values through it (``bad`` is None: no finiteness pass of this step's). On a None
    return it was told nothing.
    """
    if watch is not None and not undo_kept:
        raise ValueError("a watch needs undo_kept: only the in-place step with the caller's undo tells one")
    group = _nesterov_group(opt)
    work = None if group is None else _work(opt, group, params, grad)
    if work is None:
        if grad_blocks is not None:
            grad_blocks.finish()
        return None
    lr, momentum, dampening = group["lr"], group["momentum"], group["dampening"]
    bounds = None if undo_kept or not overwrite else _in_place_bounds(lr, momentum, grad_bound, magnitudes, work)
    if bounds is not None:
        # Nothing read ``grad`` yet: its blocks are made as the step comes to them.
        _step_in_place(work, lr, momentum, dampening, check=False, grad_blocks=grad_blocks)
        return BlockedStep(None, True, {}, Magnitudes(*bounds, _key(work)), [])
    if grad_blocks is not None:
        grad_blocks.finish()
    if undo_kept:
        # A watch sees every block stepped: its caller checks the step (the finiteness pass is not run).
        return BlockedStep(_step_in_place(work, lr, momentum, dampening, check=watch is None, watch=watch),
                           True, {}, None, [])
    return _step_to_fresh_memory(work, lr, momentum, dampening, measure=grad_bound is not None)


def _work(opt: torch.optim.Optimizer, group: dict, params: dict[str, torch.Tensor],
          grad: dict[str, torch.Tensor]) -> list | None:
    """``(name, param, grad, momentum)`` of each param, or None when the blocked step does not apply
    (reads no value of ``grad``)."""
    if len(group["params"]) != len(params):
        return None
    ids = {id(p) for p in group["params"]}
    work = []
    for name, p in params.items():
        g = grad.get(name)
        buf = opt.state.get(p, {}).get("momentum_buffer")
        if id(p) not in ids or not isinstance(g, torch.Tensor) or not isinstance(buf, torch.Tensor):
            return None
        for t in (p, g, buf):
            if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() or t.shape != p.shape:
                return None
        if p.numel() and len({p.data_ptr(), g.data_ptr(), buf.data_ptr()}) < 3:
            return None  # aliased: let torch do what it does
        work.append((name, p, g.detach(), buf))
    return work


def _in_place_bounds(lr: float, momentum: float, grad_bound: float | None, magnitudes: Magnitudes | None,
                     work: list) -> tuple[float, float] | None:
    """Bounds on the new params and momentum (the rounding margin included) that prove a step in place
    finite, or None when they are unknown or do not."""
    if grad_bound is None or magnitudes is None or magnitudes.key != _key(work):
        return None
    # |buf'| <= m |buf| + |g|, |t| <= |g| + m |buf'|, |p'| <= |p| + lr |t| (dampening is 0).
    new_momentum = momentum * magnitudes.momentum + grad_bound
    new_params = magnitudes.params + lr * (grad_bound + momentum * new_momentum)
    if not max(new_momentum, new_params) * _ROUNDING < IN_PLACE_LIMIT:  # also for a NaN or an infinity
        return None
    return new_params * _ROUNDING, new_momentum * _ROUNDING


def _step_in_place(work: list, lr: float, momentum: float, dampening: float, *, check: bool,
                   grad_blocks: GradBlocks | None = None, watch: BlockWatch | None = None) -> str | None:
    """The step over the old values; with ``check``, the first param left non-finite (else None)."""
    bad = None
    with torch.no_grad():
        largest = max((p.numel() for _, p, _, _ in work), default=0)
        scratch = torch.empty(min(BLOCK, largest))
        sums = torch.empty(-(-largest // BLOCK))
        for name, p, g, buf in work:
            pf, gf, bf = p.detach().view(-1), g.view(-1), buf.view(-1)
            n = pf.numel()
            blocks = 0
            for start in range(0, n, BLOCK):
                end = min(n, start + BLOCK)
                pb, gb, bb = pf[start:end], gf[start:end], bf[start:end]
                if grad_blocks is not None:
                    grad_blocks.block(name, start, end)
                if watch is not None:
                    watch.before(name, start, end)
                # torch.optim.SGD, _single_tensor_sgd, for one block: the same calls, the same scalars.
                bb.mul_(momentum).add_(gb, alpha=1 - dampening)
                t = torch.add(gb, bb, alpha=momentum, out=scratch[:end - start])
                pb.add_(t, alpha=-lr)
                if watch is not None:
                    watch.after(name, start, end)
                if check:
                    torch.sum(pb, 0, keepdim=True, out=sums[blocks:blocks + 1])
                    blocks += 1
            if grad_blocks is not None:
                grad_blocks.made(name)
            if watch is not None:
                watch.done(name)
            if bad is None and blocks and not bool(torch.isfinite(sums[:blocks]).all()) and not all_finite(p):
                bad = name  # a block's sum not finite: a bad element, or finite values that overflow
    return bad


def _step_to_fresh_memory(work: list, lr: float, momentum: float, dampening: float, *,
                          measure: bool) -> BlockedStep:
    bad = None
    before: dict[str, torch.Tensor] = {}
    moved: list[tuple[torch.Tensor, torch.Tensor]] = []
    largest_params = largest_momentum = 0.0
    with torch.no_grad():
        largest = max((p.numel() for _, p, _, _ in work), default=0)
        scratch = torch.empty(min(BLOCK, largest))
        # The blocks' sums go into one tensor: no small tensors stay allocated across the loop.
        sums = torch.empty(-(-largest // BLOCK))
        extremes = torch.empty(4 * -(-largest // BLOCK)) if measure else None
        for name, p, g, buf in work:
            old_p, old_buf = p.detach(), buf.detach()
            new_p, new_buf = buffers.empty_like(old_p), buffers.empty_like(old_buf)
            po, bo, gf, pn, bn = (t.view(-1) for t in (old_p, old_buf, g, new_p, new_buf))
            n = po.numel()
            blocks = 0
            for start in range(0, n, BLOCK):
                end = min(n, start + BLOCK)
                gb, nb = gf[start:end], bn[start:end]
                # The same kernels and scalars as the in-place step, each result written to the fresh
                # memory instead of over its input.
                torch.mul(bo[start:end], momentum, out=nb).add_(gb, alpha=1 - dampening)
                t = torch.add(gb, nb, alpha=momentum, out=scratch[:end - start])
                pb = torch.add(po[start:end], t, alpha=-lr, out=pn[start:end])
                torch.sum(pb, 0, keepdim=True, out=sums[blocks:blocks + 1])
                if extremes is not None:  # while the block is in the cache
                    torch.aminmax(pb, out=(extremes[4 * blocks:4 * blocks + 1].view(()),
                                           extremes[4 * blocks + 1:4 * blocks + 2].view(())))
                    torch.aminmax(nb, out=(extremes[4 * blocks + 2:4 * blocks + 3].view(()),
                                           extremes[4 * blocks + 3:4 * blocks + 4].view(())))
                blocks += 1
            p.data, buf.data = new_p, new_buf
            before[name] = old_p
            moved += [(p, old_p), (buf, old_buf)]
            if bad is None and blocks and not bool(torch.isfinite(sums[:blocks]).all()):
                # A block's sum that is not finite: a bad element, or finite values that overflow.
                if not all_finite(p):
                    bad = name
            if extremes is not None and blocks:
                e = extremes[:4 * blocks].view(blocks, 4).abs().amax(0)
                largest_params = max(largest_params, float(e[0]), float(e[1]))
                largest_momentum = max(largest_momentum, float(e[2]), float(e[3]))
    magnitudes = None
    if measure and bad is None and math.isfinite(largest_momentum):
        magnitudes = Magnitudes(largest_params, largest_momentum, _key(work))
    return BlockedStep(bad, False, before, magnitudes, moved)


def blocked_step_applies(opt: torch.optim.Optimizer) -> bool:
    """Whether ``step_in_blocks`` will step ``opt`` (as far as the optimizer says: a plain Nesterov
    SGD whose momentum exists), so that nothing need be prepared for ``opt.step()``."""
    group = _nesterov_group(opt)
    return group is not None and all(
        isinstance(opt.state.get(p, {}).get("momentum_buffer"), torch.Tensor) for p in group["params"])


__all__ = ["BLOCK", "BlockWatch", "BlockedStep", "GradBlocks", "IN_PLACE_LIMIT", "Magnitudes", "blocked_step_applies",
           "step_in_blocks"]
