"""Membership timelines: who was training, waiting, paused, dead or stopped, and when.

Data model (plain, documented, validated; no plotting needed to build one)::

    Timeline(
        intervals=[Interval("w1", WorkerState.TRAINING, 0.0, 4.2), ...],   # or plain tuples
        applied_rounds=[AppliedRound(4.3, fragment_id=0, round_id=0), ...],
        quorum_changes=[QuorumChange(9.0, below=True), QuorumChange(12.5, below=False)],
    )

* ``intervals``: ``(worker_id, state, start_s, end_s)``; times in seconds
  from the start of the run; ``start_s <= end_s``; the intervals of one
  worker must not overlap (touching ends are fine). Gaps are allowed (the
  worker was not a member then: not yet joined, or between leaving and
  rejoining).
* ``applied_rounds``: ``(t_s, fragment_id, round_id)``: an outer step applied.
* ``quorum_changes``: ``(t_s, below)``: the run went below ``min_workers``
  (``below=True``: it pauses) or back above it (``below=False``: it resumes).

Workers are drawn top to bottom in natural id order (``w2`` before ``w10``)
unless the plotting call passes ``worker_order``.

:class:`TimelineRecorder` builds one from state-change calls, as a simulator
or demo driver sees them::

    rec = TimelineRecorder()
    rec.set_state("w1", WorkerState.TRAINING, 0.0)
    rec.set_state("w1", WorkerState.WAITING, 4.2)   # closes the training interval at 4.2
    rec.applied_round(4.3, fragment_id=0, round_id=0)
    rec.quorum_changed(9.0, below=True)
    timeline = rec.finish(20.0)                     # closes every open interval at 20.0

About 430 lines: the data model, the recorder, the drawing and the checks of
plain-data input belong together (the picture is only as honest as the
validation of what it is given), and none of them is long.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, NamedTuple, Sequence

from matplotlib.axes import Axes
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from diloco.worker.states import WorkerState

__all__ = [
    "WorkerState",
    "STATE_COLOURS",
    "Interval",
    "AppliedRound",
    "QuorumChange",
    "Timeline",
    "TimelineError",
    "TimelineRecorder",
    "plot_membership_timeline",
    "draw_membership_timeline",
]


#: Bar colour per state (colour-blind-friendly-ish: distinct in hue and lightness). The states
#: are the worker's own vocabulary (``diloco.worker.states``), shared by worker, simulator and plots.
STATE_COLOURS: dict[WorkerState, str] = {
    WorkerState.JOINING: "#9ecae1",
    WorkerState.TRAINING: "#3a923a",
    WorkerState.WAITING: "#f0b429",
    WorkerState.PAUSED: "#e8743b",
    WorkerState.STOPPING: "#d9d9e0",
    WorkerState.STOPPED: "#b9b9c3",
    WorkerState.FROZEN: "#7b61a8",
    WorkerState.DEAD: "#2d2d3a",
}

_STATE_LABELS: dict[WorkerState, str] = {
    WorkerState.JOINING: "joining",
    WorkerState.TRAINING: "training",
    WorkerState.WAITING: "waiting at barrier",
    WorkerState.PAUSED: "paused (below quorum)",
    WorkerState.STOPPING: "stopping",
    WorkerState.STOPPED: "stopped",
    WorkerState.FROZEN: "frozen",
    WorkerState.DEAD: "dead",
}


def state_colour(state: WorkerState) -> str:
    """The bar colour for ``state``."""
    return STATE_COLOURS[state]


def state_label(state: WorkerState) -> str:
    """Legend text for ``state``."""
    return _STATE_LABELS[state]


_BELOW_COLOUR = "#c62828"
_ABOVE_COLOUR = "#1565c0"
_ROUND_COLOURS = ["#555555", "#7b1fa2", "#00838f", "#ad1457", "#2e7d32", "#ef6c00", "#283593", "#6d4c41"]


class TimelineError(ValueError):
    """A malformed timeline: names the item, the field and what was expected."""


class Interval(NamedTuple):
    """One worker in one state over ``[start_s, end_s]``."""

    worker_id: str
    state: WorkerState
    start_s: float
    end_s: float


class AppliedRound(NamedTuple):
    """An outer step applied at ``t_s``."""

    t_s: float
    fragment_id: int
    round_id: int


class QuorumChange(NamedTuple):
    """At ``t_s`` the run went below (``below=True``) or back above ``min_workers``."""

    t_s: float
    below: bool


@dataclass
class Timeline:
    """Everything a membership plot draws. Tuples are accepted and normalised; see the module doc."""

    intervals: list[Interval] = field(default_factory=list)
    applied_rounds: list[AppliedRound] = field(default_factory=list)
    quorum_changes: list[QuorumChange] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.intervals = [_norm_interval(i, x) for i, x in enumerate(_as_list(self.intervals, "intervals"))]
        self.applied_rounds = [_norm_round(i, x) for i, x in enumerate(_as_list(self.applied_rounds, "applied_rounds"))]
        self.quorum_changes = [_norm_quorum(i, x) for i, x in enumerate(_as_list(self.quorum_changes, "quorum_changes"))]
        self._check_overlaps()

    def worker_ids(self) -> list[str]:
        """Every worker id, in natural order (``w2`` before ``w10``)."""
        return sorted({iv.worker_id for iv in self.intervals}, key=_natural_key)

    @property
    def end_s(self) -> float:
        """Latest time mentioned anywhere (0.0 for an empty timeline)."""
        times = [iv.end_s for iv in self.intervals]
        times += [r.t_s for r in self.applied_rounds] + [q.t_s for q in self.quorum_changes]
        return max(times, default=0.0)

    def _check_overlaps(self) -> None:
        by_worker: dict[str, list[tuple[float, float, int]]] = {}
        for i, iv in enumerate(self.intervals):
            by_worker.setdefault(iv.worker_id, []).append((iv.start_s, iv.end_s, i))
        for wid, spans in by_worker.items():
            spans.sort()
            for (s0, e0, i0), (s1, e1, i1) in zip(spans, spans[1:]):
                if s1 < e0:
                    raise TimelineError(
                        f"intervals[{i1}] of worker {wid!r} starts at {s1} s, inside intervals[{i0}] "
                        f"[{s0}, {e0}] s: a worker's intervals must not overlap"
                    )


class TimelineRecorder:
    """Builds a :class:`Timeline` from state changes.

    Calls may come in any global order (e.g. several threads reading a clock),
    but each worker's own times must not go backwards; violating that raises
    :class:`TimelineError` and records nothing.
    """

    def __init__(self) -> None:
        self._open: dict[str, tuple[WorkerState, float]] = {}
        self._last_end: dict[str, float] = {}
        self._intervals: list[Interval] = []
        self._rounds: list[AppliedRound] = []
        self._quorum: list[QuorumChange] = []
        self._finished = False

    def set_state(self, worker_id: str, state: WorkerState | str | None, t_s: float) -> None:
        """Worker ``worker_id`` is in ``state`` from ``t_s`` on (closing its previous interval at ``t_s``).

        ``state=None`` means "no longer a member" (closes the interval, draws a gap).
        Setting the state it is already in is a no-op.
        """
        self._check_open("set_state")
        t = _norm_time(t_s, "set_state(t_s)")
        wid = _norm_worker(worker_id, "set_state(worker_id)")
        st = None if state is None else _norm_state(state, "set_state(state)")
        prev = self._open.get(wid)
        last = prev[1] if prev is not None else self._last_end.get(wid, 0.0)
        if t < last:
            raise TimelineError(f"set_state({wid!r}, t_s={t_s!r}) went backwards: worker {wid!r} is at {last} s")
        if prev is not None and prev[0] == st:
            return
        if prev is not None:
            self._intervals.append(Interval(wid, prev[0], prev[1], t))
            del self._open[wid]
            self._last_end[wid] = t
        if st is not None:
            self._open[wid] = (st, t)

    def applied_round(self, t_s: float, fragment_id: int, round_id: int) -> None:
        """An outer step for ``(fragment_id, round_id)`` applied at ``t_s``."""
        self._check_open("applied_round")
        self._rounds.append(_norm_round(len(self._rounds), (t_s, fragment_id, round_id)))

    def quorum_changed(self, t_s: float, below: bool) -> None:
        """The run went below (``True``) or back above (``False``) ``min_workers`` at ``t_s``."""
        self._check_open("quorum_changed")
        self._quorum.append(_norm_quorum(len(self._quorum), (t_s, below)))

    def state_of(self, worker_id: str) -> WorkerState | None:
        """The worker's current (open) state, or None."""
        entry = self._open.get(str(worker_id))
        return entry[0] if entry else None

    def snapshot(self, t_s: float) -> Timeline:
        """The timeline so far with open intervals drawn up to ``t_s`` (the recorder stays open)."""
        t = _norm_time(t_s, "snapshot(t_s)")
        for wid, (_, start) in self._open.items():
            if t < start:
                raise TimelineError(f"t_s={t_s!r} is before worker {wid!r}'s current state began ({start} s)")
        tail = [Interval(w, st, s, t) for w, (st, s) in self._open.items()]
        return Timeline(list(self._intervals) + tail, list(self._rounds), list(self._quorum))

    def finish(self, t_s: float) -> Timeline:
        """Close every open interval at ``t_s`` and return the timeline; the recorder is then closed."""
        self._check_open("finish")
        timeline = self.snapshot(t_s)
        self._finished = True
        return timeline

    def _check_open(self, what: str) -> None:
        if self._finished:
            raise TimelineError(f"{what}() after finish(): the recorder is closed")


