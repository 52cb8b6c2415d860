"""The global parameters, their fragments, and the running sums of a round.

Memory is O(parameters), not O(workers x parameters): a sync round keeps one
running sum per fragment, added to as each contribution is accepted (an
accepted contribution is never taken back, SPEC.md P1, so a sum never needs
a subtraction). The sum is fp32 over contributions scaled by a power of two
(``SUM_SCALE``): up to ``MAX_SUMMED`` finite contributions can never add up to
an infinity, and the scale is exact, so the sum rounds as a plain fp32 sum
does; the mean is at most the largest contribution in magnitude, so it stays
finite (``ParamStore.accumulate``). Async mode keeps the
tensors of contributions *held* below quorum, bounded by
``max_held_per_fragment``, as fp32 (each applies alone: nothing is summed).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from diloco.wire.measure import all_finite  # noqa: F401  (re-exported: the coordinator's checks use it)

from diloco.wire import buffers
from diloco.wire.measure import square_sum
from diloco.wire.messages import TensorSpec, Tensors, spec_of


#: Running sums hold contributions times this power of two (see ``ParamStore.accumulate``).
SUM_SCALE = 2.0 ** -20
#: So a round may sum at most this many contributions without overflow.
MAX_SUMMED = 1 << 20
#: Elements per block of ``take_mean`` (256 KiB of fp32: in the L2 cache between its two operations).
MEAN_BLOCK = 1 << 16


class Measured(Protocol):
    """What the receiver measured of a contribution's tensors as they arrived (``diloco.wire.measure``)."""

    def square(self, t: torch.Tensor) -> float | None:
        """``square_sum(t)`` if ``t`` is memory it measured, else None."""


class ParamMismatch(ValueError):
    """Tensors that do not match the run's parameters (names, shapes or dtypes)."""


class NonFinite(ParamMismatch):
    """Tensors of the right names, shapes and dtypes holding NaN or infinite values.

    ``tensor`` names the first such tensor.
    """

    def __init__(self, message: str, tensor: str) -> None:
        super().__init__(message)
        self.tensor = tensor


def _non_finite(fragment_id: int, name: str) -> NonFinite:
    return NonFinite(f"fragment {fragment_id} submission: tensor {name!r} has non-finite values (NaN or infinity)",
                     name)


def partition(spec: tuple[TensorSpec, ...], num_fragments: int) -> tuple[tuple[str, ...], ...]:
    """Split parameter names into ``num_fragments`` contiguous groups of similar size.

    Contiguous (in model order) like Streaming DiLoCo's layer-wise fragments;
    each fragment gets at least one tensor.
    """
    if num_fragments > len(spec):
        raise ParamMismatch(f"num_fragments={num_fragments} but the model has only {len(spec)} tensors")
    sizes = [max(1, _numel(s.shape)) for s in spec]
    total = sum(sizes)
    groups: list[list[str]] = [[] for _ in range(num_fragments)]
    acc = 0
    f = 0
    for i, (s, n) in enumerate(zip(spec, sizes)):
        remaining_tensors = len(spec) - i
        remaining_groups = num_fragments - f - 1
        # Move on when this group has its share, or when later groups need the rest.
        if groups[f] and (acc >= total * (f + 1) / num_fragments or remaining_tensors <= remaining_groups):
            f += 1
        groups[f].append(s.name)
        acc += n
    return tuple(tuple(g) for g in groups)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def check_tensors(tensors: Tensors, expected: tuple[TensorSpec, ...], what: str) -> None:
    """Raise ``ParamMismatch`` naming the first tensor whose name, shape or dtype is wrong."""
    names = list(tensors)
    want = [s.name for s in expected]
    if names != want:
        missing = [n for n in want if n not in tensors]
        extra = [n for n in names if n not in set(want)]
        if missing or extra:
            raise ParamMismatch(f"{what}: missing tensors {missing[:5]}, unexpected tensors {extra[:5]}")
        raise ParamMismatch(f"{what}: tensors out of order: expected {want[:5]}..., got {names[:5]}...")
    for s in expected:
        t = tensors[s.name]
        got = TensorSpec.of(s.name, t)
        if got.shape != s.shape or got.dtype != s.dtype:
            raise ParamMismatch(
                f"{what}: tensor {s.name!r} has shape {list(got.shape)} dtype {got.dtype}; "
                f"the run's parameter has shape {list(s.shape)} dtype {s.dtype}"
            )


