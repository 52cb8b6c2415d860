"""``diloco export``: a run's checkpoint becomes one safetensors file, or a clear refusal.

Real coordinator checkpoints are written in this process (``make_coordinator``,
a worker joined, rounds applied, ``save_coordinator``) and exported through
``diloco.cli.main``: the file holds exactly the coordinator's params under the
model's names with the ``{"format": "pt"}`` metadata ``from_pretrained``
expects; an existing export is kept unless ``--force``; a missing path, an
empty directory, a corrupt checkpoint and a collective-plane coordinator
(which holds no params) each exit 2 naming the problem and write nothing; a
worker's checkpoint exports its copy of the global params. ``load_run_params``
copies into a model of the run's architecture and refuses any other one
without touching it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from diloco.cli import main
from diloco.coordinator.checkpoint import list_checkpoints, save_coordinator
from diloco.deploy.export import load_run_params, read_run_params, write_export
from diloco.testing import join_message, make_coordinator
from diloco.wire.messages import Submit

PARAMS = {"layer.weight": torch.zeros(2, 3), "layer.bias": torch.zeros(2)}


class Net(torch.nn.Module):
    """The run's architecture: its parameters are ``layer.weight`` (2, 3) and ``layer.bias`` (2)."""

    def __init__(self, out_features: int = 2) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, out_features)


def run(rounds: int):
    """A hub coordinator after ``rounds`` outer steps with one worker: its params are no longer the initial ones."""
    c = make_coordinator(min_workers=1)
    c.handle("p", join_message("w1", PARAMS), 1.0)
    for _ in range(rounds):
        rid = c.fsm.open_round_ids()[0]
        grads = {k: torch.linspace(-1.0, 1.0, v.numel()).reshape(v.shape) * (rid + 1) for k, v in PARAMS.items()}
        c.handle("p", Submit("w1", 0, rid, grads), 2.0 + rid)
    assert c.fsm.rounds_applied == rounds
    return c


@pytest.fixture
def checkpoint(tmp_path):
    """(the coordinator's checkpoint directory, the coordinator's params)."""
    c = run(3)
    ckpt = tmp_path / "ckpt"
    save_coordinator(c, ckpt)
    expected = {k: v.clone() for k, v in c.store.params.items()}
    assert any(v.abs().sum() > 0 for v in expected.values())  # the rounds moved them
    return ckpt, expected


def assert_same(got: dict, expected: dict) -> None:
    assert sorted(got) == sorted(expected)
    for name, t in expected.items():
        assert torch.equal(got[name], t), name


