"""Compute utilisation against bandwidth (log x), one curve per method: ``diloco plan --plot``."""

from __future__ import annotations

from pathlib import Path

from diloco.plots._figure import PlotError, new_figure, plot_style, save_figure

_COLOURS = ("#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e")


def plot_utilisation_curves(path, bandwidths_gbit_s, curves: dict, targets=(), title: str = "") -> Path:
    """Write a PNG of each named curve (utilisation in [0, 1] at each bandwidth) and dotted target lines."""
    xs = [float(b) for b in bandwidths_gbit_s]
    if not xs or any(b <= 0 for b in xs):
        raise PlotError(f"bandwidths_gbit_s={xs[:5]!r} is invalid: expected positive values")
    if not curves:
        raise PlotError("curves is empty: expected at least one named curve")
    for name, ys in curves.items():
        if len(ys) != len(xs):
            raise PlotError(f"curves[{name!r}] has {len(ys)} points, expected {len(xs)} (one per bandwidth)")
    with plot_style():
        fig = new_figure((9, 5.5))
        ax = fig.add_subplot(1, 1, 1)
        for target in targets:
            ax.axhline(100 * target, color="#999999", linestyle=":", linewidth=0.8)
        for i, (name, ys) in enumerate(curves.items()):
            ax.plot(xs, [100 * float(y) for y in ys], marker=".", color=_COLOURS[i % len(_COLOURS)], label=name)
        ax.set_xscale("log")
        ax.set_xlabel("bandwidth (Gbit/s)")
        ax.set_ylabel("compute utilisation (%)")
        ax.set_ylim(0, 101)
        ax.grid(True, which="both", alpha=0.25)
        ax.legend(loc="lower right")
        if title:
            ax.set_title(title)
        return save_figure(fig, path)
