"""Runs in a compressed wire dtype (SPEC.md section 11, "Wire dtypes"): bf16 and int8 uploads and deltas.

Every worker must hold the coordinator's params bit for bit after each round,
the outer step must stay fp32, and a badly encoded Submit must be refused
precisely without changing anything.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from diloco import cli
from diloco.coordinator import CoordinatorConfig, OuterConfig
from diloco.core import Mode
from diloco.deploy import commands
from diloco.deploy.server import ServerSettings, build_config
from diloco.testing import join_message, joined, make_coordinator, only, params_of
from diloco.wire import compression
from diloco.wire.messages import WIRE_DTYPE_NAMES, Accepted, Error, ErrorCode, Result, Submit, Welcome
from diloco.worker import DilocoWorker, run_training
from training_harness import LoopbackEndpoint, Run, batch_at, batches, linear, mlp, mse_loss

H = 5


def _train(w: DilocoWorker, seed: int, steps: int, log: list, errors: list) -> None:
    """Train ``steps`` steps; after each sync (one fragment) log (rounds synced, global copy, model params)."""
    try:
        model, opt = w.model, w.inner_optimizer
        w.join()
        for step in range(steps):
            opt.zero_grad()
            mse_loss(model, batch_at(seed, step)).backward()
            opt.step()
            if not w.step_done():
                break
            if w.inner_step % H == 0:
                log.append((w.rounds_synced, {n: t.clone() for n, t in w.global_params.items()}, params_of(model)))
        w.leave()
    except BaseException as exc:  # surfaced by the test
        errors.append(exc)


def _run(wire_dtype: str, workers: int, steps: int, num_fragments: int = 1):
    logs: dict[str, list] = {}
    errors: list = []
    with Run(min_workers=workers, wire_dtype=wire_dtype, num_fragments=num_fragments) as run:
        threads = []
        for i in range(workers):
            wid = f"w{i}"
            w = run.worker(wid, mlp(0), sync_every=H, lr=0.05)
            logs[wid] = []
            threads.append(threading.Thread(target=_train, args=(w, i, steps, logs[wid], errors), name=wid))
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        final = {n: t.clone() for n, t in run.coordinator.store.params.items()}
        applied = list(run.applied)
        sent = run.coordinator.stats.bytes_sent
    return logs, applied, final, sent


@pytest.mark.parametrize("wire_dtype", ["bf16", "int8", "int4"])
def test_every_worker_holds_the_coordinators_params_bit_for_bit_after_each_round(wire_dtype):
    logs, applied, final, _ = _run(wire_dtype, workers=3, steps=4 * H)
    after_round = {r: params for fid, r, params in applied}
    assert sorted(after_round) == [0, 1, 2, 3]
    for wid, log in logs.items():
        assert [r for r, _, _ in log] == [1, 2, 3, 4], wid
        for synced, global_copy, model in log:
            want = after_round[synced - 1]
            for n in want:
                assert torch.equal(global_copy[n], want[n]), (wid, synced, n)
                assert torch.equal(model[n], want[n]), (wid, synced, n)
    assert all(torch.equal(logs["w0"][-1][1][n], final[n]) for n in final)


def test_int8_with_two_fragments_ends_with_identical_params_and_moves_a_quarter_of_the_bytes():
    logs, applied, final, sent = _run("int8", workers=2, steps=6 * H, num_fragments=2)
    assert {(fid, r) for fid, r, _ in applied} >= {(0, 0), (1, 0), (0, 4), (1, 4)}
    _, _, final32, sent32 = _run("fp32", workers=2, steps=6 * H, num_fragments=2)
    for n in final:
        # Not equal to the fp32 run (the deltas were rounded), but close.
        assert torch.allclose(final[n], final32[n], atol=1e-2), n
    assert sent < 0.55 * sent32  # Welcomes stay fp32; every Result is int8


def _encoded_submit(wid, tensors, wire_dtype, round_id=0, **change):
    enc = compression.encode(tensors, wire_dtype)
    values, scales = dict(enc.values), dict(enc.scales)
    values.update(change.pop("values", {}))
    scales = change.pop("scales", scales)
    return Submit(wid, 0, round_id, values, change.pop("wire_dtype", wire_dtype), scales)


P0 = {"w": torch.zeros(3, 300), "b": torch.zeros(3)}


def test_the_outer_step_is_fp32_on_the_decoded_mean_and_the_result_is_the_encoded_delta():
    c = joined(make_coordinator(min_workers=2, wire_dtype="int8", outer=OuterConfig("sgd", 1.0, 0.0),
                                outlier_factor=0.0), P0, "a", "b")  # huge on purpose: the layer beneath the bound
    summed = []
    accumulate = c.store.accumulate
    c.store.accumulate = lambda fid, t, *rest, **kw: (summed.append({n: x.dtype for n, x in t.items()}),
                                                  accumulate(fid, t, *rest, **kw))
    g = torch.Generator().manual_seed(1)
    grads = {wid: {n: torch.randn(t.shape, generator=g) for n, t in P0.items()} for wid in "ab"}
    assert isinstance(only(c.handle("a", _encoded_submit("a", grads["a"], "int8"), 0.0), Accepted), Accepted)
    out = c.handle("b", _encoded_submit("b", grads["b"], "int8"), 0.0)
    assert summed == [{"w": torch.float32, "b": torch.float32}] * 2
    decoded = {wid: compression.decode(*(lambda e: (e.values, e.scales))(compression.encode(gr, "int8")), "int8",
                                       [(n, t.shape) for n, t in P0.items()], "t") for wid, gr in grads.items()}
    mean = {n: (decoded["a"][n] + decoded["b"][n]) / 2 for n in P0}
    enc, want = compression.quantized_update(P0, {n: P0[n] - mean[n] for n in P0}, "int8")
    assert all(torch.equal(c.store.params[n], want[n]) for n in P0)
    results = [m for _, m in out if isinstance(m, Result)]
    assert len(results) == 2
    for r in results:
        assert r.delta is True and r.wire_dtype == "int8" and r.outcome == "applied"
        assert all(torch.equal(r.params[n], enc.values[n]) and torch.equal(r.scales[n], enc.scales[n]) for n in P0)
    assert c.stats.bytes_received == 2 * enc.nbytes and c.stats.bytes_sent == 2 * 903 * 4 + 2 * enc.nbytes


def test_an_update_too_large_for_bf16_is_refused_like_a_non_finite_step_and_results_carry_a_zero_delta():
    # The fp32 step lands at -3.3997e38 (finite), beyond bfloat16's range: its delta would decode to -inf.
    c = joined(make_coordinator(min_workers=1, wire_dtype="bf16", outer=OuterConfig("sgd", 1.003, 0.0),
                                outlier_factor=0.0), P0, "a")  # huge on purpose: the layer beneath the bound
    big = {n: torch.full(t.shape, 3.3895e38) for n, t in P0.items()}  # bfloat16's largest value
    r = only(c.handle("a", _encoded_submit("a", big, "bf16"), 0.0), Result)
    assert c.stats.steps_refused == 1 and all(torch.equal(c.store.params[n], P0[n]) for n in P0)
    assert r.delta is True and r.outcome == "applied" and all(not bool(r.params[n].any()) for n in P0)


def test_async_results_carry_full_fp32_params_whatever_the_wire_dtype():
    c = joined(make_coordinator(min_workers=1, mode=Mode.ASYNC, wire_dtype="bf16"), P0, "a")
    out = c.handle("a", _encoded_submit("a", {n: torch.ones_like(t) for n, t in P0.items()}, "bf16"), 0.0)
    r = only(out, Result)
    assert r.delta is False and r.wire_dtype == "fp32" and r.scales == {}
    assert all(r.params[n].dtype == torch.float32 and torch.equal(r.params[n], c.store.params[n]) for n in P0)


def _refusal(c, submit) -> Error:
    before = c.fsm.snapshot()
    params = {n: t.clone() for n, t in c.store.params.items()}
    (_, reply), = c.handle("a", submit, 0.0)
    assert isinstance(reply, Error) and reply.in_reply_to == "Submit", reply
    assert c.fsm.snapshot() == before and c.store.pending_count(0) == 0
    assert all(torch.equal(c.store.params[n], params[n]) for n in params)
    return reply


def test_badly_encoded_submissions_get_a_precise_error_and_change_nothing():
    c = joined(make_coordinator(min_workers=2, wire_dtype="int8"), P0, "a")
    g = {n: torch.randn(t.shape) for n, t in P0.items()}
    err = _refusal(c, _encoded_submit("a", g, "bf16"))
    assert err.code is ErrorCode.BAD_MESSAGE and "encoded as bf16" in err.detail and "int8" in err.detail
    err = _refusal(c, _encoded_submit("a", g, "int8", scales={}))
    assert err.code is ErrorCode.BAD_MESSAGE and "scales" in err.detail and "'w'" in err.detail
    scales = dict(compression.encode(g, "int8").scales)
    scales["w"] = scales["w"].clone()
    scales["w"][1] = float("nan")
    err = _refusal(c, _encoded_submit("a", g, "int8", scales=scales))
    # A NaN scale: the pseudo-gradient was not finite before it was encoded.
    assert err.code is ErrorCode.NON_FINITE and "scale 1 of tensor 'w' is nan" in err.detail
    err = _refusal(c, _encoded_submit("a", g, "int8", scales={"w": torch.ones(1), "b": torch.ones(1)}))
    assert err.code is ErrorCode.BAD_MESSAGE and "shape [1]" in err.detail and "[4]" in err.detail
    err = _refusal(c, _encoded_submit("a", g, "int8", values={"w": g["w"]}))  # fp32 values marked int8
    assert err.code is ErrorCode.BAD_MESSAGE and "'w' is float32" in err.detail and "int8" in err.detail
    err = _refusal(c, _encoded_submit("a", g, "int8", values={"w": torch.zeros(300, 3, dtype=torch.int8)}))
    assert err.code is ErrorCode.TENSOR_MISMATCH and "[300, 3]" in err.detail
    assert c.stats.messages_refused == 6
    assert isinstance(only(c.handle("a", _encoded_submit("a", g, "int8"), 0.0), Accepted), Accepted)


def test_the_welcome_carries_the_wire_dtype_and_the_worker_adopts_it():
    c = make_coordinator(time.monotonic(), wire_dtype="int8")
    welcome = only(make_coordinator(wire_dtype="bf16").handle("x", join_message("x", P0), 0.0), Welcome)
    assert welcome.wire_dtype == "bf16" and welcome.params["w"].dtype == torch.float32  # params: always fp32
    model = linear(0)
    ep = LoopbackEndpoint(c, "a")
    w = DilocoWorker(model, torch.optim.SGD(model.parameters(), lr=0.1), ep, worker_id="a", sync_every=2)
    assert w.wire_dtype == "fp32"
    run_training(w, batches(0), mse_loss, max_steps=6)
    assert w.wire_dtype == "int8" and w.rounds_synced == 3
    submits = [m for m in ep.sent if isinstance(m, Submit)]
    assert len(submits) == 3 and all(s.wire_dtype == "int8" and s.scales.keys() == {"weight", "bias"}
                                     and s.tensors["weight"].dtype == torch.int8 for s in submits)
    assert all(torch.equal(w.global_params[n], c.store.params[n]) for n in c.store.params)
    # The first join's fp32 params, then int8 values plus one fp32 scale per tensor.
    assert w.bytes_sent == 9 * 4 + 3 * (8 + 1 + 2 * 4)


def test_config_and_server_settings_keep_the_wire_dtype_across_a_resume():
    assert CoordinatorConfig().wire_dtype == "fp32"
    d = CoordinatorConfig(wire_dtype="int8").to_dict()
    assert CoordinatorConfig.from_dict(d).wire_dtype == "int8"
    del d["wire_dtype"]  # a checkpoint written before wire dtypes: fp32
    assert CoordinatorConfig.from_dict(d).wire_dtype == "fp32"
    with pytest.raises(ValueError, match="wire_dtype"):
        CoordinatorConfig(wire_dtype="fp8")
    assert build_config(ServerSettings()).wire_dtype == commands.DEFAULT_WIRE_DTYPE
    assert build_config(ServerSettings(), CoordinatorConfig(wire_dtype="bf16")).wire_dtype == "bf16"
    assert build_config(ServerSettings(wire_dtype="fp32"), CoordinatorConfig(wire_dtype="bf16")).wire_dtype == "fp32"
    assert commands.WIRE_DTYPES == WIRE_DTYPE_NAMES


def test_server_wire_dtype_bogus_is_a_usage_error_and_help_explains_the_flag(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["server", "--wire-dtype", "bogus"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--wire-dtype" in err and "invalid choice: 'bogus'" in err and "'int8'" in err
    with pytest.raises(SystemExit) as info:
        cli.main(["server", "--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--wire-dtype {fp32,bf16,int8,int4,sparse}" in text and f"(default {commands.DEFAULT_WIRE_DTYPE};" in text
