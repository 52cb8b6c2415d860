"""The Streaming DiLoCo sync schedule: pure arithmetic on step counts.

With H = ``sync_every`` and F fragments, fragment f's round r closes at
schedule step ``r * H + off_f`` with ``off_f = max(1, (f + 1) * H // F)``: every
fragment syncs every H inner steps and the F fragments take turns, H/F steps
apart (with F = 1: rounds close at H, 2H, ...). A worker that joins a sync run
later places itself at the last close that already happened, so every member
meets the remaining closes in the same order and no two members wait on each
other at different fragments (which would deadlock the barriers). Async mode
uses the same offsets counted from the worker's own start (versions count
contributions, not rounds, so they cannot place a worker). SPEC.md section 14.
"""

from __future__ import annotations

from typing import Sequence


def offsets(num_fragments: int, sync_every: int) -> list[int]:
    """Each fragment's close offset within a period of ``sync_every`` steps."""
    return [max(1, (f + 1) * sync_every // num_fragments) for f in range(num_fragments)]


def sync_closes(round_ids: Sequence[int], sync_every: int) -> list[int]:
    """Sync mode: the schedule step at which each fragment's open round closes."""
    return [r * sync_every + off for r, off in zip(round_ids, offsets(len(round_ids), sync_every))]


def sync_place(round_ids: Sequence[int], sync_every: int) -> tuple[list[int], int]:
    """Sync mode: (next close per fragment, schedule step) for a worker joining at these rounds.

    The schedule step is the last close that already happened (never below 0).
    """
    closes = sync_closes(round_ids, sync_every)
    return closes, max(0, max(c - sync_every for c in closes))


def async_place(sched_step: int, num_fragments: int, sync_every: int) -> list[int]:
    """Async mode: the next close of each fragment, counted from ``sched_step``."""
    return [sched_step + off for off in offsets(num_fragments, sync_every)]


def next_close_after(fragment_id: int, next_round_id: int, current_close: int, num_fragments: int,
                     sync_every: int, sync: bool) -> int:
    """Where fragment ``fragment_id`` closes next once its round released.

    Sync: from the next round's id (the run's rounds place the worker). Async: one period later.
    """
    if sync:
        return next_round_id * sync_every + offsets(num_fragments, sync_every)[fragment_id]
    return current_close + sync_every
