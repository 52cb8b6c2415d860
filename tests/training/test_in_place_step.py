"""The hub's Nesterov step is made in place only when nothing can tell: no Result still holds the params'
memory, and bounds prove every new value finite (so there is nothing to undo).

``outer.step_in_blocks`` writes fresh memory by default (the memory left behind is the undo of a refused
step and what the last Results are sent from). In place, it needs ``overwrite`` (the caller's word that
nothing else holds the params' memory), a bound on the gradient (``ParamStore.mean_bound``: twice the
largest L2 norm among the round's contributions) and the magnitudes of the params and momentum left by
the last step, still current. Either way the bits are those of ``torch.optim.SGD``.
"""

from __future__ import annotations

import pytest
import torch

from diloco.blocked_step import BLOCK, IN_PLACE_LIMIT, step_in_blocks
from diloco.outer import OuterConfig, build_outer_optimizer
from diloco.coordinator.params import ParamStore
from diloco.testing import joined, make_coordinator
from diloco.wire.messages import Result, Submit

SHAPES = {"big": (2 * BLOCK + 5,), "odd": (7, 33), "one": (1,), "empty": (0, 3)}


def _state(seed: int, steps: int = 5):
    g = torch.Generator().manual_seed(seed)
    params = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    return params, [{n: torch.randn(s, generator=g) * 0.01 for n, s in SHAPES.items()} for _ in range(steps)]


def _bound(grad) -> float:
    return 2.0 * max((float(t.abs().max()) for t in grad.values() if t.numel()), default=0.0)


def _stepped_once(params, grad):
    """Copies of ``params`` and a Nesterov optimizer whose first step (torch's own) made its momentum."""
    p = {n: t.clone() for n, t in params.items()}
    opt = build_outer_optimizer(list(p.values()), OuterConfig(), 2)
    for n, t in p.items():
        t.grad = grad[n]
    opt.step()
    return p, opt


def _torch_run(params, grads, config):
    params = {n: t.clone() for n, t in params.items()}
    opt = build_outer_optimizer(list(params.values()), config, 2)
    for grad in grads:
        for n, p in params.items():
            p.grad = grad[n]
        opt.step()
        for p in params.values():
            p.grad = None
    return params, opt


def _blocked_run(params, grads, config, *, overwrite=True, bound=_bound):
    params = {n: t.clone() for n, t in params.items()}
    opt = build_outer_optimizer(list(params.values()), config, 2)
    magnitudes, how = None, []
    for grad in grads:
        step = step_in_blocks(opt, params, grad, grad_bound=bound(grad), magnitudes=magnitudes, overwrite=overwrite)
        if step is None:  # the first step makes the momentum: torch's own
            for n, p in params.items():
                p.grad = grad[n]
            opt.step()
            for p in params.values():
                p.grad = None
            how.append("torch")
            continue
        assert step.bad is None
        magnitudes = step.magnitudes
        how.append("in place" if step.in_place else "fresh")
    return params, opt, how


@pytest.mark.parametrize("config", [OuterConfig(), OuterConfig(lr=0.3, momentum=0.95)])
def test_steps_in_place_give_the_bits_of_torch_optim(config):
    params, grads = _state(1)
    a, opt_a, how = _blocked_run(params, grads, config)
    b, opt_b = _torch_run(params, grads, config)
    # The first blocked step measures the magnitudes on fresh memory; the later ones carry the bounds.
    assert how == ["torch", "fresh", "in place", "in place", "in place"]
    for n in SHAPES:
        assert torch.equal(a[n], b[n]), n
        assert torch.equal(opt_a.state[a[n]]["momentum_buffer"], opt_b.state[b[n]]["momentum_buffer"]), n


