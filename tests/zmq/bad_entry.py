"""A worker that turns bad after a few honest rounds, for the process tests of SPEC.md section 7c.

``--entry tests/zmq/bad_entry.py:make_huge`` trains ``tiny_entry``'s MLP honestly for
``BAD_AFTER_STEPS`` inner steps (env, default 12), then its inner optimizer sets every parameter
to 1e30 at each step (finite, huge: a loss spike, a faulty device, a bug in a model);
``make_nan`` sets them to NaN instead.
"""

from __future__ import annotations

import os
import sys

import torch

from diloco.testing import PlainSGD
from diloco.worker import TrainingSetup

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny_entry  # noqa: E402  (beside this file)

AFTER = int(os.environ.get("BAD_AFTER_STEPS", "12"))


class _Saboteur(PlainSGD):
    def __init__(self, params, value: float) -> None:
        super().__init__(params)
        self.value = value

    def step(self) -> None:
        super().step()
        if self.steps > AFTER:
            with torch.no_grad():
                for p in self.params:
                    p.fill_(self.value)


def _setup(worker_id: str, value: float) -> TrainingSetup:
    honest = tiny_entry.make_setup(worker_id)
    return TrainingSetup(model=honest.model, optimizer=_Saboteur(honest.model.parameters(), value),
                         batches=honest.batches, loss_fn=honest.loss_fn)


def make_huge(worker_id: str = "w") -> TrainingSetup:
    return _setup(worker_id, 1e30)


def make_nan(worker_id: str = "w") -> TrainingSetup:
    return _setup(worker_id, float("nan"))
