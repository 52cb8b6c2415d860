"""What a worker tells the coordinator about its training, on every heartbeat.

``TrainingMetrics`` keeps the latest figures a training loop reports
(``report(loss=..., eval_loss=..., samples=...)``; ``run_training`` reports
every step's loss and batch size) and turns them, with the worker's inner
step, into the plain map a ``Heartbeat`` carries (``diloco.wire.messages.HEARTBEAT_METRICS``).
The pure session never sees any of it: the driver's ``Link`` decorates each
outgoing heartbeat with ``snapshot()``. Thread-safe: the training thread
reports, the communication thread snapshots.
"""

from __future__ import annotations

import collections
import math
import threading
from typing import Any, Callable

#: Steps per second are measured over (at most) this many seconds of recent snapshots.
RATE_WINDOW_S = 30.0
#: Snapshots kept for the rate (heartbeats are seconds apart; this bounds the memory).
RATE_POINTS = 64
#: DyLU's speed (``train_steps_per_s``) is measured over the durations of the last this many steps.
TRAIN_STEPS_KEPT = 32


def batch_size(batch: Any) -> int | None:
    """The number of samples in ``batch`` when it can be told: a tensor's (or a tuple/list/dict's first tensor's) first dimension."""
    shape = getattr(batch, "shape", None)
    if shape is None:
        if isinstance(batch, (tuple, list)) and batch:
            shape = getattr(batch[0], "shape", None)
        elif isinstance(batch, dict) and batch:
            shape = getattr(next(iter(batch.values())), "shape", None)
    try:
        return int(shape[0]) if shape is not None and len(shape) > 0 else None
    except (TypeError, ValueError):
        return None


class TrainingMetrics:
    """The latest training figures of one worker (see the module docstring)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._loss: float | None = None
        self._eval_loss: float | None = None
        self._samples = 0
        self._counted_samples = False
        self._rate: collections.deque[tuple[float, int]] = collections.deque(maxlen=RATE_POINTS)
        #: Seconds each of the last inner steps took, from "may train" to its ``step_done``.
        self._step_s: collections.deque[float] = collections.deque(maxlen=TRAIN_STEPS_KEPT)

    def step_took(self, seconds: float) -> None:
        """One inner step took ``seconds`` of training time (no waiting at the barrier in it)."""
        if math.isfinite(seconds) and seconds >= 0:
            with self._lock:
                self._step_s.append(float(seconds))

    def train_steps_per_s(self) -> float | None:
        """Inner steps per second of training time over the last steps (None before the first)."""
        with self._lock:
            total = sum(self._step_s)
            return len(self._step_s) / total if self._step_s and total > 0 else None

    def report(self, *, loss: float | None = None, eval_loss: float | None = None,
               samples: int | None = None) -> None:
        """Record a training loss, an evaluation loss and/or ``samples`` more samples trained on.

        Non-finite losses are ignored (the heartbeat carries finite numbers only);
        without any ``samples`` reported, the heartbeat's ``samples`` is the inner step.
        """
        with self._lock:
            if loss is not None and math.isfinite(float(loss)):
                self._loss = float(loss)
            if eval_loss is not None and math.isfinite(float(eval_loss)):
                self._eval_loss = float(eval_loss)
            if samples is not None and int(samples) >= 0:
                self._samples += int(samples)
                self._counted_samples = True

    def snapshot(self, step: int, train_rate: bool = False) -> dict[str, Any]:
        """The heartbeat's ``metrics`` map for inner step ``step``, now.

        ``train_rate``: add ``train_steps_per_s`` (DyLU runs only: a coordinator that predates
        the key would refuse the heartbeat).
        """
        speed = self.train_steps_per_s() if train_rate else None
        now = self._clock()
        with self._lock:
            rate = self._rate
            while rate and now - rate[0][0] > RATE_WINDOW_S:
                rate.popleft()
            out: dict[str, Any] = {"step": int(step)}
            if rate and now > rate[0][0]:
                out["steps_per_s"] = max(0.0, (step - rate[0][1]) / (now - rate[0][0]))
            if not rate or now > rate[-1][0]:
                rate.append((now, int(step)))
            if self._loss is not None:
                out["loss"] = self._loss
            if self._eval_loss is not None:
                out["eval_loss"] = self._eval_loss
            out["samples"] = self._samples if self._counted_samples else int(step)
        if speed is not None:
            out["train_steps_per_s"] = speed
        return out
