"""One round's pseudo-gradients combined among the group, in the run's wire dtype (gloo on the CPU;
NCCL on the worker's CUDA device, the result copied back to the CPU replica).

* fp32: one all-reduce (sum) of the flattened fragment, then / k. gloo's ring hands every
  rank the same reduced bytes, so every member computes the same mean.
* bf16 and int8: an all-gather of each member's *encoded* pseudo-gradient (bf16 values, or
  int8 blocks plus their fp32 scales, the hub's codec exactly) and a local fp32 sum in rank
  order: what the hub computes from the same Submits (it decodes each to fp32 and sums), and
  identical on every member. k x the encoded size in memory, for a short while.
* sparse: an all-gather of every member's fixed-size payload (int16 entries and fp32 chunk
  scales, ``diloco.wire.sparse``), each checked and its entries added into zeros in rank order
  (``sparse.add_into``): no contribution is made dense.

Everything travels as one flat buffer per dtype, so a fragment of many tensors costs one
collective, not one per tensor.

The checks (SPEC.md section 7c): where a member sees every contribution (the all-gathers, and
fp32's ``gather`` attempt that follows a mean that failed its checks) it measures each rank's
decoded contribution (``tensors_norm``, the same function a member declares its own norm with);
an fp32 all-reduce gives only the mean, whose norm is measured instead. What those numbers mean
is the member machine's to judge (``member.judge_contributions``, ``member.judge_mean``).
"""

from __future__ import annotations

import datetime
import math
from typing import Mapping

import torch
import torch.distributed as dist

from diloco.collective.groups import CollectiveError
from diloco.wire import compression, sparse
from diloco.wire.measure import square_sum

Tensors = dict[str, torch.Tensor]


#: Elements per block of ``tensors_norm``: fp32 sums this short, combined in float64.
_NORM_BLOCK = 4096


def tensors_norm(tensors: Mapping[str, torch.Tensor]) -> float:
    """The L2 norm over ``tensors``: NaN for a NaN, inf when a block's squares overflow fp32.

    Exact to about 1e-6 at any size, for the same cost as one fp32 pass: fp32's own norm of
    100M elements is off by several percent (its running sum grows too large for its mantissa),
    so it sums squares in fp32 per block of ``_NORM_BLOCK`` elements and the blocks in float64.
    Members compare norms of the same contribution measured in different processes (a
    declared one, a received one) to a relative slack of 1e-3 (``member.NORM_SLACK``)."""
    total = 0.0
    for t in tensors.values():
        flat = t.detach().reshape(-1)
        if flat.dtype != torch.float32:
            flat = flat.float()
        n = flat.numel()
        full = n - n % _NORM_BLOCK
        if full:
            blocks = torch.linalg.vector_norm(flat[:full].view(-1, _NORM_BLOCK), dim=1).double()
            total += float((blocks * blocks).sum())
        if full < n:
            total += square_sum(flat[full:])
    return total ** 0.5


def contribution_norm(encoded: compression.Encoded, wire_dtype: str, shapes: Mapping[str, torch.Size],
                      fmt: sparse.SparseFormat | None = None) -> float:
    """The norm of this member's pseudo-gradient as the group will decode it: what it declares."""
    names = list(shapes)
    if wire_dtype == "sparse":
        assert fmt is not None
        payloads = sparse.decode({n: encoded.values[n] for n in names}, {n: encoded.scales[n] for n in names},
                                 [(n, tuple(shapes[n])) for n in names], fmt, "this worker's pseudo-gradient")
        return tensors_norm({n: p.value for n, p in payloads.items()})
    if wire_dtype == "fp32":
        return tensors_norm({n: encoded.values[n] for n in names})
    decoded = compression.decode({n: encoded.values[n] for n in names},
                                 {n: encoded.scales[n] for n in names} if wire_dtype == "int8" else {},
                                 wire_dtype, [(n, tuple(shapes[n])) for n in names], "this worker's pseudo-gradient")
    return tensors_norm(decoded)


def _wait(work, timeout_s: float, what: str) -> None:
    try:
        work.wait(datetime.timedelta(seconds=timeout_s))
    except Exception as exc:
        raise CollectiveError(f"{what} failed: {exc}") from exc


