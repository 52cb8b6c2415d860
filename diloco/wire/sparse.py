"""The sparse wire (SparseLoCo): chunk-wise top-k of the error-feedback accumulator, 2 bits a value.

A run with ``--wire-dtype sparse`` sends each pseudo-gradient tensor flattened, in chunks of
``chunk`` elements (the last one may be shorter). From every chunk the ``k`` entries of largest
magnitude travel (a chunk of fewer than ``k`` elements sends all of them), so every worker's
payload for a tensor has the same size, fixed by the tensor's shape (``SparseFormat.kept``):

* ``entries`` (the message's tensor field, int16, one per kept entry): ``place << 2 | code``,
  ``place`` the entry's index inside its chunk (strictly increasing within a chunk; chunks in
  order), ``code`` its 2-bit value;
* ``scales`` (the message's scales field, fp32, one per chunk): the largest kept magnitude.

A code ``c`` stands for ``(2c - 3) / 3 * scale``: the four levels ``-s, -s/3, s/3, s``. What a
chunk left out, and what the 2 bits rounded off, stays in the worker's accumulator (``e <- beta *
e + delta``, then ``e <- e - sent``: SPEC.md section 11, "The sparse wire") and travels later.

Every receiver decodes a payload to (flat index, value) pairs and adds them into a dense sum with
``index_add_`` -- no dense copy of a contribution is made -- and the outer step is the method's:
``theta <- theta - lr * sum / n`` (``step``), the same function on the coordinator and on every
worker, so all of them hold the same bits.

Why ``chunk`` at most 8192: ``place`` (13 bits) and ``code`` (2 bits) fit a non-negative int16.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch

from diloco.wire.compression import EncodedMismatch, EncodingError, NonFiniteScale

#: Largest chunk: a place in it fits 13 bits (``place << 2 | code`` is a non-negative int16).
MAX_CHUNK = 8192
DEFAULT_CHUNK = 4096
#: Kept entries per chunk over its size (64 of 4096: 1.6%); the paper's range is 1-3%.
DEFAULT_DENSITY = 1 / 64
#: The accumulator's decay (``e <- beta * e + delta``).
DEFAULT_BETA = 0.95
#: ``diloco server``'s outer lr on the sparse wire when none is given: the best of 1, 2, 3 and 4 at
#: both densities in ``bench_training.py --wire`` at H = 10, also better than 5 at H = 50 over 30 rounds
#: and than 2 and 4 with Muon inside (benchmarks/README.md, "The sparse wire"). Each round sends a sliver
#: of the accumulator, so the step that serves it is larger than dense DiLoCo's 0.7.
DEFAULT_OUTER_LR = 3.0
#: The four levels of a code, in units of the chunk's scale.
_LEVELS = (-1.0, -1 / 3, 1 / 3, 1.0)


@dataclass(frozen=True)
class SparseFormat:
    """How a run's sparse payloads are cut: ``chunk`` elements a chunk, ``k`` kept from each."""

    chunk: int = DEFAULT_CHUNK
    k: int = round(DEFAULT_CHUNK * DEFAULT_DENSITY)

    def __post_init__(self) -> None:
        for name in ("chunk", "k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"sparse {name} must be an integer, not {value!r}")
        if not 2 <= self.chunk <= MAX_CHUNK:
            raise ValueError(f"sparse chunk {self.chunk}: expected 2 to {MAX_CHUNK} elements")
        if not 1 <= self.k < self.chunk:
            raise ValueError(f"sparse k {self.k}: expected 1 to {self.chunk - 1} (entries kept per chunk of "
                             f"{self.chunk})")

    @classmethod
    def of(cls, density: float, chunk: int = DEFAULT_CHUNK) -> "SparseFormat":
        """The format keeping about ``density`` of each chunk (at least one entry)."""
        if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0 < density < 1:
            raise ValueError(f"sparse density {density!r}: expected a number between 0 and 1 (e.g. 0.0156)")
        return cls(chunk, max(1, round(chunk * density)))

    @property
    def density(self) -> float:
        return self.k / self.chunk

    def chunks(self, numel: int) -> int:
        return -(-numel // self.chunk)

    def kept(self, numel: int) -> int:
        """Entries a tensor of ``numel`` elements sends: ``k`` per full chunk, all of a short last one
        up to ``k``."""
        full, rest = divmod(numel, self.chunk)
        return full * self.k + min(self.k, rest)

    def nbytes(self, numel: int) -> int:
        """Payload bytes of one tensor: 2 per kept entry, 4 per chunk."""
        return 2 * self.kept(numel) + 4 * self.chunks(numel)

    def to_dict(self) -> dict:
        return {"chunk": self.chunk, "k": self.k}


@dataclass(frozen=True)
class SparseWire:
    """A sparse run's settings, as the Welcome tells every worker (``Welcome.wire_options``)."""

    fmt: SparseFormat
    #: The accumulator's decay: ``e <- beta * e + delta`` before each Submit.
    beta: float = DEFAULT_BETA
    #: The outer step's learning rate (``step``).
    lr: float = 1.0

    def __post_init__(self) -> None:
        for name, low, high in (("beta", 0.0, 1.0), ("lr", 0.0, 1e6)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high \
                    or (name == "lr" and value == 0):
                raise ValueError(f"sparse {name} {value!r}: expected a number in {'(' if name == 'lr' else '['}"
                                 f"{low:g}, {high:g}]")

    def to_dict(self) -> dict:
        return {**self.fmt.to_dict(), "beta": float(self.beta), "lr": float(self.lr)}

    @classmethod
    def from_dict(cls, d: Mapping) -> "SparseWire":
        """From a Welcome's ``wire_options``; ``ValueError`` naming what is missing or wrong."""
        try:
            return cls(SparseFormat(d["chunk"], d["k"]), d["beta"], d["lr"])
        except (KeyError, TypeError) as exc:
            raise ValueError(f"the sparse wire's options {dict(d)!r} lack {exc}") from None


@dataclass(frozen=True)
class Payload:
    """One tensor's sparse payload, decoded: flat indices (int64, ascending) and fp32 values."""

    index: torch.Tensor
    value: torch.Tensor

    def norm(self) -> float:
        """The L2 norm of the contribution it stands for (indices are distinct: no entry counts twice)."""
        return math.sqrt(float(torch.dot(self.value.double(), self.value.double()))) if self.value.numel() else 0.0


# ------------------------------------------------------------------ encode

#: Elements ``encode_tensor`` ranks at a time (1 MiB of fp32: 64 chunks at the default size): each
#: block's magnitudes are made, ranked and dropped while in the cache, with no tensor-sized temporary.
_ENCODE_BLOCK_ELEMS = 1 << 18


def _encode_rows(rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(entries, scales)`` of the chunks that are the rows of ``rows``, ``k`` kept from each."""
    # (A sorted top-k is faster than an unsorted one on the CPU; the places are sorted after.)
    place = rows.abs().topk(k, dim=1).indices.sort(dim=1).values
    value = rows.gather(1, place)
    scale = value.abs().amax(dim=1)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    # value / scale in [-1, 1] -> the nearest of the four levels: code = round((3 v / s + 3) / 2).
    code = torch.round((value / safe[:, None] * 3 + 3) / 2).clamp_(0, 3).to(torch.int32)
    return ((place.to(torch.int32) << 2) | code).reshape(-1).to(torch.int16), scale


def encode_tensor(t: torch.Tensor, fmt: SparseFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """``(entries, scales)`` of ``t``: int16 of ``fmt.kept(numel)``, fp32 of ``fmt.chunks(numel)``.
    Each chunk is encoded on its own: a block of chunks at a time is the same bits as all at once."""
    x = t.detach().to("cpu", torch.float32).reshape(-1)
    n = x.numel()
    full, rest = divmod(n, fmt.chunk)
    entries = torch.empty(fmt.kept(n), dtype=torch.int16)
    scales = torch.empty(fmt.chunks(n), dtype=torch.float32)
    if full:
        rows = x[: full * fmt.chunk].view(full, fmt.chunk)
        block = max(1, _ENCODE_BLOCK_ELEMS // fmt.chunk)
        for r in range(0, full, block):
            e, s = _encode_rows(rows[r:r + block], fmt.k)
            entries[r * fmt.k:r * fmt.k + e.numel()] = e
            scales[r:r + s.numel()] = s
    if rest:
        e, s = _encode_rows(x[full * fmt.chunk:].view(1, -1), min(fmt.k, rest))
        entries[full * fmt.k:] = e
        scales[full:] = s
    return entries, scales


def encode(tensors: Mapping[str, torch.Tensor], fmt: SparseFormat) -> tuple[dict, dict]:
    values, scales = {}, {}
    for n, t in tensors.items():
        values[n], scales[n] = encode_tensor(t, fmt)
    return values, scales


# ------------------------------------------------------------------ decode

@functools.lru_cache(maxsize=1024)
def _chunk_of_entries(numel: int, fmt: SparseFormat) -> torch.Tensor:
    """For each kept entry of a tensor of ``numel`` elements, the chunk it belongs to (read only: kept
    per shape, as every payload of a tensor, a Result's k of them included, has the same layout)."""
    full, rest = divmod(numel, fmt.chunk)
    per_chunk = torch.full((fmt.chunks(numel),), fmt.k, dtype=torch.int64)
    if rest:
        per_chunk[-1] = min(fmt.k, rest)
    return torch.repeat_interleave(torch.arange(per_chunk.numel()), per_chunk)


def decode_tensor(entries: torch.Tensor, scales: torch.Tensor, numel: int, fmt: SparseFormat, name: str,
                  what: str) -> Payload:
    """Check one tensor's payload and decode it. Raises ``EncodedMismatch`` (its size is not the
    shape's), ``NonFiniteScale`` or ``EncodingError`` (anything else), naming the tensor."""
    kept, chunks = fmt.kept(numel), fmt.chunks(numel)
    if entries.dtype != torch.int16 or entries.dim() != 1:
        raise EncodingError(f"{what}: tensor {name!r} is {_dtype(entries)} of shape {list(entries.shape)}; in "
                            f"wire dtype sparse it must be a 1-D int16 of kept entries")
    if entries.numel() != kept:
        raise EncodedMismatch(f"{what}: tensor {name!r} carries {entries.numel()} entries; a parameter of "
                              f"{numel} elements sends exactly {kept} ({fmt.k} per chunk of {fmt.chunk})")
    if scales.dtype != torch.float32 or scales.dim() != 1 or scales.numel() != chunks:
        raise EncodingError(f"{what}: scales of tensor {name!r} are {_dtype(scales)} of shape "
                            f"{list(scales.shape)}; expected float32 of shape [{chunks}] (one per chunk)")
    bad = ~(torch.isfinite(scales) & (scales >= 0))
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        error = NonFiniteScale if not math.isfinite(float(scales[i])) else EncodingError
        raise error(f"{what}: scale {i} of tensor {name!r} is {float(scales[i]):g}; scales must be finite "
                    f"and >= 0")
    if not kept:
        return Payload(torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.float32))
    raw = entries.to(torch.int64)
    if bool((raw < 0).any()):
        raise EncodingError(f"{what}: tensor {name!r} holds a negative entry (a place is 13 bits)")
    place, code = raw >> 2, raw & 3
    chunk = _chunk_of_entries(numel, fmt)
    start = chunk * fmt.chunk
    index = start + place
    outside = (index >= numel) | (place >= fmt.chunk)
    if bool(outside.any()):
        i = int(outside.nonzero()[0, 0])
        raise EncodingError(f"{what}: tensor {name!r} entry {i} points at element {int(index[i])} (chunk "
                            f"{int(chunk[i])}, place {int(place[i])}); the parameter has {numel}")
    same_chunk = chunk[1:] == chunk[:-1]
    if bool((same_chunk & (place[1:] <= place[:-1])).any()):
        i = int((same_chunk & (place[1:] <= place[:-1])).nonzero()[0, 0]) + 1
        raise EncodingError(f"{what}: tensor {name!r} entry {i} repeats or goes back to place {int(place[i])} "
                            f"in chunk {int(chunk[i])}: places must be strictly increasing within a chunk")
    levels = torch.tensor(_LEVELS, dtype=torch.float32)
    value = levels[code] * scales[chunk]
    return Payload(index, value)


def decode(values: Mapping[str, torch.Tensor], scales: Mapping[str, torch.Tensor],
           expected: Iterable[tuple[str, tuple[int, ...]]], fmt: SparseFormat, what: str) -> dict[str, Payload]:
    """Check a sparse message's tensors against ``expected`` ``(name, shape)`` pairs and decode them."""
    expected = [(n, tuple(s)) for n, s in expected]
    want = [n for n, _ in expected]
    if list(values) != want:
        raise EncodedMismatch(f"{what}: tensors: expected {want[:5]}, got {list(values)[:5]}")
    if list(scales) != want:
        raise EncodingError(f"{what}: scales: expected one vector per tensor {want[:5]}, got {list(scales)[:5]}")
    return {n: decode_tensor(values[n], scales[n], math.prod(shape), fmt, n, what) for n, shape in expected}


def subtract_from(total: torch.Tensor, payload: Payload) -> None:
    """``total -= payload`` in place, touching only its entries: the same bits as subtracting the dense
    tensor it stands for (``x - 0`` is ``x``), without making it."""
    total.view(-1).index_add_(0, payload.index, payload.value, alpha=-1)


def densify(payload: Payload, shape: tuple[int, ...]) -> torch.Tensor:
    """The dense tensor a payload stands for (zeros elsewhere): what the sender subtracts from its
    accumulator, and what tests compare with."""
    out = torch.zeros(math.prod(shape), dtype=torch.float32)
    out.index_add_(0, payload.index, payload.value)
    return out.view(shape)


# ------------------------------------------------------------------ the sum and the step

def add_into(total: torch.Tensor, payload: Payload) -> None:
    """``total += payload`` in place, touching only its entries (``total`` fp32, contiguous)."""
    total.view(-1).index_add_(0, payload.index, payload.value)


def step(params: torch.Tensor, total: torch.Tensor, count: int, lr: float) -> torch.Tensor:
    """SparseLoCo's outer step on one tensor: ``params - lr * total / count`` (new memory), the one
    expression every holder of the params evaluates. ``total`` is the caller's sum, spent: it is
    divided in place (the same bits as ``total / count``, without a model-sized temporary)."""
    return torch.add(params, total.div_(count), alpha=-lr)


def _dtype(t) -> str:
    return str(getattr(t, "dtype", t)).removeprefix("torch.")


# ------------------------------------------------------------------ a round's Result

def contributions_in(entries: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple[int, ...]],
                     fmt: SparseFormat, what: str) -> int:
    """How many payloads a Result carries: each tensor's entries are that many payloads' in a row
    (0: the step was refused or made no change, and the params stay as they are)."""
    counts = {n: entries[n].numel() // max(fmt.kept(math.prod(shape)), 1) for n, shape in shapes.items()
              if fmt.kept(math.prod(shape))}
    found = set(counts.values())
    if len(found) > 1:
        raise EncodingError(f"{what}: its tensors carry different numbers of payloads {sorted(found)}")
    return found.pop() if found else 0


def apply_result(values: Mapping[str, torch.Tensor], scales: Mapping[str, torch.Tensor],
                 base: Mapping[str, torch.Tensor], wire: SparseWire, what: str) -> dict[str, torch.Tensor]:
    """The params after a sparse Result: its payloads (each tensor's, one after another, in the order
    the coordinator summed them) added into zeros, then ``step`` -- the coordinator's own arithmetic,
    so the same bits. Checks every payload as a Submit's is checked."""
    fmt = wire.fmt
    shapes = {n: tuple(t.shape) for n, t in base.items()}
    if list(values) != list(base) or list(scales) != list(base):
        raise EncodedMismatch(f"{what}: tensors {list(values)[:5]} and scales {list(scales)[:5]}; expected "
                              f"{list(base)[:5]}")
    count = contributions_in(values, shapes, fmt, what)
    out = {}
    for n, b in base.items():
        numel = b.numel()
        kept, chunks = fmt.kept(numel), fmt.chunks(numel)
        entries, scale = values[n], scales[n]
        if entries.numel() != count * kept or scale.numel() != count * chunks:
            raise EncodedMismatch(f"{what}: tensor {n!r} carries {entries.numel()} entries and {scale.numel()} "
                                  f"scales; {count} payloads of a parameter of {numel} elements are "
                                  f"{count * kept} and {count * chunks}")
        if count == 0:
            out[n] = b.to(torch.float32).clone()
            continue
        total = torch.zeros(numel, dtype=torch.float32)
        for i in range(count):
            add_into(total, decode_tensor(entries[i * kept:(i + 1) * kept], scale[i * chunks:(i + 1) * chunks],
                                          numel, fmt, n, f"{what}, payload {i}"))
        out[n] = step(b.to(torch.float32), total.view(b.shape), count, wire.lr)
    return out


# ------------------------------------------------------------------ a worker's accumulator

def accumulate(tensors: Mapping[str, torch.Tensor], residual: Mapping[str, torch.Tensor], beta: float) -> None:
    """``e <- beta * e + delta`` in place: each of ``tensors`` (this round's delta) gains its residual."""
    for n, t in tensors.items():
        r = residual.get(n)
        if r is not None:
            t.add_(r, alpha=beta)


def send_from(tensors: Mapping[str, torch.Tensor], fmt: SparseFormat,
              what: str) -> tuple[dict, dict, dict[str, Payload]]:
    """The payload of each accumulator in ``tensors``, and what it carries taken out of it in place,
    entry by entry (no dense copy of the payload): ``(entries, scales, sent)``, ``tensors`` then
    holding the residual the next Submit starts from."""
    values, scales = encode(tensors, fmt)
    sent = {n: decode_tensor(values[n], scales[n], t.numel(), fmt, n, what) for n, t in tensors.items()}
    for n, t in tensors.items():
        subtract_from(t, sent[n])
    return values, scales, sent
