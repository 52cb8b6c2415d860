"""Error feedback (SPEC.md section 14, "Error feedback"): what quantization leaves out is sent later, not lost.

A worker whose every round moves each parameter by a fixed step, with one
value per int8 block far larger than the rest, sends nothing of the small
values without error feedback (they round to 0 against the block's scale,
round after round); with it, their sum reaches the coordinator, to within one
quantization step. The residual is part of the worker's checkpoint.
"""

from __future__ import annotations

import pytest
import torch

from diloco.outer import OuterConfig
from diloco.wire import compression
from diloco.worker.checkpoint import load_worker_checkpoint
from training_harness import Run, in_thread

ROUNDS = 12
SMALL, BIG = 1e-3, 1.0  # int8 scale of a block holding BIG: BIG / 127 ~ 7.9e-3 > 2 x SMALL


class FixedStep(torch.optim.Optimizer):
    """An inner 'optimizer' that moves every param by ``-step`` per step: a known pseudo-gradient."""

    def __init__(self, params, step: torch.Tensor) -> None:
        super().__init__(params, {})
        self.step_by = step

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                p.sub_(self.step_by)


def run(feedback: bool | None, tmp_path=None) -> tuple[torch.Tensor, torch.Tensor, object]:
    """One worker, H = 1, int8, outer SGD lr 1 momentum 0: params move by minus the decoded submissions."""
    model = torch.nn.Linear(256, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    step = torch.full((1, 256), SMALL)
    step[0, 0] = BIG
    with Run(min_workers=1, wire_dtype="int8", outer=OuterConfig("sgd", 1.0, 0.0)) as r:
        w = r.worker("w1", model, sync_every=1, optimizer=FixedStep(model.parameters(), step),
                     error_feedback=feedback, checkpoint_dir=tmp_path)

        def train():
            w.join()
            for _ in range(ROUNDS):
                w.inner_optimizer.step()
                assert w.step_done()
            if tmp_path is not None:
                w.save_checkpoint()
            w.leave()

        in_thread(train)
        received = -r.coordinator.store.params["weight"].clone()  # sum of what the coordinator decoded
    return received, step * ROUNDS, w


def test_without_error_feedback_values_below_the_blocks_quantization_step_are_lost_for_good():
    received, sent_by_training, w = run(False)
    assert not w.error_feedback_on
    assert torch.allclose(received[0, 0], sent_by_training[0, 0], rtol=1e-5)
    assert torch.count_nonzero(received[0, 1:]) == 0  # 12 rounds x 1e-3 each, and not a trace of it


def test_with_error_feedback_their_sum_arrives_to_within_one_quantization_step():
    received, sent_by_training, w = run(None)  # on by default for int8
    assert w.error_feedback_on
    quantum = BIG / compression.QMAX
    gap = (received - sent_by_training).abs()
    assert float(gap.max()) <= quantum / 2 + 1e-6, gap
    assert torch.count_nonzero(received[0, 1:]) == 255
    # What is still owed is exactly the worker's residual.
    assert torch.allclose(received + w._keeper.residual["weight"], sent_by_training, atol=1e-6)


def test_the_residual_is_saved_in_the_workers_checkpoint(tmp_path):
    _, _, w = run(True, tmp_path)
    ckpt = load_worker_checkpoint(w.checkpoint_path)
    assert set(ckpt.residual) == {"weight"}
    assert torch.equal(ckpt.residual["weight"], w._keeper.residual["weight"])
    assert float(ckpt.residual["weight"].abs().max()) > 0


def test_error_feedback_is_off_by_default_for_lossless_enough_wire_dtypes():
    with Run(min_workers=1, wire_dtype="fp32") as r:
        w = r.worker("w1", torch.nn.Linear(2, 1), sync_every=1)
        assert w.error_feedback is None and not w.error_feedback_on
        w.wire_dtype = "bf16"
        assert not w.error_feedback_on
        w.wire_dtype = "int8"
        assert w.error_feedback_on

    with pytest.raises(ValueError, match="error_feedback='yes'"):
        with Run(min_workers=1) as r:
            r.worker("w2", torch.nn.Linear(2, 1), sync_every=1, error_feedback="yes")
