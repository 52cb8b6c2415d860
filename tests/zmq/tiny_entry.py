"""A tiny training setup for the process tests: ``--entry tests/zmq/tiny_entry.py:make_setup``.

An 8 -> 16 -> 1 MLP on a synthetic regression problem. The inner optimizer
is ``diloco.testing.PlainSGD``, plain SGD with the ``torch.optim`` interface the worker
uses (``step``, ``zero_grad``, ``state_dict``, ``load_state_dict``) instead
of ``torch.optim.SGD``: the first ``torch.optim`` optimizer a process builds
imports ``torch._dynamo``, seconds of start-up per worker process on a
2-core machine, which these tests would pay a dozen times. Each step sleeps
``TINY_STEP_S`` (env, default 0.01 s) so rounds come at a human pace.
"""

from __future__ import annotations

import os
import time

import torch

from diloco.testing import PlainSGD
from diloco.worker import TrainingSetup

DIM = 8
STEP_S = float(os.environ.get("TINY_STEP_S", "0.01"))


def _batches(seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.linspace(-1, 1, DIM).reshape(DIM, 1)
    while True:
        x = torch.randn(16, DIM, generator=g)
        yield x, x @ w


def _loss(model, batch):
    if STEP_S:
        time.sleep(STEP_S)
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def make_setup(worker_id: str = "w") -> TrainingSetup:
    torch.manual_seed(0)  # every worker starts from the same weights
    model = torch.nn.Sequential(torch.nn.Linear(DIM, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    return TrainingSetup(model=model, optimizer=PlainSGD(model.parameters()),
                         batches=_batches(sum(map(ord, worker_id))), loss_fn=_loss)
