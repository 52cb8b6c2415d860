"""The outer step, checked against hand computations (Coordinator driven sans-IO).

DiLoCo (Douillard et al. 2023, Algorithm 1): the coordinator averages the
round's pseudo-gradients and steps an outer optimizer on them; the paper's
default is SGD with Nesterov momentum, lr 0.7, momentum 0.9 (0.8 here), with torch's
semantics::

    buf = momentum * buf + g        (buf = g on the first step)
    p  -= lr * (g + momentum * buf)
"""

from __future__ import annotations

import torch

from diloco.core import Mode
from diloco.coordinator import Coordinator, OuterConfig
from diloco.outer import DelayedNesterov
from diloco.testing import join_message, make_coordinator, only
from diloco.wire.messages import Accepted, Result, Submit, Welcome

LR, MOMENTUM = 0.7, 0.9


def make(mode: Mode = Mode.SYNC, *, min_workers: int = 2, num_fragments: int = 1,
         outer: OuterConfig | None = None) -> Coordinator:
    return make_coordinator(min_workers=min_workers, mode=mode, num_fragments=num_fragments,
                            outer=outer or OuterConfig("nesterov", LR, MOMENTUM))


def join(c: Coordinator, wid: str, params: dict[str, torch.Tensor]) -> Welcome:
    return only(c.handle(wid, join_message(wid, params), 0.0), Welcome)


def submit(c: Coordinator, wid: str, fid: int, rid: int, tensors: dict[str, torch.Tensor]) -> list:
    out = c.handle(wid, Submit(wid, fid, rid, tensors), 0.0)
    assert any(isinstance(m, Accepted) for _, m in out), out
    return out


def results(out: list) -> dict[str, Result]:
    return {peer: m for peer, m in out if isinstance(m, Result)}


P0 = {"w": torch.tensor([1.0, -2.0, 0.5]), "b": torch.tensor([0.25])}


def test_nesterov_on_the_plain_average_over_two_rounds():
    c = make()
    join(c, "a", P0)
    join(c, "b", P0)
    # Pseudo-gradients (global - local) of two rounds, chosen by hand.
    g = {
        0: ({"w": torch.tensor([0.2, 0.0, -0.4]), "b": torch.tensor([1.0])},
            {"w": torch.tensor([0.4, 0.2, 0.0]), "b": torch.tensor([-0.5])}),
        1: ({"w": torch.tensor([-0.1, 0.3, 0.1]), "b": torch.tensor([0.0])},
            {"w": torch.tensor([0.1, 0.1, 0.3]), "b": torch.tensor([0.25])}),
    }
    # By hand, in float64 on plain numbers.
    p = {"w": [1.0, -2.0, 0.5], "b": [0.25]}
    buf: dict[str, list[float]] | None = None
    expected = []
    for r in (0, 1):
        mean = {n: [(x + y) / 2 for x, y in zip(g[r][0][n].tolist(), g[r][1][n].tolist())] for n in p}
        if buf is None:
            buf = {n: list(mean[n]) for n in p}
        else:
            buf = {n: [MOMENTUM * b + m for b, m in zip(buf[n], mean[n])] for n in p}
        p = {n: [x - LR * (m + MOMENTUM * b) for x, m, b in zip(p[n], mean[n], buf[n])] for n in p}
        expected.append({n: list(v) for n, v in p.items()})
    # Round 0 by hand, written out, as a check of the check: mean w[0] = 0.3, buf = 0.3,
    # w[0] = 1 - 0.7 * (0.3 + 0.9 * 0.3) = 0.601.
    assert abs(expected[0]["w"][0] - 0.601) < 1e-7  # inputs are float32-rounded

    for r in (0, 1):
        submit(c, "a", 0, r, g[r][0])
        out = submit(c, "b", 0, r, g[r][1])
        res = results(out)
        assert set(res) == {"a", "b"}
        for m in res.values():
            assert (m.round_id, m.outcome, m.next_round_id) == (r, "applied", r + 1)
            for n in p:
                torch.testing.assert_close(m.params[n], torch.tensor(expected[r][n], dtype=torch.float32),
                                           rtol=0, atol=1e-6)
        # Every contributor is sent the same values: bit-identical to the coordinator's.
        for n in p:
            assert torch.equal(res["a"].params[n], c.store.params[n])
            assert torch.equal(res["b"].params[n], c.store.params[n])


def test_outer_sgd_lr1_without_momentum_is_the_plain_average_of_local_params():
    """FedAvg: global - lr * mean(global - local) with lr 1 is mean(local)."""
    c = make(outer=OuterConfig("sgd", 1.0, 0.0))
    join(c, "a", P0)
    join(c, "b", P0)
    local_a = {"w": torch.tensor([0.5, -1.0, 0.5]), "b": torch.tensor([0.0])}
    local_b = {"w": torch.tensor([1.5, -3.0, 1.5]), "b": torch.tensor([1.0])}
    submit(c, "a", 0, 0, {n: P0[n] - local_a[n] for n in P0})
    submit(c, "b", 0, 0, {n: P0[n] - local_b[n] for n in P0})
    torch.testing.assert_close(c.store.params["w"], torch.tensor([1.0, -2.0, 1.0]), rtol=0, atol=1e-7)
    torch.testing.assert_close(c.store.params["b"], torch.tensor([0.5]), rtol=0, atol=1e-7)


