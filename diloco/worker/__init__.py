"""The worker: a pure protocol session and the PyTorch driver around it.

``WorkerSession`` (``diloco.worker.session``) is the worker's side of the
protocol, pure like the core (SPEC.md section 14); ``DilocoWorker`` drives it
with a real model, endpoint and clock; ``run_training`` is the ready-made
loop; ``TrainingSetup`` is what a ``--entry`` function returns. Names load on
first use (PEP 562), so the pure modules never pull in torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from diloco.lazy import lazy_exports

if TYPE_CHECKING:
    from diloco.worker.loop import TrainingSetup, WorkerReport, run_training
    from diloco.worker.session import WorkerSession
    from diloco.worker.states import WorkerState
    from diloco.worker.worker import DilocoWorker, DilocoWorkerError

_LAZY = {
    "DilocoWorker": "worker", "DilocoWorkerError": "worker",
    "TrainingSetup": "loop", "WorkerReport": "loop", "run_training": "loop",
    "WorkerSession": "session", "WorkerState": "states",
}


__getattr__, __dir__ = lazy_exports(__name__, globals(), _LAZY)


__all__ = ["DilocoWorker", "DilocoWorkerError", "TrainingSetup", "WorkerReport", "WorkerSession", "WorkerState",
           "run_training"]
