"""``--grace-window auto`` (SPEC.md P5, "The window that sets itself"): the window's length from the
arrivals the coordinator saw -- median plus three median absolute deviations of the offsets after a
window opens, within the floor and the ceiling, recomputed at every close -- told to the core, shown
in status and /metrics; a window too short for the workers it should merge grows back."""

from __future__ import annotations

import pytest
import torch

from diloco.coordinator import Coordinator, CoordinatorConfig
from diloco.coordinator.grace_auto import FLOOR_S, MIN_SAMPLES, AutoGraceWindow
from diloco.core import ConfigError, FSMConfig, Mode
from diloco.outer import OuterConfig
from diloco.testing import joined, replies
from diloco.wire.messages import Result, Submit


def test_nothing_is_proposed_before_enough_arrivals_then_median_plus_three_mads():
    auto = AutoGraceWindow(5.0)
    auto.accepted(0, 10.0)
    auto.accepted(0, 10.2)
    auto.accepted(0, 10.4)
    assert auto.closed(0, everyone_in=True) is None and auto.window_s == 5.0  # 2 offsets < MIN_SAMPLES
    auto.accepted(0, 20.0)
    auto.accepted(0, 20.2)
    auto.accepted(0, 20.4)
    # Offsets 0.2, 0.4, 0.2, 0.4: median 0.3, MAD 0.1 -> 0.6 s.
    assert MIN_SAMPLES == 4 and auto.closed(0, everyone_in=True) == pytest.approx(0.6)
    assert auto.window_s == pytest.approx(0.6)
    assert auto.status() == {"auto": True, "window_s": 0.6, "ceiling_s": 5.0, "samples": 4}


def test_the_proposal_stays_within_the_floor_and_the_ceiling_and_small_changes_are_not_told():
    def windows(auto, offsets):
        told = []
        for i, offset in enumerate(offsets):
            auto.accepted(0, 10.0 * i)
            auto.accepted(0, 10.0 * i + offset)
            told.append(auto.closed(0, True))
        return told

    auto = AutoGraceWindow(1.0)
    assert windows(auto, [0.001] * 4)[-1] == FLOOR_S
    auto = AutoGraceWindow(1.0)
    assert windows(auto, [0.9, 0.95, 1.4, 2.0]) == [None] * 4  # capped at the ceiling, where it is
    assert auto.window_s == 1.0
    auto = AutoGraceWindow(5.0)
    auto.window_s = 1.0
    assert windows(auto, [1.0, 1.01, 0.99, 1.0])[-1] is None, "a change under 5% is not told"


def test_a_window_that_closed_with_members_out_learns_their_arrival_from_the_next_opener():
    auto = AutoGraceWindow(5.0)
    auto.window_s = 0.5
    for i in range(4):  # two fast workers 0.1 s apart, a third 1.5 s after the window opened
        t = 10.0 * i
        auto.accepted(0, t)
        auto.accepted(0, t + 0.1)
        auto.closed(0, everyone_in=False)  # the 0.5 s deadline passed without the third
        auto.accepted(0, t + 1.5)          # it opens the next window: 1.5 s after the last one opened
        auto.closed(0, everyone_in=True)
    # Without the censored arrivals every offset would be 0.1; with them the window covers 1.5 s.
    assert auto.window_s >= 1.5


def _coordinator(auto: bool = True, ceiling: float = 5.0) -> Coordinator:
    fsm = FSMConfig(min_workers=1, mode=Mode.ASYNC, heartbeat_timeout_s=1e9, grace_window_s=ceiling)
    return Coordinator(CoordinatorConfig(fsm=fsm, outer=OuterConfig("sgd", 0.7, 0.0), grace_auto=auto), 0.0)


P0 = {"w": torch.zeros(3)}


