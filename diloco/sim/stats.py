"""What a simulated run counts (``SimStats``): kept apart so that the pieces that count need not
import the ``Simulation`` that wires them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SimStats:
    events: int = 0
    messages_sent: int = 0
    messages_delivered: int = 0
    messages_dropped: int = 0
    applied: int = 0
    worker_rounds: int = 0
    faults: dict = field(default_factory=dict)
    end_reason: str = ""
    sim_time_s: float = 0.0
    heal_at_s: float | None = None
    liveness_s: float | None = None
    stop_at_s: float | None = None
    error: str = ""
