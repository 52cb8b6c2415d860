"""A bound on contributions that needs no tuning: far out of line with the recent ones is refused.

A finite contribution can still wreck a run: one worker (or one key) that
submits 1e30 makes every parameter about 1e29 after the outer step, and every
worker's next int8 encoding non-finite. ``--max-update-norm`` is an absolute
bound, but it needs a number nobody knows before the run. This one adapts: per
fragment it keeps the L2 norms of the last ``WINDOW`` accepted contributions
and refuses a new one whose norm exceeds ``factor`` times their median
(``update_too_large``), before it enters a round. Honest pseudo-gradients of
one run vary by a small factor from round to round (their norm falls slowly as
training goes on); an attack or a divergence is orders of magnitude out.

Until ``MIN_HISTORY`` norms are known the bound is ``WARMUP_FACTOR`` times the
fragment's parameter norm (at least 1): a pseudo-gradient is a difference of
two parameter vectors a few hundred inner steps apart, never thousands of
times the parameters themselves.
"""

from __future__ import annotations

import statistics
from collections import deque

import torch

from diloco.wire.measure import square_sum

#: Accepted norms kept per fragment.
WINDOW = 16
#: Norms needed before the median bound applies.
MIN_HISTORY = 3
#: Before that: this many times the fragment's parameter norm (or 1, if larger).
WARMUP_FACTOR = 1000.0
#: ``--outlier-factor``'s default.
DEFAULT_FACTOR = 10.0


def fast_norm(tensors: dict[str, torch.Tensor]) -> float:
    """The L2 norm over all ``tensors``, summed in fp32 per tensor (a float64 copy of a 100M-parameter
    contribution would cost more than the rest of its checks); an overflow gives inf, which no bound
    lets in."""
    total = 0.0
    for t in tensors.values():
        if t.numel():
            total += square_sum(t)
    return total ** 0.5


class OutlierGuard:
    """Per fragment, the recent accepted norms and the bound they give."""

    def __init__(self, num_fragments: int, factor: float = DEFAULT_FACTOR) -> None:
        self.factor = factor
        self._norms = [deque(maxlen=WINDOW) for _ in range(num_fragments)]
        self.refused = 0

    def bound(self, fragment_id: int, params: dict[str, torch.Tensor]) -> tuple[float, str]:
        """The largest norm accepted now for ``fragment_id``, and what it was derived from."""
        recent = self._norms[fragment_id]
        if len(recent) >= MIN_HISTORY:
            median = statistics.median(recent)
            return self.factor * median, (f"{self.factor:g} x the median norm {median:.4g} of the last "
                                          f"{len(recent)} accepted contributions")
        scale = max(1.0, fast_norm(params))
        return WARMUP_FACTOR * scale, (f"{WARMUP_FACTOR:g} x the fragment's parameter norm {scale:.4g} (fewer than "
                                       f"{MIN_HISTORY} contributions accepted yet)")

    def check(self, fragment_id: int, norm: float, params: dict[str, torch.Tensor]) -> str | None:
        """Why a contribution of L2 norm ``norm`` is refused, or None to let it in."""
        if self.factor <= 0:
            return None
        limit, basis = self.bound(fragment_id, params)
        if norm <= limit:
            return None
        self.refused += 1
        return f"L2 norm {norm:.4g} is far out of line: the bound is {limit:.4g}, {basis} (--outlier-factor)"

    def known(self, fragment_id: int) -> int:
        """How many accepted norms the fragment's bound is made of (the median bound needs ``MIN_HISTORY``)."""
        return len(self._norms[fragment_id])

    def accepted(self, fragment_id: int, norm: float) -> None:
        self._norms[fragment_id].append(norm)