def test_a_checkpoint_directory_exports_exactly_the_coordinators_params(checkpoint, tmp_path, capsys):
    ckpt, expected = checkpoint
    out = tmp_path / "out"
    assert main(["export", str(ckpt), str(out)]) == 0
    target = out / "model.safetensors"
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]  # no temporary file left
    assert_same(load_file(str(target)), expected)
    with safe_open(str(target), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    said = capsys.readouterr().out
    assert "exported 2 tensors (8 params)" in said and "3 outer steps applied" in said and str(target) in said


def test_an_out_ending_in_safetensors_is_the_file_written(checkpoint, tmp_path):
    ckpt, expected = checkpoint
    target = tmp_path / "sub" / "final.safetensors"
    assert main(["export", str(ckpt), str(target)]) == 0
    assert target.is_file() and not (target / "model.safetensors").exists()
    assert_same(load_file(str(target)), expected)


def test_an_existing_export_is_kept_without_force_and_replaced_with_it(checkpoint, tmp_path, capsys):
    ckpt, expected = checkpoint
    out = tmp_path / "out"
    out.mkdir()
    target = out / "model.safetensors"
    target.write_bytes(b"an earlier export")
    assert main(["export", str(ckpt), str(out)]) == 2
    err = capsys.readouterr().err
    assert "diloco export: error:" in err and str(target) in err and "--force" in err
    assert target.read_bytes() == b"an earlier export"
    assert main(["export", str(ckpt), str(out), "--force"]) == 0
    assert_same(load_file(str(target)), expected)
    with pytest.raises(FileExistsError, match="--force"):  # the library call says the same
        write_export(read_run_params(ckpt), out)


def _refused(capsys, checkpoint_arg, out) -> str:
    assert main(["export", str(checkpoint_arg), str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert not out.exists()  # nothing written, not even the directory
    return captured.err


def test_a_missing_path_is_refused(tmp_path, capsys):
    err = _refused(capsys, tmp_path / "nowhere", tmp_path / "out")
    assert f"{tmp_path / 'nowhere'}: no such file or directory" in err


def test_an_empty_directory_is_refused_and_a_worker_checkpoint_there_is_pointed_at(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    err = _refused(capsys, empty, tmp_path / "out")
    assert f"{empty}: no coordinator checkpoint" in err and "worker" not in err
    _worker_checkpoint(empty / "worker-w1.safetensors")
    err = _refused(capsys, empty, tmp_path / "out")
    assert "no coordinator checkpoint; worker checkpoints there: export one of them (worker-w1.safetensors" in err


def test_a_corrupt_checkpoint_is_refused_naming_the_file_and_why(checkpoint, tmp_path, capsys):
    ckpt, _ = checkpoint
    (path,) = list_checkpoints(ckpt)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # a flipped bit in the payload: only the checksum sees it
    path.write_bytes(bytes(data))
    err = _refused(capsys, ckpt, tmp_path / "out")
    assert f"no valid checkpoint in {ckpt}" in err and "checksum mismatch" in err
    path.write_bytes(bytes(data[:100]))  # torn
    err = _refused(capsys, ckpt, tmp_path / "out")
    assert f"no valid checkpoint in {ckpt}" in err and str(path) in err
    err = _refused(capsys, path, tmp_path / "out")  # the file itself given
    assert str(path) in err


def test_a_collective_coordinator_checkpoint_sends_the_user_to_a_worker_checkpoint(tmp_path, capsys):
    c = make_coordinator(0.0, min_workers=1, data_plane="collective", heartbeat_timeout_s=60.0,
                         reduce_timeout_s=30.0, collective_timeout_s=5.0)
    spec_only = join_message("w1", list(join_message("w1", PARAMS).spec))
    c.handle("w1", dataclasses.replace(spec_only, holds_params=True, held_rounds=(0,)), 1.0)
    assert c.has_state and c.store is None
    save_coordinator(c, tmp_path / "ckpt")
    err = _refused(capsys, tmp_path / "ckpt", tmp_path / "out")
    assert "the coordinator of a collective run holds no params" in err
    assert "export a worker's checkpoint file, worker-<id>.safetensors" in err


def _worker_checkpoint(path):
    from diloco.worker.checkpoint import WorkerCheckpoint, save_worker_checkpoint

    global_params = {"layer.weight": torch.arange(6.0).reshape(2, 3), "layer.bias": torch.tensor([7.0, 8.0])}
    local = {k: v + 1 for k, v in global_params.items()}  # H inner steps away: not what is exported
    ckpt = WorkerCheckpoint(worker_id="w1", sync_every=2, inner_step=5, sched_step=5, next_close=[6],
                            round_ids=[2], rounds_synced=2, mode="sync", fragments=(tuple(global_params),),
                            model_state=local, optimizer_state={"state": {}, "param_groups": []},
                            global_params=global_params)
    save_worker_checkpoint(path, ckpt)
    return global_params


def test_a_worker_checkpoint_exports_its_copy_of_the_global_params(tmp_path, capsys):
    path = tmp_path / "w1" / "worker-w1.safetensors"
    expected = _worker_checkpoint(path)
    out = tmp_path / "out"
    assert main(["export", str(path), str(out)]) == 0
    assert_same(load_file(str(out / "model.safetensors")), expected)
    assert "a worker's copy of the global params" in capsys.readouterr().out


def test_load_run_params_copies_into_the_runs_architecture(checkpoint):
    ckpt, expected = checkpoint
    model = Net()
    summary = load_run_params(ckpt, model)
    assert_same({n: p.detach() for n, p in model.named_parameters()}, expected)
    assert summary.rounds_applied == 3 and summary.num_elements == 8


@pytest.mark.parametrize("other, problem", [
    (lambda: Net(out_features=4), "shapes differ: layer.weight (2, 3) != (4, 3)"),
    (lambda: torch.nn.Sequential(torch.nn.Linear(3, 2)), "missing in the checkpoint: 0.weight, 0.bias"),
    (lambda: torch.nn.ModuleDict({"layer": torch.nn.Linear(3, 2, bias=False)}), "not in the model: layer.bias"),
])
def test_load_run_params_refuses_another_architecture_and_leaves_it_alone(checkpoint, other, problem):
    ckpt, _ = checkpoint
    model = other()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="its params do not fit") as info:
        load_run_params(ckpt, model)
    assert problem in str(info.value) and type(model).__name__ in str(info.value)
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
