"""Plots: valid, non-trivial PNGs; timelines validated with errors that name the bad item."""

from __future__ import annotations

import math

import pytest

from diloco.plots import (
    STATE_COLOURS,
    PlotError,
    Timeline,
    TimelineError,
    TimelineRecorder,
    WorkerState,
    plot_demo_figure,
    plot_loss_curves,
    plot_membership_timeline,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
W = WorkerState


def _assert_png(path, min_kb=20):
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert len(data) > min_kb * 1024, len(data)  # a blank 12x5 in figure is ~10 kB; ours has content
    # IHDR: width and height (big-endian) at bytes 16..24.
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    return width, height


def _curves():
    xs = list(range(0, 501, 10))
    return {
        "DiLoCo k=4 H=10": (xs, [1.7 + 3.8 * math.exp(-x / 60) for x in xs]),
        "sync data parallel k=4": (xs, [1.76 + 3.7 * math.exp(-x / 55) for x in xs]),
        "single worker": (xs, [2.1 + 3.4 * math.exp(-x / 70) for x in xs]),
    }


def _timeline() -> Timeline:
    rec = TimelineRecorder()
    for w in ("w0", "w1", "w2"):
        rec.set_state(w, W.TRAINING, 0.0)
    rec.set_state("w0", W.WAITING, 2.0)
    rec.set_state("w1", W.WAITING, 2.3)
    rec.set_state("w2", W.WAITING, 2.5)
    rec.applied_round(2.5, 0, 0)
    for w in ("w0", "w1", "w2"):
        rec.set_state(w, W.TRAINING, 2.5)
    rec.set_state("w2", W.DEAD, 3.0)
    rec.quorum_changed(3.0, below=True)
    rec.set_state("w0", W.PAUSED, 4.5)
    rec.set_state("w1", W.PAUSED, 4.7)
    rec.set_state("w3", W.TRAINING, 6.0)
    rec.set_state("w3", W.WAITING, 8.0)
    rec.quorum_changed(6.0, below=False)
    rec.applied_round(8.0, 0, 1)
    for w in ("w0", "w1", "w3"):
        rec.set_state(w, W.STOPPED, 9.0)
    return rec.finish(10.0)


def test_the_timeline_draws_the_workers_own_states_each_with_its_own_colour():
    from diloco.worker.states import WorkerState as SessionState
    assert WorkerState is SessionState  # one vocabulary: worker, simulator, plots
    assert [s.value for s in WorkerState] == ["joining", "training", "waiting", "paused", "stopping", "stopped",
                                              "frozen", "dead"]
    assert set(STATE_COLOURS) == set(WorkerState)
    assert len(set(STATE_COLOURS.values())) == len(WorkerState)
    assert W("dead") is W.DEAD


def test_recorder_builds_closed_intervals():
    tl = _timeline()
    assert tl.worker_ids() == ["w0", "w1", "w2", "w3"]
    w2 = [iv for iv in tl.intervals if iv.worker_id == "w2"]
    assert [(iv.state, iv.start_s, iv.end_s) for iv in w2] == [
        (W.TRAINING, 0.0, 2.5), (W.WAITING, 2.5, 2.5), (W.TRAINING, 2.5, 3.0), (W.DEAD, 3.0, 10.0),
    ]
    assert all(iv.start_s <= iv.end_s for iv in tl.intervals)
    assert tl.end_s == 10.0 and len(tl.applied_rounds) == 2 and len(tl.quorum_changes) == 2


def test_recorder_rejects_time_going_backwards_and_use_after_finish():
    rec = TimelineRecorder()
    rec.set_state("w0", W.TRAINING, 5.0)
    with pytest.raises(TimelineError, match="went backwards: worker 'w0' is at 5.0 s"):
        rec.set_state("w0", W.WAITING, 4.0)
    rec.set_state("w1", W.TRAINING, 1.0)  # other workers may report earlier times
    with pytest.raises(TimelineError, match="WorkerState"):
        rec.set_state("w0", "sleeping", 6.0)
    rec.finish(7.0)
    with pytest.raises(TimelineError, match="after finish"):
        rec.set_state("w0", W.TRAINING, 8.0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(intervals=[("w0", "training", 3.0, 1.0)]), r"intervals\[0\] of worker 'w0' ends \(1.0 s\) before it starts"),
        (dict(intervals=[("w0", "flying", 0.0, 1.0)]), r"intervals\[0\].state='flying' is invalid"),
        (dict(intervals=[("w0", "training", 0.0)]), r"intervals\[0\]=.* expected \(worker_id, state, start_s, end_s\)"),
        (dict(intervals=[("w0", "training", -1.0, 1.0)]), r"intervals\[0\].start_s=-1.0"),
        (dict(intervals=[("w0", "training", 0.0, math.inf)]), r"intervals\[0\].end_s=inf"),
        (dict(intervals=[("", "training", 0.0, 1.0)]), r"intervals\[0\].worker_id=''"),
        (
            dict(intervals=[("w0", "training", 0.0, 2.0), ("w0", "waiting", 1.0, 3.0)]),
            r"intervals\[1\] of worker 'w0' starts at 1.0 s, inside intervals\[0\]",
        ),
        (dict(applied_rounds=[(1.0, -1, 0)]), r"applied_rounds\[0\].fragment_id=-1"),
        (dict(applied_rounds=[(1.0, 0)]), r"applied_rounds\[0\]=.*expected \(t_s, fragment_id, round_id\)"),
        (dict(quorum_changes=[(1.0, "yes")]), r"quorum_changes\[0\].below='yes' is invalid: expected a bool"),
        (dict(intervals="w0"), "Timeline.intervals must be a list"),
    ],
)
def test_malformed_timelines_are_rejected_with_a_precise_error(kwargs, match):
    with pytest.raises(TimelineError, match=match):
        Timeline(**kwargs)