def test_the_carried_bounds_hold_every_value():
    params, grads = _state(2, steps=30)
    p = {n: t.clone() for n, t in params.items()}
    opt = build_outer_optimizer(list(p.values()), OuterConfig(), 2)
    magnitudes = None
    for i, grad in enumerate(grads):
        step = step_in_blocks(opt, p, grad, grad_bound=_bound(grad), magnitudes=magnitudes, overwrite=True)
        if step is None:
            for n, t in p.items():
                t.grad = grad[n]
            opt.step()
            continue
        magnitudes = step.magnitudes
        largest_p = max(float(t.abs().max()) for t in p.values() if t.numel())
        largest_m = max(float(opt.state[t]["momentum_buffer"].abs().max()) for t in p.values() if t.numel())
        assert largest_p <= magnitudes.params and largest_m <= magnitudes.momentum, i


def test_no_step_is_made_in_place_without_the_callers_word():
    params, grads = _state(3)
    _, _, how = _blocked_run(params, grads, OuterConfig(), overwrite=False)
    assert how == ["torch"] + ["fresh"] * 4


def test_no_step_is_made_in_place_without_a_bound_on_the_gradient():
    params, grads = _state(3)
    _, _, how = _blocked_run(params, grads, OuterConfig(), bound=lambda g: None)
    assert how == ["torch"] + ["fresh"] * 4


@pytest.mark.parametrize("bound", [IN_PLACE_LIMIT, float("inf"), float("nan")])
def test_a_bound_that_does_not_prove_the_step_finite_goes_to_fresh_memory(bound):
    params, grads = _state(4)
    _, _, how = _blocked_run(params, grads, OuterConfig(), bound=lambda g: bound)
    assert how == ["torch"] + ["fresh"] * 4


def test_params_written_since_the_last_step_are_measured_again():
    params, grads = _state(5)
    p, opt = _stepped_once(params, grads[0])
    first = step_in_blocks(opt, p, grads[1], grad_bound=_bound(grads[1]), overwrite=True)
    assert first is not None and not first.in_place and first.magnitudes is not None
    with torch.no_grad():
        p["odd"].mul_(1e37)  # something writes the params: the magnitudes no longer hold
    second = step_in_blocks(opt, p, grads[2], grad_bound=_bound(grads[2]), magnitudes=first.magnitudes,
                            overwrite=True)
    assert second is not None and not second.in_place
    assert second.magnitudes is not None and second.magnitudes.params >= 1e36


def test_the_store_bounds_the_mean_by_the_largest_norm_and_only_when_every_norm_is_known():
    g = torch.Generator().manual_seed(6)
    store = ParamStore({"a": torch.zeros(10), "b": torch.zeros(3)}, 1)
    contributions = [{"a": torch.randn(10, generator=g), "b": torch.randn(3, generator=g) * 50} for _ in range(3)]
    for t in contributions:
        store.accumulate(0, t, norm=float(torch.cat([x.view(-1) for x in t.values()]).norm()))
    mean = store.take_mean(0, 3)
    bound = store.mean_bound(0)
    assert bound is not None and all(float(t.abs().max()) <= bound for t in mean.values())
    store.accumulate(0, contributions[0], norm=1.0)
    store.accumulate(0, contributions[1])  # no norm: no bound
    store.take_mean(0, 2)
    assert store.mean_bound(0) is None
    store.accumulate(0, contributions[0], norm=float("inf"))
    store.take_mean(0, 1)
    assert store.mean_bound(0) is None


P0 = {"a": torch.linspace(-1.0, 1.0, 12).reshape(3, 4), "c": torch.linspace(2.0, 3.0, 30)}


def _round(c, r: int, huge: bool = False):
    out = []
    for i, wid in enumerate(("w1", "w2")):
        g = torch.Generator().manual_seed(100 * r + i)
        grad = {n: torch.full(t.shape, 3e38) if huge else torch.randn(t.shape, generator=g) * 0.01
                for n, t in P0.items()}
        out += c.handle(wid, Submit(wid, 0, r, grad), float(r))
    return [m for _, m in out if isinstance(m, Result)]


