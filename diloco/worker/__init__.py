"""The PyTorch side of DiLoCo: embed ``DilocoWorker`` in any training loop.

``DilocoWorker`` wraps any ``nn.Module`` and any ``torch.optim`` inner
optimizer; ``run_training`` is the ready-made loop; ``TrainingSetup`` is what
a ``--entry`` function returns. See ``diloco.worker.worker`` for the sync
schedule, pausing, stopping, errors and checkpoints.
"""

from diloco.worker.lifecycle import WorkerState
from diloco.worker.loop import TrainingSetup, WorkerReport, run_training
from diloco.worker.worker import DilocoWorker, DilocoWorkerError

__all__ = ["DilocoWorker", "DilocoWorkerError", "TrainingSetup", "WorkerReport", "WorkerState", "run_training"]
