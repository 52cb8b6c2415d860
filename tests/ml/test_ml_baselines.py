"""Reference trainers: deterministic, they learn, the accounting is right, and DiLoCo reduces to plain training."""

from __future__ import annotations

import math

import pytest
import torch

from diloco.baselines import (
    TrainSettings,
    comm_bytes_per_sync,
    simulate_diloco_reference,
    train_single_worker,
    train_sync_data_parallel,
)


def _same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_single_worker_is_deterministic(small_corpus, tiny_settings):
    a = train_single_worker(12, settings=tiny_settings, corpus=small_corpus, seed=0)
    b = train_single_worker(12, settings=tiny_settings, corpus=small_corpus, seed=0)
    c = train_single_worker(12, settings=tiny_settings, corpus=small_corpus, seed=1)
    assert a.train_losses == b.train_losses and a.eval_losses == b.eval_losses
    assert _same_state(a.final_state, b.final_state)
    assert a.train_losses != c.train_losses
    assert a.syncs == 0 and a.bytes_moved == 0 and a.steps == list(range(1, 13))
    assert a.eval_steps == [0, 10, 12] and a.final_eval_loss == a.eval_losses[-1]


def test_sync_dp_is_deterministic_and_counts_bytes(small_corpus, tiny_settings):
    a = train_sync_data_parallel(3, 6, settings=tiny_settings, corpus=small_corpus, seed=0)
    b = train_sync_data_parallel(3, 6, settings=tiny_settings, corpus=small_corpus, seed=0)
    assert a.train_losses == b.train_losses and _same_state(a.final_state, b.final_state)
    pbytes = 4 * a.num_params
    assert a.syncs == 6 and a.bytes_moved == 6 * 2 * 3 * pbytes == 6 * comm_bytes_per_sync(3, pbytes)


def test_diloco_is_deterministic_and_counts_rounds(small_corpus, tiny_settings):
    kw = dict(settings=tiny_settings, corpus=small_corpus, seed=0)
    a = simulate_diloco_reference(2, 4, 10, **kw)
    b = simulate_diloco_reference(2, 4, 10, **kw)
    assert a.train_losses == b.train_losses and a.eval_losses == b.eval_losses
    assert _same_state(a.final_state, b.final_state)
    # Rounds end at steps 4, 8 and (short last round) 10.
    assert a.syncs == 3 and a.bytes_moved == 3 * comm_bytes_per_sync(2, 4 * a.num_params)
    assert a.eval_steps == [0, 10]


def test_training_reduces_loss(small_corpus, tiny_settings):
    r = train_single_worker(40, settings=tiny_settings.with_(lr=1e-2), corpus=small_corpus, seed=0)
    assert r.eval_losses[0] > 5.0
    assert r.final_eval_loss < r.eval_losses[0] - 1.5, r.eval_losses
    assert all(math.isfinite(x) for x in r.train_losses)


def test_sync_dp_with_one_worker_is_single_worker(small_corpus, tiny_settings):
    kw = dict(settings=tiny_settings, corpus=small_corpus, seed=3)
    single = train_single_worker(8, **kw)
    dp = train_sync_data_parallel(1, 8, **kw)
    assert dp.train_losses == single.train_losses
    assert _same_state(dp.final_state, single.final_state)


def test_diloco_k1_h1_plain_averaging_is_single_worker(small_corpus, tiny_settings):
    # k=1, H=1, outer SGD lr 1 without momentum: global <- global - 1 * (global - local) = local,
    # so DiLoCo must follow plain AdamW training step for step (up to float rounding of g - (g - l)).
    kw = dict(settings=tiny_settings, corpus=small_corpus, seed=3)
    single = train_single_worker(15, **kw)
    dl = simulate_diloco_reference(1, 1, 15, outer_lr=1.0, outer_momentum=0.0, **kw)
    assert dl.syncs == 15
    assert dl.train_losses == pytest.approx(single.train_losses, rel=1e-4, abs=1e-5)
    for name, p in single.final_state.items():
        assert torch.allclose(dl.final_state[name], p, atol=1e-5, rtol=1e-4), name
    # ...and the outer step is not a no-op: Nesterov momentum changes the trajectory.
    nes = simulate_diloco_reference(1, 1, 15, outer_lr=1.0, outer_momentum=0.9, **kw)
    assert nes.train_losses[-1] != pytest.approx(single.train_losses[-1], rel=1e-3)


def test_diloco_large_h_without_outer_momentum_is_single_worker_per_round(small_corpus, tiny_settings):
    # k=1, any H: with lr 1 / momentum 0 the global model after each round is the replica's.
    kw = dict(settings=tiny_settings, corpus=small_corpus, seed=4)
    single = train_single_worker(12, **kw)
    dl = simulate_diloco_reference(1, 6, 12, outer_lr=1.0, outer_momentum=0.0, **kw)
    assert dl.syncs == 2
    for name, p in single.final_state.items():
        assert torch.allclose(dl.final_state[name], p, atol=1e-5, rtol=1e-4), name


def test_progress_callback_sees_every_step(small_corpus, tiny_settings):
    seen = []
    simulate_diloco_reference(2, 3, 7, settings=tiny_settings, corpus=small_corpus, progress=lambda *a: seen.append(a))
    assert [s for s, _, _ in seen] == list(range(1, 8))
    assert all(total == 7 and math.isfinite(loss) for _, total, loss in seen)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: train_single_worker(0), "steps=0"),
        (lambda: train_sync_data_parallel(0, 5), "k=0"),
        (lambda: simulate_diloco_reference(2, 0, 5), "H=0"),
        (lambda: simulate_diloco_reference(2, 2, 5, outer_momentum=1.0), "outer_momentum=1.0"),
        (lambda: simulate_diloco_reference(2, 2, 5, outer_lr=float("nan")), "outer_lr=nan"),
        (lambda: TrainSettings(lr=0.0), "TrainSettings.lr=0.0"),
        (lambda: TrainSettings(schedule="linear"), "schedule='linear'"),
    ],
)
def test_bad_arguments_are_named(call, match):
    with pytest.raises(ValueError, match=match):
        call()