def _flat(tensors: Mapping[str, torch.Tensor], names: list[str], dtype: torch.dtype,
          out: torch.Tensor | None = None) -> torch.Tensor:
    """One new flat tensor (``torch.cat`` copies), or ``out`` refilled when it fits."""
    parts = [tensors[n].detach().reshape(-1).to(dtype) for n in names]
    if not parts:
        return torch.empty(0, dtype=dtype)
    if out is not None and out.dtype == dtype and out.numel() == sum(t.numel() for t in parts):
        return torch.cat(parts, out=out)
    return torch.cat(parts)


def _unflat(flat: torch.Tensor, shapes: Mapping[str, torch.Size], names: list[str]) -> Tensors:
    out: Tensors = {}
    offset = 0
    for n in names:
        numel = shapes[n].numel()
        out[n] = flat[offset:offset + numel].view(shapes[n])
        offset += numel
    return out


def reduce_buffer(buffers: dict[int, torch.Tensor], fid: int, shapes: Mapping[str, torch.Size]) -> torch.Tensor:
    """Fragment ``fid``'s flat fp32 reduce buffer in ``buffers``, kept from round to round (made anew
    when the fragment's size changed). A round reuses it only after the previous round's verdict:
    its mean was stepped into the replica by then."""
    numel = sum(s.numel() for s in shapes.values())
    buf = buffers.get(fid)
    if buf is None or buf.numel() != numel:
        buf = buffers[fid] = torch.empty(numel, dtype=torch.float32)
    return buf


def bytes_on_link(encoded: compression.Encoded, wire_dtype: str, size: int, gather: bool = False) -> int:
    """What one member sends for one reduce, by the algorithm's own count: a ring all-reduce sends
    2(k-1)/k of the fp32 payload; an all-gather sends the encoded payload to each of the k-1 others."""
    if wire_dtype == "fp32" and not gather:
        return int(2 * (size - 1) * compression.tensor_nbytes(encoded.values) / size)
    return (size - 1) * encoded.nbytes


def _allreduce(group: dist.ProcessGroup, flat: torch.Tensor, timeout_s: float, device) -> None:
    """Sum ``flat`` (on the CPU) over the group, in place: on ``device`` for NCCL, else where it is."""
    if device is None:
        _wait(group.allreduce([flat]), timeout_s, "the all-reduce")
        return
    on_device = flat.to(device)
    _wait(group.allreduce([on_device]), timeout_s, "the all-reduce")
    flat.copy_(on_device)


def _allgather(group: dist.ProcessGroup, tensor: torch.Tensor, timeout_s: float, device,
               what: str) -> list[torch.Tensor]:
    """Every rank's ``tensor``, in rank order, on the CPU (gathered on ``device`` for NCCL)."""
    src = tensor if device is None else tensor.to(device)
    out = [torch.empty_like(src) for _ in range(group.size())]
    _wait(group.allgather([out], [src]), timeout_s, what)
    return out if device is None else [t.cpu() for t in out]


#: Elements per chunk of ``_divide_and_measure``: a chunk is measured while it is in the cache.
_MEASURE_CHUNK = 1 << 18


def _divide_and_measure(flat: torch.Tensor, size: int) -> float:
    """``flat /= size``, and ``tensors_norm`` of the result, in one pass over ``flat``."""
    total = 0.0
    for start in range(0, flat.numel(), _MEASURE_CHUNK):
        part = flat[start:start + _MEASURE_CHUNK]
        part /= size
        total += tensors_norm({"": part}) ** 2
    return total ** 0.5


