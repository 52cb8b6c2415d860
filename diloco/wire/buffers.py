"""Model-sized tensors whose memory is reused from round to round instead of faulted in again.

torch allocates a CPU tensor with ``posix_memalign`` (64-byte alignment), and glibc (2.36 here)
serves an aligned request of ``n`` bytes only from a free block of about ``n`` plus the alignment
plus a header: the block a tensor of the same size freed is too small by those few bytes. So a
model-sized tensor allocated every round takes fresh memory at the top of the heap each time and
faults all its pages in again, whatever ``deploy.tuning.keep_freed_memory`` keeps (measured: a
90 MB tensor allocated and filled, 33 ms with 85 MB of page faults every round, against 13 ms and
none). numpy allocates with plain ``malloc``, which does reuse a freed block of the same size, so
a tensor made on a numpy array costs only what is written into it from the second round on.

numpy also asks the kernel for transparent huge pages on arrays of 4 MiB or more
(``madvise(MADV_HUGEPAGE)``), and where the kernel compacts memory to find them on a fault
(``/sys/kernel/mm/transparent_hugepage/defrag`` = ``madvise``, the default), that fault can stall:
a worker's 400 MB Result decoded onto fresh huge pages took 845 ms instead of 70. So these
buffers are allocated with that request off, as torch's own allocations are.

For buffers made every round (a decoded tensor, a running sum, the params' next copy); buffers
kept from round to round need none of this.
"""

from __future__ import annotations

import numpy as np
import torch

try:  # numpy >= 2
    from numpy._core.multiarray import _set_madvise_hugepage
except ImportError:  # pragma: no cover - numpy 1.x
    try:
        from numpy.core.multiarray import _set_madvise_hugepage
    except ImportError:
        _set_madvise_hugepage = None


def empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor (like ``torch.empty``) on memory from ``malloc``."""
    numel = 1
    for d in shape:
        numel *= int(d)
    if numel == 0:  # numpy's empty array has a 0 stride, which torch will not view as another dtype
        return torch.empty(tuple(shape), dtype=dtype)
    # uint8 then a dtype view: any torch dtype (bfloat16 has no numpy twin). malloc aligns to 16 bytes.
    return torch.from_numpy(empty_bytes(numel * dtype.itemsize)).view(dtype).reshape(tuple(shape))


def empty_bytes(nbytes: int) -> np.ndarray:
    """``nbytes`` uninitialised bytes (a 1-D uint8 numpy array) from ``malloc``, as ``empty``'s."""
    if _set_madvise_hugepage is None:
        array = np.empty(nbytes, dtype=np.uint8)
    else:
        # numpy's switch is process-wide: off only around this allocation (another thread's numpy
        # array allocated meanwhile merely goes without the request).
        was = _set_madvise_hugepage(False)
        try:
            array = np.empty(nbytes, dtype=np.uint8)
        finally:
            if was:
                _set_madvise_hugepage(True)
    return array


def empty_like(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return empty(t.shape, t.dtype if dtype is None else dtype)


__all__ = ["empty", "empty_bytes", "empty_like"]
