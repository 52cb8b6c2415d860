"""Regressions found while running deployments for real (not ZeroMQ-specific).

0-dim tensors (an optimizer's step count: AdamW's ``step``, DelayedNesterov's
``step``) could not be written by the first checkpoint format: ``view(torch.uint8)``
refuses a 0-dim tensor whose element is wider than a byte. A worker's
save-and-stop (AdamW state) and an async coordinator's checkpoint (Delayed
Nesterov state) both failed with a RuntimeError.
"""

from __future__ import annotations

import torch

from diloco.coordinator.checkpoint import load_coordinator, save_coordinator
from diloco.core import Mode
from diloco.ckptio import read_safetensors, write_safetensors
from diloco.testing import join_message, make_coordinator
from diloco.wire.messages import Submit


def test_a_checkpoint_file_round_trips_zero_dim_tensors(tmp_path):
    tensors = {"f": torch.tensor(3.5), "i": torch.tensor(7, dtype=torch.int64), "b": torch.tensor(True),
               "h": torch.tensor(1.5, dtype=torch.bfloat16), "v": torch.arange(4.0)}
    write_safetensors(tmp_path / "x.safetensors", dict(tensors), {"k": 1}, "diloco.test")
    meta, back = read_safetensors(tmp_path / "x.safetensors", "diloco.test")
    assert meta["k"] == 1
    for name, t in tensors.items():
        assert back[name].shape == t.shape and back[name].dtype == t.dtype and torch.equal(back[name], t)


def test_async_coordinator_checkpoint_with_delayed_nesterov_state(tmp_path):
    c = make_coordinator(min_workers=1, mode=Mode.ASYNC)
    params = {"w": torch.zeros(3)}
    c.handle("p", join_message("w1", params), 1.0)
    c.handle("p", Submit("w1", 0, 0, {"w": torch.ones(3)}), 2.0)
    assert c.fsm.rounds_applied == 1
    save_coordinator(c, tmp_path)
    back = load_coordinator(tmp_path, 10.0)
    assert torch.equal(back.store.params["w"], c.store.params["w"])
    assert back.fsm.rounds_applied == 1


def test_submission_finiteness_check_is_exact():
    """The fast finiteness check (a finite sum proves it) agrees with ``isfinite(t).all()``."""
    import pytest

    from diloco.coordinator.params import ParamMismatch, ParamStore, all_finite

    big = torch.finfo(torch.float32).max
    cases = [torch.zeros(5), torch.tensor([1.0, float("nan")]), torch.tensor([float("inf"), 1.0]),
             torch.tensor([float("inf"), float("-inf")]), torch.tensor([-float("inf")]),
             torch.tensor([big, big]),  # finite values whose sum overflows: still finite
             torch.empty(0), torch.tensor(3.0), torch.tensor([1.0, float("nan")], dtype=torch.bfloat16)]
    for t in cases:
        assert all_finite(t) == bool(torch.isfinite(t).all()), t
    store = ParamStore({"w": torch.zeros(2)}, 1)
    store.check_submission(0, {"w": torch.tensor([big, big])})
    with pytest.raises(ParamMismatch, match="non-finite"):
        store.check_submission(0, {"w": torch.tensor([0.0, float("nan")])})