# --------------------------------------------------------------------------- drawing


def draw_membership_timeline(
    ax: Axes,
    timeline: Timeline,
    *,
    title: str | None = None,
    legend: bool = True,
    worker_order: Sequence[str] | None = None,
) -> None:
    """Draw ``timeline`` into an existing matplotlib ``Axes`` (used by the one- and two-panel figures).

    ``worker_order`` (top to bottom) must list every worker of the timeline
    exactly once; by default natural id order.
    """
    if not isinstance(timeline, Timeline):
        raise TimelineError(f"timeline must be a Timeline, got {type(timeline).__name__}")
    workers = _worker_order(timeline, worker_order)
    row = {w: i for i, w in enumerate(workers)}
    end = timeline.end_s if timeline.end_s > 0 else 1.0

    # Shade the spans where the run was below quorum (from each below=True to the next below=False).
    below_since: float | None = None
    for q in sorted(timeline.quorum_changes, key=lambda q: q.t_s):
        if q.below and below_since is None:
            below_since = q.t_s
        elif not q.below and below_since is not None:
            ax.axvspan(below_since, q.t_s, color=_BELOW_COLOUR, alpha=0.07, lw=0, zorder=0)
            below_since = None
    if below_since is not None:
        ax.axvspan(below_since, end, color=_BELOW_COLOUR, alpha=0.07, lw=0, zorder=0)

    bar_h = 0.72
    for state in WorkerState:
        for w in workers:
            spans = [
                (iv.start_s, max(iv.end_s - iv.start_s, end * 1e-4))
                for iv in timeline.intervals
                if iv.worker_id == w and iv.state is state
            ]
            if spans:
                ax.broken_barh(spans, (row[w] - bar_h / 2, bar_h), facecolors=state_colour(state), edgecolor="none", zorder=2)

    fragments = sorted({r.fragment_id for r in timeline.applied_rounds})
    many_rounds = len(timeline.applied_rounds) > 60
    for r in timeline.applied_rounds:
        c = _ROUND_COLOURS[fragments.index(r.fragment_id) % len(_ROUND_COLOURS)]
        ax.axvline(r.t_s, color=c, lw=0.6 if many_rounds else 0.9, alpha=0.35 if many_rounds else 0.55, ls=":", zorder=3)
    for q in timeline.quorum_changes:
        ax.axvline(q.t_s, color=_BELOW_COLOUR if q.below else _ABOVE_COLOUR, lw=1.8, ls="--", zorder=4)

    n = len(workers)
    step = max(1, math.ceil(n / 30))  # at most ~30 labels, however many workers
    ax.set_yticks(range(0, n, step))
    ax.set_yticklabels([workers[i] for i in range(0, n, step)])
    ax.set_ylim(n - 0.5 if n else 0.5, -0.5)  # first worker on top
    ax.set_xlim(0, end * 1.01)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("worker")
    ax.grid(axis="x", color="#dddddd", lw=0.6, zorder=0)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    if title:
        ax.set_title(title, loc="left", fontsize=12, fontweight="bold")

    if legend:
        # The legend names the states drawn, so a plain run is not cluttered with frozen/dead.
        drawn = {iv.state for iv in timeline.intervals}
        handles: list = [Patch(facecolor=state_colour(s), label=state_label(s)) for s in WorkerState if s in drawn]
        if len(fragments) <= 1:
            handles.append(Line2D([], [], color=_ROUND_COLOURS[0], ls=":", lw=1.2, label="round applied"))
        else:
            for f in fragments:
                c = _ROUND_COLOURS[fragments.index(f) % len(_ROUND_COLOURS)]
                handles.append(Line2D([], [], color=c, ls=":", lw=1.2, label=f"round applied (fragment {f})"))
        handles.append(Line2D([], [], color=_BELOW_COLOUR, ls="--", lw=1.8, label="quorum lost (pause)"))
        handles.append(Line2D([], [], color=_ABOVE_COLOUR, ls="--", lw=1.8, label="quorum regained"))
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=9)


