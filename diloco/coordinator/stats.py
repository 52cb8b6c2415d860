"""The coordinator's counters, and the pause clock: what ``diloco status`` and the run's summary report.

Never the core's: the core decides; these count what the coordinator did with its decisions.
Both data planes' halves (``plane.py``) add to them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CoordinatorStats:
    rounds_applied: int = 0
    contributions_accepted: int = 0
    bytes_received: int = 0
    bytes_sent: int = 0
    #: Total seconds spent below quorum after the run first formed.
    paused_s: float = 0.0
    paused_since_s: float | None = None
    messages_refused: int = 0
    #: Outer steps undone because they made a parameter non-finite (SPEC.md section 12).
    steps_refused: int = 0
    #: Workers that presented a round this coordinator has not opened (they are ahead of its
    #: durable state, e.g. after a resume from an older checkpoint) and were told to re-join
    #: (SPEC.md section 12, "Reconciliation").
    reconciled: int = 0
    #: Durable checkpoints written by the runner (one per step that applied a round), and their seconds.
    checkpoints_written: int = 0
    checkpoint_write_s: float = 0.0
    #: Journal commits (``persist.py``), and the seconds the loop waited for them before announcing.
    journal_records: int = 0
    journal_wait_s: float = 0.0

    def pause_began(self, now: float) -> None:
        """The run went below quorum after it first formed (again, while paused: nothing changes)."""
        if self.paused_since_s is None:
            self.paused_since_s = now

    def pause_ended(self, now: float) -> None:
        """The run is back at quorum, or stopped: the pause's time adds to ``paused_s``."""
        if self.paused_since_s is not None:
            self.paused_s += now - self.paused_since_s
            self.paused_since_s = None

    def paused_total(self, now: float) -> float:
        """Seconds paused so far, the pause going on included."""
        extra = now - self.paused_since_s if self.paused_since_s is not None else 0.0
        return self.paused_s + extra
