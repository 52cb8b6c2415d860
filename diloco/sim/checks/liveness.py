"""The run's phases and its end: **I7** (after the heal, every fragment applies another
round within the bound the trace states), **I5** at the end (a requested shutdown stops
the run; after the stop no worker is still training, waiting, paused, stopping or
frozen), and a crash of the simulation itself.
"""

from __future__ import annotations


class LivenessChecks:
    """A mixin of ``TraceChecker``: ``phase`` records, and the verdicts only the end can give."""

    def _on_phase(self, rec: dict) -> None:
        what = rec["what"]
        if what == "heal":
            self.heal_t = rec["t"]
            self.bound_s = rec["bound_s"]
        elif what == "shutdown":
            self.shutdown_requested = True
        elif what == "crash":
            self.crash_error = rec.get("error", "?")
        elif what == "end":
            self.end = rec

    def _judge_end(self) -> None:
        """The verdicts of the whole run, once its last record is fed."""
        if self.crash_error:
            self._violate("crash", f"the simulation raised: {self.crash_error}")
        if self.heal_t is not None:
            nfrag = len(self.model.rounds) if self.model else self.cfg["num_fragments"]
            late = [f for f in range(nfrag)
                    if f not in self.live_applied or self.live_applied[f] > self.heal_t + self.bound_s]
            if late:
                self._violate("I7", f"liveness: after the heal at t={self.heal_t:.3f}s fragments {late} applied "
                                    f"no round within the bound of {self.bound_s:.1f}s")
        if self.shutdown_requested and not self.stopped:
            self._violate("I5", "a shutdown was requested but the run never stopped")
        if self.stopped:
            # A worker still joining (say, retrying after too_many_workers) is not a member and
            # holds nothing: not parked. One training, waiting or paused missed the stop.
            for wid, state in sorted(self.wstate.items()):
                if state in ("training", "waiting", "paused", "stopping", "frozen"):
                    self._violate("I5", f"{wid} is still {state} at the end of the run, after the stop")
