"""``DilocoCallback`` for Lightning's ``Trainer``: one callback makes each Trainer a DiLoCo worker.

::

    from diloco.integrations.lightning import DilocoCallback

    trainer = lightning.Trainer(max_steps=1000,
                                callbacks=[DilocoCallback(connect="tcp://127.0.0.1:5555", sync_every=50)])
    trainer.fit(module, train_loader)

The same contract as the Hugging Face callback (``diloco.integrations.transformers``):
the worker joins when training starts (the run's global params into the
module), every *optimizer* step is an inner step (``trainer.global_step``
counts them, so ``accumulate_grad_batches`` micro-batches are not steps), a sync
point submits and waits (paused below ``min_workers``), the run's stop ends
``fit`` at that step, and the worker leaves when training ends or raises
(Lightning's ``on_exception``). ``tokens_of(batch)`` counts what each batch
trained on (``--merge tokens``, ``--token-budget``); the ``loss`` and
``val_loss`` the module logs reach ``diloco status``. One optimizer: the first
of ``configure_optimizers`` is the inner optimizer whose state DiLoCo keeps.
"""

from __future__ import annotations

import os
from typing import Any, Callable

try:  # the extra: pip install 'diloco[lightning]'; the older package name works too
    from lightning.pytorch import Callback
except ImportError:  # pragma: no cover - depends on what is installed
    from pytorch_lightning import Callback  # type: ignore[assignment]

from diloco.integrations.attached import AttachedWorker, CallbackControls
from diloco.wire.endpoints import WorkerEndpoint


class DilocoCallback(CallbackControls, Callback):
    """Make the Lightning ``Trainer`` it is given to a DiLoCo worker of the run at ``connect``.

    ``sync_every``: optimizer steps per round (H). ``tokens_of(batch) -> int``:
    tokens a batch trained on (None: each step counts one). ``worker_id``,
    ``key``, ``server_key`` and the other keywords are ``diloco.Worker``'s.
    """

    def __init__(self, connect: str | WorkerEndpoint, sync_every: int, *, worker_id: str | None = None,
                 key: str | os.PathLike | None = None, server_key: str | os.PathLike | None = None,
                 tokens_of: Callable[[Any], int] | None = None, **options: Any) -> None:
        self.attached = AttachedWorker(connect=connect, sync_every=sync_every, worker_id=worker_id,
                                       key=key, server_key=server_key, **options)
        self._tokens_of = tokens_of
        self._global_step: int | None = None

    # -- Lightning's hooks

    def on_train_start(self, trainer, pl_module) -> None:
        optimizers = trainer.optimizers
        if len(optimizers) != 1:
            raise RuntimeError(f"DilocoCallback needs exactly one optimizer (configure_optimizers returned "
                               f"{len(optimizers)}): it is the inner optimizer whose state each worker keeps")
        self.attached.start(pl_module, optimizers[0])
        self._global_step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._tokens_of is not None:
            self.attached.add_tokens(self._tokens_of(batch))
        # global_step counts optimizer steps: it moves once per accumulate_grad_batches micro-batches.
        step = trainer.global_step
        if self._global_step is None or step == self._global_step:
            return
        for _ in range(step - self._global_step):
            if not self.attached.optimizer_step():
                trainer.should_stop = True
                break
        self._global_step = step
        loss = trainer.callback_metrics.get("loss", trainer.callback_metrics.get("train_loss"))
        if loss is not None:
            self.attached.report(loss=float(loss))

    def on_validation_end(self, trainer, pl_module) -> None:
        val = trainer.callback_metrics.get("val_loss")
        if val is not None:
            self.attached.report(eval_loss=float(val))

    def on_train_end(self, trainer, pl_module) -> None:
        self.attached.finish()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self.attached.finish()


__all__ = ["DilocoCallback"]
