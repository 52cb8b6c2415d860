"""Bad input gets a precise error naming the field, the value and what was expected."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

import diloco.worker.worker as worker_module
from diloco.coordinator import Coordinator
from diloco.testing import join_message, joined, make_coordinator
from diloco.transport.inproc import InprocNetwork
from diloco.wire.messages import PROTOCOL_VERSION, Accepted, Error, ErrorCode, Submit
from diloco.worker import DilocoWorker, DilocoWorkerError, run_training
from training_harness import LoopbackEndpoint, Run, batches, linear, mlp

P0 = {"w": torch.zeros(3, 2), "b": torch.zeros(3)}


def coordinator(**fsm) -> Coordinator:
    return joined(make_coordinator(**fsm), P0, "a")


def refusal(c: Coordinator, tensors: dict[str, torch.Tensor]) -> Error:
    before = c.fsm.snapshot()
    (_, reply), = c.handle("a", Submit("a", 0, 0, tensors), 0.0)
    assert isinstance(reply, Error), reply
    assert c.fsm.snapshot() == before and c.store.pending_count(0) == 0  # nothing was kept
    return reply


def test_submission_with_a_wrong_shape_names_the_tensor_and_both_shapes():
    err = refusal(coordinator(), {"w": torch.zeros(2, 3), "b": torch.zeros(3)})
    assert err.code is ErrorCode.TENSOR_MISMATCH and err.in_reply_to == "Submit"
    assert "'w'" in err.detail and "[2, 3]" in err.detail and "[3, 2]" in err.detail


def test_submission_with_a_wrong_dtype_names_both_dtypes():
    err = refusal(coordinator(), {"w": torch.zeros(3, 2, dtype=torch.float64), "b": torch.zeros(3)})
    assert err.code is ErrorCode.TENSOR_MISMATCH
    assert "'w'" in err.detail and "float64" in err.detail and "float32" in err.detail


def test_submission_with_wrong_names_lists_missing_and_unexpected():
    err = refusal(coordinator(), {"w": torch.zeros(3, 2), "bias": torch.zeros(3)})
    assert err.code is ErrorCode.TENSOR_MISMATCH
    assert "'b'" in err.detail and "'bias'" in err.detail


def test_submission_with_non_finite_values_is_refused():
    err = refusal(coordinator(), {"w": torch.full((3, 2), float("nan")), "b": torch.zeros(3)})
    assert err.code is ErrorCode.NON_FINITE and "'w'" in err.detail and "non-finite" in err.detail


def test_a_good_submission_after_bad_ones_is_accepted():
    c = coordinator(min_workers=2)
    refusal(c, {"w": torch.zeros(2, 3), "b": torch.zeros(3)})
    (_, reply), = c.handle("a", Submit("a", 0, 0, {"w": torch.ones(3, 2), "b": torch.ones(3)}), 0.0)
    assert isinstance(reply, Accepted)


def test_wrong_protocol_version_is_refused_naming_both_versions():
    c = make_coordinator()
    (_, err), = c.handle("a", join_message("a", P0, version=PROTOCOL_VERSION + 98), 0.0)
    assert isinstance(err, Error) and err.code is ErrorCode.PROTOCOL_VERSION
    assert str(PROTOCOL_VERSION + 98) in err.detail and f"version {PROTOCOL_VERSION}" in err.detail
    assert c.store is None and c.fsm.live_workers == 0


def test_worker_speaking_another_protocol_version_raises_naming_both(monkeypatch):
    monkeypatch.setattr(worker_module, "PROTOCOL_VERSION", PROTOCOL_VERSION + 1)
    model = linear(0)
    c = make_coordinator(time.monotonic())
    w = DilocoWorker(model, torch.optim.SGD(model.parameters(), lr=0.1), LoopbackEndpoint(c, "a"),
                     worker_id="a", sync_every=2)
    with pytest.raises(DilocoWorkerError) as info:
        w.join()
    assert info.value.code == "protocol_version"
    assert str(PROTOCOL_VERSION + 1) in str(info.value) and str(PROTOCOL_VERSION) in str(info.value)
    assert w.state == "stopped" and w.step_done() is False


def test_a_worker_whose_model_does_not_match_the_run_is_refused_at_join():
    with Run(min_workers=1) as run:
        first = run.worker("first", linear(0), sync_every=5)
        first.join()
        wrong = run.worker("wrong", torch.nn.Linear(8, 2), sync_every=5)
        with pytest.raises(DilocoWorkerError) as info:
            wrong.join()
        wrong.leave()
        first.leave()
    msg = str(info.value)
    assert info.value.code == "model_mismatch"
    assert "'weight'" in msg and "[2, 8]" in msg and "[1, 8]" in msg, msg
    assert wrong.state == "stopped" and wrong.stop_reason.startswith("error")


def test_a_mangled_submission_raises_tensor_mismatch_in_the_worker():
    def drop_bias(msg):
        if isinstance(msg, Submit):
            return dataclasses.replace(msg, tensors={"weight": msg.tensors["weight"]})
        return msg

    model = linear(0)
    c = make_coordinator(time.monotonic())
    w = DilocoWorker(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     LoopbackEndpoint(c, "a", tamper=drop_bias), worker_id="a", sync_every=2)
    with pytest.raises(DilocoWorkerError) as info:
        run_training(w, batches(0), _loss, max_steps=10)
    assert info.value.code == "tensor_mismatch" and "'bias'" in str(info.value)
    assert w.inner_step == 2 and w.state == "stopped"


def test_join_without_a_coordinator_gives_up_after_the_coordinator_timeout():
    model = linear(0)
    w = DilocoWorker(model, torch.optim.SGD(model.parameters(), lr=0.1), InprocNetwork().connect("a"),
                     worker_id="a", sync_every=2, coordinator_timeout_s=0.2)
    t0 = time.monotonic()
    w.join()
    assert w.stopped and w.stop_reason == "coordinator_unreachable"
    assert 0.2 <= time.monotonic() - t0 < 2.0


def test_coordinator_timeout_s_defaults_to_ten_minutes():
    model = linear(0)
    assert DilocoWorker(model, torch.optim.SGD(model.parameters(), lr=0.1), InprocNetwork().connect("b"),
                        worker_id="b", sync_every=2).coordinator_timeout_s == 600.0


def test_joining_a_stopped_run_stops_the_worker_cleanly():
    c = make_coordinator(time.monotonic())
    c.handle("x", join_message("x", P0), time.monotonic())
    from diloco.wire.messages import AdminRequest
    c.handle("admin", AdminRequest("shutdown", {"kind": "abort"}), time.monotonic())
    model = linear(0)
    w = DilocoWorker(model, torch.optim.SGD(model.parameters(), lr=0.1), LoopbackEndpoint(c, "a"),
                     worker_id="a", sync_every=2)
    report = run_training(w, batches(0), _loss, max_steps=10)
    assert report.inner_steps == 0 and w.state == "stopped" and "stopped" in report.stop_reason


def test_bad_worker_arguments_are_refused():
    model = linear(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ep = InprocNetwork().connect("a")
    with pytest.raises(ValueError, match="sync_every"):
        DilocoWorker(model, opt, ep, worker_id="a", sync_every=0)
    with pytest.raises(ValueError, match="worker_id"):
        DilocoWorker(model, opt, ep, worker_id="", sync_every=1)
    with pytest.raises(ValueError, match="poll_interval_s"):
        DilocoWorker(model, opt, ep, worker_id="a", sync_every=1, poll_interval_s=0)


def test_a_corrupt_or_foreign_worker_checkpoint_is_refused_clearly(tmp_path):
    model = mlp(0)
    opt = torch.optim.AdamW(model.parameters())
    path = tmp_path / "worker-a.safetensors"
    path.write_bytes(b"\x10" + b"\x00" * 27)  # a header length and then too little of anything
    with pytest.raises(DilocoWorkerError, match="torn or corrupt") as info:
        DilocoWorker(model, opt, InprocNetwork().connect("a"), worker_id="a", sync_every=4,
                     checkpoint_dir=tmp_path)
    assert info.value.code == "bad_checkpoint"
    # A checkpoint saved with another H would put the worker off the run's schedule.
    path.unlink()
    w = DilocoWorker(model, opt, InprocNetwork().connect("a"), worker_id="a", sync_every=4,
                     checkpoint_dir=tmp_path)
    w.save_checkpoint()
    with pytest.raises(DilocoWorkerError, match="sync_every=4.*sync_every=8"):
        DilocoWorker(model, opt, InprocNetwork().connect("a"), worker_id="a", sync_every=8,
                     checkpoint_dir=tmp_path)
    # And another model does not fit.
    other = linear(0)
    with pytest.raises(DilocoWorkerError, match="model state does not fit"):
        DilocoWorker(other, torch.optim.AdamW(other.parameters()), InprocNetwork().connect("a"), worker_id="a",
                     sync_every=4, checkpoint_dir=tmp_path)


def test_checkpoint_file_names_cannot_escape_the_directory(tmp_path):
    from diloco.worker.checkpoint import checkpoint_path
    p = checkpoint_path(tmp_path, "../../etc/passwd")
    assert p.parent == tmp_path and "/" not in p.name


def _loss(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def test_first_join_with_non_fp32_params_is_refused_naming_the_tensor():
    """Regression: a bf16 first join used to be welcomed (the store converts to fp32), after
    which every later worker with the same bf16 spec was refused as model_mismatch."""
    c = make_coordinator()
    bf16 = {"w": torch.zeros(3, 2, dtype=torch.bfloat16), "b": torch.zeros(3)}
    (_, err), = c.handle("a", join_message("a", bf16), 0.0)
    assert isinstance(err, Error) and err.code is ErrorCode.BAD_MESSAGE
    assert "'w'" in err.detail and "bfloat16" in err.detail and "float32" in err.detail
    assert c.store is None and c.fsm.live_workers == 0


def test_a_bf16_model_trains_with_fp32_global_params():
    """The worker sends fp32 copies and spec, so bf16 models join, and several of them can."""
    with Run(min_workers=2) as run:
        ws = []
        for i in range(2):
            model = linear(0).to(torch.bfloat16)
            ws.append(run.worker(f"w{i}", model, sync_every=2))
        for i, w in enumerate(ws):
            run.start(w, ((x.bfloat16(), y.bfloat16()) for x, y in batches(i, 0, 4)))
        reports = run.join_workers()
    assert all(r.rounds_synced == 2 for r in reports.values())
    assert all(t.dtype == torch.float32 for t in run.coordinator.store.params.values())
    final = run.coordinator.store.params
    for w in ws:
        assert all(torch.equal(p, final[n].to(torch.bfloat16)) for n, p in w.model.named_parameters())