def test_touching_intervals_are_fine():
    timeline = Timeline(intervals=[("w0", "training", 0.0, 2.0), ("w0", "waiting", 2.0, 3.0)])
    assert len(timeline.intervals) == 2 and timeline.end_s == 3.0


def test_loss_curves_png(tmp_path):
    w, h = _assert_png(plot_loss_curves(_curves(), tmp_path / "loss.png", "Held-out loss"))
    assert (w, h) == (1440, 600)  # 12 x 5 in at dpi 120


def test_membership_timeline_png(tmp_path):
    _assert_png(plot_membership_timeline(_timeline(), tmp_path / "sub" / "timeline.png", "Membership"))


def test_demo_figure_png(tmp_path):
    w, h = _assert_png(plot_demo_figure(_curves(), _timeline(), tmp_path / "demo.png", "demo"), min_kb=40)
    assert (w, h) == (1440, 840)  # 12 x 7 in at dpi 120


def test_empty_timeline_still_plots(tmp_path):
    _assert_png(plot_membership_timeline(Timeline(), tmp_path / "empty.png"), min_kb=5)


def test_plot_input_errors(tmp_path):
    with pytest.raises(PlotError, match="lengths must match"):
        plot_loss_curves({"a": ([1, 2, 3], [1.0, 2.0])}, tmp_path / "x.png")
    with pytest.raises(PlotError, match="non-empty dict"):
        plot_loss_curves({}, tmp_path / "x.png")
    with pytest.raises(PlotError, match=r"ending in \.png"):
        plot_loss_curves(_curves(), tmp_path / "x.jpg")
    with pytest.raises(TimelineError, match="must be a Timeline"):
        plot_demo_figure(_curves(), [("w0", "training", 0, 1)], tmp_path / "x.png")
    with pytest.raises(TimelineError, match=r"missing \['w3'\]"):
        plot_membership_timeline(_timeline(), tmp_path / "x.png", worker_order=["w0", "w1", "w2"])
    assert not list(tmp_path.iterdir())  # nothing written on bad input
