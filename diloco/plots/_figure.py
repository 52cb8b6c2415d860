"""Figure plumbing shared by every plot: Agg canvas, no pyplot, no display, no global state.

Figures are built with ``matplotlib.figure.Figure`` and rendered by
``FigureCanvasAgg`` directly, so plotting never touches pyplot's global
figure manager or the process-wide backend (safe in threads, in tests and
next to a user's own interactive matplotlib session).
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

#: Default size of the two-panel demo figure (inches) and resolution.
DEFAULT_FIGSIZE = (12, 7)
DEFAULT_DPI = 120

_RC = {
    "font.size": 10,
    "axes.titlesize": 12,
    "axes.labelsize": 10.5,
    "xtick.labelsize": 9.5,
    "ytick.labelsize": 9.5,
}


class PlotError(ValueError):
    """Bad input to a plotting function: names the argument, the value and what was expected."""


def plot_style():
    """Context manager with the house font sizes; wrap the whole build-and-save of a figure in it."""
    import matplotlib

    return matplotlib.rc_context(_RC)


def new_figure(figsize=DEFAULT_FIGSIZE) -> Figure:
    """A blank Agg-backed figure with constrained layout (keeps outside legends inside the PNG)."""
    fig = Figure(figsize=figsize, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save_figure(fig: Figure, path, dpi: int = DEFAULT_DPI) -> Path:
    """Render ``fig`` to a PNG at ``path`` (parent directories are created) and return the path."""
    p = Path(path)
    if p.suffix.lower() != ".png":
        raise PlotError(f"path={str(p)!r} is invalid: expected a file name ending in .png")
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=dpi, format="png", facecolor="white")
    return p