def test_delayed_nesterov_by_hand():
    """delay=2, lr 0.5, momentum 0.9, one scalar: each gradient term at once, momentum every 2nd."""
    p = torch.zeros(1)
    opt = DelayedNesterov([p], lr=0.5, momentum=0.9, delay=2)
    steps = [1.0, 3.0, 2.0, -2.0]
    seen = []
    for gval in steps:
        p.grad = torch.tensor([gval])
        opt.step()
        seen.append(p.item())
    # 1st: p -= 0.5*1/2 = 0.25                              -> -0.25
    # 2nd: p -= 0.5*3/2 = 0.75 -> -1.0; m = 0.9*0 + 4/2 = 2; p -= 0.5*0.9*2 = 0.9   -> -1.9
    # 3rd: p -= 0.5*2/2 = 0.5                               -> -2.4
    # 4th: p -= 0.5*(-2)/2 = -0.5 -> -1.9; m = 0.9*2 + 0/2 = 1.8; p -= 0.5*0.9*1.8 = 0.81 -> -2.71
    assert all(abs(a - b) < 1e-6 for a, b in zip(seen, [-0.25, -1.9, -2.4, -2.71])), seen
    # The same rounds as sync Nesterov on the means (2, then 0): -1.9, then -2.71.
    q = torch.zeros(1)
    sgd = torch.optim.SGD([q], lr=0.5, momentum=0.9, nesterov=True)
    for mean in (2.0, 0.0):
        q.grad = torch.tensor([mean])
        sgd.step()
    assert abs(q.item() - seen[-1]) < 1e-6


def test_delayed_nesterov_equals_sync_nesterov_on_the_mean():
    torch.manual_seed(0)
    delay = 3
    p_delayed = torch.randn(5)
    p_sync = p_delayed.clone()
    delayed = DelayedNesterov([p_delayed], lr=LR, momentum=MOMENTUM, delay=delay)
    sync = torch.optim.SGD([p_sync], lr=LR, momentum=MOMENTUM, nesterov=True)
    for _round in range(6):
        grads = [torch.randn(5) for _ in range(delay)]
        for g in grads:
            p_delayed.grad = g
            delayed.step()
        p_sync.grad = torch.stack(grads).mean(0)
        sync.step()
        torch.testing.assert_close(p_delayed, p_sync, rtol=1e-5, atol=1e-6)


def test_async_coordinator_with_delayed_nesterov_tracks_the_sync_coordinator():
    """Async mode (default outer: delayed Nesterov, delay = min_workers = 2): when both
    workers contribute once per 'round', the global params after each pair equal the
    sync coordinator's after each round on the same pseudo-gradients."""
    sync = make(Mode.SYNC)
    asyn = make(Mode.ASYNC)
    assert asyn.config.outer.name == "delayed_nesterov"
    for c in (sync, asyn):
        join(c, "a", P0)
        join(c, "b", P0)
    torch.manual_seed(1)
    version = 0
    for r in range(4):
        ga = {n: torch.randn_like(t) * 0.1 for n, t in P0.items()}
        gb = {n: torch.randn_like(t) * 0.1 for n, t in P0.items()}
        submit(sync, "a", 0, r, ga)
        submit(sync, "b", 0, r, gb)
        # Both started from the same base version (the second is one version stale).
        submit(asyn, "a", 0, version, ga)
        submit(asyn, "b", 0, version, gb)
        version += 2
        for n in P0:
            torch.testing.assert_close(asyn.store.params[n], sync.store.params[n], rtol=1e-5, atol=1e-6)
    assert asyn.fsm.open_round_ids() == (8,)


MLP_PARAMS = {
    "fc1.weight": torch.arange(12, dtype=torch.float32).reshape(4, 3) / 10,
    "fc1.bias": torch.ones(4),
    "fc2.weight": torch.full((1, 4), 0.5),
    "fc2.bias": torch.zeros(1),
}


def test_a_fragment_round_changes_only_its_fragment():
    c = make(min_workers=1, num_fragments=2)
    welcome = join(c, "a", MLP_PARAMS)
    frag0, frag1 = welcome.fragments
    assert frag0 and frag1 and set(frag0) | set(frag1) == set(MLP_PARAMS) and not set(frag0) & set(frag1)
    for fid, (mine, other) in enumerate(((frag0, frag1), (frag1, frag0))):
        before = {n: t.clone() for n, t in c.store.params.items()}
        out = submit(c, "a", fid, 0, {n: torch.full_like(MLP_PARAMS[n], 0.1) for n in mine})
        (res,) = results(out).values()
        assert (res.fragment_id, res.outcome) == (fid, "applied")
        assert list(res.params) == list(mine)
        for n in other:
            assert torch.equal(c.store.params[n], before[n]), f"{n} changed by fragment {fid}'s round"
        for n in mine:
            assert not torch.equal(c.store.params[n], before[n])
    assert c.fsm.open_round_ids() == (1, 1)
