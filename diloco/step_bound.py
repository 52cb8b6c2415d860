"""How far one outer step can move the params, given how large its pseudo-gradient can be.

On the collective plane every member checks its own proposal before it votes on it
(SPEC.md section 7c, M11): the step must be finite and its norm within the bound this module
computes. The contributions are already checked against the norms their senders declared, so
the mean pseudo-gradient ``g`` of a round has a known bound ``G`` (the mean of the declared
norms, ``member.mean_bound``). What the outer optimizer does with ``g`` is deterministic; a step
beyond the bound below therefore means a corrupted optimizer state (a faulty device, a bit flip,
a bug), and a replica must not vote for it.

The bounds, per optimizer (torch's semantics; ``lr`` and the momentum ``mu`` of the step itself,
so a momentum schedule is followed):

- SGD with momentum: ``buf' = mu * buf + g``; the step is ``lr * buf'``, or with Nesterov
  ``lr * (g + mu * buf')``. A bound ``B`` on ``|buf|`` is carried from step to step
  (``B' = mu * B + G``), measured once from the real buffers when a replica is built from a
  state; a buffer that grows past what its history allows is what the check catches.
- Delayed Nesterov (``outer.DelayedNesterov``): ``lr * g / delay`` at once, and every
  ``delay``-th step ``lr * mu * m'`` with ``m' = mu * m + buf / delay``; bounds on ``|m|`` and on
  the delay buffer are carried the same way.
- Adam (betas ``(mu, b2)``, step count ``t``): per element, by Cauchy-Schwarz over the moment
  sums, ``|m_hat| / sqrt(v_hat) <= (1 - mu) / sqrt(1 - b2) * sqrt(S_t) * sqrt(1 - b2^t) /
  (1 - mu^t)`` with ``S_t = sum_{j<t} (mu^2 / b2)^j``, whatever the gradients were (1 at
  ``t = 1``: Adam's first step is ``lr`` per element). The step's norm is at most that times
  ``lr * sqrt(numel)``. No state to carry.

A lossy wire rounds the step to the nearest representable value (``quantized_update``); a
round-to-nearest never more than doubles an element's magnitude, so such a wire doubles the
bound. ``SLACK`` covers fp32 rounding of the step's own arithmetic; storing the new params in
fp32 rounds each element by up to half its unit in the last place, so a step measured as
``after - before`` may also be off by ``ROUNDING`` times the params' norm (``params_bound``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

#: Relative slack on every bound: the step is computed in fp32.
SLACK = 1e-3
#: The fp32 rounding of the params a step writes, relative to their norm: up to three roundings
#: (a step of two adds, then a lossy wire's apply) of half an ulp (2^-24) each, doubled for margin.
ROUNDING = 6 * 2.0 ** -24


@dataclass(frozen=True, slots=True)
class StepBound:
    #: Bound on the norm of the step (inf: nothing known to bound it by).
    step: float
    #: Bounds on the norms of the optimizer's state after the step (names as ``state_norms``).
    state: dict[str, float] = field(default_factory=dict)


def step_bound(name: str, group: dict, grad_bound: float, state: dict[str, float], steps_taken: int,
               numel: int, lossy_wire: bool, params_bound: float) -> StepBound:
    """The bound of the step an optimizer called ``name`` just took on a pseudo-gradient of norm
    at most ``grad_bound``, measured on fp32 params whose norm was at most ``params_bound`` before it.
    ``group`` is its param group as the step left it (lr, momentum); ``state`` the bounds carried
    from before the step (names as ``state_keys``); ``steps_taken`` the optimizer's step count
    including this step; ``numel`` the fragment's element count."""
    bound = _step_bound(name, group, grad_bound, state, steps_taken, numel)
    step = bound.step * (2.0 if lossy_wire else 1.0)
    scaled = step * (1 + SLACK) + ROUNDING * (params_bound + step) + 1e-30
    return StepBound(scaled, bound.state)


def _step_bound(name: str, group: dict, grad_bound: float, state: dict[str, float], steps_taken: int,
                numel: int) -> StepBound:
    lr = float(group["lr"])
    if name in ("nesterov", "sgd"):
        mu = float(group.get("momentum", 0.0))
        if mu == 0:
            return StepBound(lr * grad_bound)
        buf = mu * state.get("momentum", 0.0) + grad_bound
        update = grad_bound + mu * buf if group.get("nesterov") else buf
        return StepBound(lr * update, {"momentum": buf})
    if name == "adam":
        b1, b2 = (float(b) for b in group["betas"])
        t = max(1, steps_taken)
        r = b1 * b1 / b2
        series = t if r == 1 else (1 - r ** t) / (1 - r)
        per_element = (1 - b1) / math.sqrt(1 - b2) * math.sqrt(series) * math.sqrt(1 - b2 ** t) / (1 - b1 ** t)
        return StepBound(lr * per_element * math.sqrt(numel))
    if name == "delayed_nesterov":
        mu, delay = float(group["momentum"]), int(group["delay"])
        pending = state.get("delay", 0.0) + grad_bound
        momentum = state.get("momentum", 0.0)
        step = lr * grad_bound / delay
        if steps_taken % delay == 0:
            momentum = mu * momentum + pending / delay
            step += lr * mu * momentum
            pending = 0.0
        return StepBound(step, {"momentum": momentum, "delay": pending})
    return StepBound(math.inf)


def state_keys(name: str) -> dict[str, str]:
    """Which torch state tensor each carried bound follows: bound name -> state key."""
    if name in ("nesterov", "sgd"):
        return {"momentum": "momentum_buffer"}
    if name == "delayed_nesterov":
        return {"momentum": "momentum_buffer", "delay": "delay_buffer"}
    return {}
