"""The demo's waits, each bounded, and what a failed one says: where each worker is.

Every wait of ``diloco demo`` ends: when what it waits for happens, when an error
is reported, or with an error naming what it waited for and, per worker, what it
last reported, what its session says, what it waits for, whether the coordinator
answers and when it last trained. While a wait lasts a line says the same every
so often, so a slow run is never silent.
"""

from __future__ import annotations

import time
from typing import Callable

from diloco.plots.timeline import WorkerState
from diloco.worker import DilocoWorker

#: While a wait lasts, a line every this many seconds says what it waits for (and where the
#: workers are); a wait for the workers' own progress says so only when none has come for this long.
PROGRESS_EVERY_S = 15.0
#: How often a wait looks.
POLL_S = 0.05


def wait_until(what: str, done: Callable[[], bool], *, where: Callable[[], str], check: Callable[[], None],
               last_progress: Callable[[], float], note: Callable[[str], None], error: type[Exception],
               limit_s: float | None = None, stall_s: float | None = None,
               report_every_s: float | None = None) -> None:
    """Wait until ``done()``. ``check()`` raises what went wrong meanwhile.

    Raises ``error`` naming ``what`` and ``where()`` after ``limit_s`` seconds, or after
    ``stall_s`` seconds since ``last_progress()`` (a monotonic time; the wait's start
    counts as progress). ``note`` gets a line every ``report_every_s`` seconds (with
    ``stall_s``: whenever nothing has moved for ``PROGRESS_EVERY_S``).
    """
    start = time.monotonic()
    last_report = start
    every = report_every_s if report_every_s is not None else (PROGRESS_EVERY_S if stall_s is not None else None)
    while not done():
        check()
        now = time.monotonic()
        quiet = now - max(start, last_progress())
        if limit_s is not None and now - start > limit_s:
            raise error(f"gave up waiting for {what} after {limit_s:g} s: {where()}")
        if stall_s is not None and quiet > stall_s:
            raise error(f"gave up waiting for {what}: nothing moved for {quiet:.0f} s: {where()}")
        if every is not None and now - last_report >= every and (stall_s is None or quiet >= every):
            last_report = now
            note(f"still waiting for {what} ({now - start:.0f} s): {where()}")
        time.sleep(POLL_S)
    check()


def describe_worker(worker_id: str, recorded: WorkerState | None, worker: DilocoWorker | None,
                    last_step: tuple[float, int] | None, now: float) -> str:
    """``w2 is waiting (its session says paused, waiting for ..., coordinator answering, ...)``."""
    text = f"{worker_id} is {recorded.value if recorded else 'not started'}"
    if worker is None:
        return text
    facts = []
    if worker.state != (recorded.value if recorded else None):
        facts.append(f"its session says {worker.state}")
    try:
        facts.append(f"waiting for {worker.session.waiting_for()}"
                     if worker.state in ("waiting", "paused", "joining") else f"inner step {worker.inner_step}")
        facts.append(f"run below quorum: {'yes' if worker.below_min_workers else 'no'}")
        silence = worker.session.silence(now)
        facts.append(f"coordinator silent for {silence:.1f} s" if silence else "coordinator answering")
    except RuntimeError:  # a dict the communication thread changed under us: skip the detail
        pass
    if last_step is not None:
        at, step = last_step
        facts.append(f"last inner step ({step}) {now - at:.1f} s ago")
    return f"{text} ({', '.join(facts)})"
