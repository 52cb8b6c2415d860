"""The membership timeline of a simulated run, built from its trace alone.

Uses ``diloco.plots.timeline`` (the same drawing ``diloco demo`` uses): a
row per worker id (a restarted worker keeps its row), coloured by state,
dotted lines at applied rounds, dashed lines where the run lost or regained
its quorum. On top, this module shades the spans where the coordinator was
down and marks the heal (the start of the liveness phase) and the stop.

Worker states in the trace are the worker's own vocabulary
(``diloco.worker.states.WorkerState``: joining, training, waiting, paused,
stopping, stopped, and the observed-only frozen and dead), drawn as they are.

A worker that crashed or left is drawn dead/stopped until the coordinator
forgets it (its death or leave is reported, or the coordinator crashes):
that span is the failure-detection window, while the run still counts it.
After that (at once, if the coordinator did not count it) its row is empty
until it restarts. Workers stopped by the
run's shutdown stay stopped to the end. The top row is the coordinator:
shaded while it is down.
"""

from __future__ import annotations

from pathlib import Path

from diloco.plots.timeline import TimelineRecorder, draw_membership_timeline
from diloco.worker.states import WorkerState

_STATES = {s.value: s for s in WorkerState}


class TimelineBuilder:
    """A trace consumer: feed it every record, then ``plot(path)``."""

    def __init__(self) -> None:
        self.rec = TimelineRecorder()
        self.below: bool | None = None
        self.coord_down: list[list[float]] = []
        self.heal_t: float | None = None
        self.stop_t: float | None = None
        self.end_t = 0.0
        self.title = ""
        self.raw: dict[str, str] = {}
        #: Workers the coordinator counts as members (from its observer's reports).
        self.members: set[str] = set()

    def feed(self, r: dict) -> None:
        k = r["k"]
        t = r.get("t", 0.0)
        if t > self.end_t:
            self.end_t = t
        if k == "worker":
            wid, state = r["w"], r["state"]
            self.raw[wid] = state
            self.rec.set_state(wid, _STATES.get(state), t)
            if state in ("dead", "stopped") and wid not in self.members and self.stop_t is None:
                self.rec.set_state(wid, None, t)  # nobody counts it any more
        elif k == "obs":
            what = r["what"]
            if what == "join":
                self.members.add(r["worker_id"])
            elif what in ("dead", "left"):
                self.members.discard(r["worker_id"])
                if self.raw.get(r["worker_id"]) in ("dead", "stopped"):
                    self.rec.set_state(r["worker_id"], None, t)
            elif what == "apply":
                self.rec.applied_round(t, r["fragment_id"], r["round_id"])
            elif what == "quorum":
                below = r["below_min_workers"]
                if below != self.below:
                    self.rec.quorum_changed(t, below)
                    self.below = below
            elif what == "stop":
                self.stop_t = t
        elif k == "fault":
            if r["what"] == "coord_crash":
                self.coord_down.append([t, -1.0])
                self.below = None
                self.members.clear()
                for wid, state in self.raw.items():
                    if state in ("dead", "stopped"):
                        self.rec.set_state(wid, None, t)
            elif r["what"] == "coord_restart" and self.coord_down:
                self.coord_down[-1][1] = t
        elif k == "phase" and r["what"] == "heal":
            self.heal_t = t
        elif k == "config":
            self.title = (f"diloco sim seed={r['seed']}: {r['mode']}, {r['workers']} workers, "
                          f"min_workers={r['min_workers']}, {r['num_fragments']} fragment(s), faults={r['faults']}")

    def plot(self, path: str | Path, title: str | None = None) -> Path:
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch

        from diloco.plots._figure import new_figure, plot_style, save_figure

        timeline = self.rec.finish(self.end_t)
        n_workers = len(timeline.worker_ids())
        height = min(14.0, 3.0 + 0.28 * min(n_workers, 40))
        with plot_style():
            fig = new_figure((13, height))
            ax = fig.add_subplot(1, 1, 1)
            draw_membership_timeline(ax, timeline, title=title or self.title, legend=True)
            extra = []
            # The coordinator's own row, above the workers: up (light) or down (purple).
            ax.broken_barh([(0.0, self.end_t)], (-1.36, 0.72), facecolors="#e3f2fd", edgecolor="none", zorder=2)
            spans = [(a, (b if b >= 0 else self.end_t) - a) for a, b in self.coord_down]
            if spans:
                ax.broken_barh(spans, (-1.36, 0.72), facecolors="#6a1b9a", edgecolor="none", zorder=2)
                extra.append(Patch(facecolor="#6a1b9a", label="coordinator down"))
            ticks = list(ax.get_yticks())
            labels = [t.get_text() for t in ax.get_yticklabels()]
            ax.set_yticks([-1.0] + ticks)
            ax.set_yticklabels(["coordinator"] + labels)
            bottom, _top = ax.get_ylim()
            ax.set_ylim(bottom, -1.6)
            if self.heal_t is not None:
                ax.axvline(self.heal_t, color="#00897b", lw=2.2, zorder=5)
                extra.append(Line2D([], [], color="#00897b", lw=2.2, label="heal: liveness phase"))
            if self.stop_t is not None:
                ax.axvline(self.stop_t, color="black", lw=2.2, zorder=5)
                extra.append(Line2D([], [], color="black", lw=2.2, label="run stopped"))
            if extra:
                legend = ax.get_legend()
                handles = list(legend.legend_handles) if legend is not None else []
                ax.legend(handles=handles + extra, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False,
                          fontsize=9)
            ax.set_xlabel("simulated time (s)")
            return save_figure(fig, path)
