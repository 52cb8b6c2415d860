"""Process tuning for long-running server and worker processes.

``keep_freed_memory()``: every round allocates and frees tensors the size of
the model (decoded submissions, the running sum, the snapshot of the new
params, the outer optimizer's temporaries). glibc returns large freed blocks
to the OS (anything over its mmap threshold, at most 32 MiB, and heap tops
over the trim threshold), so the next round page-faults fresh memory in
again: on a 40 MB model that was most of the coordinator's time per round
after the wire itself. Raising both thresholds keeps freed memory for reuse.
The cost: the process keeps its peak memory instead of shrinking after it.
Linux/glibc only; a no-op elsewhere. ``DILOCO_MALLOC_TUNING=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_freed_memory(threshold_bytes: int = 1 << 30) -> bool:
    """Ask glibc to keep freed blocks up to ``threshold_bytes`` for reuse. True when applied."""
    if os.environ.get("DILOCO_MALLOC_TUNING", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, ...)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    threshold = int(min(threshold_bytes, (1 << 31) - 1))
    ok = mallopt(_M_MMAP_THRESHOLD, threshold) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, threshold) == 1 and ok
    return ok
