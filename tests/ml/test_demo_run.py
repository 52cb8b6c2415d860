"""``diloco demo`` end to end on a tiny model: the fault, the pause, the replacement, the
baselines, and the same result from the same seed however the threads are scheduled."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from diloco.demo import run as demo
from diloco.testing import QuietDemoUI


def _run(tiny_settings, **kw):
    cfg = demo.DemoConfig(workers=3, steps=30, sync_every=5, settings=tiny_settings, heartbeat_timeout_s=0.5,
                          replacement_delay_s=0.2, stall_timeout_s=60.0, **kw)
    ui = QuietDemoUI()
    return demo.run_demo(cfg, ui), ui


def _untimed(notes: list[str]) -> list[str]:
    # "[  12.3s] text" -> "text"
    return [re.sub(r"^\[\s*[\d.]+s\] ", "", n) for n in notes if not n.startswith("still waiting")]


def test_the_demo_pauses_below_quorum_resumes_with_a_replacement_and_trains_the_baselines(tiny_settings):
    result, ui = _run(tiny_settings)
    notes = _untimed(ui.notes)
    # The victim (the last worker) crashes at a fixed step, halfway through round 2.
    assert notes[0].startswith("worker-3 killed before its step 13, mid-round"), notes
    assert any(n.startswith("quorum lost: paused: 2 live workers < min_workers 3") for n in notes), notes
    assert "worker-1, worker-2 paused at their sync point: below quorum nothing is applied" in notes
    assert notes.index("starting replacement worker-4") < notes.index("worker-4 joined; enlisted in the open round")
    assert any(n.startswith("quorum back: quorum met: 3 live workers >= min_workers 3") for n in notes), notes
    assert result.paused_s > 0
    assert result.diloco.syncs == 30 // 5  # every round applied, none twice, none with fewer than 3
    assert result.baseline is not None and result.single is not None
    assert result.baseline.syncs == 30 and result.single.syncs == 0
    for r in (result.diloco, result.baseline, result.single):
        assert r.eval_losses[-1] < r.eval_losses[0]  # each learned something


def test_the_same_seed_gives_the_same_demo(tiny_settings):
    (a, ua), (b, ub) = _run(tiny_settings, baselines=False), _run(tiny_settings, baselines=False)
    assert _untimed(ua.notes) == _untimed(ub.notes)
    # Bit-identical except for the order the coordinator sums a round's contributions in
    # (fp32 addition is not associative): agreement far below the printed 4 decimals.
    assert a.diloco.eval_losses == pytest.approx(b.diloco.eval_losses, rel=1e-5, abs=0)
    c, _ = _run(tiny_settings, baselines=False, seed=1)
    assert c.diloco.eval_losses[-1] != pytest.approx(a.diloco.eval_losses[-1], rel=1e-3)


@pytest.mark.parametrize("flags, message", [
    (["--seq-len", "0"], "seq_len"),
    (["--lr", "0"], "lr"),
    (["--lr", "nan"], "lr"),
    (["--batch-size", "0"], "batch_size"),
    (["--outer-lr", "-1"], "outer lr=-1.0 is invalid"),
    (["--outer-lr", "nan"], "outer lr=nan is invalid"),
    (["--outer-momentum", "1.5"], "outer momentum=1.5 is invalid"),
])
def test_bad_demo_flags_exit_2_naming_the_setting(flags, message):
    proc = subprocess.run([sys.executable, "-m", "diloco", "demo", *flags], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_the_collective_demo_pauses_resumes_and_ends_where_the_hub_does(tiny_settings):
    """``diloco demo --data-plane collective``: the same story (kill, pause, replacement that heals
    from a member) and the same loss as on the hub, up to the order of fp32 sums."""
    hub, _ = _run(tiny_settings, baselines=False)
    coll, ui = _run(tiny_settings, baselines=False, data_plane="collective")
    notes = _untimed(ui.notes)
    assert notes[0].startswith("worker-3 killed before its step 13, mid-round"), notes
    assert any(n.startswith("quorum lost: paused: 2 live workers < min_workers 3") for n in notes), notes
    assert any(n.startswith("quorum back: quorum met: 3 live workers >= min_workers 3") for n in notes), notes
    assert coll.diloco.syncs == hub.diloco.syncs == 30 // 5
    assert coll.paused_s > 0 and coll.bytes_moved > 0
    assert coll.diloco.eval_losses[-1] == pytest.approx(hub.diloco.eval_losses[-1], rel=5e-3)