def first_non_finite(tensors: Tensors) -> str | None:
    """The name of the first tensor holding a NaN or an infinity, or None when all are finite."""
    for name, t in tensors.items():
        if not all_finite(t):
            return name
    return None


def l2_norm(tensors: Tensors) -> float:
    """The L2 norm over all elements of all ``tensors``, computed in float64.

    Squares of finite fp32 values (up to ~1.2e77) and their sums stay finite in
    float64, so the norm of finite tensors is finite and exact to float64 rounding.
    """
    total = 0.0
    for t in tensors.values():
        if t.numel():
            total += float(torch.linalg.vector_norm(t, dtype=torch.float64)) ** 2
    return total ** 0.5


class ParamStore:
    """Global fp32 params split into fragments, plus per-fragment running sums."""

    def __init__(self, params: Tensors, num_fragments: int) -> None:
        self.params: Tensors = {n: t.detach().to(torch.float32).clone().contiguous() for n, t in params.items()}
        self.spec = spec_of(self.params)
        self.fragments = partition(self.spec, num_fragments)
        by_name = {s.name: s for s in self.spec}
        self.fragment_specs = tuple(tuple(by_name[n] for n in names) for names in self.fragments)
        self._sums: list[Tensors | None] = [None] * num_fragments
        self._counts = [0] * num_fragments
        #: Token-weighted rounds: the sum of the weights, and the first contribution's tokens (the unit).
        self._weights: list[float] = [0.0] * num_fragments
        self._unit: list[int | None] = [None] * num_fragments
        #: The largest L2 norm among the round's contributions, None once one came without its norm;
        #: ``take_mean`` turns it into a bound on the mean (``mean_bound``).
        self._largest_norm: list[float | None] = [0.0] * num_fragments
        self._mean_bound: list[float | None] = [None] * num_fragments
        #: A round's last contribution and its scale, left by ``accumulate(last=True)`` to ``take_mean``.
        self._last: list[tuple[Tensors, float] | None] = [None] * num_fragments
        self.bytes_received = 0

    def fragment_params(self, fragment_id: int) -> Tensors:
        return {n: self.params[n] for n in self.fragments[fragment_id]}

    # -- outer steps: the params' memory is never written once it was handed out
    def begin_step(self, fragment_id: int) -> Tensors:
        """Move fragment ``fragment_id``'s params to fresh memory holding the same values, for an
        outer step to change in place; return the old values (the memory they leave).

        Params are never changed in place otherwise, so tensors handed out as views of them (the
        Results of a round, which a transport may still be sending from that memory, or a
        simulator holding them) keep what they held without a copy, and the old values are the
        exact undo of a refused step (``undo_step``). The tensor objects stay the same (the outer
        optimizer's state is keyed by them): only their memory moves.
        """
        old = {}
        for n in self.fragments[fragment_id]:
            p = self.params[n]
            old[n] = p.detach()
            p.data = buffers.empty_like(p).copy_(p.detach())
        return old

    def undo_step(self, fragment_id: int, old: Tensors) -> None:
        """Put back the values ``begin_step`` returned (bit for bit: the same memory)."""
        for n in self.fragments[fragment_id]:
            self.params[n].data = old[n]

    def released(self, fragment_id: int) -> Tensors:
        """Views of fragment ``fragment_id``'s params for a Result: nothing writes that memory again
        (the next outer step moves the params first, ``begin_step``), so no copy is needed."""
        return {n: self.params[n].detach() for n in self.fragments[fragment_id]}

    def fragment_spec(self, fragment_id: int) -> tuple[TensorSpec, ...]:
        return self.fragment_specs[fragment_id]

    def check_submission(self, fragment_id: int, tensors: Tensors, *, norm: bool = False,
                         measured: Measured | None = None) -> float | None:
        """Names, shapes, dtypes and finiteness (checked before the core sees it); with ``norm``,
        also return the L2 norm of ``tensors`` (the value ``outliers.fast_norm`` gives).
        ``measured``: each tensor's sum of squares where the receiver already measured that very
        memory as it arrived (``diloco.wire.measure``): the same value, not computed twice.

        Raises ``ParamMismatch`` for a wrong name, shape or dtype, and its subclass
        ``NonFinite`` for a NaN or an infinity.

        With ``norm`` one pass over each tensor does both: a finite norm proves every element
        finite (as a finite sum does, ``all_finite``), and only a tensor whose norm is not finite
        (a bad element, or squares that overflow) gets the exact check. A second pass of its own,
        at 100M parameters, was 30 ms a submission.
        """
        check_tensors(tensors, self.fragment_specs[fragment_id], f"fragment {fragment_id} submission")
        if not norm:
            bad = first_non_finite(tensors)
            if bad is not None:
                raise _non_finite(fragment_id, bad)
            return None
        total = 0.0
        for name, t in tensors.items():
            if not t.numel():
                continue
            square = None if measured is None else measured.square(t)
            if square is None:
                square = square_sum(t)
            if not math.isfinite(square) and not all_finite(t):
                raise _non_finite(fragment_id, name)
            total += square
        return total ** 0.5

    # -- sync rounds: running sums (scaled fp32, see the module docstring)
    def accumulate(self, fragment_id: int, tensors: Tensors, tokens: int | None = None,
                   norm: float | None = None, *, last: bool = False, owned: bool = False) -> None:
        """Add a contribution to fragment ``fragment_id``'s running sum.

        ``norm``: the contribution's L2 norm when the checks computed it (``check_submission``); it
        bounds every element, and so the round's largest bounds its mean (``mean_bound``).
        ``tokens`` (a token-weighted merge, SPEC.md section 12): the contribution enters with the weight
        tokens / the round's first contribution's tokens, so weights stay near 1 and the weighted sum
        has the plain sum's range; ``take_mean`` divides by the weights' sum. None: weight 1.
        ``last``: the caller knows the round's mean is taken next (its outer step follows), so the
        addition is left to ``take_mean``, which makes it in the same pass as the division: the sum is
        read and written once less, on the round's critical path, for the same bits.
        ``owned``: ``tensors`` are the caller's to change (fp32, contiguous; memory nothing else holds
        or will read, such as a receive buffer), so a round's sum may start in them, scaled in place,
        rather than in a copy: the same bits, one model-sized stream fewer.
        """
        weight = 1.0
        if tokens is not None:
            unit = self._unit[fragment_id]
            if unit is None:
                self._unit[fragment_id] = unit = tokens
            weight = tokens / unit
        self._weights[fragment_id] += weight
        alpha = SUM_SCALE * weight
        largest = self._largest_norm[fragment_id]
        known = largest is not None and norm is not None and math.isfinite(norm)
        self._largest_norm[fragment_id] = max(largest, norm) if known else None
        self._counts[fragment_id] += 1
        self.bytes_received += sum(t.numel() * t.element_size() for t in tensors.values())
        if last:
            self._last[fragment_id] = ({n: t.detach().to(torch.float32).reshape(-1) for n, t in tensors.items()},
                                       alpha)
            return
        # A scaled fp32 sum: each contribution enters multiplied by SUM_SCALE = 2^-20, so
        # at most 2^20 finite fp32 contributions (the core allows at most 1,000,000
        # workers) can never sum past fp32's largest value. Scaling by a power of two is
        # exact (bar values under ~1e-32, which become subnormal), so the sum rounds as a
        # plain fp32 sum does, in one fused pass per contribution (a float64 sum cost 3x).
        s = self._sums[fragment_id]
        if s is None and owned:
            self._sums[fragment_id] = {n: t.detach().mul_(alpha) for n, t in tensors.items()}
        elif s is None:
            # A new sum every round (it is handed out as the step's input, ``take_mean``), on memory
            # that is reused from round to round (``buffers``).
            self._sums[fragment_id] = {n: torch.mul(t.detach().to(torch.float32), alpha,
                                                    out=buffers.empty_like(t, torch.float32))
                                       for n, t in tensors.items()}
        else:
            for n, t in tensors.items():
                s[n].add_(t.detach(), alpha=alpha)

    def take_mean(self, fragment_id: int, contributors: int) -> Tensors:
        """The mean pseudo-gradient of the round (fp32), and reset the sum. ``contributors`` must match."""
        mean = self.open_mean(fragment_id, contributors)
        mean.finish()
        return mean.tensors

    def open_mean(self, fragment_id: int, contributors: int) -> "OpenMean":
        """``take_mean`` with its one pass left to the caller, block by block (``OpenMean``): an outer
        step can then make each block of the mean just before it reads it, while the block is in the
        cache (``outer.step_in_blocks``'s ``grad_blocks``). The sum is reset now."""
        s, count, last = self._sums[fragment_id], self._counts[fragment_id], self._last[fragment_id]
        if (s is None and last is None) or count != contributors:
            raise RuntimeError(
                f"fragment {fragment_id}: {count} contributions summed but the round lists {contributors}"
            )
        weighted, total = self._unit[fragment_id] is not None, self._weights[fragment_id]
        largest = self._largest_norm[fragment_id]
        # The mean is a convex combination of the contributions, each element at most its L2 norm; the
        # factor 2 covers the rounding of the norms and of the scaled sum of up to MAX_SUMMED terms.
        self._mean_bound[fragment_id] = None if largest is None else 2.0 * largest
        self.reset_sum(fragment_id)
        if s is None:  # the round's only contribution was left to this pass
            s = {n: buffers.empty(self.params[n].shape) for n in last[0]}
        return OpenMean(s, last, count == 1, total if weighted else contributors)

    def mean_bound(self, fragment_id: int) -> float | None:
        """A bound on every element of the last mean ``take_mean`` gave, or None when a contribution to
        it came without its norm (an outer step that knows it can be made in place, ``outer.step_in_blocks``)."""
        return self._mean_bound[fragment_id]

    def reset_sum(self, fragment_id: int) -> None:
        self._last[fragment_id] = None
        self._largest_norm[fragment_id] = 0.0
        self._sums[fragment_id] = None
        self._counts[fragment_id] = 0
        self._weights[fragment_id] = 0.0
        self._unit[fragment_id] = None

    def pending_count(self, fragment_id: int) -> int:
        return self._counts[fragment_id]


