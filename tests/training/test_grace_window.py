"""The async grace window on the coordinator (SPEC.md P5): a merged step is the mean of its
contributions, made through the sync rounds' running sum (the same bits as a sync round of the
same pseudo-gradients), every contributor's Result names the one new version, and a journal
replay of merged steps comes back bit for bit.
"""

from __future__ import annotations

import json

import pytest
import torch

from diloco.coordinator import CoordinatorConfig
from diloco.coordinator.checkpoint import find_newest, load_coordinator
from diloco.core import FSMConfig, Mode
from diloco.coordinator import Coordinator
from diloco.outer import OuterConfig
from diloco.testing import joined, replies
from diloco.wire.messages import Result, Submit

from tests.training.test_journal import _same_state, _state_of, run, script

P0 = {"w": torch.tensor([1.0, 2.0, -3.0]), "b": torch.tensor([0.5])}


def _grad(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(t.shape, generator=g) * 0.3 for n, t in P0.items()}


def _coordinator(mode: str, window: float = 0.0, wire: str = "fp32", min_workers: int = 1,
                 outer: str = "sgd") -> Coordinator:
    fsm = FSMConfig(min_workers=min_workers, mode=Mode(mode), heartbeat_timeout_s=1e9, grace_window_s=window)
    config = CoordinatorConfig(fsm=fsm, outer=OuterConfig(outer, 0.7, 0.8), wire_dtype=wire)
    return Coordinator(config, 0.0)


def test_a_merged_step_is_the_mean_of_its_contributions_as_a_sync_round_makes_it():
    a = joined(_coordinator("async", window=5.0), P0, "w1", "w2", "w3")
    s = joined(_coordinator("sync"), P0, "w1", "w2", "w3")
    results = []
    for i, wid in enumerate(("w1", "w2", "w3")):
        results += replies(a.handle(wid, Submit(wid, 0, 0, _grad(i)), 0.1 * (i + 1)), Result)
        s.handle(wid, Submit(wid, 0, 0, _grad(i)), 0.1 * (i + 1))
    # Every live member is in the window: it closed early, as one outer step.
    assert a.fsm.open_round_ids() == (1,) and a.stats.rounds_applied == 1
    assert sorted(w for w, _ in results) == ["w1", "w2", "w3"]
    assert {r.next_round_id for _, r in results} == {1}
    # Delayed Nesterov with delay 1 steps like plain Nesterov on its first step: the same bits.
    for n in P0:
        assert torch.equal(a.store.params[n], s.store.params[n]), n
        for _, r in results:
            assert torch.equal(r.params[n], a.store.params[n])


def test_the_window_closes_on_the_tick_after_its_deadline_with_what_it_has():
    c = joined(_coordinator("async", window=2.0), P0, "w1", "w2", "w3")
    assert not replies(c.handle("w1", Submit("w1", 0, 0, _grad(1)), 1.0), Result)
    assert not replies(c.handle("w2", Submit("w2", 0, 0, _grad(2)), 2.5), Result)
    assert not c.tick(2.9)
    out = c.tick(3.0)  # 1.0 + 2.0: the deadline
    assert sorted(p for p, m in out if isinstance(m, Result)) == ["w1", "w2"]
    assert c.fsm.open_round_ids() == (1,)


def test_window_zero_is_one_step_per_contribution():
    c = joined(_coordinator("async"), P0, "w1", "w2")
    for i, wid in enumerate(("w1", "w2")):
        (res,) = replies(c.handle(wid, Submit(wid, 0, 0, _grad(i)), 0.0), Result)
        assert res[1].next_round_id == i + 1


def test_a_journal_of_merged_steps_replays_bit_for_bit(tmp_path):
    for wire in ("fp32", "int8"):
        ck = tmp_path / wire
        c = _coordinator("async", window=1e6, wire=wire, outer="delayed_nesterov")
        # Two workers submit from each base version: each window closes early with both.
        run(ck, script(6, wire=wire), c, full_every=4)
        assert c.fsm.rounds_applied == 6 and c.stats.contributions_accepted == 12
        assert find_newest(ck).replayed > 0
        _same_state(_state_of(load_coordinator(ck, 0.0)), _state_of(c))


