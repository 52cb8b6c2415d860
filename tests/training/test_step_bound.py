"""M11: a member checks its own proposal before it votes on it. The outer step must be finite and
within the bound ``diloco.step_bound`` derives from the checked mean pseudo-gradient's bound; an
honest optimizer, whatever its pseudo-gradients, never exceeds it, and a corrupted optimizer state
does, and is refused with the replica left exactly as it was."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco.collective.reduce import tensors_norm
from diloco.collective.digest import digest, digest_and_step_norm
from diloco.collective.replica import Replica, StepRefused
from diloco.outer import OuterConfig

FRAGMENTS = (("a", "b"),)

CONFIGS = {
    "nesterov": OuterConfig(),
    "nesterov-0.95": OuterConfig(momentum=0.95),
    "sgd-momentum": OuterConfig(name="sgd", lr=0.5, momentum=0.9),
    "sgd-plain": OuterConfig(name="sgd", lr=1.0, momentum=0.0),
    "adam": OuterConfig(name="adam", lr=0.01, momentum=0.9),
    "delayed-3": OuterConfig(name="delayed_nesterov", delay=3),
    "scheduled": OuterConfig(momentum=0.9, momentum_warmup=3, momentum_decay_start=4, momentum_decay_rounds=3),
}


def fresh(config: OuterConfig, wire: str = "fp32", seed: int = 0) -> Replica:
    g = torch.Generator().manual_seed(seed)
    params = {"a": torch.randn(40, 30, generator=g), "b": torch.randn(17, generator=g)}
    return Replica(params, FRAGMENTS, [0], config, wire, 2)


def mean_of_norm(norm: float, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    raw = {"a": torch.randn(40, 30, generator=g), "b": torch.randn(17, generator=g)}
    scale = norm / tensors_norm(raw)
    return {n: t * scale for n, t in raw.items()}


def run_rounds(r: Replica, norms: list[float], start: int = 0) -> None:
    """Commit one round per norm, each mean exactly that norm and declared as that bound."""
    for i, norm in enumerate(norms):
        rid = r.round_ids[0]
        vote = r.propose(0, rid, mean_of_norm(norm, start + i), mean_bound=norm * (1 + 1e-6))
        assert r.commit(0, rid, vote)


@settings(max_examples=80, deadline=None)
@given(name=st.sampled_from(sorted(CONFIGS)), wire=st.sampled_from(["fp32", "int8", "bf16"]),
       norms=st.lists(st.floats(1e-4, 1e3), min_size=1, max_size=12), seed=st.integers(0, 1000))
def test_an_honest_optimizer_never_exceeds_its_bound(name, wire, norms, seed):
    r = fresh(CONFIGS[name], wire, seed)
    run_rounds(r, norms, seed)  # raises StepRefused if a bound were too tight
    assert r.round_ids == [len(norms)]


@pytest.mark.parametrize("name", ["nesterov", "sgd-momentum", "delayed-3"])
def test_a_corrupted_momentum_buffer_is_refused_and_the_replica_is_left_as_it_was(name):
    r = fresh(CONFIGS[name])
    run_rounds(r, [1.0] * 6)
    opt = r.optimizers[0]
    for p in opt.param_groups[0]["params"]:
        opt.state[p]["momentum_buffer"].mul_(1e3)  # a faulty device's momentum, not its history's
    before_params, before_state = digest(r.params), [opt.state[p]["momentum_buffer"].clone()
                                                    for p in opt.param_groups[0]["params"]]
    with pytest.raises(StepRefused, match="beyond its bound"):
        for i in range(3):  # delayed nesterov steps its momentum every third round
            rid = r.round_ids[0]
            vote = r.propose(0, rid, mean_of_norm(1.0, 100 + i), mean_bound=1.0)
            assert r.commit(0, rid, vote)
    assert not r.has_proposal(0)
    if name != "delayed-3":  # its refused round is the third; two honest ones committed before it
        assert digest(r.params) == before_params and r.round_ids == [6]
        assert all(torch.equal(opt.state[p]["momentum_buffer"], b)
                   for p, b in zip(opt.param_groups[0]["params"], before_state))


def test_adam_with_a_corrupted_second_moment_is_refused():
    r = fresh(CONFIGS["adam"])
    run_rounds(r, [1.0] * 4)
    opt = r.optimizers[0]
    for p in opt.param_groups[0]["params"]:
        opt.state[p]["exp_avg_sq"].mul_(1e-8)  # steps of about lr / 1e-4 per element
    with pytest.raises(StepRefused, match="beyond its bound"):
        r.propose(0, 4, mean_of_norm(1.0, 9), mean_bound=1.0)
    assert r.round_ids == [4] and not r.has_proposal(0)


def test_a_mean_larger_than_its_declared_bound_makes_a_step_beyond_the_bound():
    r = fresh(CONFIGS["nesterov"])
    run_rounds(r, [1.0] * 3)
    with pytest.raises(StepRefused, match="beyond its bound"):
        r.propose(0, 3, mean_of_norm(10.0, 5), mean_bound=1.0)
    vote = r.propose(0, 3, mean_of_norm(10.0, 5), mean_bound=10.0)  # declared honestly: fine
    assert r.commit(0, 3, vote)


def test_a_replica_built_from_a_state_measures_its_momentum_once_and_goes_on():
    r = fresh(CONFIGS["nesterov"])
    run_rounds(r, [2.0] * 5)
    _, params, states = r.committed_state()
    again = Replica(params, FRAGMENTS, [5], CONFIGS["nesterov"], "fp32", 2, optimizer_states=states)
    run_rounds(again, [2.0] * 3, start=50)
    assert again.round_ids == [8]


def test_a_non_finite_step_is_refused_as_non_finite():
    r = fresh(CONFIGS["nesterov"])
    mean = mean_of_norm(1.0, 1)
    mean["b"][3] = math.nan
    with pytest.raises(StepRefused, match="made 'b' non-finite"):
        r.propose(0, 0, mean)
    assert r.round_ids == [0] and not r.has_proposal(0)


def test_the_digest_and_the_step_norm_in_one_pass_are_the_digest_and_the_exact_step_norm():
    # Several chunks (a chunk is 65,536 elements through this scratch), an odd size, a tail shorter
    # than a digest block, an empty tensor: each chunk's block sums and difference are the whole's.
    a = {"x": torch.randn(3 * 65_536 + 7), "y": torch.randn(3), "z": torch.randn(0)}
    b = {n: t + torch.randn(t.shape) for n, t in a.items()}
    expected = float(torch.cat([(a[n] - b[n]).double().reshape(-1) for n in a]).norm())
    vote, norm = digest_and_step_norm(a, b, torch.empty(65_536 + 5))
    assert vote == digest(a)
    assert norm == pytest.approx(expected, rel=1e-6)
    a["x"][150_000] += 1.0  # one element in the third chunk: another digest, another norm
    vote2, norm2 = digest_and_step_norm(a, b, torch.empty(65_536))
    assert vote2 != vote and vote2 == digest(a) and norm2 != norm
    a["x"][9_000] = math.inf
    assert not math.isfinite(digest_and_step_norm(a, b, torch.empty(65_536))[1])
    with pytest.raises(ValueError, match="smaller than one chunk"):
        digest_and_step_norm(a, b, torch.empty(4096))


def test_the_fp32_mean_is_divided_and_measured_in_one_pass_to_the_norm_the_checks_would_measure():
    """The fp32 all-reduce's mean comes with its norm (measured as it is divided): what
    ``tensors_norm`` of the mean gives, so the check on the mean (M9) judges the same number."""
    from diloco.collective import reduce

    torch.manual_seed(5)
    flat = torch.randn(3 * reduce._MEASURE_CHUNK + 4099)  # whole chunks, and a last one of odd size
    expected_mean = flat / 3
    norm = reduce._divide_and_measure(flat, 3)
    assert torch.equal(flat, expected_mean)
    assert norm == pytest.approx(tensors_norm({"m": expected_mean}), rel=1e-12)
    flat[7] = math.inf
    assert not math.isfinite(reduce._divide_and_measure(flat, 3))


def test_a_one_rank_gloo_reduce_returns_the_mean_and_its_norm_and_a_gather_returns_the_contributions():
    from diloco.collective.groups import build_group, connect_store
    from diloco.collective.reduce import mean_pseudo_gradient
    from diloco.collective.store import StoreHost
    from diloco.wire import compression

    host = StoreHost()
    group = build_group(connect_store("127.0.0.1", host.port, 10), "g/0", 0, 1, "127.0.0.1", 10)
    grad = {"w": torch.randn(300, 7), "b": torch.randn(5)}
    shapes = {n: t.shape for n, t in grad.items()}
    mean, norms, mean_norm = mean_pseudo_gradient(group, compression.encode(grad, "fp32"), "fp32", shapes, 10)
    assert norms == () and mean_norm == pytest.approx(tensors_norm(grad), rel=1e-6)
    assert all(torch.equal(mean[n], grad[n]) for n in grad)
    mean, norms, mean_norm = mean_pseudo_gradient(group, compression.encode(grad, "fp32"), "fp32", shapes, 10,
                                                  gather=True)
    assert mean_norm is None and norms == (pytest.approx(tensors_norm(grad), rel=1e-6),)
