"""The coordinator's real-time loop: a transport, a monotonic clock, a ``Coordinator``.

The only place the coordinator meets time and I/O. Each turn: receive one
message (or time out), read the clock, let the coordinator handle it, persist
(with a checkpoint directory: when the step applied a round, or the run just
stopped with save-and-stop; then the audit log's lines of the step), *then*
send (SPEC.md section 5).
After the run stops it stays until every connected worker has heard the stop (a
Result, a heartbeat reply or a refusal that says so; ``stop_notice.py``) -- at once
when none is connected -- and at most a few heartbeat intervals (a worker that went
silent is not waited for longer), then returns.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable

from diloco.core import ShutdownKind
from diloco.coordinator.audit import AuditLog
from diloco.coordinator.checkpoint import DEFAULT_KEEP
from diloco.coordinator.persist import Durability
from diloco.coordinator.service import Coordinator
from diloco.wire.endpoints import CoordinatorEndpoint

log = logging.getLogger("diloco.coordinator")

#: Once every worker has been told of the stop, the loop runs this long more before it returns: the
#: last replies leave the transport's queue (its socket closes with linger 0) and a late heartbeat
#: still gets its answer.
FLUSH_S = 0.25

#: A gap longer than this between two turns of the loop means the process did not run (stopped,
#: starved): ``RunningClock`` leaves it out of the coordinator's time.
STALL_S = 2.0


class RunningClock:
    """The coordinator's time without the stretches its process did not run (SPEC.md R9).

    While the coordinator is stopped (SIGSTOP, a stalled host) the workers' heartbeats wait in
    its sockets; counted as their silence, the first turn after it declared every worker dead
    before reading a single one of them -- and a heal for each on its re-join. A gap of more than
    ``STALL_S`` between two readings counts as ``tick_s`` (one turn of the loop): the workers'
    own rule for their coordinator's silence (W11), on the coordinator's side.
    """

    def __init__(self, clock: Callable[[], float], tick_s: float) -> None:
        self._clock = clock
        self._tick_s = tick_s
        self._last: float | None = None
        #: Seconds left out so far.
        self.skipped = 0.0

    def __call__(self) -> float:
        now = self._clock()
        if self._last is not None and now - self._last > STALL_S:
            gap = now - self._last
            self.skipped += gap - self._tick_s
            log.warning("the coordinator did not run for %.1f s (stopped or starved): that time is not its "
                        "workers' silence", gap)
        self._last = now
        return now - self.skipped


def serve(endpoint: CoordinatorEndpoint, coordinator: Coordinator, *,
          checkpoint_dir: str | os.PathLike | None = None,
          keep: int = DEFAULT_KEEP,
          full_every: int = 1,
          audit: AuditLog | None = None,
          clock: Callable[[], float] = time.monotonic,
          stop_event: threading.Event | None = None,
          tick_interval_s: float = 0.05,
          linger_s: float | None = None) -> Coordinator:
    """Run until the run stops (and the linger passes) or ``stop_event`` is set.

    With ``checkpoint_dir``, every step that applied a round (applied or refused
    outer steps) or banned or unbanned a worker (``Coordinator.take_durable_change``)
    is made durable before any of the step's messages is sent (``persist.py``: a full
    checkpoint, keeping the newest ``keep`` files, or with ``full_every`` > 1 a
    journal commit and a full checkpoint every ``full_every`` rounds); then the
    step's ``audit`` lines are appended and fsync'd. A failed write raises: nothing
    of that step is announced (restart with ``--resume``).
    """
    durability = Durability(checkpoint_dir, keep, full_every) if checkpoint_dir is not None else None
    if durability is not None:
        durability.attach(coordinator)
    try:
        return _loop(endpoint, coordinator, durability, audit, clock, stop_event, tick_interval_s, linger_s)
    finally:
        if durability is not None:
            durability.close()


def _loop(endpoint: CoordinatorEndpoint, coordinator: Coordinator, durability: Durability | None,
          audit: AuditLog | None, clock: Callable[[], float], stop_event: threading.Event | None,
          tick_interval_s: float, linger_s: float | None) -> Coordinator:
    if linger_s is None:
        linger_s = 3 * coordinator.config.heartbeat_interval_s
    saved = False
    stopped_at: float | None = None
    told_at: float | None = None
    # What happened before the loop (a resume, a --min-workers given at start) is on disk already
    # or was never to be: only the loop's own steps are made durable.
    coordinator.take_durable_change()
    clock = RunningClock(clock, tick_interval_s)
    while stop_event is None or not stop_event.is_set():
        arrival = endpoint.recv(tick_interval_s)
        now = clock()
        if arrival is None:
            out = coordinator.tick(now)
        else:
            out = coordinator.handle(arrival.peer, arrival.message, now, identity=arrival.identity,
                                     measured=arrival.measured)
        # A transport that sees connections close reports peers gone for good (SPEC.md R7):
        # a dead worker is noticed in about a second, not after the heartbeat timeout.
        for peer in endpoint.lost_peers():
            out.extend(coordinator.peer_lost(peer, now))
        # A worker whose message keeps arriving lives, even when that message outlasts the heartbeat timeout.
        for peer in endpoint.arriving_peers():
            out.extend(coordinator.peer_arriving(peer, now))
        if coordinator.stopped and stopped_at is None:
            stopped_at = now
            log.info("run stopped (%s)", coordinator.stop_kind.value)
            if coordinator.stop_kind is ShutdownKind.SAVE_AND_STOP and not saved:
                if durability is None:
                    log.warning("save-and-stop requested but no checkpoint directory is configured")
                elif not coordinator.has_state:
                    log.warning("save-and-stop: no worker ever joined, nothing to save")
                else:
                    path = durability.save_now()
                    log.info("checkpoint written to %s", path)
                saved = True
        changed = coordinator.take_durable_change()
        if durability is not None and not saved:
            # Persist before announce (SPEC.md section 5): the step's Results go out only once
            # the round they announce is on disk -- and a ban or unban is confirmed to the
            # operator only once a restart would keep it.
            try:
                durability.after_step(changed)
            except BaseException:
                if audit is not None:
                    audit.discard()  # no line for a round that is not durable
                raise
        if audit is not None:
            audit.flush()
        _forget_retired_groups(coordinator)
        coordinator.stop_notice.sent(out)
        for peer, message in out:
            endpoint.send(peer, message)
        if stopped_at is not None:
            if told_at is None and coordinator.stop_notice.everyone_told:
                told_at = now
            if now - stopped_at >= linger_s or (told_at is not None and now - told_at >= FLUSH_S):
                break
    return coordinator


def _forget_retired_groups(coordinator: Coordinator) -> None:
    """Collective plane: delete old groups' rendezvous keys from the store (SPEC.md C7)."""
    plane, host = coordinator.collective, getattr(coordinator, "collective_store", None)
    if plane is None or host is None:
        return
    while plane.retired:
        prefix, size = plane.retired.popleft()
        host.forget(prefix, size)


class CoordinatorThread(threading.Thread):
    """``serve`` in a daemon thread (tests, ``diloco demo``). ``stop()`` ends it."""

    def __init__(self, endpoint: CoordinatorEndpoint, coordinator: Coordinator, **kwargs) -> None:
        super().__init__(name="diloco-coordinator", daemon=True)
        self.endpoint = endpoint
        self.coordinator = coordinator
        self._stop_event = threading.Event()
        self._kwargs = kwargs
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            serve(self.endpoint, self.coordinator, stop_event=self._stop_event, **self._kwargs)
        except BaseException as exc:  # surfaced to the caller by join_checked()
            self.error = exc
            log.exception("coordinator loop failed")

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop_event.set()
        self.join(timeout_s)

    def join_checked(self, timeout_s: float) -> None:
        self.join(timeout_s)
        if self.error is not None:
            raise RuntimeError("the coordinator loop failed") from self.error
