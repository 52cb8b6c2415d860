"""``DilocoCallback`` for the Hugging Face ``Trainer``: one callback makes each Trainer a DiLoCo worker.

::

    from diloco.integrations.transformers import DilocoCallback

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[DilocoCallback(connect="tcp://127.0.0.1:5555", sync_every=50)])
    trainer.train()

* When training begins the worker joins: the run's global params are copied into
  the model (the first worker to join supplies them), so every Trainer starts
  from the same weights.
* Every *optimizer* step counts as one inner step (with
  ``gradient_accumulation_steps`` > 1, the micro-batches are not steps); at each
  ``sync_every``-th the pseudo-gradient goes to the coordinator and the Trainer
  waits for the round's outer step (paused, not training, while the run is below
  ``min_workers``).
* When the run tells the worker to stop (``diloco shutdown``, a token budget
  reached, a kick) the Trainer stops at that step, as if ``max_steps`` were reached.
* When training ends the worker leaves; a script that dies of an exception
  leaves at exit (the Trainer calls no hook for exceptions). Code that catches the
  exception and goes on calls ``callback.close()``.
* With ``TrainingArguments(include_num_input_tokens_seen=True)`` each step
  reports the tokens it trained on (``diloco server --merge tokens``,
  ``--token-budget``); otherwise each step counts one.
* The Trainer's logged ``loss`` and ``eval_loss`` reach ``diloco status`` and the dashboard.

``export_pretrained`` turns a run's checkpoint into a directory that
``from_pretrained`` loads (config and ``model.safetensors``).
"""

from __future__ import annotations

import os
from typing import Any

from transformers import TrainerCallback  # the extra: pip install 'diloco[transformers]'

from diloco.integrations.attached import AttachedWorker, CallbackControls
from diloco.deploy.export import RunParams, load_run_params
from diloco.wire.endpoints import WorkerEndpoint


class DilocoCallback(CallbackControls, TrainerCallback):
    """Make the Trainer it is given to a DiLoCo worker of the run at ``connect``.

    ``sync_every``: optimizer steps per round (H). ``worker_id`` defaults to
    ``HOSTNAME-PID``; ``key``/``server_key`` (or ``DILOCO_KEY``/``DILOCO_SERVER_KEY``)
    authenticate against ``diloco server --auth``. Other keywords are
    ``diloco.Worker``'s (``checkpoint_dir``, ``coordinator_timeout_s``, ``overlap_steps``, ...).
    """

    def __init__(self, connect: str | WorkerEndpoint, sync_every: int, *, worker_id: str | None = None,
                 key: str | os.PathLike | None = None, server_key: str | os.PathLike | None = None,
                 **options: Any) -> None:
        self.attached = AttachedWorker(connect=connect, sync_every=sync_every, worker_id=worker_id,
                                       key=key, server_key=server_key, **options)
        self._tokens_seen: int | None = None

    # -- the Trainer's hooks

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.attached.start(model, optimizer)
        self._tokens_seen = state.num_input_tokens_seen
        return control

    def on_step_end(self, args, state, control, **kwargs):
        # Called once per optimizer step (after the scheduler), not per micro-batch.
        if not self.attached.optimizer_step(self._tokens_this_step(state)):
            control.should_training_stop = True
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs:
            self.attached.report(loss=logs.get("loss"), eval_loss=logs.get("eval_loss"))
        return control

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if metrics:
            self.attached.report(eval_loss=metrics.get("eval_loss"))
        return control

    def on_train_end(self, args, state, control, **kwargs):
        self.attached.finish()
        return control

    def _tokens_this_step(self, state) -> int | None:
        seen = state.num_input_tokens_seen
        if not seen or self._tokens_seen is None:
            return None  # not counted: include_num_input_tokens_seen is off
        tokens, self._tokens_seen = seen - self._tokens_seen, seen
        return tokens if tokens > 0 else None


def export_pretrained(run_checkpoint: str | os.PathLike, model, out_dir: str | os.PathLike) -> RunParams:
    """Load the run's global params (the newest checkpoint in ``run_checkpoint``, with its journal
    replayed) into ``model`` and ``model.save_pretrained(out_dir)``: config.json and
    model.safetensors, which ``from_pretrained(out_dir)`` loads. Returns what was loaded
    (``load_run_params``'s summary). The model must be the run's architecture: every
    parameter name and shape is checked."""
    summary = load_run_params(run_checkpoint, model)
    model.save_pretrained(os.fspath(out_dir), safe_serialization=True)
    return summary


__all__ = ["DilocoCallback", "export_pretrained"]
