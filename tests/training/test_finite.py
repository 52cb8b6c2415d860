"""No non-finite or absurd value reaches a worker or a checkpoint (SPEC.md sections 11 and 12).

* a first join's params must be finite (``non_finite``), and so must submissions;
* a Join carries only the spec: the first one is answered ``params_required`` and
  the worker sends its params once; later joins' params are dropped at once;
* the sync running sum is scaled by 2^-20: finite fp32 contributions cannot sum to inf;
* an outer step that makes a parameter non-finite is undone exactly (params and
  optimizer state), counted (``steps_refused``), and the round's Results carry
  the unchanged params;
* ``max_update_norm`` refuses a contribution with a larger L2 norm (``update_too_large``).
"""

from __future__ import annotations

import copy
import gc
import io
import time
import weakref

import pytest
import torch

from diloco.core import ConfigError, Mode
from diloco.coordinator import Coordinator, CoordinatorConfig, OuterConfig
from diloco.coordinator.params import ParamStore, l2_norm
from diloco.testing import join_message, joined, make_coordinator, only
from diloco.wire.messages import (
    Accepted,
    Error,
    ErrorCode,
    Join,
    Result,
    Submit,
    Welcome,
    spec_of,
)
from diloco.worker import DilocoWorker, run_training
from training_harness import LoopbackEndpoint, Run, batches, linear, mse_loss, wait_for

P0 = {"w": torch.tensor([[1.0, -2.0], [0.5, 0.25]]), "b": torch.tensor([0.5, -0.5])}
SANE = {"w": torch.tensor([[0.1, -0.2], [0.05, 0.0]]), "b": torch.tensor([0.3, -0.1])}
HUGE = 3e38  # finite in fp32 (largest: 3.4028e38); twice it is not


def make(*, min_workers: int = 2, **config) -> Coordinator:
    # These tests push huge finite values through on purpose (the non-finite step's refusal is the
    # layer beneath the outlier bound, tested in test_outliers.py): the bound is off here.
    config.setdefault("outlier_factor", 0.0)
    """Two workers by default; the outer optimizer is Nesterov 0.7 / 0.9 unless ``outer=`` says otherwise."""
    return make_coordinator(min_workers=min_workers, **config)


def join(c: Coordinator, wid: str, params=None) -> list:
    """``wid`` joins with P0's spec and ``params`` (default P0)."""
    return c.handle(wid, join_message(wid, P0, params=P0 if params is None else params), 0.0)


def full(value: float) -> dict[str, torch.Tensor]:
    return {n: torch.full_like(t, value) for n, t in P0.items()}


def params_copy(c: Coordinator) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in c.store.params.items()}


def opt_state(c: Coordinator, fid: int = 0) -> dict:
    return copy.deepcopy(c.hub._optimizers[fid].state_dict())


