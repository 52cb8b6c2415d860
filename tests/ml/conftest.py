"""Shared fixtures for the ML-side tests: a tiny corpus, a tiny model, tiny settings.

Everything here is sized so each test runs in well under a few seconds on one
CPU thread; the real 1000-step comparison is a benchmark
(``python -m diloco.baselines``), not a test.
"""

from __future__ import annotations

import pytest
import torch

from diloco.baselines import TrainSettings
from diloco.data import Corpus, load_stdlib_text
from diloco.models import ModelConfig
from diloco.testing import one_torch_thread


@pytest.fixture(autouse=True)
def _one_thread():
    # Determinism and speed on a shared 2-core box; restore whatever was set.
    with one_torch_thread():
        yield


@pytest.fixture(scope="session")
def small_corpus() -> Corpus:
    """~200 kB of the standard library."""
    return Corpus.from_bytes(load_stdlib_text(200_000), source="stdlib-200k")


@pytest.fixture(scope="session")
def tiny_model_config() -> ModelConfig:
    return ModelConfig(seq_len=32, d_model=32, n_layers=1, n_heads=2)


@pytest.fixture(scope="session")
def tiny_settings(tiny_model_config) -> TrainSettings:
    # The first torch.optim constructor in a process imports torch._dynamo (~2-4 s);
    # pay it once here rather than inside whichever test happens to run first.
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    return TrainSettings(
        model=tiny_model_config, batch_size=8, lr=3e-3, warmup_steps=5, eval_every=10,
        eval_batches=2, eval_batch_size=16,
    )