def test_the_server_flag_sets_the_window_and_a_resume_keeps_or_changes_it(tmp_path):
    import io

    from diloco.coordinator.checkpoint import save_coordinator
    from diloco.cli import build_parser
    from diloco.deploy.server import EventPrinter, ServerError, ServerSettings, build_config
    from diloco.deploy.server import make_coordinator as server_coordinator

    args = build_parser().parse_args(["server", "--mode", "async", "--grace-window", "1.5"])
    assert args.grace_window == 1.5
    with pytest.raises(SystemExit):
        build_parser().parse_args(["server", "--grace-window", "-1"])
    cfg = build_config(ServerSettings(min_workers=1, mode="async", grace_window_s=1.5))
    assert cfg.fsm.grace_window_s == 1.5
    # With DyLU and fragments too (each fragment has its own window).
    both = build_config(ServerSettings(mode="async", grace_window_s=1.0, dylu=True, sync_every=10, fragments=2))
    assert both.dylu and both.fsm.num_fragments == 2 and both.fsm.grace_window_s == 1.0
    with pytest.raises(ServerError, match="--grace-window 2 needs --mode async"):
        build_config(ServerSettings(grace_window_s=2.0))
    with pytest.raises(ServerError, match="at most heartbeat_timeout_s=5"):
        build_config(ServerSettings(mode="async", heartbeat_timeout_s=5.0, grace_window_s=6.0))
    c = Coordinator(cfg, 0.0)
    joined(c, P0, "w1")
    save_coordinator(c, tmp_path)
    out = io.StringIO()
    kept = server_coordinator(ServerSettings(resume=str(tmp_path), checkpoint_dir=str(tmp_path)),
                              EventPrinter(out), 10.0, out=out)
    assert kept.config.fsm.grace_window_s == 1.5 and kept.config.fsm.mode is Mode.ASYNC
    changed = server_coordinator(ServerSettings(resume=str(tmp_path), checkpoint_dir=str(tmp_path),
                                                grace_window_s=0.0), EventPrinter(out), 10.0, out=out)
    assert changed.config.fsm.grace_window_s == 0.0
    assert "grace window 1.5 s" in _status_text(kept)
    from diloco.deploy.startup import startup_lines

    lines = startup_lines(kept, ServerSettings(), "tcp://127.0.0.1:5555", None, None)
    assert any(line.startswith("  grace window 1.5 s: ") for line in lines), lines
    plain = server_coordinator(ServerSettings(mode="async"), EventPrinter(out), 0.0, out=out)
    assert not any("grace window" in line for line in startup_lines(plain, ServerSettings(), "tcp://x", None, None))


def _status_text(c: Coordinator) -> str:
    from diloco.deploy.admin import render_status

    return render_status(c.status(), width=400)


def test_an_audit_log_of_a_window_run_replays_through_the_pure_machine(tmp_path):
    """Trace validation (``check-log``): windows open, merge, close on a tick, early and on a death, and
    a restart from a checkpoint keeps the window setting; the logged Ticked inputs reproduce every close."""
    from diloco.coordinator.audit import AuditLog, Tee
    from diloco.coordinator.checkpoint import coordinator_state, restore_coordinator
    from diloco.coordinator.tracecheck import check_log
    from diloco.testing import join_message, make_coordinator
    from diloco.wire.messages import AdminRequest, Heartbeat

    audit = AuditLog(tmp_path)
    c = make_coordinator(observer=Tee(audit), min_workers=1, mode=Mode.ASYNC, heartbeat_timeout_s=10.0,
                         grace_window_s=1.0)
    audit.attach(c)
    audit.record_start(pid=0)
    for wid in ("w1", "w2", "w3"):
        c.handle(wid, join_message(wid, P0), 0.5)
    c.handle("w1", Submit("w1", 0, 0, _grad(1)), 1.0)
    c.handle("w2", Submit("w2", 0, 0, _grad(2)), 1.4)
    c.tick(1.7)
    c.tick(2.05)  # the deadline (2.0) passed: w1 and w2 merged
    assert c.fsm.open_round_ids() == (1,)
    for i, wid in enumerate(("w3", "w1", "w2")):  # everyone in: an early close
        c.handle(wid, Submit(wid, 0, 1 if wid != "w3" else 0, _grad(3 + i)), 2.2 + 0.1 * i)
    assert c.fsm.open_round_ids() == (2,)
    c.handle("w1", Submit("w1", 0, 2, _grad(7)), 3.0)
    for t in (5.0, 9.0, 12.9):  # w3 falls silent; w1 and w2 beat; its death releases the window
        c.handle("w1", Heartbeat("w1"), t)
        c.handle("w2", Heartbeat("w2"), t)
    c.tick(13.5)
    assert c.fsm.open_round_ids() == (3,) and not c.fsm.is_member("w3")
    audit.flush()
    meta, tensors = coordinator_state(c)
    audit.close()
    audit = AuditLog(tmp_path)
    c = restore_coordinator(meta, tensors, 14.0, observer=Tee(audit))
    assert c.config.fsm.grace_window_s == 1.0
    audit.attach(c)
    audit.record_start(pid=1)
    c.handle("w1", join_message("w1", P0), 14.5)
    c.handle("w1", Submit("w1", 0, 3, _grad(8)), 14.6)  # the only member: an early close
    c.handle("admin", AdminRequest("shutdown", {"kind": "abort"}), 15.0)
    audit.close()
    report = check_log(tmp_path)
    assert report.ok, report.summary()
    applies = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()
               if json.loads(x)["event"] == "apply"]
    assert [a["contributors"] for a in applies] == [["w1", "w2"], ["w3", "w1", "w2"], ["w1"], ["w1"]]
