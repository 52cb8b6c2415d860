"""The membership timeline of a simulated run (diloco.plots.timeline underneath)."""

from __future__ import annotations

from diloco.sim import run_seed
from diloco.sim.timeline import TimelineBuilder
from diloco.sim.trace import read_trace


def test_plot_of_a_faulty_run(tmp_path):
    trace, png = tmp_path / "t.jsonl", tmp_path / "t.png"
    r = run_seed(11, trace_path=str(trace), plot_path=str(png))
    assert r.ok and r.plot_path == str(png)
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_timeline_from_a_trace_file_has_every_worker_and_the_coordinator_gaps(tmp_path):
    trace = tmp_path / "t.jsonl"
    run_seed(13, trace_path=str(trace))
    b = TimelineBuilder()
    for rec in read_trace(str(trace)):
        b.feed(rec)
    assert b.coord_down and all(end >= start for start, end in b.coord_down)
    assert b.heal_t is not None
    timeline = b.rec.snapshot(b.end_t)
    assert "worker-0" in timeline.worker_ids()
    assert len(timeline.applied_rounds) >= 30
    b.plot(tmp_path / "t.png")
