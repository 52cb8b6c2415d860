"""One ``diloco.Worker`` driven by a trainer's hooks instead of a hand-written loop.

A trainer owns the loop, so the worker cannot be a ``with`` block around it:
it joins when training begins (``start``), counts each *optimizer* step
(``optimizer_step``; micro-batches of gradient accumulation are not steps), and
leaves when training ends (``finish``). A trainer that raises calls no hook on
the way out (the Hugging Face ``Trainer`` has none for exceptions), so ``start``
also registers ``finish`` with ``atexit``: a script that dies of the exception
still tells the coordinator it left, at once, instead of after the heartbeat
timeout. A caller that catches the exception and goes on calls ``finish``
itself (the callbacks' ``close()``).
"""

from __future__ import annotations

import atexit
import os
from typing import Any

import torch

from diloco.wire.endpoints import WorkerEndpoint
from diloco.worker.api import Worker


class AttachedWorker:
    """The worker of one training run, created when the trainer hands over its model and optimizer."""

    def __init__(self, *, connect: str | WorkerEndpoint, sync_every: int, worker_id: str | None = None,
                 key: str | os.PathLike | None = None, server_key: str | os.PathLike | None = None,
                 **options: Any) -> None:
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every={sync_every!r}: expected a whole number of optimizer steps >= 1")
        self._connect = connect
        self._sync_every = sync_every
        self._worker_id = worker_id
        self._key = key
        self._server_key = server_key
        self._options = options
        #: The worker of the latest ``start`` (kept after ``finish`` for its figures: rounds_synced, ...).
        self.worker: Worker | None = None
        self._joined = False
        #: Tokens of the micro-batches since the last optimizer step (``add_tokens``); None: none counted.
        self._pending_tokens: int | None = None

    @property
    def joined(self) -> bool:
        """True from ``start`` until ``finish``."""
        return self._joined

    def start(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Join the run: the global params are copied into ``model``. A second ``start`` while joined
        (a trainer's ``train()`` called again) keeps the worker it has."""
        if self._joined:
            return
        if model is None or optimizer is None:
            raise RuntimeError("the trainer gave no model or no optimizer at the start of training: "
                               "DiLoCo needs both (the inner optimizer must exist when training begins)")
        worker = Worker(model, optimizer, connect=self._connect, sync_every=self._sync_every,
                        worker_id=self._worker_id, key=self._key, server_key=self._server_key, **self._options)
        worker.__enter__()  # joins; on failure it has closed itself and the error propagates
        self.worker, self._joined = worker, True
        atexit.register(self.finish)

    def add_tokens(self, tokens: int) -> None:
        """Count what one micro-batch trained on (summed until the next optimizer step)."""
        self._pending_tokens = (self._pending_tokens or 0) + int(tokens)

    def optimizer_step(self, tokens: int | None = None) -> bool:
        """One optimizer step happened; at a sync point submit and wait (paused below quorum).
        False: the run told this worker to stop, so the trainer should stop."""
        if not self._joined or self.worker is None:
            return False
        pending, self._pending_tokens = self._pending_tokens, None  # this step's micro-batches, counted once
        if tokens is None:
            tokens = pending
        if self.worker.stopped:
            return False
        return self.worker.step(tokens)

    def report(self, **figures: float | None) -> None:
        """Loss figures for the heartbeats (``diloco status``, the dashboard); unknown names are ignored."""
        if not self._joined or self.worker is None:
            return
        known = {k: float(v) for k, v in figures.items() if k in ("loss", "eval_loss") and v is not None}
        if known:
            self.worker.report(**known)

    def finish(self) -> None:
        """Leave the run and close the connection (idempotent; also run at interpreter exit)."""
        if not self._joined or self.worker is None:
            return
        self._joined = False
        atexit.unregister(self.finish)
        self.worker.close()

    def __getattr__(self, name: str) -> Any:
        # inner_step, rounds_synced, stop_reason, stopped, ...: the joined worker's.
        worker = self.__dict__.get("worker")
        if worker is None:
            raise AttributeError(f"{name}: no worker yet (it joins when training begins)")
        return getattr(worker, name)


class CallbackControls:
    """What either trainer callback offers its caller: leave now, and the worker's figures."""

    attached: AttachedWorker

    def close(self) -> None:
        """Leave the run now (idempotent): after catching an exception from the trainer, for instance."""
        self.attached.finish()

    @property
    def worker(self) -> Worker | None:
        """The ``diloco.Worker`` of the latest training call (``inner_step``, ``rounds_synced``,
        ``stop_reason``, ...); None before training begins."""
        return self.attached.worker
