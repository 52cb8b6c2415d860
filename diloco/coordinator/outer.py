"""The outer optimizer's old home (it lives in ``diloco.outer``: the collective plane's members run it
too), and the hub's Nesterov step made in cache-sized blocks, to the same bits.

``torch.optim.SGD``'s Nesterov step (its single-tensor path, which CPU tensors take) makes four passes
over each parameter and a parameter-sized temporary: ``buf.mul_(m).add_(g)``, ``t = g.add(buf,
alpha=m)``, ``p.add_(t, alpha=-lr)``. Every one of them is memory-bound, 200 ms a step at 100M
parameters here, after the round's last contribution and so on its critical path. ``step_in_blocks``
makes the very same operations on one block of each tensor at a time, so that the block's values
are still in the cache for the next operation (and the temporary is one block): each element goes
through the same kernels with the same scalars, so the result is the same bit for bit (tests
compare it with ``opt.step()`` on odd sizes, with one thread and two). It also proves the new params
finite on the way (``all_finite`` by block), and writes the new params and momentum to fresh memory,
not over the old: the memory left behind is the undo of a refused step and what the last Results are
still sent from, so neither needs a copy of the model made ahead. Anything else (Adam, plain SGD, delayed Nesterov, the
first step, which creates the momentum, hooks) is left to ``opt.step()``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diloco.outer import DelayedNesterov, OPTIMIZERS, OuterConfig, OuterConfigError, build_outer_optimizer
from diloco.outer import all_finite
from diloco.wire import buffers

#: Elements per block: four fp32 blocks (the param, its momentum, its gradient and the temporary)
#: of 256 KiB fit the L2 cache; larger blocks gained nothing, smaller ones pay torch's per-call cost.
BLOCK = 1 << 16


def _nesterov_group(opt: torch.optim.Optimizer) -> dict | None:
    """The one param group of a plain Nesterov ``torch.optim.SGD`` without hooks, or None."""
    if type(opt) is not torch.optim.SGD or len(opt.param_groups) != 1:
        return None
    if opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks:
        return None
    from torch.optim import optimizer as _optimizer

    if _optimizer._global_optimizer_pre_hooks or _optimizer._global_optimizer_post_hooks:
        return None
    g = opt.param_groups[0]
    if not (g.get("nesterov") and g.get("momentum", 0) > 0 and g.get("dampening", 0) == 0
            and g.get("weight_decay", 0) == 0 and not g.get("maximize") and not g.get("foreach")
            and not g.get("fused") and not g.get("differentiable")):
        return None
    if type(g["lr"]) not in (int, float) or type(g["momentum"]) not in (int, float):
        return None
    return g


@dataclass
class BlockedStep:
    """What ``step_in_blocks`` did: the first param left non-finite (or None), and the memory the
    params and their momentum left, which still holds their values from before the step."""

    bad: str | None
    #: The params' values before the step, on the memory they left (a Result may still be sent from it).
    before: dict[str, torch.Tensor]
    _moved: list[tuple[torch.Tensor, torch.Tensor]]  # (live tensor, the memory it left)

    def undo(self) -> None:
        """Put the params and the momentum back on the memory they left: the values before, bit for bit."""
        for live, old in self._moved:
            live.data = old


def step_in_blocks(opt: torch.optim.Optimizer, params: dict[str, torch.Tensor],
                   grad: dict[str, torch.Tensor]) -> BlockedStep | None:
    """``opt.step()`` with ``grad`` as the params' gradients, made block by block into fresh memory when
    ``opt`` is a plain Nesterov SGD whose momentum exists; None when it does not apply (nothing was
    changed: step as usual).

    The new params and momentum are written to fresh memory (``buffers``) and the tensors moved onto
    it (the objects stay: the optimizer's state is keyed by them). Nothing the step reads is written,
    so the memory left behind is both the exact undo of a refused step and what the last Results are
    still sent from, with no copy made for either.
    """
    group = _nesterov_group(opt)
    if group is None or len(group["params"]) != len(params):
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
    lr, momentum, dampening = group["lr"], group["momentum"], group["dampening"]
    bad = None
    before: dict[str, torch.Tensor] = {}
    moved: list[tuple[torch.Tensor, torch.Tensor]] = []
    with torch.no_grad():
        largest = max((p.numel() for _, p, _, _ in work), default=0)
        scratch = torch.empty(min(BLOCK, largest))
        # The blocks' sums go into one tensor: no small tensors stay allocated across the loop.
        sums = torch.empty(-(-largest // BLOCK))
        for name, p, g, buf in work:
            old_p, old_buf = p.detach(), buf.detach()
            new_p, new_buf = buffers.empty_like(old_p), buffers.empty_like(old_buf)
            po, bo, gf, pn, bn = (t.view(-1) for t in (old_p, old_buf, g, new_p, new_buf))
            n = po.numel()
            blocks = 0
            for start in range(0, n, BLOCK):
                end = min(n, start + BLOCK)
                gb, nb = gf[start:end], bn[start:end]
                # torch.optim.SGD, _single_tensor_sgd, for one block: the same kernels, the same scalars
                # (``buf.mul_(m).add_(g)``, ``t = g.add(buf, alpha=m)``, ``p.add_(t, alpha=-lr)``), each
                # result written to the fresh memory instead of over its input.
                torch.mul(bo[start:end], momentum, out=nb).add_(gb, alpha=1 - dampening)
                t = torch.add(gb, nb, alpha=momentum, out=scratch[:end - start])
                pb = torch.add(po[start:end], t, alpha=-lr, out=pn[start:end])
                torch.sum(pb, 0, keepdim=True, out=sums[blocks:blocks + 1])
                blocks += 1
            p.data, buf.data = new_p, new_buf
            before[name] = old_p
            moved += [(p, old_p), (buf, old_buf)]
            if bad is None and blocks and not bool(torch.isfinite(sums[:blocks]).all()):
                # A block's sum that is not finite: a bad element, or finite values that overflow.
                if not all_finite(p):
                    bad = name
    return BlockedStep(bad, before, moved)


def blocked_step_applies(opt: torch.optim.Optimizer) -> bool:
    """Whether ``step_in_blocks`` will step ``opt`` (as far as the optimizer says: a plain Nesterov
    SGD whose momentum exists), so that nothing need be prepared for ``opt.step()``."""
    group = _nesterov_group(opt)
    return group is not None and all(
        isinstance(opt.state.get(p, {}).get("momentum_buffer"), torch.Tensor) for p in group["params"])


__all__ = ["BLOCK", "BlockedStep", "DelayedNesterov", "OPTIMIZERS", "OuterConfig", "OuterConfigError", "build_outer_optimizer",
           "blocked_step_applies", "step_in_blocks"]
