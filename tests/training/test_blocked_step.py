"""The hub's Nesterov step and mean made block by block give the very bits of the whole-tensor ones.

``diloco.blocked_step.step_in_blocks`` makes ``torch.optim.SGD``'s Nesterov step one cache-sized
block at a time, and ``ParamStore.take_mean`` divides and unscales block by block: both elementwise,
with the same kernels and scalars, so nothing may change by a bit (a journal written before replays
to the same params). Odd sizes put elements on the kernels' scalar tails; one and two threads split
the work differently.
"""

from __future__ import annotations

import pytest
import torch

from diloco.blocked_step import BLOCK, step_in_blocks
from diloco.outer import OuterConfig, build_outer_optimizer
from diloco.coordinator.params import SUM_SCALE, ParamStore

SHAPES = {"big": (3 * BLOCK + 17,), "odd": (7, 1001), "one": (1,), "empty": (0, 3), "edge": (BLOCK,)}


def _state(seed: int):
    g = torch.Generator().manual_seed(seed)
    params = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    return params, [{n: torch.randn(s, generator=g) * 0.01 for n, s in SHAPES.items()} for _ in range(4)]


def _run(params, grads, blocked: bool, config: OuterConfig):
    params = {n: t.clone() for n, t in params.items()}
    opt = build_outer_optimizer(list(params.values()), config, 2)
    used = []
    for grad in grads:
        step = step_in_blocks(opt, params, grad) if blocked else None
        used.append(step is not None)
        bad = None if step is None else step.bad
        if step is None:
            for n, p in params.items():
                p.grad = grad[n]
            opt.step()
            for p in params.values():
                p.grad = None
        assert bad is None
    return params, opt, used


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("config", [OuterConfig(), OuterConfig(lr=0.3, momentum=0.95)])
def test_the_blocked_nesterov_step_gives_the_bits_of_torch_optim(threads, config):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        params, grads = _state(threads)
        a, opt_a, used = _run(params, grads, True, config)
        b, opt_b, _ = _run(params, grads, False, config)
    finally:
        torch.set_num_threads(before)
    assert used == [False, True, True, True]  # the first step makes the momentum: torch's own
    for n in SHAPES:
        assert torch.equal(a[n], b[n]), n
        assert torch.equal(opt_a.state[a[n]]["momentum_buffer"], opt_b.state[b[n]]["momentum_buffer"]), n


@pytest.mark.parametrize("name", ["adam", "sgd", "delayed_nesterov"])
def test_other_optimizers_are_left_to_torch(name):
    params, grads = _state(0)
    _, _, used = _run(params, grads, True, OuterConfig(name=name, lr=0.1))
    assert not any(used)


def test_a_step_to_a_non_finite_value_names_the_first_such_tensor():
    params, grads = _state(1)
    p = {n: t.clone() for n, t in params.items()}
    opt = build_outer_optimizer(list(p.values()), OuterConfig(), 2)
    assert step_in_blocks(opt, p, grads[0]) is None  # no momentum yet
    for n, t in p.items():
        t.grad = grads[0][n]
    opt.step()
    huge = {n: g.clone() for n, g in grads[1].items()}
    huge["odd"][3, 5] = float("inf")
    huge["big"][-1] = 3e38  # finite, but the step overflows
    values = {n: t.clone() for n, t in p.items()}
    momentum = {n: opt.state[t]["momentum_buffer"].clone() for n, t in p.items()}
    step = step_in_blocks(opt, p, huge)
    assert step is not None and step.bad == "big"
    assert not bool(torch.isfinite(p["big"]).all()) and not bool(torch.isfinite(p["odd"]).all())
    step.undo()  # the params and the momentum are back, bit for bit
    for n, t in p.items():
        assert torch.equal(t, values[n]) and torch.equal(opt.state[t]["momentum_buffer"], momentum[n]), n
    # Finite values whose block sums overflow are still finite.
    q = {n: t.clone() for n, t in params.items()}
    opt = build_outer_optimizer(list(q.values()), OuterConfig(lr=1e-3, momentum=0.5), 2)
    for n, t in q.items():
        t.grad = torch.zeros_like(t)
    opt.step()
    q["big"].fill_(3e38)
    step = step_in_blocks(opt, q, {n: torch.zeros_like(t) for n, t in q.items()})
    assert step is not None and step.bad is None


def test_the_blocked_step_writes_fresh_memory_and_leaves_the_old_values_in_place():
    """What the step read is never written: the memory the params and momentum left holds their values
    from before (a Result may still be sent from it), and is what ``before`` hands out."""
    params, grads = _state(3)
    p = {n: t.clone() for n, t in params.items()}
    opt = build_outer_optimizer(list(p.values()), OuterConfig(), 2)
    for n, t in p.items():
        t.grad = grads[0][n]
    opt.step()
    views = {n: t.detach() for n, t in p.items()}  # what a Result of the last round holds
    kept = {n: t.clone() for n, t in p.items()}
    buffers_before = {n: opt.state[t]["momentum_buffer"].detach() for n, t in p.items()}
    momentum_kept = {n: b.clone() for n, b in buffers_before.items()}
    step = step_in_blocks(opt, p, grads[1])
    assert step is not None and step.bad is None
    for n in SHAPES:
        assert torch.equal(views[n], kept[n]) and torch.equal(step.before[n], kept[n]), n
        assert torch.equal(buffers_before[n], momentum_kept[n]), n
        if p[n].numel():
            assert p[n].data_ptr() != views[n].data_ptr(), n
            assert not torch.equal(p[n], kept[n]), n  # the step did change the values


