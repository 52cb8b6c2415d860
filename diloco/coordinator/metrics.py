"""What the coordinator remembers of the workers' training figures: bounded histories, no rules.

Workers put their latest figures on their heartbeats (``Heartbeat.metrics``,
SPEC.md section 11). The coordinator keeps, per worker, the latest sample and
the last ``points`` samples, and per applied round the time, fragment,
round, contributors and the mean of the contributors' latest losses. All of
it is bounded (deques; at most ``max_workers`` workers' histories, the oldest
departed ones forgotten first) and none of it reaches the round state
machine: it is for ``status``, the dashboard and ``/metrics`` only.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

#: Samples kept per worker (a heartbeat every few seconds: hours of a run at a coarse grain).
DEFAULT_POINTS = 720
#: Applied rounds kept.
DEFAULT_ROUNDS = 2000
#: Workers whose histories are kept (members and departed ones; the oldest departed go first).
DEFAULT_WORKERS = 256


@dataclass(frozen=True, slots=True)
class Sample:
    """One heartbeat's metrics from one worker, at the coordinator's clock ``t_s``."""

    t_s: float
    metrics: dict[str, Any]


@dataclass(frozen=True, slots=True)
class RoundPoint:
    """One applied round: when, which, by whom, and the mean of its contributors' latest losses."""

    t_s: float
    fragment_id: int
    round_id: int
    contributors: tuple[str, ...]
    loss: float | None


class MetricsHistory:
    """Bounded per-worker and per-round histories (see the module docstring)."""

    def __init__(self, points: int = DEFAULT_POINTS, rounds: int = DEFAULT_ROUNDS,
                 workers: int = DEFAULT_WORKERS) -> None:
        self.points = points
        self.max_workers = workers
        #: worker id -> its samples, oldest first (insertion order: least recently sampled first).
        self.workers: dict[str, collections.deque[Sample]] = {}
        self.rounds: collections.deque[RoundPoint] = collections.deque(maxlen=rounds)
        #: Samples ever recorded (for the metrics log: which are new since it last looked).
        self.samples_recorded = 0

    def record(self, worker_id: str, t_s: float, metrics: dict[str, Any]) -> Sample:
        """Keep one heartbeat's metrics (already validated by the wire decoder)."""
        samples = self.workers.pop(worker_id, None)
        if samples is None:
            samples = collections.deque(maxlen=self.points)
            while len(self.workers) >= self.max_workers:
                del self.workers[next(iter(self.workers))]
        self.workers[worker_id] = samples  # now the most recently sampled
        sample = Sample(t_s, dict(metrics))
        samples.append(sample)
        self.samples_recorded += 1
        return sample

    def latest(self, worker_id: str) -> Sample | None:
        samples = self.workers.get(worker_id)
        return samples[-1] if samples else None

    def round_applied(self, t_s: float, fragment_id: int, round_id: int, contributors) -> RoundPoint:
        losses = [s.metrics["loss"] for s in (self.latest(w) for w in contributors)
                  if s is not None and "loss" in s.metrics]
        point = RoundPoint(t_s, fragment_id, round_id, tuple(contributors),
                           sum(losses) / len(losses) if losses else None)
        self.rounds.append(point)
        return point

    def member_view(self, worker_id: str, now_s: float) -> dict[str, Any]:
        """The latest metrics of a worker for ``status`` (with ``metrics_age_s``), or {} if none."""
        s = self.latest(worker_id)
        if s is None:
            return {}
        return {**s.metrics, "metrics_age_s": round(max(0.0, now_s - s.t_s), 3)}
