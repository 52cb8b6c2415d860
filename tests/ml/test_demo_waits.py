"""Every wait of ``diloco demo`` ends: with what it waited for, or with an error saying
where each worker is (the demo once sat silent for 400 s waiting for a PAUSED report)."""

from __future__ import annotations

import time

import pytest

from diloco.demo import run as demo
from diloco.testing import QuietDemoUI
from diloco.demo.waits import wait_until


class Boom(Exception):
    pass


def _wait(done, **kw):
    notes: list[str] = []
    kw.setdefault("last_progress", lambda: 0.0)
    wait_until("the thing", done, where=lambda: "w1 is waiting", check=lambda: None, note=notes.append,
               error=Boom, **kw)
    return notes


def test_a_wait_with_a_limit_fails_naming_what_it_waited_for_and_where_the_workers_are():
    t0 = time.monotonic()
    with pytest.raises(Boom, match=r"gave up waiting for the thing after 0.3 s: w1 is waiting"):
        _wait(lambda: False, limit_s=0.3)
    assert time.monotonic() - t0 < 2.0


def test_a_wait_for_progress_fails_once_nothing_moves_and_reports_while_it_lasts(monkeypatch):
    monkeypatch.setattr("diloco.demo.waits.PROGRESS_EVERY_S", 0.1)
    notes: list[str] = []
    with pytest.raises(Boom, match=r"the thing: nothing moved for 0 s: w1 is waiting"):
        wait_until("the thing", lambda: False, where=lambda: "w1 is waiting", check=lambda: None,
                   last_progress=lambda: 0.0, note=notes.append, error=Boom, stall_s=0.35)
    assert notes and all(n.startswith("still waiting for the thing (") for n in notes)


def test_a_wait_ends_when_done_and_raises_what_check_raises():
    assert _wait(lambda: True, limit_s=0.1) == []
    with pytest.raises(KeyError):
        wait_until("x", lambda: False, where=str, check=lambda: {}["gone"], last_progress=time.monotonic,
                   note=print, error=Boom, limit_s=5)


def test_survivors_that_never_report_paused_end_the_demo_with_where_they_are(tiny_settings, small_corpus,
                                                                              monkeypatch):
    """A survivor whose PAUSED never reaches the demo: an error within stall_timeout_s naming
    it, what it reported and what its session says -- not a silent wait."""
    real = demo._Run._on_state

    def lose_worker_1s_pause(self, worker_id, state, t):
        if not (worker_id == "worker-1" and state == "paused"):
            real(self, worker_id, state, t)

    monkeypatch.setattr(demo._Run, "_on_state", lose_worker_1s_pause)
    cfg = demo.DemoConfig(workers=3, steps=20, sync_every=5, baselines=False, settings=tiny_settings,
                          heartbeat_timeout_s=0.5, stall_timeout_s=4.0)
    ui = QuietDemoUI()
    t0 = time.monotonic()
    with pytest.raises(demo.DemoError) as info:
        demo.run_demo(cfg, ui)
    text = str(info.value)
    assert text.startswith("gave up waiting for the survivors to report PAUSED at their sync point after 4 s: "
                           "worker-1 is waiting (its session says paused, waiting for the Result"), text
    assert "worker-2" not in text  # it paused
    assert time.monotonic() - t0 < 60
    assert any("quorum lost" in n for n in ui.notes)
