"""Simulated time: a heap of events keyed by ``(time, seq)``; no sleeps, no clock.

``EventQueue`` is the run's clock (``world.Clock``): ``schedule`` queues
``fn(arg)`` at a simulated time (ties run in the order they were scheduled),
``run`` pops and runs them in order, advancing ``now``, until ``stop`` is
called, the queue empties or ``max_events`` is reached (then ``on_cap``).
Every other piece of the simulation holds this object, not the simulation,
to read the time and to schedule.
"""

from __future__ import annotations

import heapq
from typing import Any, Callable


class EventQueue:
    """The simulation's clock and event heap."""

    def __init__(self) -> None:
        #: The simulated time of the event being run.
        self.now = 0.0
        #: Events run so far.
        self.events = 0
        #: Set by ``stop``: ``run`` returns before the next event.
        self.stopped = False
        self._heap: list = []
        self._seq = 0

    def schedule(self, t: float, fn: Callable[[Any], None], arg: Any = None) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fn, arg))

    def stop(self) -> None:
        self.stopped = True

    def run(self, max_events: int, on_cap: Callable[[str], None]) -> None:
        # Locals: this loop runs once per event.
        heap = self._heap
        pop = heapq.heappop
        while heap and not self.stopped:
            t, _seq, fn, arg = pop(heap)
            self.now = t
            self.events += 1
            fn(arg)
            if self.events >= max_events:
                on_cap("event cap")
