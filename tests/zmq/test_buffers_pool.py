"""Large buffers (``diloco.wire.buffers``) come back from a pool once nothing references them.

A model-sized buffer freed to ``malloc`` was not always reused for the next one of its size (a
small block carved out of it meanwhile), and the next round faulted its pages in again. The pool
hands a buffer out again only when no tensor, view or memoryview of it is left.
"""

from __future__ import annotations

import gc

import torch

from diloco.wire import buffers

N = buffers.POOL_MIN_BYTES * 3 + 8


def test_a_free_buffer_is_handed_out_again_and_a_referenced_one_never():
    a = buffers.empty((N // 4,))
    ptr_a = a.data_ptr()
    b = buffers.empty((N // 4,))
    assert b.data_ptr() != ptr_a  # a is alive
    view = a[10:20]
    del a
    c = buffers.empty((N // 4,))
    assert c.data_ptr() not in (ptr_a, b.data_ptr())  # a view keeps it
    del view
    gc.collect()
    d = buffers.empty((N // 4,))
    assert d.data_ptr() == ptr_a  # nothing references it any more: the same memory
    mv = memoryview(buffers.empty_bytes(N + 4))
    ptr = torch.frombuffer(mv, dtype=torch.uint8).data_ptr()
    assert torch.frombuffer(memoryview(buffers.empty_bytes(N + 4)), dtype=torch.uint8).data_ptr() != ptr
    del mv
    assert torch.frombuffer(memoryview(buffers.empty_bytes(N + 4)), dtype=torch.uint8).data_ptr() == ptr


def test_small_buffers_are_not_pooled_and_values_are_whatever_is_written():
    before = buffers.pooled_bytes()
    small = buffers.empty((16,))
    assert buffers.pooled_bytes() == before
    big = buffers.empty((N // 4,)).fill_(3.0)
    assert bool((big == 3.0).all())
    assert buffers.empty((0, 4)).shape == (0, 4)


def test_a_tensor_made_from_a_memoryview_of_a_pooled_buffer_keeps_it():
    # The codec's path: a coalesced buffer -> a memoryview slice -> torch.frombuffer.
    array = buffers.empty_bytes(N + 12)
    ptr = array.ctypes.data
    t = torch.frombuffer(memoryview(array)[:N].cast("B"), dtype=torch.float32)
    del array
    gc.collect()
    assert buffers.empty_bytes(N + 12).ctypes.data != ptr  # the tensor still uses it
    del t
    gc.collect()
    assert buffers.empty_bytes(N + 12).ctypes.data == ptr
