"""Char transformer: shapes, size, causality, deterministic init, deterministic evaluation."""

from __future__ import annotations

import pytest
import torch

from diloco.models import ModelConfig, build_model, count_params, evaluate_loss, param_bytes


def test_default_config_size_matches_calibration_model():
    m = build_model(ModelConfig(), seed=0)
    n = count_params(m)
    # The reference calibration used a 116k-param model; ours is ~125k.
    assert 100_000 <= n <= 150_000, n
    assert param_bytes(m) == 4 * n
    assert m.head.weight is m.tok_emb.weight  # tied


def test_forward_shapes_and_loss(tiny_model_config):
    m = build_model(tiny_model_config, seed=0)
    x = torch.randint(0, 256, (3, 20))
    assert m(x).shape == (3, 20, 256)
    loss = m.loss(x, torch.randint(0, 256, (3, 20)))
    assert loss.ndim == 0 and abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.2  # ~uniform at init
    with pytest.raises(ValueError, match="exceeds ModelConfig.seq_len=32"):
        m(torch.zeros(1, 33, dtype=torch.long))


def test_attention_is_causal(tiny_model_config):
    m = build_model(tiny_model_config, seed=1).eval()
    x = torch.randint(0, 256, (1, 16))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % 256  # change only the future
    with torch.no_grad():
        assert torch.allclose(m(x)[0, :10], m(y)[0, :10], atol=1e-6)
        assert not torch.allclose(m(x)[0, 10:], m(y)[0, 10:])


def test_build_model_is_deterministic_and_leaves_global_rng_alone():
    state = torch.get_rng_state()
    a, b, c = build_model(seed=5), build_model(seed=5), build_model(seed=6)
    assert torch.equal(state, torch.get_rng_state())
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("n_heads", 3, "divisor of d_model=64"),
        ("d_model", 0, r"d_model=0 is invalid"),
        ("seq_len", 1.5, r"seq_len=1.5 is invalid"),
        ("n_layers", True, r"n_layers=True is invalid"),
        ("tie_embeddings", 1, "expected a bool"),
    ],
)
def test_config_validation_names_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**{field: value})


def test_evaluate_loss_is_deterministic_and_restores_mode(small_corpus, tiny_model_config):
    m = build_model(tiny_model_config, seed=0)
    m.train()
    a = evaluate_loss(m, small_corpus.eval, batch_size=8, num_batches=3)
    b = evaluate_loss(m, small_corpus.eval, batch_size=8, num_batches=3)
    assert a == b and 5.0 < a < 6.0
    assert m.training
    assert all(p.grad is None for p in m.parameters())


def test_evaluate_loss_eval_set_too_small(tiny_model_config):
    m = build_model(tiny_model_config, seed=0)
    with pytest.raises(ValueError, match="seq_len \\+ 1 = 33"):
        evaluate_loss(m, torch.zeros(10, dtype=torch.uint8))