def describe_mismatch(got, want) -> str:
    """Why a joiner's spec ``got`` is not the run's ``want``: the first tensor that differs."""
    got_by_name = {s.name: s for s in got}
    for s in want:
        g = got_by_name.get(s.name)
        if g is None:
            return f"the worker's model has no tensor {s.name!r} (the run's model has {len(want)} tensors)"
        if tuple(g.shape) != tuple(s.shape) or g.dtype != s.dtype:
            return (f"tensor {s.name!r}: the worker's model has shape {list(g.shape)} dtype {g.dtype}; "
                    f"the run's has shape {list(s.shape)} dtype {s.dtype}")
    extra = [s.name for s in got if s.name not in {w.name for w in want}]
    if extra:
        return f"the worker's model has tensors the run's model does not: {extra[:5]}"
    return "the worker's model lists the run's tensors in a different order"


class OpenMean:
    """A round's mean still to be made, block by block (``ParamStore.open_mean``): ``tensors`` hold the
    scaled sum until each block is made (``block``), then the mean. Every block must be made once,
    in any order (``finish`` makes those not yet made)."""

    def __init__(self, sums: Tensors, last: tuple[Tensors, float] | None, only: bool, divisor: float) -> None:
        self.tensors = sums
        self._last = last
        self._only = only
        self._divisor = divisor
        self._made: set[str] = set()

    def block(self, name: str, start: int, end: int) -> None:
        """Make elements ``start:end`` of tensor ``name``'s mean (flat indices)."""
        flat = self.tensors[name].view(-1)
        block = flat[start:end]
        if self._last is not None:
            part = self._last[0][name][start:end]
            if self._only:  # the round's only contribution: the sum starts here
                torch.mul(part, self._last[1], out=block)
            else:
                block.add_(part, alpha=self._last[1])
        # Divide first, then undo the scale: sum / k is at most fp32's largest value * 2^-20.
        block.div_(self._divisor).mul_(1.0 / SUM_SCALE)

    def made(self, name: str) -> None:
        """Tensor ``name`` was made whole, block by block (by ``block`` calls)."""
        self._made.add(name)

    def finish(self) -> None:
        """Make every tensor not yet made, block by block (so that each operation finds the block in the
        cache; elementwise: the same bits as whole-tensor operations), the last contribution's
        addition (``accumulate(last=True)``) first."""
        for name, t in self.tensors.items():
            if name in self._made:
                continue
            n = t.numel()
            for start in range(0, n, MEAN_BLOCK):
                self.block(name, start, min(n, start + MEAN_BLOCK))
            self._made.add(name)
