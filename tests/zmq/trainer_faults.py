"""Trainers that fail or are stopped, for tests/zmq/test_trainer_stops.py (run as a script).

``python trainer_faults.py MODE ADDRESS WORKER_ID``:

* ``hf-raise``: the GPT-2 example's Hugging Face Trainer whose data raises at its 8th batch (after one
  round with H = 5); the Trainer calls no hook for it, so the worker leaves at exit.
* ``lightning-raise``: a Lightning Trainer whose ``training_step`` raises at its 8th batch (``on_exception``).
* ``hf-train``: the example's Trainer for up to 100 optimizer steps, H = 5 (the run may stop it sooner).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

H = 5
FAIL_AT = 7  # 0-based batch index: a round has applied before it


class FailingData(torch.utils.data.Dataset):
    """``inner``, except that the ``fail_at``-th item read raises (whatever the sampler's order)."""

    def __init__(self, inner, fail_at: int) -> None:
        self.inner, self.fail_at, self.reads = inner, fail_at, 0

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int):
        self.reads += 1
        if self.reads == self.fail_at:
            raise RuntimeError("injected data error")
        return self.inner[i]


def hf(address: str, worker_id: str, fail: bool) -> None:
    import hf_gpt2

    with tempfile.TemporaryDirectory() as tmp:
        trainer = hf_gpt2.make_trainer(worker_id, connect=address, sync_every=H, steps=100, out_dir=tmp,
                                       coordinator_timeout_s=60)
        if fail:  # the first item of batch FAIL_AT (0-based) raises
            trainer.train_dataset = FailingData(trainer.train_dataset, FAIL_AT * hf_gpt2.BATCH_SIZE + 1)
        trainer.train()
        worker = next(c for c in trainer.callback_handler.callbacks if hasattr(c, "attached")).worker
        print(f"RESULT trainer worker={worker_id} inner_steps={worker.inner_step} "
              f"rounds_synced={worker.rounds_synced} stop_reason={worker.stop_reason}", flush=True)


def lightning_raise(address: str, worker_id: str) -> None:
    import lightning as L

    from diloco.integrations.lightning import DilocoCallback

    class Failing(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            if batch_idx == FAIL_AT:
                raise RuntimeError("injected training error")
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    x = torch.randn(400, 8)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)
    trainer = L.Trainer(max_steps=100, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[DilocoCallback(connect=address, sync_every=H, worker_id=worker_id)])
    trainer.fit(Failing(), loader)


if __name__ == "__main__":
    mode, address, worker_id = sys.argv[1:4]
    if mode == "lightning-raise":
        lightning_raise(address, worker_id)
    else:
        hf(address, worker_id, fail=(mode == "hf-raise"))