def assert_bit_identical(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), (a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (a, b)
        for k in a:
            assert_bit_identical(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), (a, b)
        for x, y in zip(a, b):
            assert_bit_identical(x, y)
    else:
        assert a == b, (a, b)


# ---------------------------------------------------------------- first join, submissions


def test_a_first_join_with_nan_params_is_refused_naming_the_tensor_then_a_finite_one_is_welcomed():
    c = make(min_workers=1)
    bad = {"w": P0["w"].clone(), "b": torch.tensor([0.0, float("nan")])}
    (_, err), = join(c, "a", bad)
    assert isinstance(err, Error) and err.code is ErrorCode.NON_FINITE and err.in_reply_to == "Join"
    assert "'b'" in err.detail and "non-finite" in err.detail
    assert c.store is None and c.fsm.live_workers == 0  # the run stays without params
    bad_inf = {"w": torch.full((2, 2), float("-inf")), "b": P0["b"].clone()}
    (_, err), = join(c, "a", bad_inf)
    assert err.code is ErrorCode.NON_FINITE and "'w'" in err.detail
    welcome = only(join(c, "a"), Welcome)
    assert_bit_identical(dict(welcome.params), P0)


def test_a_submission_with_inf_is_non_finite_and_changes_nothing():
    c = joined(make(), P0, "a", "b")
    before, params = c.fsm.snapshot(), params_copy(c)
    (_, err), = c.handle("a", Submit("a", 0, 0, {"w": SANE["w"], "b": torch.tensor([1.0, float("inf")])}), 0.0)
    assert isinstance(err, Error) and err.code is ErrorCode.NON_FINITE and err.in_reply_to == "Submit"
    assert "'b'" in err.detail
    assert c.fsm.snapshot() == before and c.store.pending_count(0) == 0
    assert_bit_identical(params_copy(c), params)
    # A wrong shape is still tensor_mismatch.
    (_, err), = c.handle("a", Submit("a", 0, 0, {"w": torch.zeros(4), "b": SANE["b"]}), 0.0)
    assert err.code is ErrorCode.TENSOR_MISMATCH


# ---------------------------------------------------------------- aggregation


def test_the_running_sum_of_two_huge_contributions_has_a_finite_mean():
    store = ParamStore(P0, 1)
    store.accumulate(0, full(HUGE))
    store.accumulate(0, full(HUGE))
    mean = store.take_mean(0, 2)
    for n, t in mean.items():
        assert t.dtype == torch.float32 and torch.isfinite(t).all(), (n, t)
        assert torch.equal(t, torch.full_like(P0[n], HUGE))
    # Through the coordinator: plain SGD with lr 0.5 steps to -1.5e38, finite: applied.
    c = joined(make(outer=OuterConfig("sgd", 0.5, 0.0)), P0, "a", "b")
    c.handle("a", Submit("a", 0, 0, full(HUGE)), 0.0)
    out = c.handle("b", Submit("b", 0, 0, full(HUGE)), 0.0)
    assert {m.outcome for _, m in out if isinstance(m, Result)} == {"applied"}
    assert c.stats.steps_refused == 0
    assert all(torch.isfinite(t).all() and (t < -1e38).all() for t in c.store.params.values())


# ---------------------------------------------------------------- the post-step check


def test_an_outer_step_that_overflows_is_refused_and_undone_exactly():
    events = []
    c = joined(make(observer=lambda kind, now, info: events.append((kind, info))), P0, "a", "b")
    # Round 0 applies normally, so the optimizer has momentum to restore.
    c.handle("a", Submit("a", 0, 0, SANE), 0.0)
    c.handle("b", Submit("b", 0, 0, SANE), 0.0)
    params, state, applied = params_copy(c), opt_state(c), c.fsm.rounds_applied
    assert state["state"], "round 0 should have left momentum buffers"
    events.clear()

    # Round 1: a finite mean of 3e38 that Nesterov (lr 0.7, momentum 0.8) steps to -inf.
    assert isinstance(only(c.handle("a", Submit("a", 0, 1, full(HUGE)), 0.0), Accepted), Accepted)
    out = c.handle("b", Submit("b", 0, 1, full(HUGE)), 0.0)
    results = {p: m for p, m in out if isinstance(m, Result)}
    assert set(results) == {"a", "b"}
    for m in results.values():
        assert (m.round_id, m.outcome, m.next_round_id) == (1, "applied", 2)
        assert_bit_identical(dict(m.params), params)  # the workers continue from the last good params
    assert_bit_identical(params_copy(c), params)
    assert_bit_identical(opt_state(c), state)
    assert c.stats.steps_refused == 1 and c.status()["steps_refused"] == 1
    assert c.fsm.open_round_ids() == (2,) and c.fsm.rounds_applied == applied + 1
    kinds = [k for k, _ in events]
    assert kinds == ["step_refused", "apply"], kinds
    info = events[0][1]
    assert info["fragment_id"] == 0 and info["round_id"] == 1 and info["contributors"] == ["a", "b"]
    assert info["tensor"] in P0

    # Round 2 with sane values applies normally: exactly as if round 1 had never been.
    c.handle("a", Submit("a", 0, 2, SANE), 0.0)
    out = c.handle("b", Submit("b", 0, 2, SANE), 0.0)
    ref = joined(make(), P0, "a", "b")
    for r in (0, 1):
        ref.handle("a", Submit("a", 0, r, SANE), 0.0)
        ref.handle("b", Submit("b", 0, r, SANE), 0.0)
    assert_bit_identical(params_copy(c), params_copy(ref))
    assert_bit_identical(opt_state(c), opt_state(ref))
    assert c.stats.steps_refused == 1
    assert all(torch.equal(m.params["w"], c.store.params["w"]) for _, m in out if isinstance(m, Result))


def test_an_async_step_that_overflows_is_refused_too():
    c = make(min_workers=1, mode=Mode.ASYNC, outer=OuterConfig("delayed_nesterov", 0.7, 0.9, delay=1))
    joined(c, P0, "a")
    params, state = params_copy(c), opt_state(c)
    out = c.handle("a", Submit("a", 0, 0, full(3.4e38)), 0.0)
    result = only(out, Result)
    assert result.outcome == "applied" and result.next_round_id == 1
    assert_bit_identical(dict(result.params), params)
    assert_bit_identical(params_copy(c), params)
    assert_bit_identical(opt_state(c), state)
    assert c.stats.steps_refused == 1


def test_the_server_prints_a_refused_step_and_no_applied_line_for_it():
    from diloco.deploy.server import EventPrinter

    buf = io.StringIO()
    printer = EventPrinter(buf)
    info = dict(fragment_id=0, round_id=12, contributors=["w1", "w2"])
    printer("step_refused", 0.0, dict(info, tensor="w"))
    printer("apply", 0.0, info)
    printer("apply", 0.0, dict(info, round_id=13))
    lines = buf.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].endswith("REFUSED  fragment 0 round 12: the outer step made 'w' non-finite; params unchanged, "
                             "contributions of [w1, w2] discarded")
    assert "applied  fragment 0 round 13" in lines[1]


