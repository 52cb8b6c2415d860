"""The NCCL path of the collective plane: chosen for workers on CUDA, same store and recipe.

gloo is the CPU path every other collective test runs. Here: the choice of backend, a clear
error where NCCL cannot run, and -- only where two CUDA devices exist -- a real two-rank NCCL
reduce on the coordinator's store, against the same mean gloo computes.
"""

from __future__ import annotations

import threading

import pytest
import torch

from diloco.collective.groups import CollectiveError, GroupCache, backend_for, build_group, connect_store
from diloco.collective.reduce import mean_pseudo_gradient
from diloco.collective.store import StoreHost
from diloco.wire import compression


def test_workers_on_cuda_reduce_over_nccl_and_the_rest_over_gloo():
    assert backend_for(None) == "gloo" and backend_for(torch.device("cpu")) == "gloo"
    assert backend_for(torch.device("cuda", 1)) == "nccl" and backend_for("cuda:0") == "nccl"
    cache = GroupCache(lambda: None, "127.0.0.1", 5.0, torch.device("cpu"))
    assert cache.backend == "gloo" and cache.device is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is absent")
def test_an_nccl_group_without_cuda_is_a_clear_collective_error():
    host = StoreHost()
    store = connect_store("127.0.0.1", host.port, 5.0)
    with pytest.raises(CollectiveError, match="NCCL needs CUDA"):
        build_group(store, "p/g0", 0, 1, "127.0.0.1", 2.0, "nccl", torch.device("cuda", 0))
    with pytest.raises(CollectiveError, match="unknown backend"):
        build_group(store, "p/g1", 0, 1, "127.0.0.1", 2.0, "mpi")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (one per NCCL rank)")
@pytest.mark.parametrize("wire_dtype", ["fp32", "int8"])
def test_a_two_rank_nccl_reduce_gives_every_rank_the_mean(wire_dtype):
    host = StoreHost()
    shapes = {"w": torch.Size([64, 8]), "b": torch.Size([8])}
    grads = [{n: torch.randn(s, generator=torch.Generator().manual_seed(r)) for n, s in shapes.items()}
             for r in range(2)]
    out: dict[int, dict] = {}

    def rank(r: int) -> None:
        device = torch.device("cuda", r)
        store = connect_store("127.0.0.1", host.port, 30.0)
        group = build_group(store, "nccl/g0", r, 2, "127.0.0.1", 30.0, "nccl", device)
        encoded = compression.encode(grads[r], wire_dtype)
        out[r] = mean_pseudo_gradient(group, encoded, wire_dtype, shapes, 30.0, device=device)[0]

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert set(out) == {0, 1}
    for n in shapes:
        assert out[0][n].device.type == "cpu" and torch.equal(out[0][n], out[1][n])
        if wire_dtype == "fp32":
            assert torch.allclose(out[0][n], (grads[0][n] + grads[1][n]) / 2, atol=1e-6)
