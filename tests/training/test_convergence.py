"""DiLoCo with k=2 beats a single worker that takes the same number of inner steps.

Problem: noisy linear regression whose input features have scales from 1 down
to 0.1 (ill-conditioned, so plain SGD is slow along the small directions).
Each DiLoCo worker trains on its own shard; the single worker trains on the
first worker's shard with the same inner optimizer, lr and step count.
DiLoCo gets there with outer Nesterov momentum and twice the data.

Deterministic: seeded data and init, two workers (the coordinator's sum of
two pseudo-gradients does not depend on arrival order), min_workers=2 (both
contribute to every round). Across six seed sets the DiLoCo/single loss ratio
was 0.12 to 0.55; the test uses one seed set, where it is 0.34, and asserts
< 0.6.
"""

from __future__ import annotations

import torch

from training_harness import DIM, W_TRUE, Run, linear, mse_loss

SCALES = torch.logspace(0, -1, DIM)
H, STEPS, LR = 5, 100, 0.1


def batch(seed: int, step: int, batch_size: int = 16, noise: float = 0.3):
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    x = torch.randn(batch_size, DIM, generator=g) * SCALES
    return x, x @ W_TRUE + noise * torch.randn(batch_size, 1, generator=g)


def shard(seed: int):
    for step in range(STEPS):
        yield batch(seed, step)


def held_out_loss(model: torch.nn.Module) -> float:
    with torch.no_grad():
        return float(mse_loss(model, batch(999, 0, batch_size=4096, noise=0.0)))


def test_diloco_k2_ends_clearly_below_a_single_worker():
    single = linear(0)
    opt = torch.optim.SGD(single.parameters(), lr=LR)
    for b in shard(1):
        opt.zero_grad()
        mse_loss(single, b).backward()
        opt.step()

    with Run(min_workers=2) as run:
        for i in range(2):
            run.start(run.worker(f"w{i}", linear(0), sync_every=H, lr=LR), shard(1 + i), max_steps=STEPS)
        reports = run.join_workers()
    assert all(r.inner_steps == STEPS and r.rounds_synced == STEPS // H for r in reports.values())
    diloco = linear(0)
    with torch.no_grad():
        for n, p in diloco.named_parameters():
            p.copy_(run.coordinator.store.params[n])

    initial, single_loss, diloco_loss = held_out_loss(linear(0)), held_out_loss(single), held_out_loss(diloco)
    assert single_loss < 0.05 * initial  # both learn ...
    assert diloco_loss < 0.6 * single_loss, (initial, single_loss, diloco_loss)  # ... DiLoCo clearly more
