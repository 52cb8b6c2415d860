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

Even plain ``malloc`` did not always reuse them (most likely something small was carved out of a
freed model-sized block before the next request of its size, which depends on the timing of other
threads' allocations): at 100M parameters, with other jobs loading the machine, a coordinator's
round faulted in 0.2-1.7 GB of fresh pages from one run to the next. So buffers of ``POOL_MIN_BYTES`` or more are pooled: each
is kept once made, and handed out again for the next request of its size once nothing references
it any more (its reference count: a tensor, a view, a memoryview or a send in progress holds a
reference to the array). At most ``POOL_PER_SIZE`` buffers of one size are kept; what the pool keeps
is what the process once held at the same time, which its heap kept anyway.
"""

from __future__ import annotations

import sys
import threading

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


#: Buffers at least this large are pooled (module docstring); smaller ones go to ``malloc`` every time.
POOL_MIN_BYTES = 1 << 20
#: Most buffers of one size the pool keeps.
POOL_PER_SIZE = 16
#: Most sizes the pool keeps buffers of; past it, sizes whose buffers are all free are forgotten.
POOL_SIZES = 256
_pool: dict[int, list[np.ndarray]] = {}
_pool_lock = threading.Lock()
#: ``sys.getrefcount`` of a pooled array nobody else references, seen from ``_take``'s loop: the
#: pool's list, the loop's variable and the call's argument.
_FREE_REFS = 3


def _take(nbytes: int) -> np.ndarray | None:
    """A pooled buffer of ``nbytes`` that nothing references any more, or None. Call with the lock."""
    for array in _pool.get(nbytes, ()):
        if sys.getrefcount(array) == _FREE_REFS:
            return array
    return None


def _keep(nbytes: int, array: np.ndarray) -> None:
    """Pool a buffer just made (unless its size has ``POOL_PER_SIZE`` already). Call with the lock."""
    kept = _pool.get(nbytes)
    if kept is None:
        if len(_pool) >= POOL_SIZES:
            for size in [n for n, arrays in _pool.items()
                         if all(sys.getrefcount(a) == _FREE_REFS for a in arrays)]:
                del _pool[size]
            if len(_pool) >= POOL_SIZES:
                return
        kept = _pool[nbytes] = []
    if len(kept) < POOL_PER_SIZE:
        kept.append(array)


def pooled_bytes() -> int:
    """Bytes the pool holds, in use or free (tests, diagnostics)."""
    with _pool_lock:
        return sum(n * len(arrays) for n, arrays in _pool.items())


def empty_bytes(nbytes: int) -> np.ndarray:
    """``nbytes`` uninitialised bytes (a 1-D uint8 numpy array) from ``malloc``, as ``empty``'s; a large
    one from the pool when one of its size is free (module docstring)."""
    if nbytes < POOL_MIN_BYTES:
        return _malloc(nbytes)
    with _pool_lock:
        array = _take(nbytes)
        if array is not None:
            return array
    array = _malloc(nbytes)
    with _pool_lock:
        _keep(nbytes, array)
    return array


def _malloc(nbytes: int) -> np.ndarray:
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


__all__ = ["POOL_MIN_BYTES", "empty", "empty_bytes", "empty_like", "pooled_bytes"]
