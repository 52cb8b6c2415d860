"""Loss curves: ``{label: (steps, losses)}`` -> one line per run."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from matplotlib.axes import Axes

from diloco.plots._figure import PlotError, new_figure, plot_style, save_figure

__all__ = ["plot_loss_curves", "draw_loss_curves", "CURVE_COLOURS"]

#: Line colours, in order of the curves dict.
CURVE_COLOURS = ["#1f6fb4", "#d1495b", "#3a923a", "#8e5fb0", "#e08e0b", "#00798c", "#7f7f7f", "#b5651d"]


def _validate(curves: object) -> dict[str, tuple[list[float], list[float]]]:
    if not isinstance(curves, Mapping) or not curves:
        raise PlotError(f"curves={curves!r:.80} is invalid: expected a non-empty dict {{label: (steps, losses)}}")
    out: dict[str, tuple[list[float], list[float]]] = {}
    for label, value in curves.items():
        if not isinstance(label, str) or not label:
            raise PlotError(f"curves key {label!r} is invalid: expected a non-empty str label")
        if not isinstance(value, (tuple, list)) or len(value) != 2:
            raise PlotError(f"curves[{label!r}] is invalid: expected a pair (steps, losses)")
        try:
            xs = [float(x) for x in value[0]]
            ys = [float(y) for y in value[1]]
        except (TypeError, ValueError):
            raise PlotError(f"curves[{label!r}] is invalid: steps and losses must be sequences of numbers") from None
        if len(xs) != len(ys):
            raise PlotError(f"curves[{label!r}] has {len(xs)} steps but {len(ys)} losses: lengths must match")
        if not xs:
            raise PlotError(f"curves[{label!r}] is empty: expected at least one (step, loss) point")
        if not all(math.isfinite(x) for x in xs):
            raise PlotError(f"curves[{label!r}] has a non-finite step")
        out[label] = (xs, ys)
    return out


def _auto_top(data: Mapping[str, tuple[list[float], list[float]]]) -> float | None:
    """Trim the y axis above the early steep drop when it would squash the rest.

    Looks at the points past the first 10% of the x range: if the full range
    is more than 2.5x theirs, the top is set just above their maximum.
    """
    xs_all = [x for xs, _ in data.values() for x in xs]
    x0, x1 = min(xs_all), max(xs_all)
    cut = x0 + 0.1 * (x1 - x0)
    heads = [y for _, ys in data.values() for y in ys if math.isfinite(y)]
    tails = [y for xs, ys in data.values() for x, y in zip(xs, ys) if x >= cut and math.isfinite(y)]
    if len(tails) < 2 or not heads:
        return None
    lo, hi_tail, hi = min(heads), max(tails), max(heads)
    if hi_tail > lo and hi - lo > 2.5 * (hi_tail - lo):
        return hi_tail + 0.15 * (hi_tail - lo)
    return None


def draw_loss_curves(
    ax: Axes,
    curves: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    *,
    title: str | None = None,
    xlabel: str = "inner step",
    ylabel: str = "loss (nats / char)",
    ylim: tuple[float, float] | None | str = "auto",
    legend: bool = True,
) -> None:
    """Draw the curves into an existing ``Axes``; labels get the final value appended.

    ``ylim="auto"`` trims the initial steep drop when it would squash the
    interesting part of the curves; ``None`` leaves matplotlib's limits;
    a pair sets them.
    """
    data = _validate(curves)
    for i, (label, (xs, ys)) in enumerate(data.items()):
        colour = CURVE_COLOURS[i % len(CURVE_COLOURS)]
        final = ys[-1]
        marker = "o" if len(xs) <= 40 else None
        lw = 1.8 if len(xs) <= 300 else 1.1  # long (per-step) curves: thinner, so several stay readable
        ax.plot(xs, ys, color=colour, lw=lw, marker=marker, ms=3.5, label=f"{label}  ({final:.3f})", alpha=0.9)
    if ylim == "auto":
        top = _auto_top(data)
        if top is not None:
            bottom = min(y for _, ys in data.values() for y in ys if math.isfinite(y))
            ax.set_ylim(bottom - 0.05 * (top - bottom), top)
    elif ylim is not None:
        ax.set_ylim(*ylim)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(color="#e3e3e3", lw=0.7)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    if title:
        ax.set_title(title, loc="left", fontsize=12, fontweight="bold")
    if legend:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=9, title="run  (final loss)",
                  title_fontsize=8.5, alignment="left")


def plot_loss_curves(
    curves: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    path: str | Path,
    title: str = "Loss",
    *,
    xlabel: str = "inner step",
    ylabel: str = "loss (nats / char)",
    ylim: tuple[float, float] | None | str = "auto",
    figsize=(12, 5),
    dpi: int = 120,
) -> Path:
    """Write a loss-curve PNG to ``path`` and return it. ``curves``: ``{label: (steps, losses)}``."""
    _validate(curves)  # fail before creating a figure
    with plot_style():
        fig = new_figure(figsize)
        ax = fig.add_subplot(1, 1, 1)
        draw_loss_curves(ax, curves, title=title, xlabel=xlabel, ylabel=ylabel, ylim=ylim)
        return save_figure(fig, path, dpi)
