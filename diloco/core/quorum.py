"""The quorum rule: one tiny pure function, its decision and the reason a human reads.

Like torchft's ``quorum_compute``, it returns *why* as well as *what*; the
status view shows the reason verbatim. Everything in the core that asks "may
anything apply?" asks this function (SPEC.md R5), so the rule lives in one place.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class QuorumDecision:
    #: True while live members < min_workers: nothing may apply, the run is paused.
    below_min_workers: bool
    #: One sentence for the status page.
    reason: str


def quorum_decision(live_workers: int, min_workers: int) -> QuorumDecision:
    """Decide whether a run with ``live_workers`` members may apply outer steps."""
    if live_workers >= min_workers:
        return QuorumDecision(
            False,
            f"quorum met: {live_workers} live worker{_s(live_workers)} >= min_workers {min_workers}",
        )
    missing = min_workers - live_workers
    return QuorumDecision(
        True,
        f"paused: {live_workers} live worker{_s(live_workers)} < min_workers {min_workers}; "
        f"waiting for {missing} more (start a replacement, or lower min_workers)",
    )


def _s(n: int) -> str:
    return "" if n == 1 else "s"
