"""diloco: DiLoCo training whose membership rules live in one pure, proven state machine.

The one rule: no outer step is ever applied with fewer than ``min_workers``
contributors. See SPEC.md.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    # ``diloco.Worker`` loads torch and the worker on first use, so ``diloco --help`` stays fast.
    if name == "Worker":
        from diloco.worker.api import Worker

        globals()["Worker"] = Worker
        return Worker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