def test_the_coordinator_steps_in_place_once_the_last_results_are_gone_and_keeps_held_ones_intact():
    c = joined(make_coordinator(min_workers=2), P0, "w1", "w2")  # the outlier bound: norms are checked
    plain = joined(make_coordinator(min_workers=2, outlier_factor=0.0), P0, "w1", "w2")  # no norms
    for r in range(3):
        assert _round(c, r) and _round(plain, r)
    where = {n: p.data_ptr() for n, p in c.store.params.items()}
    assert _round(c, 3) and _round(plain, 3)  # the Results of round 2 are gone: in place
    assert {n: p.data_ptr() for n, p in c.store.params.items()} == where
    held = _round(c, 4)  # a driver holds these Results (a transport still sending them)
    assert _round(plain, 4)
    kept = {n: t.clone() for n, t in held[0].params.items()}
    assert _round(c, 5) and _round(plain, 5)  # so this step writes fresh memory
    for n, t in held[0].params.items():
        assert torch.equal(t, kept[n]) and c.store.params[n].data_ptr() != t.data_ptr(), n
    for n in P0:  # in place or not, the same bits as a coordinator that never steps in place
        assert torch.equal(c.store.params[n], plain.store.params[n]), n


def test_a_step_to_an_infinity_is_never_made_in_place_and_is_undone():
    # --max-update-norm makes the coordinator compute every norm: the mean has a bound, too large.
    c = joined(make_coordinator(min_workers=2, outlier_factor=0.0, max_update_norm=1e300), P0, "w1", "w2")
    for r in range(3):
        assert _round(c, r)
    values = {n: p.clone() for n, p in c.store.params.items()}
    assert _round(c, 3, huge=True)  # finite contributions whose step overflows
    assert c.stats.steps_refused == 1
    for n, p in c.store.params.items():
        assert torch.equal(p, values[n]), n


def test_a_step_with_its_undo_kept_is_made_in_place_checked_and_left_to_the_caller_to_undo():
    params, grads = _state(7)
    p, opt = _stepped_once(params, grads[0])
    where = {n: t.data_ptr() for n, t in p.items()}
    step = step_in_blocks(opt, p, grads[1], undo_kept=True)
    assert step is not None and step.in_place and step.bad is None
    assert {n: t.data_ptr() for n, t in p.items()} == where
    b, _ = _torch_run(params, grads[:2], OuterConfig())
    assert all(torch.equal(p[n], b[n]) for n in SHAPES)
    huge = {n: g.clone() for n, g in grads[2].items()}
    huge["big"][-1] = 3e38
    step = step_in_blocks(opt, p, huge, undo_kept=True)
    assert step is not None and step.bad == "big"  # found on the way; the caller puts its copy back


def _store_with_round(weights, seed: int = 9):
    """A store holding one round: each contribution summed, the last left to the mean's pass."""
    g = torch.Generator().manual_seed(seed)
    store = ParamStore({n: torch.zeros(s) for n, s in SHAPES.items()}, 1)
    for i, tokens in enumerate(weights):
        t = {n: torch.randn(s, generator=g) * 0.01 for n, s in SHAPES.items()}
        norm = float(torch.cat([x.reshape(-1) for x in t.values()]).norm())
        store.accumulate(0, t, tokens, norm=norm, last=i == len(weights) - 1)
    return store


@pytest.mark.parametrize("weights", [[None], [None, None, None], [100, 30, 70]])
def test_the_mean_made_in_the_steps_own_pass_gives_the_same_bits(weights):
    """``ParamStore.open_mean`` + ``step_in_blocks(grad_blocks=...)``: each block of the mean is made just
    before the in-place step reads it; the params, the momentum and the mean are those of the mean
    taken first."""
    params, grads = _state(8, steps=2)
    fused_p, fused_opt = _stepped_once(params, grads[0])
    plain_p, plain_opt = _stepped_once(params, grads[0])
    magnitudes = step_in_blocks(fused_opt, fused_p, grads[1], grad_bound=_bound(grads[1]), overwrite=False).magnitudes
    step_in_blocks(plain_opt, plain_p, grads[1], grad_bound=_bound(grads[1]), overwrite=False)
    fused_store, plain_store = _store_with_round(weights), _store_with_round(weights)
    mean = fused_store.open_mean(0, len(weights))
    made = []
    original = mean.block
    mean.block = lambda name, start, end: (made.append(name), original(name, start, end))[1]
    step = step_in_blocks(fused_opt, fused_p, mean.tensors, grad_bound=fused_store.mean_bound(0),
                          magnitudes=magnitudes, overwrite=True, grad_blocks=mean)
    assert step is not None and step.in_place  # the fused path was taken ...
    assert set(made) == {n for n, s in SHAPES.items() if torch.Size(s).numel()}  # ... and made every block
    plain_mean = plain_store.take_mean(0, len(weights))
    step_in_blocks(plain_opt, plain_p, plain_mean, grad_bound=plain_store.mean_bound(0), magnitudes=magnitudes,
                   overwrite=True)
    mean.finish()  # nothing left to make: a no-op
    for n in SHAPES:
        assert torch.equal(mean.tensors[n], plain_mean[n]), n
        assert torch.equal(fused_p[n], plain_p[n]), n
        assert torch.equal(fused_opt.state[fused_p[n]]["momentum_buffer"],
                           plain_opt.state[plain_p[n]]["momentum_buffer"]), n


