"""The convenience loop: join, train, ``step_done`` after every step, leave.

``run_training`` is the few lines a user would write around ``DilocoWorker``;
``TrainingSetup`` is what a ``--entry`` function hands the CLI (a model, its
inner optimizer, an iterable of batches and a loss function).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch

from diloco.worker.metrics import batch_size
from diloco.worker.errors import DilocoWorkerError
from diloco.worker.worker import DilocoWorker


@dataclass
class TrainingSetup:
    """What a user's entry function returns: everything ``run_training`` needs besides the worker."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    #: Any iterable of batches; each is passed to ``loss_fn`` as is.
    batches: Iterable[Any]
    #: ``loss_fn(model, batch) -> scalar loss tensor`` (``backward()`` is called on it).
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor]
    #: ``tokens_of(batch) -> int``: what a batch trains on, for a token-weighted merge and the token
    #: budget (``step_done(tokens=...)``); None: each step counts 1.
    tokens_of: Callable[[Any], int] | None = None
    #: ``unit_batches(index, units) -> iterable of batches``: the data of work unit ``index`` of ``units``
    #: (``diloco server --data-units``); the loop reads the unit the run hands this worker for each round.
    #: None, or a run without units: ``batches``.
    unit_batches: Callable[[int, int], Iterable[Any]] | None = None


@dataclass
class WorkerReport:
    """How a worker's run went (returned by ``run_training``)."""

    worker_id: str
    #: The worker's inner step counter at the end (includes steps restored from a checkpoint).
    inner_steps: int
    #: Inner steps taken in this call.
    steps_this_run: int
    rounds_synced: int
    #: Why it ended: the worker's ``stop_reason``, or "max_steps" / "batches_exhausted".
    stop_reason: str | None
    seconds_paused: float
    bytes_sent: int
    bytes_received: int
    wall_s: float
    #: Training loss of every inner step of this call, in order.
    losses: list[float] = field(default_factory=list)

    @property
    def final_loss(self) -> float | None:
        return self.losses[-1] if self.losses else None


def run_training(worker: DilocoWorker, batches: Iterable[Any],
                 loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
                 max_steps: int | None = None,
                 after_backward: Callable[[torch.nn.Module], None] | None = None,
                 tokens_of: Callable[[Any], int] | None = None,
                 unit_batches: Callable[[int, int], Iterable[Any]] | None = None) -> WorkerReport:
    """Join, then for each batch: zero_grad, loss, backward, step, ``step_done``; leave at the end.

    Ends when the run tells the worker to stop, when ``batches`` runs out, or when the
    worker's ``inner_step`` reaches ``max_steps`` (a total: a worker restored from its
    checkpoint at step 40 with ``max_steps=100`` takes 60 more). Always leaves (even on
    an exception), so the coordinator hears of it at once instead of after a timeout.

    ``after_backward(model)`` runs between ``backward`` and ``step`` (a multi-rank
    worker averages its ranks' gradients there: ``diloco.worker.group``). ``tokens_of(batch)``
    says what each step trained on (``step_done(tokens=...)``; None: one per step). With
    ``unit_batches`` and a run that hands out data units, each round's batches come from the unit
    the run gave this worker (``unit_batches(index, units)``), read again if the round outlasts it.
    """
    started = time.monotonic()
    model, opt = worker.model, worker.inner_optimizer
    losses: list[float] = []
    reason: str | None = None
    # What the heartbeats carry (a multi-rank worker's other ranks send none: they have no report).
    report = getattr(worker, "report", None)
    try:
        worker.join()
        if not worker.stopped:
            reason = "batches_exhausted"
            it = _batches(worker, batches, unit_batches)
            while True:
                if max_steps is not None and worker.inner_step >= max_steps:
                    reason = "max_steps"
                    break
                try:
                    batch = next(it)
                except StopIteration:
                    break
                opt.zero_grad(set_to_none=True)
                loss = loss_fn(model, batch)
                loss.backward()
                if after_backward is not None:
                    after_backward(model)
                opt.step()
                losses.append(float(loss.detach()))
                if report is not None:
                    report(loss=losses[-1], samples=batch_size(batch))
                if not (worker.step_done(tokens_of(batch)) if tokens_of else worker.step_done()):
                    reason = None
                    break
    except BaseException:
        # A rank of a sharded member that fails on its own must not wait for its leader's leave.
        abandon = getattr(worker, "abandon", None)
        if abandon is not None:
            abandon()
        raise
    finally:
        worker.leave()
    return WorkerReport(
        worker_id=worker.worker_id,
        inner_steps=worker.inner_step,
        steps_this_run=len(losses),
        rounds_synced=worker.rounds_synced,
        stop_reason=reason or worker.stop_reason,
        seconds_paused=worker.seconds_paused,
        bytes_sent=worker.bytes_sent,
        bytes_received=worker.bytes_received,
        wall_s=time.monotonic() - started,
        losses=losses,
    )


def _batches(worker: Any, batches: Iterable[Any],
             unit_batches: Callable[[int, int], Iterable[Any]] | None) -> Iterator[Any]:
    """The loop's batches: from the worker's data unit of the moment when the run hands units out and
    the setup reads them (``data_unit`` changes at sync points only), else from ``batches``."""
    plain: Iterator[Any] | None = None
    current, from_unit = None, iter(())
    while True:
        unit = getattr(worker, "data_unit", None) if unit_batches is not None else None
        if unit is None:
            plain = plain if plain is not None else iter(batches)
            try:
                yield next(plain)
            except StopIteration:
                return
            continue
        assert unit_batches is not None  # a unit is only read with them (above)
        if unit != current:
            current, from_unit = unit, _read_unit(unit_batches, unit[1], worker.units_per_epoch)
        batch = next(from_unit, _END)
        if batch is _END:  # the round outlasts the unit: read it again
            from_unit = _read_unit(unit_batches, unit[1], worker.units_per_epoch)
            batch = next(from_unit, _END)
            if batch is _END:
                raise DilocoWorkerError(f"unit_batches({unit[1]}, {worker.units_per_epoch}) gave no batch")
        yield batch


def _read_unit(unit_batches: Callable[[int, int], Iterable[Any]], index: int, units: int) -> Iterator[Any]:
    try:
        return iter(unit_batches(index, units))
    except (ValueError, TypeError) as exc:  # the setup cannot read the unit the run handed out
        raise DilocoWorkerError(f"data unit {index} of {units}: {exc}") from exc


_END = object()