def test_the_mean_made_block_by_block_gives_the_same_bits():
    params, grads = _state(2)
    store = ParamStore(params, 1)
    for g in grads[:3]:
        store.accumulate(0, g)
    expected = {n: t.clone().div_(3).mul_(1.0 / SUM_SCALE) for n, t in store._sums[0].items()}
    mean = store.take_mean(0, 3)
    for n in SHAPES:
        assert torch.equal(mean[n], expected[n]), n


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("tokens", [None, [300, 100, 250, 7]])
def test_the_last_contribution_added_in_the_means_pass_gives_the_same_bits(k, tokens):
    """``accumulate(last=True)`` leaves the addition to ``take_mean``, made block by block with the division."""
    params, grads = _state(4)
    fused, plain = ParamStore(params, 1), ParamStore(params, 1)
    for i, g in enumerate(grads[:k]):
        t = None if tokens is None else tokens[i]
        fused.accumulate(0, g, t, last=i == k - 1)
        plain.accumulate(0, g, t)
    assert fused.pending_count(0) == plain.pending_count(0) == k
    a, b = fused.take_mean(0, k), plain.take_mean(0, k)
    for n in SHAPES:
        assert torch.equal(a[n], b[n]), n
    assert fused.pending_count(0) == 0 and fused._last[0] is None


def test_only_an_accept_its_own_rounds_apply_follows_is_left_to_the_mean():
    from diloco.coordinator.service import _closes_round
    from diloco.core.effects import AcceptContribution, ApplyRound

    accept = AcceptContribution("w2", 0, 3)
    assert _closes_round([accept, ApplyRound(0, 3, ("w1", "w2"))], 0)
    assert not _closes_round([ApplyRound(0, 3, ("w1", "w2")), accept], 1)  # an apply before it
    assert not _closes_round([accept, ApplyRound(0, 2, ("w1", "w2"))], 0)  # another round's
    assert not _closes_round([accept, ApplyRound(1, 3, ("w1", "w2"))], 0)  # another fragment's
    assert not _closes_round([accept, ApplyRound(0, 3, ("w1", "w3"))], 0)  # not listing it


@pytest.mark.parametrize("tokens", [None, [300, 100, 250]])
def test_a_sum_started_in_the_contributions_own_memory_gives_the_same_bits(tokens):
    """``accumulate(owned=True)``: the round's sum starts in the first contribution's memory, scaled in
    place, instead of a copy (a receive buffer nothing else reads); the mean is the same."""
    params, grads = _state(6)
    owned, plain = ParamStore(params, 1), ParamStore(params, 1)
    mine = [{n: t.clone() for n, t in g.items()} for g in grads[:3]]
    for i in range(3):
        w = None if tokens is None else tokens[i]
        owned.accumulate(0, mine[i], w, owned=True)
        plain.accumulate(0, grads[i], w)
        if i == 0:  # the sum is the first contribution's memory
            assert all(owned._sums[0][n].data_ptr() == mine[0][n].data_ptr() for n in SHAPES if mine[0][n].numel())
    a, b = owned.take_mean(0, 3), plain.take_mean(0, 3)
    for n in SHAPES:
        assert torch.equal(a[n], b[n]), n
        assert torch.equal(mine[1][n], grads[1][n]), n  # only a round's first sum starts in its tensors


def test_a_momentum_free_sgd_step_in_blocks_is_torchs_step_with_the_backup_norm_and_digest_in_one_pass():
    """The collective sparse wire's outer step (SGD, momentum 0): block by block, the same bits as
    ``opt.step()``, the backup the old params, and the watch's digest and step norm those of the
    separate pass (``digest_and_step_norm``)."""
    from diloco.blocked_step import sgd_step_in_blocks
    from diloco.collective.digest import StepWatch, digest_and_step_norm

    torch.manual_seed(0)
    params = {"a": torch.randn(3), "b": torch.randn(BLOCK + 7), "c": torch.randn(2 * BLOCK, 3)}
    grads = {n: torch.randn_like(p) * 1e-2 for n, p in params.items()}
    old = {n: p.clone() for n, p in params.items()}
    ref = {n: p.clone() for n, p in params.items()}
    opt_ref = build_outer_optimizer(list(ref.values()), OuterConfig(name="sgd", lr=3.0, momentum=0.0), 1)
    for n, p in ref.items():
        p.grad = grads[n]
    opt_ref.step()
    opt = build_outer_optimizer(list(params.values()), OuterConfig(name="sgd", lr=3.0, momentum=0.0), 1)
    before = {n: torch.empty_like(p) for n, p in params.items()}
    scratch = torch.empty(2 * BLOCK)
    watch = StepWatch(params, before, scratch)
    assert sgd_step_in_blocks(opt, params, grads, watch)
    digest, norm = watch.result()
    assert all(torch.equal(params[n], ref[n]) and torch.equal(before[n], old[n]) for n in params)
    want_digest, want_norm = digest_and_step_norm(ref, old, scratch)
    assert digest == want_digest and norm == pytest.approx(want_norm, rel=1e-6)
    # Anything else is stepped as usual: nothing touched.
    nesterov = build_outer_optimizer(list(params.values()), OuterConfig(name="nesterov", lr=0.7, momentum=0.9), 1)
    now = {n: p.clone() for n, p in params.items()}
    assert not sgd_step_in_blocks(nesterov, params, grads, StepWatch(params, before, scratch))
    assert all(torch.equal(params[n], now[n]) for n in params)
