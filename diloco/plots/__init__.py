"""PNG plots shared by ``diloco demo`` and ``diloco sim``: loss curves and membership timelines.

Rendering uses matplotlib's Agg canvas directly (no pyplot, no display, no
global backend switch): see :mod:`diloco.plots._figure`.
"""

from diloco.plots._figure import PlotError
from diloco.plots.curves import CURVE_COLOURS, draw_loss_curves, plot_loss_curves
from diloco.plots.demo import plot_demo_figure
from diloco.plots.timeline import (
    STATE_COLOURS,
    AppliedRound,
    Interval,
    QuorumChange,
    Timeline,
    TimelineError,
    TimelineRecorder,
    WorkerState,
    draw_membership_timeline,
    plot_membership_timeline,
)

__all__ = [
    "CURVE_COLOURS",
    "STATE_COLOURS",
    "AppliedRound",
    "Interval",
    "PlotError",
    "QuorumChange",
    "Timeline",
    "TimelineError",
    "TimelineRecorder",
    "WorkerState",
    "draw_loss_curves",
    "draw_membership_timeline",
    "plot_demo_figure",
    "plot_loss_curves",
    "plot_membership_timeline",
]