# ---------------------------------------------------------------- max_update_norm


def test_a_contribution_over_max_update_norm_is_refused_and_changes_nothing():
    c = joined(make(max_update_norm=10.0), P0, "a", "b")
    before, params = c.fsm.snapshot(), params_copy(c)
    (_, err), = c.handle("a", Submit("a", 0, 0, full(1e30)), 0.0)
    assert isinstance(err, Error) and err.code is ErrorCode.UPDATE_TOO_LARGE and err.in_reply_to == "Submit"
    assert "2.44949e+30" in err.detail and "10" in err.detail  # the norm (sqrt(6) * 1e30) and the limit
    assert c.fsm.snapshot() == before and c.store.pending_count(0) == 0
    assert_bit_identical(params_copy(c), params)
    # Under the limit: accepted.
    assert isinstance(only(c.handle("a", Submit("a", 0, 0, SANE), 0.0), Accepted), Accepted)


def test_l2_norm_is_float64_and_does_not_overflow():
    t = {"a": torch.full((4,), 3e38), "b": torch.full((5,), -3e38)}
    x = float(torch.tensor(3e38))  # 3e38 rounded to fp32
    assert l2_norm(t) == pytest.approx(x * 3, rel=1e-12)
    assert l2_norm({"a": torch.tensor([3.0]), "b": torch.tensor([4.0]), "e": torch.zeros(0)}) == 5.0


def test_max_update_norm_config_validation_and_old_checkpoints():
    for bad in (0, -1.0, float("nan"), float("inf"), True, "3"):
        with pytest.raises(ConfigError, match="max_update_norm"):
            CoordinatorConfig(max_update_norm=bad)
    c = CoordinatorConfig(max_update_norm=5)
    assert c.max_update_norm == 5.0
    assert CoordinatorConfig.from_dict(c.to_dict()) == c
    old = CoordinatorConfig().to_dict()
    del old["max_update_norm"]  # a checkpoint written before the option existed
    assert CoordinatorConfig.from_dict(old).max_update_norm is None