def plot_membership_timeline(
    timeline: Timeline,
    path: str | Path,
    title: str = "Membership timeline",
    *,
    worker_order: Sequence[str] | None = None,
    figsize=(12, 5),
    dpi: int = 120,
) -> Path:
    """Write a membership-timeline PNG to ``path`` and return it (``TimelineError`` on a malformed timeline)."""
    if not isinstance(timeline, Timeline):
        raise TimelineError(f"timeline must be a Timeline, got {type(timeline).__name__}")
    _worker_order(timeline, worker_order)
    from diloco.plots._figure import new_figure, plot_style, save_figure

    with plot_style():
        fig = new_figure(figsize)
        ax = fig.add_subplot(1, 1, 1)
        draw_membership_timeline(ax, timeline, title=title, worker_order=worker_order)
        return save_figure(fig, path, dpi)


# --------------------------------------------------------------------------- validation


def _worker_order(timeline: Timeline, order: Sequence[str] | None) -> list[str]:
    ids = timeline.worker_ids()
    if order is None:
        return ids
    if isinstance(order, str):
        raise TimelineError(f"worker_order={order!r} is invalid: expected a list of worker ids")
    given = [str(w) for w in order]
    if sorted(given) != sorted(ids):
        missing = sorted(set(ids) - set(given), key=_natural_key)
        extra = sorted(set(given) - set(ids), key=_natural_key)
        raise TimelineError(
            f"worker_order is invalid: expected each worker of the timeline exactly once "
            f"(missing {missing}, unknown {extra}, {len(given) - len(set(given))} duplicates)"
        )
    return given


