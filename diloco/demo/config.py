"""What ``diloco demo`` runs with: :class:`DemoConfig`, checked on construction, and its defaults.

The defaults (1200 steps of 8 x 64 characters, inner lr 1e-3, H = 10, outer
lr 0.7, momentum 0.8) come from benchmarks/bench_demo.py and bench_training.py
--outer-sweep (tables in benchmarks/README.md).
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass, field

from diloco.baselines import TrainSettings
from diloco.outer import OuterConfig, OuterConfigError
from diloco.models import ModelConfig


class DemoError(Exception):
    """The demo could not run as configured (bad settings, a worker failed)."""


@dataclass(frozen=True)
class DemoConfig:
    #: Workers k (and min_workers when faults are on).
    workers: int = 4
    #: Inner steps per worker (and for each baseline).
    steps: int = 1200
    #: Inner steps per outer round, H.
    sync_every: int = 10
    outer_lr: float = 0.7
    outer_momentum: float = 0.8
    #: Kill one worker mid-run and bring in a replacement.
    faults: bool = True
    #: Seconds without a heartbeat before the coordinator declares a worker dead.
    heartbeat_timeout_s: float = 1.5
    #: How long the run stays paused before the replacement is started.
    replacement_delay_s: float = 2.0
    #: How long any wait of the demo may go without progress (a step, an applied round, a
    #: worker's move) -- and how long the survivors may take to pause -- before it fails
    #: with an error naming what it waited for and where each worker is.
    stall_timeout_s: float = 120.0
    #: Skip the two baselines (faster; the table then shows DiLoCo only).
    baselines: bool = True
    #: "hub" or "collective" (SPEC.md section 7b): where the rounds are combined.
    data_plane: str = "hub"
    seed: int = 0
    #: A text file to train on instead of the Python standard library's sources.
    data: pathlib.Path | None = None
    #: The demo's defaults, chosen by benchmarks/bench_demo.py (see ``diloco demo --help``).
    settings: TrainSettings = field(default_factory=lambda: TrainSettings(
        batch_size=8, lr=1e-3, eval_every=80, model=ModelConfig(seq_len=64)))

    def __post_init__(self) -> None:
        def bad(name, allowed):
            raise DemoError(f"{name}={getattr(self, name)!r} is invalid: expected {allowed}")
        for name in ("workers", "steps", "sync_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                bad(name, "an integer >= 1")
        if self.faults and self.workers < 2:
            bad("workers", "at least 2 with faults on (one is killed); use --no-faults for 1")
        if self.steps < 2 * self.sync_every:
            bad("steps", f"at least 2 * sync_every = {2 * self.sync_every} (two outer rounds)")
        if self.faults and self.steps < 4 * self.sync_every:
            bad("steps", f"at least 4 * sync_every = {4 * self.sync_every} with faults on "
                         "(rounds before the kill and after the replacement)")
        if self.data_plane not in ("hub", "collective"):
            bad("data_plane", "'hub' or 'collective'")
        if not 0 < self.heartbeat_timeout_s <= 60:
            bad("heartbeat_timeout_s", "a number of seconds in (0, 60]")
        if not 0 < self.stall_timeout_s < float("inf"):
            bad("stall_timeout_s", "a finite number of seconds > 0")
        try:  # the coordinator's own checks, so a bad --outer-lr is a usage error, not a crash mid-run
            OuterConfig("nesterov", self.outer_lr, self.outer_momentum)
        except OuterConfigError as exc:
            raise DemoError(str(exc)) from None
