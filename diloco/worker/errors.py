"""The worker's one exception type."""

from __future__ import annotations


class DilocoWorkerError(Exception):
    """The run refused this worker, or the worker cannot continue; ``code`` says why."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code