def mean_pseudo_gradient(group: dist.ProcessGroup, encoded: compression.Encoded, wire_dtype: str,
                         shapes: Mapping[str, torch.Size], timeout_s: float,
                         buffer: torch.Tensor | None = None, device=None,
                         gather: bool = False,
                         fmt: sparse.SparseFormat | None = None) -> tuple[Tensors, tuple[float, ...], float | None]:
    """The group's mean pseudo-gradient (fp32, on the CPU) from this member's ``encoded`` one, each
    rank's contribution norm in rank order (empty for an fp32 all-reduce, which shows no
    contribution but the sum: ``gather`` all-gathers fp32 contributions too, to see them), and the
    mean's own norm where that is all the checks can see (the fp32 all-reduce; else None).

    fp32: the result is views into ``buffer`` when one of the right size is given (the caller
    keeps it from round to round: no fresh pages per round), else into a new flat tensor.
    ``device``: the CUDA device an NCCL group reduces on (None: gloo, on the CPU). The sum is
    the same bits either way in bf16/int8 (the decode and the sum run on the CPU, in rank order);
    in fp32 NCCL's ring sums in its own order, identical on every rank of the group."""
    names = list(shapes)
    size = group.size()
    if wire_dtype == "fp32" and not gather:
        flat = _flat(encoded.values, names, torch.float32, out=buffer)
        _allreduce(group, flat, timeout_s, device)
        mean_norm = _divide_and_measure(flat, size)
        return _unflat(flat, shapes, names), (), mean_norm
    if wire_dtype == "sparse":
        assert fmt is not None
        return _sparse_mean(group, encoded, shapes, timeout_s, device, fmt, buffer)
    values = _flat(encoded.values, names, encoded.values[names[0]].dtype if names else torch.float32)
    gathered_values = _allgather(group, values, timeout_s, device, "the all-gather of values")
    gathered_scales: list[torch.Tensor] = []
    if wire_dtype == "int8":
        scales = _flat(encoded.scales, names, torch.float32)
        gathered_scales = _allgather(group, scales, timeout_s, device, "the all-gather of scales")
    total = {n: torch.zeros(shapes[n], dtype=torch.float32) for n in names}
    scale_shapes = {n: torch.Size([encoded.scales[n].numel()]) for n in names} if wire_dtype == "int8" else {}
    norms = []
    for rank in range(size):  # rank order: the same sum on every member
        member_values = _unflat(gathered_values[rank], shapes, names)
        member_scales = _unflat(gathered_scales[rank], scale_shapes, names) if wire_dtype == "int8" else {}
        decoded = compression.decode(member_values, member_scales, wire_dtype,
                                     [(n, tuple(shapes[n])) for n in names], f"rank {rank}'s pseudo-gradient")
        norms.append(tensors_norm(decoded))
        for n in names:
            total[n] += decoded[n]
    for t in total.values():
        t /= size
    return total, tuple(norms), None


def _sparse_mean(group: dist.ProcessGroup, encoded: compression.Encoded, shapes: Mapping[str, torch.Size],
                 timeout_s: float, device, fmt: sparse.SparseFormat,
                 buffer: torch.Tensor | None = None) -> tuple[Tensors, tuple[float, ...], None]:
    """The sparse wire's reduce: every rank's payload (one int16 and one fp32 buffer, the same size on
    every rank), each checked and added into zeros in rank order; each rank's contribution norm. The
    sum is made in ``buffer`` (zeroed) when one of the right size is given, as fp32's all-reduce is:
    no fresh model-sized tensor per round."""
    names = list(shapes)
    numel = {n: shapes[n].numel() for n in names}
    entry_shapes = {n: torch.Size([fmt.kept(numel[n])]) for n in names}
    scale_shapes = {n: torch.Size([fmt.chunks(numel[n])]) for n in names}
    # One collective of bytes (gloo gathers no int16): the scales' bytes (4-aligned), then the entries'.
    scales = _flat(encoded.scales, names, torch.float32)
    payload = torch.cat([scales.view(torch.uint8), _flat(encoded.values, names, torch.int16).view(torch.uint8)])
    gathered = _allgather(group, payload, timeout_s, device, "the all-gather of sparse payloads")
    cut = scales.numel() * 4
    gathered_scales = [g[:cut].view(torch.float32) for g in gathered]
    gathered_entries = [g[cut:].view(torch.int16) for g in gathered]
    numel_all = sum(numel.values())
    if buffer is not None and buffer.dtype == torch.float32 and buffer.numel() == numel_all:
        total = _unflat(buffer.zero_(), shapes, names)
    else:
        total = {n: torch.zeros(shapes[n], dtype=torch.float32) for n in names}
    norms = []
    for rank in range(group.size()):  # rank order: the same sum on every member
        try:
            payloads = sparse.decode(_unflat(gathered_entries[rank], entry_shapes, names),
                                     _unflat(gathered_scales[rank], scale_shapes, names),
                                     [(n, tuple(shapes[n])) for n in names], fmt, f"rank {rank}'s pseudo-gradient")
        except compression.EncodingError:
            # A malformed payload (repeated or wild places, bad scales) is not what any member declares:
            # its NaN norm gets its sender blamed by every member alike (``member.judge_contributions``).
            norms.append(math.nan)
            continue
        norms.append(tensors_norm({n: p.value for n, p in payloads.items()}))
        for n, payload in payloads.items():
            sparse.add_into(total[n], payload)
    for t in total.values():
        t /= group.size()
    return total, tuple(norms), None
