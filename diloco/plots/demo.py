"""The two-panel figure of ``diloco demo`` (and ``diloco sim --plot``): loss on top, membership below."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from diloco.plots._figure import DEFAULT_DPI, DEFAULT_FIGSIZE, new_figure, plot_style, save_figure
from diloco.plots.curves import _validate, draw_loss_curves
from diloco.plots.timeline import Timeline, TimelineError, _worker_order, draw_membership_timeline

__all__ = ["plot_demo_figure"]


def plot_demo_figure(
    curves: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    timeline: Timeline,
    path: str | Path,
    title: str = "DiLoCo demo",
    *,
    curves_title: str = "Loss",
    timeline_title: str = "Membership",
    xlabel: str = "inner step",
    ylabel: str = "loss (nats / char)",
    worker_order: Sequence[str] | None = None,
    figsize=DEFAULT_FIGSIZE,
    dpi: int = DEFAULT_DPI,
) -> Path:
    """Write one PNG: loss curves (``{label: (steps, losses)}``) on top, the membership timeline below.

    The two panels have their own x axes (steps vs seconds). Inputs are
    validated before anything is drawn (``PlotError`` / ``TimelineError``).
    """
    _validate(curves)
    if not isinstance(timeline, Timeline):
        raise TimelineError(f"timeline must be a Timeline, got {type(timeline).__name__}")
    n_workers = len(_worker_order(timeline, worker_order))
    with plot_style():
        fig = new_figure(figsize)
        # Give the timeline more room when there are many workers.
        bottom = 1.0 if n_workers <= 8 else 1.4
        top_ax, bottom_ax = fig.subplots(2, 1, height_ratios=[1.15, bottom])
        draw_loss_curves(top_ax, curves, title=curves_title, xlabel=xlabel, ylabel=ylabel)
        draw_membership_timeline(bottom_ax, timeline, title=timeline_title, worker_order=worker_order)
        fig.suptitle(title, fontsize=14, fontweight="bold", x=0.01, ha="left")
        return save_figure(fig, path, dpi)
