"""Compressed tensors on the wire: a name -> tensor mapping encoded in a run's wire dtype.

The run's wire dtype (``diloco server --wire-dtype``, ``CoordinatorConfig.wire_dtype``,
told to every worker in its ``Welcome``) governs what workers upload (the
pseudo-gradients of ``Submit``) and what the coordinator broadcasts (the
``Result`` of a sync round, as a delta). SPEC.md section 11, "Wire dtypes".
Pure tensor functions: no I/O, no messages but the marking of a delta ``Result``.

``fp32``  the tensors as they are (float32), no scales.
``bf16``  each tensor cast to bfloat16 (round to nearest even): 2 bytes per
          element, relative error at most 2^-9.
``int8``  symmetric per-block absmax quantisation of the flattened tensor:
          block b of ``BLOCK`` consecutive elements (the last one shorter) gets
          the fp32 scale ``s_b = max|x| / 127`` over the block, and each element
          travels as ``q = round(x / s_b)`` in [-127, 127] (int8, the tensor's own
          shape). Decoded: ``q * s_b``; the error per element is at most
          ``s_b / 2`` (plus fp32 rounding of the two operations), and an
          all-zero block decodes to exact zeros (``s_b = 0``).

Why ``BLOCK = 256``: one 4-byte scale per 256 one-byte values is 1.6 % of
overhead (1.016 bytes per element, 3.94x smaller than fp32). Smaller blocks
tighten the error bound only where a block's largest value is an outlier
(the bound is that block's ``max|x| / 254``), at 6 % overhead for 64 and
12.5 % for 32; larger ones save under 1.6 % and let one outlier coarsen more
elements. 256 is also the block size of common blockwise 8-bit schemes.

The scales travel in a separate tensor field of the message (``scales``,
keyed by the same parameter names as the values): no naming convention, so
nothing can collide with a real parameter's name. fp32 and bf16 carry no
scales.

Decoding checks everything against the expected names and shapes (names in
order, shapes, dtype of the wire dtype, one 1-D fp32 scale vector of exactly
``ceil(numel / BLOCK)`` finite, non-negative entries per tensor, small enough
that ``127 * s`` is finite, and no ``-128``) and raises ``EncodingError``
naming the tensor, what it found and what was expected (``EncodedMismatch``,
its subclass, for names and shapes: the coordinator answers that
``tensor_mismatch``, the rest ``bad_message``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch

from diloco.wire.measure import all_finite
from diloco.wire.messages import WIRE_DTYPE_NAMES, Result, Tensors

#: The wire dtypes, in the order --help lists them.
WIRE_DTYPES = WIRE_DTYPE_NAMES
#: Elements per int8 block (one fp32 scale each); see the module docstring.
BLOCK = 256
#: The largest value a symmetric int8 element holds.
QMAX = 127

#: int4: elements per block (one fp32 scale each: 0.5 bit per element on top of the 4), and the largest
#: value a symmetric int4 element holds. Elements are packed two per byte as ``q + 8`` (1..15), the even
#: element in the low nibble; an odd count pads the last high nibble with 8 (zero).
BLOCK4 = 64
QMAX4 = 7

#: Wire dtypes that lose part of what they send: error feedback is on by default there (sparse
#: needs it: its accumulator is the method).
LOSSY = frozenset({"int8", "int4", "sparse"})
_VALUE_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8, "int4": torch.uint8}
#: Elements per scale, by quantized wire dtype.
_BLOCKS = {"int8": BLOCK, "int4": BLOCK4}


class EncodingError(ValueError):
    """Tensors that are not a valid encoding in the wire dtype (the detail says what and where)."""


class EncodedMismatch(EncodingError):
    """Encoded tensors whose names or shapes are not the expected ones."""


class NonFiniteScale(EncodingError):
    """An int8 or int4 scale that is NaN or infinite: the values it scales were not finite."""


@dataclass(frozen=True)
class Encoded:
    """``values`` (one tensor per name) and ``scales`` (int8 only: one fp32 vector per name)."""

    values: Tensors
    scales: Tensors

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.values) + tensor_nbytes(self.scales)


def check_wire_dtype(wire_dtype: Any) -> str:
    if wire_dtype not in WIRE_DTYPES:
        raise ValueError(f"wire dtype {wire_dtype!r} is unknown: expected one of {list(WIRE_DTYPES)}")
    return wire_dtype


def scale_count(numel: int, wire_dtype: str = "int8") -> int:
    """Scales of a quantized tensor of ``numel`` elements: one per started block."""
    return -(-numel // _BLOCKS[wire_dtype])


def packed_shape(shape: tuple[int, ...], wire_dtype: str) -> tuple[int, ...]:
    """The shape a tensor of ``shape`` has on the wire: its own, or int4's bytes (two elements each)."""
    if wire_dtype != "int4":
        return tuple(shape)
    return (-(-math.prod(shape) // 2),)


# ------------------------------------------------------------------ encode

def quantize_int8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scales)``: ``q`` int8 in [-127, 127] of ``t``'s shape, ``scales`` fp32 of ``scale_count(numel)``."""
    x = t.detach().to("cpu", torch.float32).reshape(-1)
    n = x.numel()
    if n == 0:
        return torch.empty(t.shape, dtype=torch.int8), torch.empty(0, dtype=torch.float32)
    blocks = _blocks(x)
    scales = blocks.abs().amax(dim=1) / QMAX
    # A block whose scale is 0 (all zeros, or values so tiny that max/127 underflows) encodes as 0.
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(blocks / safe[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q.reshape(-1)[:n].reshape(t.shape), scales


def quantize_int4(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed, scales)``: uint8 of ``ceil(numel / 2)`` bytes (two nibbles ``q + 8``, q in [-7, 7]),
    fp32 scales of ``scale_count(numel, "int4")`` (``max |x| / 7`` per block of ``BLOCK4``)."""
    x = t.detach().to("cpu", torch.float32).reshape(-1)
    n = x.numel()
    if n == 0:
        return torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.float32)
    blocks = _blocks(x, BLOCK4)
    scales = blocks.abs().amax(dim=1) / QMAX4
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(blocks / safe[:, None]).clamp_(-QMAX4, QMAX4).reshape(-1)[:n].to(torch.int16) + 8
    if n % 2:
        q = torch.cat([q, q.new_full((1,), 8)])
    pairs = q.view(-1, 2)
    return (pairs[:, 0] | (pairs[:, 1] << 4)).to(torch.uint8), scales


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """fp32 values of ``shape`` from ``quantize_int4``'s bytes and scales (no checks: see ``decode``)."""
    n = math.prod(shape)
    if n == 0:
        return torch.empty(shape, dtype=torch.float32)
    b = packed.to(torch.int16)
    q = torch.stack([b & 0xF, b >> 4], dim=1).reshape(-1)[:n].to(torch.float32) - 8
    return (_blocks(q, BLOCK4) * scales[:, None]).reshape(-1)[:n].reshape(shape)


def encode(tensors: Mapping[str, torch.Tensor], wire_dtype: str, options: Any = None) -> Encoded:
    """``tensors`` (fp32) in ``wire_dtype``. fp32 sends the tensors themselves (no copy).
    ``options``: the sparse wire's settings (``sparse.SparseWire``), which it needs."""
    check_wire_dtype(wire_dtype)
    if wire_dtype == "sparse":
        from diloco.wire import sparse  # it builds on this module's errors

        if options is None:
            raise ValueError("the sparse wire needs its settings (chunk, k) to encode")
        return Encoded(*sparse.encode(tensors, options.fmt))
    if wire_dtype == "fp32":
        return Encoded(dict(tensors), {})
    if wire_dtype == "bf16":
        return Encoded({n: t.detach().to("cpu", torch.bfloat16) for n, t in tensors.items()}, {})
    quantize = quantize_int4 if wire_dtype == "int4" else quantize_int8
    values, scales = {}, {}
    for n, t in tensors.items():
        values[n], scales[n] = quantize(t)
    return Encoded(values, scales)


# ------------------------------------------------------------------ decode

def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 ``q * scale`` of each element's block, in ``q``'s shape (no checks: see ``decode``)."""
    n = q.numel()
    if n == 0:
        return torch.empty(q.shape, dtype=torch.float32)
    blocks = _blocks(q.reshape(-1).to(torch.float32))
    return (blocks * scales[:, None]).reshape(-1)[:n].reshape(q.shape)


def decode(values: Mapping[str, torch.Tensor], scales: Mapping[str, torch.Tensor], wire_dtype: str,
           expected: Iterable[tuple[str, tuple[int, ...]]], what: str) -> Tensors:
    """Check ``values``/``scales`` against ``expected`` ``(name, shape)`` pairs and decode them to fp32.

    fp32 returns the tensors as they are (their dtype is the caller's to check).
    Raises ``EncodedMismatch`` (names, shapes) or ``EncodingError`` (anything else),
    the detail starting with ``what`` (e.g. "fragment 0 submission").
    """
    if wire_dtype not in WIRE_DTYPES:
        raise EncodingError(f"{what}: wire dtype {wire_dtype!r} is unknown: expected one of {list(WIRE_DTYPES)}")
    if wire_dtype == "sparse":
        raise EncodingError(f"{what}: sparse payloads decode to entries, not tensors (``diloco.wire.sparse``)")
    expected = [(name, tuple(shape)) for name, shape in expected]
    _check_names(list(values), [n for n, _ in expected], what, "tensors")
    if wire_dtype not in LOSSY and scales:
        raise EncodingError(f"{what}: carries {len(scales)} scale tensors (first {next(iter(scales))!r}); "
                            f"wire dtype {wire_dtype} has none (only int8 and int4 do)")
    if wire_dtype in LOSSY:
        _check_names(list(scales), [n for n, _ in expected], what, "scales", EncodingError)
    out: Tensors = {}
    want = _VALUE_DTYPE[wire_dtype]
    for name, shape in expected:
        t = values[name]
        if tuple(t.shape) != packed_shape(shape, wire_dtype):
            raise EncodedMismatch(f"{what}: tensor {name!r} has shape {list(t.shape)}; the run's parameter has "
                                  f"shape {list(shape)}" + (f", so {list(packed_shape(shape, wire_dtype))} bytes "
                                                            f"in int4" if wire_dtype == "int4" else ""))
        if wire_dtype == "fp32":
            out[name] = t
            continue
        if t.dtype != want:
            raise EncodingError(f"{what}: tensor {name!r} is {_dtype(t)}; in wire dtype {wire_dtype} it must be "
                                f"{_dtype(want)}")
        if wire_dtype == "bf16":
            out[name] = t.to(torch.float32)
            continue
        s = scales[name]
        numel = math.prod(shape)
        count = scale_count(numel, wire_dtype)
        if s.dtype != torch.float32 or s.dim() != 1 or s.numel() != count:
            raise EncodingError(f"{what}: scales of tensor {name!r} are {_dtype(s)} of shape {list(s.shape)}; "
                                f"expected float32 of shape [{count}] (one per {_BLOCKS[wire_dtype]} elements "
                                f"of {numel})")
        qmax = QMAX4 if wire_dtype == "int4" else QMAX
        bad = ~(torch.isfinite(s * qmax) & (s >= 0))
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            error = NonFiniteScale if not math.isfinite(float(s[i])) else EncodingError
            raise error(f"{what}: scale {i} of tensor {name!r} is {float(s[i]):g}; scales must be finite, "
                        f">= 0 and at most float32's largest value / {qmax}")
        if wire_dtype == "int4":
            _check_int4(t, numel, name, what)
            out[name] = dequantize_int4(t, s, shape)
            continue
        if t.numel() and bool((t == -QMAX - 1).any()):
            raise EncodingError(f"{what}: tensor {name!r} holds -128, outside the symmetric int8 range "
                                f"[-{QMAX}, {QMAX}]")
        out[name] = dequantize_int8(t, s)
    return out


def _check_int4(packed: torch.Tensor, numel: int, name: str, what: str) -> None:
    """Refuse nibble 0 (-8, outside [-7, 7]) and an odd count's padding nibble other than 8."""
    if not numel:
        return
    low, high = packed & 0xF, packed >> 4
    if bool((low == 0).any()) or bool((high[: numel // 2] == 0).any()):
        raise EncodingError(f"{what}: tensor {name!r} holds -8, outside the symmetric int4 range "
                            f"[-{QMAX4}, {QMAX4}]")
    if numel % 2 and int(high[-1]) != 8:
        raise EncodingError(f"{what}: tensor {name!r} has {numel} elements, so its last byte's high nibble "
                            f"is padding and must be 8 (zero), not {int(high[-1])}")


# ------------------------------------------------------------------ deltas (SPEC.md section 11, "Result")

def apply_delta(base: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """``base + delta`` in fp32: the one sum the coordinator and every worker compute, so both hold the same bits."""
    return torch.add(base.to(torch.float32), delta.to(torch.float32))


def quantized_update(before: Tensors, after: Tensors, wire_dtype: str) -> tuple[Encoded, Tensors]:
    """The outer step's delta ``after - before`` encoded in ``wire_dtype``, and ``before + decode(it)``.

    The coordinator adopts the second as its params and broadcasts the first.
    A delta too large for the wire dtype decodes to non-finite values: the caller
    checks the new params (and refuses the step) as it checks any outer step.
    """
    enc = encode({n: after[n] - before[n] for n in before}, wire_dtype)
    new = {n: apply_delta(before[n], _decode_trusted(enc, n, wire_dtype, tuple(before[n].shape))) for n in before}
    return enc, new


def decoded(enc: Encoded, wire_dtype: str, like: Mapping[str, torch.Tensor]) -> Tensors:
    """What the receiver of ``enc`` decodes (fp32, shaped as ``like``'s tensors), with no checks: the
    sender's own view of what it sent (error feedback)."""
    return {n: _decode_trusted(enc, n, wire_dtype, tuple(like[n].shape)) for n in enc.values}


def _decode_trusted(enc: Encoded, name: str, wire_dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Decode one tensor of the element ``shape`` (int4's bytes do not say it)."""
    if wire_dtype == "int8":
        return dequantize_int8(enc.values[name], enc.scales[name])
    if wire_dtype == "int4":
        return dequantize_int4(enc.values[name], enc.scales[name], shape)
    return enc.values[name].to(torch.float32)


class DeltaParams(dict):
    """A delta ``Result``'s params, still encoded: ``resolve(base)`` gives the new fp32 params.

    The worker wraps them on receipt (``mark_delta``) and resolves them when it
    installs them, against its copy of the global params at that moment, in order.
    """

    def __init__(self, values: Mapping[str, torch.Tensor], scales: Mapping[str, torch.Tensor],
                 wire_dtype: str, options: Any = None) -> None:
        super().__init__(values)
        self.scales = dict(scales)
        self.wire_dtype = wire_dtype
        #: The sparse wire's settings (``sparse.SparseWire``): its Results carry the round's payloads.
        self.options = options

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self) + tensor_nbytes(self.scales)

    def resolve(self, base: Mapping[str, torch.Tensor], names: Iterable[str], what: str) -> Tensors:
        names = list(names)
        missing = [n for n in names if n not in base]
        if missing:
            raise EncodingError(f"{what}: a delta for {missing[:5]}, which this worker holds no global params of")
        if self.wire_dtype == "sparse":
            from diloco.wire import sparse

            if self.options is None:
                raise EncodingError(f"{what}: a sparse Result, and this worker was told no sparse settings")
            new = sparse.apply_result(dict(self), self.scales, {n: base[n] for n in names}, self.options, what)
        else:
            delta = decode(dict(self), self.scales, self.wire_dtype, [(n, tuple(base[n].shape)) for n in names],
                           what)
            new = {n: apply_delta(base[n], delta[n]) for n in names}
        # One summing pass per tensor, not a mask (``all_finite``): a receiver's largest cost besides decoding.
        bad = next((n for n, t in new.items() if not all_finite(t)), None)
        if bad is not None:
            raise EncodingError(f"{what}: the delta makes parameter {bad!r} non-finite")
        return new


def mark_delta(message: Any, options: Any = None) -> Any:
    """A ``Result`` whose params are a delta, with them wrapped in ``DeltaParams`` (with the sparse
    wire's ``options`` for a sparse one); anything else as it is."""
    if isinstance(message, Result) and message.delta and not isinstance(message.params, DeltaParams):
        return dataclasses.replace(message, params=DeltaParams(message.params, message.scales, message.wire_dtype,
                                                               options))
    return message


# ------------------------------------------------------------------ helpers

def _blocks(x: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """A flat tensor as rows of ``block``, zero-padded at the end."""
    pad = (-x.numel()) % block
    if pad:
        x = torch.cat([x, x.new_zeros(pad)])
    return x.view(-1, block)


def _check_names(got: list[str], want: list[str], what: str, field: str,
                 error: type[EncodingError] = EncodedMismatch) -> None:
    if got == want:
        return
    missing = [n for n in want if n not in got]
    extra = [n for n in got if n not in set(want)]
    if missing or extra:
        raise error(f"{what}: {field}: missing {missing[:5]}, unexpected {extra[:5]}")
    raise error(f"{what}: {field} out of order: expected {want[:5]}..., got {got[:5]}...")


def _dtype(t: Any) -> str:
    return str(getattr(t, "dtype", t)).removeprefix("torch.")


def tensor_nbytes(tensors: Mapping[str, torch.Tensor]) -> int:
    """Payload bytes of named tensors (what the coordinator and the worker count as sent or received)."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


__all__ = [
    "BLOCK", "WIRE_DTYPES", "DeltaParams", "Encoded", "EncodedMismatch", "EncodingError", "apply_delta",
    "check_wire_dtype", "decode", "decoded", "dequantize_int4", "dequantize_int8", "encode", "mark_delta",
    "packed_shape", "quantize_int4", "quantize_int8",
    "quantized_update", "scale_count", "tensor_nbytes",
]
