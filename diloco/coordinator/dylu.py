"""DyLU, dynamic local updates (Liu et al. 2024, "Asynchronous Local-SGD Training for Language
Modeling", arXiv:2401.09135): a slower worker takes fewer inner steps per round.

Pure arithmetic and a small bounded table, no torch and no clock (the coordinator passes
its readings in). SPEC.md section 14, "DyLU", is the contract:

- **Speed** (``v_w``): the ``train_steps_per_s`` a worker reports on its heartbeats (inner
  steps per second of *training* time; waits at the barrier would make every worker of a
  sync run look as fast as the slowest), smoothed by an exponential moving average
  (``SMOOTHING``). A report of 0 (or none yet) is no measurement.
- **H_w** = ``max(1, floor(v_w / v_max * H))``, ``v_max`` the fastest smoothed speed among
  the members, ``H`` the server's ``--sync-every``; a worker without a measurement, or with
  no measured member at all, keeps ``H``. So H_w is always in ``1..H`` and the fastest
  worker keeps ``H``.
"""

from __future__ import annotations

import math

#: Weight of a new report in the moving average of a worker's speed.
SMOOTHING = 0.5
#: Added before the floor so that an exact ratio computed in floating point (0.3 * 10 =
#: 2.9999...) is not rounded down a whole step.
EPSILON = 1e-9


def dylu_sync_every(speed: float | None, fastest: float | None, sync_every: int) -> int:
    """H_w for a worker of speed ``speed`` when the fastest member runs at ``fastest``."""
    if speed is None or fastest is None or not speed > 0 or not fastest > 0:
        return sync_every
    ratio = min(1.0, speed / fastest)
    return max(1, min(sync_every, math.floor(ratio * sync_every + EPSILON)))


class SpeedTable:
    """Each member's smoothed speed (at most one entry per member: the coordinator drops leavers).

    The fastest speed is cached: every heartbeat reply asks for it, so it must not cost a scan of
    all members each time. It is recomputed only when the fastest member slows down or leaves.
    """

    def __init__(self, smoothing: float = SMOOTHING) -> None:
        self.smoothing = smoothing
        self.speeds: dict[str, float] = {}
        self._fastest: float | None = None

    def report(self, worker_id: str, train_steps_per_s: float | None) -> None:
        if train_steps_per_s is None or not math.isfinite(train_steps_per_s) or train_steps_per_s <= 0:
            return  # no measurement
        old = self.speeds.get(worker_id)
        v = float(train_steps_per_s)
        new = v if old is None else old + self.smoothing * (v - old)
        self.speeds[worker_id] = new
        if self._fastest is None or new >= self._fastest:
            self._fastest = new
        elif old is not None and old >= self._fastest:  # the fastest slowed down: someone else may lead
            self._fastest = max(self.speeds.values())

    def forget(self, worker_id: str) -> None:
        old = self.speeds.pop(worker_id, None)
        if old is not None and self._fastest is not None and old >= self._fastest:
            self._fastest = max(self.speeds.values(), default=None)

    def fastest(self) -> float | None:
        return self._fastest

    def sync_every(self, worker_id: str, sync_every: int) -> int:
        """This worker's H_w (its own speed against the fastest member's)."""
        return dylu_sync_every(self.speeds.get(worker_id), self._fastest, sync_every)
