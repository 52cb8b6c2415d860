"""Simulated time: a heap of events keyed by ``(time, seq)``; no sleeps, no clock.

``EventQueue`` is a mixin of ``Simulation``: ``schedule`` queues ``fn(arg)`` at a
simulated time (ties run in the order they were scheduled), ``_run_events`` pops
and runs them in order, advancing ``now``, until the host's ``_done`` is set, the
queue empties or ``max_events`` is reached (then the host's ``_end``).
"""

from __future__ import annotations

import heapq


class EventQueue:
    """The simulation's clock and event heap (a mixin of ``Simulation``)."""

    def _init_queue(self) -> None:
        self.now = 0.0
        self._heap: list = []
        self._seq = 0

    def schedule(self, t: float, fn, arg=None) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fn, arg))

    def _run_events(self) -> None:
        heap = self._heap
        pop = heapq.heappop
        stats = self.stats
        while heap and not self._done:
            t, _seq, fn, arg = pop(heap)
            self.now = t
            stats.events += 1
            fn(arg)
            if stats.events >= self.max_events:
                self._end("event cap")