def test_server_settings_and_flag_set_max_update_norm():
    from diloco.cli import build_parser
    from diloco.deploy.server import ServerSettings, build_config

    assert build_config(ServerSettings()).max_update_norm is None
    assert build_config(ServerSettings(max_update_norm=7.5)).max_update_norm == 7.5
    saved = CoordinatorConfig(max_update_norm=3.0)
    assert build_config(ServerSettings(), saved).max_update_norm == 3.0  # resume keeps the saved limit
    assert build_config(ServerSettings(max_update_norm=0.0), saved).max_update_norm is None  # 0: no limit
    args = build_parser().parse_args(["server", "--max-update-norm", "12.5"])
    assert args.max_update_norm == 12.5
    with pytest.raises(SystemExit):
        build_parser().parse_args(["server", "--max-update-norm", "-1"])


# ---------------------------------------------------------------- params_required


def test_a_spec_only_first_join_is_answered_params_required():
    c = make(min_workers=1)
    (_, err), = c.handle("a", join_message("a", spec_of(P0)), 0.0)
    assert isinstance(err, Error) and err.code is ErrorCode.PARAMS_REQUIRED and err.in_reply_to == "Join"
    assert c.store is None and c.fsm.live_workers == 0
    welcome = only(join(c, "a"), Welcome)
    assert_bit_identical(dict(welcome.params), P0)
    # Once the run has params, a spec-only join is welcomed at once.
    assert isinstance(only(c.handle("b", join_message("b", spec_of(P0)), 0.0), Welcome), Welcome)


def test_a_worker_sends_its_params_only_when_asked_and_trains():
    model = linear(0)
    c = make_coordinator(time.monotonic(), min_workers=1)
    ep = LoopbackEndpoint(c, "a")
    w = DilocoWorker(model, torch.optim.SGD(model.parameters(), lr=0.05), ep, worker_id="a", sync_every=2)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    report = run_training(w, batches(0), mse_loss, max_steps=6)
    assert report.rounds_synced == 3
    joins = [m for m in ep.sent if isinstance(m, Join)]
    assert len(joins) == 2 and joins[0].params == {}
    assert_bit_identical(dict(joins[1].params), initial)
    assert c.fsm.rounds_applied == 3


def test_real_workers_over_the_inproc_transport_join_and_train():
    with Run(min_workers=2) as run:
        a = run.worker("a", linear(0), sync_every=2)
        b = run.worker("b", linear(1), sync_every=2)
        run.start(a, batches(0), max_steps=6)
        wait_for(lambda: bool(a.global_params), what="a welcomed")
        run.start(b, batches(1), max_steps=6)
        reports = run.join_workers()
    assert all(r.rounds_synced == 3 for r in reports.values())
    # Both submitted 3 full pseudo-gradients; only a (the first, asked) also sent its params.
    model_bytes = sum(p.numel() * 4 for p in a.model.parameters())
    assert a.bytes_sent == 4 * model_bytes and b.bytes_sent == 3 * model_bytes
    final = run.coordinator.store.params
    assert all(torch.equal(p, final[n]) for n, p in a.model.named_parameters())
    assert all(torch.equal(p, final[n]) for n, p in b.model.named_parameters())


def test_a_later_join_with_params_is_welcomed_and_its_params_are_not_kept():
    c = joined(make(), P0, "a")
    theirs = {n: torch.full_like(t, 7.0) for n, t in P0.items()}
    refs = [weakref.ref(t) for t in theirs.values()]
    msg = join_message("b", theirs)
    out = c.handle("b", msg, 0.0)
    welcome = only(out, Welcome)
    assert_bit_identical(dict(welcome.params), P0)  # the run's params, not the joiner's
    assert_bit_identical(params_copy(c), P0)
    del msg, theirs, out
    gc.collect()
    assert all(r() is None for r in refs), "the coordinator kept a reference to a later join's params"