@pytest.mark.parametrize("how", ["fresh memory", "undo kept", "not a blocked step"])
def test_a_step_that_is_not_the_fused_one_makes_the_whole_mean_first(how):
    params, grads = _state(10, steps=2)
    p, opt = _stepped_once(params, grads[0])
    if how == "not a blocked step":
        opt = torch.optim.SGD(list(p.values()), lr=0.1)  # plain SGD: left to opt.step()
    store, plain = _store_with_round([None, None]), _store_with_round([None, None])
    mean = store.open_mean(0, 2)
    finished = []
    original = mean.finish
    mean.finish = lambda: (finished.append(True), original())[1]
    step = step_in_blocks(opt, p, mean.tensors, grad_bound=store.mean_bound(0), overwrite=how != "fresh memory",
                          undo_kept=how == "undo kept", grad_blocks=mean)
    assert finished == [True]
    assert (step is None) == (how == "not a blocked step")
    want = plain.take_mean(0, 2)
    assert all(torch.equal(mean.tensors[n], want[n]) for n in SHAPES)


def test_the_coordinator_makes_the_mean_in_the_steps_pass_unless_a_journal_writes_it_first(monkeypatch):
    from diloco.coordinator.params import OpenMean

    finished = []
    original = OpenMean.finish
    monkeypatch.setattr(OpenMean, "finish", lambda self: (finished.append(len(self._made)), original(self))[1])
    c = joined(make_coordinator(min_workers=2), P0, "w1", "w2")
    plain = joined(make_coordinator(min_workers=2, outlier_factor=0.0), P0, "w1", "w2")  # no bound: no fusion
    for r in range(3):
        assert _round(c, r) and _round(plain, r)
    where = {n: p.data_ptr() for n, p in c.store.params.items()}
    finished.clear()
    assert _round(c, 3)
    # Round 3 stepped in place (see above), with the mean made block by block in that pass: nothing
    # was left for finish to make.
    assert {n: p.data_ptr() for n, p in c.store.params.items()} == where
    assert finished in ([], [len(P0)])
    finished.clear()
    assert _round(plain, 3)
    assert finished == [0]  # no bound on the mean, no step in place: the whole mean first
    for n in P0:
        assert torch.equal(c.store.params[n], plain.store.params[n]), n

    class Recorder:
        def contribution(self, *args):
            pass

        def step(self, fid, inputs, grad):
            seen.append({n: t.clone() for n, t in grad.items()})

    seen: list = []
    c.hub.recorder = Recorder()
    assert _round(c, 4)
    assert _round(plain, 4)
    sent = []  # what _round submitted in round 4
    for i in range(2):
        g = torch.Generator().manual_seed(400 + i)
        sent.append({n: torch.randn(t.shape, generator=g) * 0.01 for n, t in P0.items()})
    mean = {n: (sent[0][n] + sent[1][n]) / 2 for n in P0}
    assert len(seen) == 1  # the journal got the whole mean before the step
    for n in P0:
        assert torch.allclose(seen[0][n], mean[n], atol=1e-6), n
        assert torch.equal(c.store.params[n], plain.store.params[n]), n
