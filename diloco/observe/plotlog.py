"""``diloco plot-log DIR --out run.png``: loss curves and the membership timeline of a metrics log, as a PNG.

Reads ``DIR/metrics.jsonl`` and its rotated files (``diloco.observe.metrics_log``)
and draws, with ``diloco.plots``, every worker's reported training loss and
each applied round's mean contributor loss over time (top), and each
worker's state as the coordinator saw it (bottom). Time is wall-clock
seconds since the log's first line, so server restarts (``--resume``) line up.
"""

from __future__ import annotations

import os
from pathlib import Path

from diloco.observe.metrics_log import read_log


class PlotLogError(Exception):
    """The directory holds no metrics log, or nothing to draw."""


def load(directory: str | os.PathLike):
    """(curves ``{label: (seconds, losses)}``, ``TimelineRecorder`` filled, end time, run ids) of a log."""
    from diloco.plots import TimelineRecorder, WorkerState

    lines = list(read_log(directory))
    if not lines:
        raise PlotLogError(f"{directory}: no metrics log there (expected {Path(directory) / 'metrics.jsonl'}, "
                           f"written by `diloco server --log-dir {directory}`)")
    t0 = float(lines[0]["t"])
    curves: dict[str, tuple[list[float], list[float]]] = {}
    rounds: tuple[list[float], list[float]] = ([], [])
    rec = TimelineRecorder()
    run_ids: list[str] = []
    open_since: dict[str, float] = {}  # worker -> time of its last state line (its own times never go back)
    end = 0.0
    for line in lines:
        try:
            t = max(0.0, float(line["t"]) - t0)
        except (TypeError, ValueError, KeyError):
            continue
        end = max(end, t)
        kind = line["kind"]
        if kind == "start":
            if isinstance(line.get("run_id"), str) and line["run_id"] not in run_ids:
                run_ids.append(line["run_id"])
            for wid in list(open_since):  # a restarted server: its workers re-join
                rec.set_state(wid, None, max(t, open_since.pop(wid)))
        elif kind == "sample" and _number(line.get("loss")):
            xs, ys = curves.setdefault(str(line.get("worker_id")), ([], []))
            xs.append(t)
            ys.append(float(line["loss"]))
        elif kind == "round":
            if _number(line.get("loss")):
                rounds[0].append(t)
                rounds[1].append(float(line["loss"]))
            if isinstance(line.get("fragment_id"), int) and isinstance(line.get("round_id"), int):
                rec.applied_round(t, line["fragment_id"], line["round_id"])
        elif kind == "event" and line.get("event") == "quorum" and isinstance(line.get("below_min_workers"), bool):
            rec.quorum_changed(t, line["below_min_workers"])
        elif kind == "state" and isinstance(line.get("worker_id"), str):
            wid, state = line["worker_id"], line.get("state")
            try:
                st = WorkerState(state) if state else None
            except ValueError:
                continue
            at = max(t, open_since.get(wid, 0.0))
            rec.set_state(wid, st, at)
            if st is None:
                open_since.pop(wid, None)
            else:
                open_since[wid] = at
    if rounds[0]:
        curves["applied rounds (mean contributor loss)"] = rounds
    return curves, rec, end, run_ids


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def plot_log(directory: str | os.PathLike, out: str | os.PathLike, title: str | None = None) -> Path:
    from diloco.plots import plot_demo_figure

    curves, rec, end, run_ids = load(directory)
    if not curves:
        raise PlotLogError(f"{directory}: the log has no loss yet (workers report it on their heartbeats)")
    timeline = rec.finish(end)
    title = title or ("diloco run " + ", ".join(run_ids) if run_ids else "diloco run")
    return plot_demo_figure(curves, timeline, out, title=title, xlabel="seconds since the log began",
                            ylabel="loss", curves_title="Loss (each worker's reports; applied rounds)",
                            timeline_title="Membership (as the coordinator saw it)")
