"""The hub's round makes no copy of the model it does not need (benchmarks/README.md, bench_transport).

* A round's Results carry views of the params, not a copy: the next outer step moves the params to
  fresh memory before it changes them, so a Result still queued (a slow worker, a simulator holding
  messages) keeps the values it was released with.
* A refused step puts back the very memory the params had (the undo is exact without a copy).
* The norm the outlier bound needs is computed in the same pass that proves a submission finite.
* A chunked tensor decodes onto memory from ``buffers`` (plain malloc), correctly.
"""

from __future__ import annotations

import pytest
import torch

from diloco.coordinator.outliers import fast_norm
from diloco.coordinator.params import NonFinite, ParamStore
from diloco.testing import joined, make_coordinator
from diloco.wire import buffers, codec
from diloco.wire.messages import Result, Submit

P0 = {"w": torch.linspace(-1.0, 1.0, 12).reshape(3, 4), "b": torch.tensor([0.5, -0.5])}


def grads(seed: int, scale: float = 0.01) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(t.shape, generator=g) * scale for n, t in P0.items()}


def round_results(c, r: int) -> dict[str, Result]:
    c.handle("a", Submit("a", 0, r, grads(2 * r)), float(r))
    out = c.handle("b", Submit("b", 0, r, grads(2 * r + 1)), float(r))
    return {peer: m for peer, m in out if isinstance(m, Result)}


def test_results_carry_views_of_the_params_that_no_later_step_writes():
    c = joined(make_coordinator(min_workers=2), P0, "a", "b")
    first = round_results(c, 0)
    assert set(first) == {"a", "b"}
    for n, p in c.store.params.items():
        # No copy: both Results and the params share one memory right after the round.
        assert first["a"].params[n].data_ptr() == first["b"].params[n].data_ptr() == p.data_ptr()
    kept = {n: t.clone() for n, t in first["a"].params.items()}
    for r in (1, 2, 3):
        assert round_results(c, r)["a"].outcome == "applied"
    for n, t in first["a"].params.items():
        assert torch.equal(t, kept[n]), n  # what round 0 released is still what it was
        assert not torch.equal(c.store.params[n], kept[n])  # while the params moved on
        assert c.store.params[n].data_ptr() != t.data_ptr()


def test_a_refused_step_puts_back_the_very_memory_of_the_params():
    c = joined(make_coordinator(min_workers=2, outlier_factor=0.0), P0, "a", "b")
    round_results(c, 0)  # momentum exists from here on
    ptrs = {n: p.data_ptr() for n, p in c.store.params.items()}
    values = {n: p.clone() for n, p in c.store.params.items()}
    huge = {n: torch.full_like(t, 3e38) for n, t in P0.items()}
    c.handle("a", Submit("a", 0, 1, huge), 1.0)
    out = c.handle("b", Submit("b", 0, 1, huge), 1.0)
    assert c.stats.steps_refused == 1
    for n, p in c.store.params.items():
        assert p.data_ptr() == ptrs[n] and torch.equal(p, values[n])
    for _, m in out:
        if isinstance(m, Result):
            assert all(m.params[n].data_ptr() == ptrs[n] for n in P0)


def test_the_norm_for_the_outlier_bound_comes_with_the_finiteness_check():
    store = ParamStore(P0, 1)
    g = grads(3)
    assert store.check_submission(0, g, norm=True) == fast_norm(g)  # the very value, bit for bit
    assert store.check_submission(0, g) is None
    nan_in_b = {"w": g["w"], "b": torch.tensor([1.0, float("nan")])}
    for norm in (True, False):
        with pytest.raises(NonFinite) as err:
            store.check_submission(0, nan_in_b, norm=norm)
        assert err.value.tensor == "b"
    # Finite values whose squares overflow: a norm of inf (the outlier bound refuses it), not non-finite.
    big = {n: torch.full_like(t, 3e38) for n, t in P0.items()}
    assert store.check_submission(0, big, norm=True) == float("inf") == fast_norm(big)


def test_buffers_and_a_chunked_decode_on_them():
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.uint8):
        t = buffers.empty((3, 5), dtype)
        assert t.shape == (3, 5) and t.dtype == dtype and t.is_contiguous()
        t.fill_(1)
        assert int(t.sum()) == 15
    x = torch.randn(1000)
    frames = codec.encode(Submit("a", 0, 0, {"x": x}), chunk_bytes=1024)  # 4 frames of 1 KiB
    assert len(frames) == 1 + 4
    got = codec.decode([bytes(f) for f in frames]).tensors["x"]
    assert torch.equal(got, x)
    got.add_(1.0)  # writable, and its own memory
    assert torch.equal(got, x + 1.0)