def test_the_coordinator_shrinks_the_window_to_the_arrivals_and_tells_the_core_status_and_metrics():
    events = []
    c = joined(_coordinator(), P0, "w1", "w2", "w3")
    c._observer = lambda kind, now, info: events.append((kind, info))
    assert c.status()["grace_window_s"] == 5.0 and c.status()["grace_auto"] is True
    version, t = 0, 0.0
    for _ in range(4):  # every worker in within 0.4 s of the first: each window closes as the last comes
        out = []
        for i, wid in enumerate(("w1", "w2", "w3")):
            out += c.handle(wid, Submit(wid, 0, version, {"w": torch.ones(3)}), t + 0.2 * i)
        assert {r.next_round_id for _, r in replies(out, Result)} == {version + 1}
        version, t = version + 1, t + 10.0
    assert c.fsm.grace_window_s == pytest.approx(0.6) == c.status()["grace_window_s"]
    assert ("grace_window", {"seconds": pytest.approx(0.6)}) in events
    from diloco.observe.prom import RunCollector

    class Observatory:
        def snapshot(self):
            return c.status()

    metrics = {m.name: m for m in RunCollector(Observatory()).collect()}
    assert metrics["diloco_grace_window_seconds"].samples[0].value == pytest.approx(0.6)
    # The next window lasts 0.6 s, not 5: a lone contribution applies on the tick after it.
    c.handle("w1", Submit("w1", 0, version, {"w": torch.ones(3)}), t)
    assert not replies(c.tick(t + 0.5), Result)
    assert [w for w, _ in replies(c.tick(t + 0.7), Result)] == ["w1"]


def test_auto_needs_a_window_and_the_server_parses_it():
    from diloco.deploy.server import ServerError, ServerSettings, build_config

    with pytest.raises(ConfigError, match="grace_auto"):
        CoordinatorConfig(FSMConfig(min_workers=1, mode=Mode.ASYNC), grace_auto=True)
    cfg = build_config(ServerSettings(mode="async", grace_window_s="auto"))
    assert cfg.grace_auto and cfg.fsm.grace_window_s == 5.0
    cfg = build_config(ServerSettings(mode="async", grace_window_s="auto", grace_window_max_s=2.0))
    assert cfg.fsm.grace_window_s == 2.0
    assert CoordinatorConfig.from_dict(cfg.to_dict()).grace_auto
    resumed = build_config(ServerSettings(), base=cfg)
    assert resumed.grace_auto and resumed.fsm.grace_window_s == 2.0
    assert not build_config(ServerSettings(grace_window_s=0.0), base=cfg).grace_auto
    with pytest.raises(ServerError, match="needs --mode async"):
        build_config(ServerSettings(grace_window_s="auto"))
    with pytest.raises(ServerError, match="--grace-window-max bounds"):
        build_config(ServerSettings(mode="async", grace_window_s=1.0, grace_window_max_s=2.0))


def test_the_cli_takes_auto_and_refuses_nonsense(capsys):
    from diloco.cli import main

    for bad in (["--grace-window", "soon"], ["--grace-window", "auto", "--grace-window-max", "0"]):
        with pytest.raises(SystemExit) as exc:
            main(["server", "--mode", "async", *bad])
        assert exc.value.code == 2
        assert "--grace-window" in capsys.readouterr().err


def test_a_restarted_or_resumed_coordinator_opens_its_windows_at_the_length_it_had_set():
    from diloco.coordinator.checkpoint import coordinator_state, restore_coordinator
    from diloco.core import GraceWindowChanged

    c = joined(_coordinator(), P0, "w1")
    c.fsm.step(GraceWindowChanged(1.2))
    meta, tensors = coordinator_state(c)
    assert restore_coordinator(meta, tensors, 100.0).fsm.grace_window_s == 1.2
    lower = _coordinator(ceiling=1.0).config  # resumed under a lower --grace-window-max: its ceiling
    assert restore_coordinator(meta, tensors, 100.0, config=lower).fsm.grace_window_s == 1.0
    higher = _coordinator(ceiling=8.0).config
    assert restore_coordinator(meta, tensors, 100.0, config=higher).fsm.grace_window_s == 1.2