def _natural_key(text: str) -> tuple:
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", text) if part)


def _as_list(value: object, name: str) -> list:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TimelineError(f"Timeline.{name} must be a list, got {type(value).__name__}")
    return list(value)


def _norm_time(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise TimelineError(f"{where}={value!r} is invalid: expected a finite number of seconds >= 0")
    return float(value)


def _norm_worker(value: object, where: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)) or value == "":
        raise TimelineError(f"{where}={value!r} is invalid: expected a non-empty str (or int) worker id")
    return str(value)


def _norm_state(value: object, where: str) -> WorkerState:
    try:
        return WorkerState(value)
    except ValueError:
        allowed = ", ".join(repr(s.value) for s in WorkerState)
        raise TimelineError(f"{where}={value!r} is invalid: expected a WorkerState ({allowed})") from None


def _norm_interval(i: int, x: object) -> Interval:
    if not isinstance(x, (tuple, list)) or len(x) != 4:
        raise TimelineError(f"intervals[{i}]={x!r} is invalid: expected (worker_id, state, start_s, end_s)")
    wid = _norm_worker(x[0], f"intervals[{i}].worker_id")
    st = _norm_state(x[1], f"intervals[{i}].state")
    s = _norm_time(x[2], f"intervals[{i}].start_s")
    e = _norm_time(x[3], f"intervals[{i}].end_s")
    if e < s:
        raise TimelineError(f"intervals[{i}] of worker {wid!r} ends ({e} s) before it starts ({s} s)")
    return Interval(wid, st, s, e)


def _norm_round(i: int, x: object) -> AppliedRound:
    if not isinstance(x, (tuple, list)) or len(x) != 3:
        raise TimelineError(f"applied_rounds[{i}]={x!r} is invalid: expected (t_s, fragment_id, round_id)")
    t = _norm_time(x[0], f"applied_rounds[{i}].t_s")
    for name, v in (("fragment_id", x[1]), ("round_id", x[2])):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise TimelineError(f"applied_rounds[{i}].{name}={v!r} is invalid: expected an int >= 0")
    return AppliedRound(t, x[1], x[2])


def _norm_quorum(i: int, x: object) -> QuorumChange:
    if not isinstance(x, (tuple, list)) or len(x) != 2:
        raise TimelineError(f"quorum_changes[{i}]={x!r} is invalid: expected (t_s, below)")
    t = _norm_time(x[0], f"quorum_changes[{i}].t_s")
    if not isinstance(x[1], bool):
        raise TimelineError(f"quorum_changes[{i}].below={x[1]!r} is invalid: expected a bool")
    return QuorumChange(t, x[1])
