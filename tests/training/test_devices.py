"""Devices and rank context (SPEC.md section 15, D1 and G5): choosing a device, moving batches, the entry's keywords."""

from __future__ import annotations

import subprocess
import sys
from collections import namedtuple

import pytest
import torch

from diloco.deploy.worker_main import call_entry, load_entry
from diloco.exits import UsageError
from diloco.worker import TrainingSetup
from diloco.worker.device import loss_on_device, resolve_device, to_device
from diloco.worker.group import RankInfo

CUDA = torch.cuda.is_available()


def test_auto_and_cpu_choose_the_cpu_on_a_machine_without_cuda():
    if CUDA:
        assert resolve_device("auto", local_rank=0).type == "cuda"
    else:
        assert resolve_device("auto", local_rank=3) == torch.device("cpu")
    assert resolve_device("cpu", local_rank=3) == torch.device("cpu")


@pytest.mark.parametrize("spec", ["gpu", "cuda:", "cuda:-1", "CPU", "", "cuda:0:1", "mps"])
def test_a_device_that_is_not_auto_cpu_or_cuda_n_is_refused_with_what_is_allowed(spec):
    with pytest.raises(ValueError, match="expected auto, cpu, cuda or cuda:N"):
        resolve_device(spec)


@pytest.mark.skipif(CUDA, reason="this machine has CUDA")
@pytest.mark.parametrize("spec", ["cuda", "cuda:0", "cuda:3"])
def test_asking_for_cuda_without_it_says_so(spec):
    with pytest.raises(ValueError, match="no CUDA device"):
        resolve_device(spec)


def test_batches_move_to_the_device_inside_tuples_lists_dicts_and_named_tuples():
    Batch = namedtuple("Batch", "x y")
    batch = {"a": (torch.ones(2), [torch.zeros(1), "label"]), "b": Batch(torch.ones(1), 3)}
    moved = to_device(batch, torch.device("cpu"))
    assert isinstance(moved["b"], Batch) and moved["b"].y == 3
    assert moved["a"][1][1] == "label"
    assert torch.equal(moved["a"][0], torch.ones(2))
    meta = to_device(batch, torch.device("meta"))
    assert meta["a"][0].device.type == "meta" and meta["a"][1][0].device.type == "meta"
    assert meta["b"].x.device.type == "meta"


def test_the_loss_sees_batches_on_the_device():
    seen = []
    loss = loss_on_device(lambda model, batch: seen.append(batch.device.type), torch.device("meta"))
    loss(None, torch.ones(1))
    assert seen == ["meta"]
    plain = lambda model, batch: None  # noqa: E731
    assert loss_on_device(plain, torch.device("cpu")) is plain


def test_rank_info_comes_from_torchrun_s_environment_and_is_checked():
    assert RankInfo.from_env({}) == RankInfo(0, 1, 0)
    info = RankInfo.from_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"})
    assert (info.rank, info.world_size, info.local_rank, info.is_leader) == (3, 4, 1, False)
    with pytest.raises(ValueError, match="expected 0 <= RANK < WORLD_SIZE"):
        RankInfo.from_env({"RANK": "4", "WORLD_SIZE": "4"})
    with pytest.raises(ValueError, match="expected integers"):
        RankInfo.from_env({"RANK": "zero"})


def _setup():
    model = torch.nn.Linear(1, 1)
    return TrainingSetup(model, torch.optim.SGD(model.parameters(), lr=0.1), [], lambda m, b: m(b).sum())


def test_an_entry_gets_the_rank_keywords_it_names_and_no_others():
    got = {}

    def by_rank(worker_id, rank, world_size):
        got.update(worker_id=worker_id, rank=rank, world_size=world_size)
        return _setup()

    def bare():
        return _setup()

    def anything(**kw):
        got["kw"] = kw
        return _setup()

    context = {"rank": 1, "world_size": 2, "device": torch.device("cpu")}
    call_entry(by_rank, "w1", **context)
    assert got == {"worker_id": "w1", "rank": 1, "world_size": 2}
    assert isinstance(call_entry(bare, "w1", **context), TrainingSetup)
    call_entry(anything, "w1", **context)
    assert got["kw"] == {"worker_id": "w1", **context}
    with pytest.raises(UsageError, match="expected diloco.worker.TrainingSetup"):
        call_entry(lambda: 3, "w1")


def _worker_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os
    return subprocess.run([sys.executable, "-m", "diloco", "worker", "--connect", "tcp://127.0.0.1:1", *args],
                          capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})


def test_a_bad_device_flag_is_a_usage_error():
    proc = _worker_cli("--device", "gpu")
    assert proc.returncode == 2, proc.stderr
    assert "--device 'gpu': expected auto, cpu, cuda or cuda:N" in proc.stderr


def test_a_multi_rank_worker_needs_an_id():
    proc = _worker_cli(env={"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    assert proc.returncode == 2, proc.stderr
    assert "needs --id" in proc.stderr


def test_pseudo_gradients_on_the_device_path_equal_the_cpu_path():
    """The device mirror's arithmetic (forced on, on the CPU) gives global - local exactly, as fp32 on the CPU."""
    from diloco.worker.device import DeviceGlobal

    g = torch.Generator().manual_seed(0)
    params = {"a": torch.nn.Parameter(torch.randn(3, 4, generator=g)), "b": torch.nn.Parameter(torch.randn(5, generator=g))}
    global_cpu = {n: torch.randn(p.shape, generator=g) for n, p in params.items()}
    plain = DeviceGlobal(params)
    assert not plain.active  # everything on the CPU: no mirror is kept
    want = plain.pseudo_gradients(["a", "b"], params, global_cpu)
    mirrored = DeviceGlobal(params)
    mirrored.active = True
    for n, t in global_cpu.items():
        mirrored.set(n, t, torch.device("cpu"))
    got = mirrored.pseudo_gradients(["a", "b"], params, global_cpu)
    for n in params:
        assert got[n].device.type == "cpu" and got[n].dtype == torch.float32
        assert torch.equal(got[n], want[n]) and torch.equal(want[n], global_cpu[n] - params[n].detach())


def test_an_entry_file_with_postponed_annotations_and_a_dataclass_loads(tmp_path):
    # dataclasses resolve a class's module through sys.modules: a file loaded by path must be there.
    entry = tmp_path / "my_entry.py"
    entry.write_text("from __future__ import annotations\n"
                     "import dataclasses\n\n"
                     "@dataclasses.dataclass\n"
                     "class Settings:\n"
                     "    width: int = 4\n\n"
                     "def make_setup():\n"
                     "    return Settings().width\n")
    func = load_entry(f"{entry}:make_setup")
    assert func() == 4
    with pytest.raises(UsageError, match="no such file"):
        load_entry(f"{tmp_path / 'absent.py'}:make_setup")
