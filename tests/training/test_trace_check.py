"""Trace validation (``diloco check-log``, ``tracecheck.py``; SPEC.md section 12): the audit log's inputs,
replayed through the pure machine, give exactly the live coordinator's effects and decisions.

A run with joins, rounds, a death, a leave, a quorum change, a restart from a checkpoint and a
shutdown checks clean; a coordinator whose machine was patched to apply one round differently,
a driver that logs a decision the machine did not make, and a log missing a decision line are
each caught, with the line and its context.
"""

from __future__ import annotations

import json

import pytest
import torch

from diloco import cli
from diloco.coordinator.audit import AuditLog, Tee
from diloco.coordinator.checkpoint import coordinator_state, restore_coordinator
from diloco.coordinator.tracecheck import check_log
from diloco.core import ApplyRound
from diloco.core import RoundFSM
from diloco.testing import join_message, make_coordinator
from diloco.wire.messages import AdminRequest, Heartbeat, Leave, Submit

PARAMS = {"w": torch.zeros(4)}


def scripted_run(ck, *, restart: bool = True):
    """Three workers, rounds, a death, a leave, a quorum change; a restart from a checkpoint; a shutdown."""
    audit = AuditLog(ck)
    c = make_coordinator(observer=Tee(audit), min_workers=2, heartbeat_timeout_s=10.0)
    audit.attach(c)
    audit.record_start(pid=0)
    t = 1.0
    for w in ("w1", "w2", "w3"):
        c.handle(f"p{w}", join_message(w, PARAMS), t)
    for r in range(3):
        t += 1.0
        for w in ("w1", "w2", "w3"):
            c.handle(f"p{w}", Submit(w, 0, r, {"w": torch.full((4,), 0.1 * (r + 1))}), t)
    c.handle("pw3", Leave("w3"), t + 0.5)
    for _ in range(4):  # w2 falls silent: dead after the heartbeat timeout
        t += 4.0
        c.handle("pw1", Heartbeat("w1"), t)
        c.tick(t)
    c.handle("admin", AdminRequest("set_min_workers", {"min_workers": 1}), t + 0.1)
    c.handle("pw1", Submit("w1", 0, 3, {"w": torch.ones(4)}), t + 0.2)
    audit.flush()
    if restart:
        meta, tensors = coordinator_state(c)
        audit.close()
        audit = AuditLog(ck)
        c = restore_coordinator(meta, tensors, t + 1.0, observer=Tee(audit))
        audit.attach(c)
        audit.record_start(pid=1)
        t += 2.0
        c.handle("pw1", join_message("w1", PARAMS), t)
        c.handle("pw1", Submit("w1", 0, c.fsm.open_round_ids()[0], {"w": torch.ones(4)}), t + 0.1)
    c.handle("admin", AdminRequest("shutdown", {"kind": "abort"}), t + 0.5)
    c.tick(t + 1.0)
    audit.close()
    return c


def lines_of(ck) -> list[dict]:
    return [json.loads(x) for x in (ck / "events.jsonl").read_text().splitlines()]


def test_a_run_with_a_restart_replays_exactly(tmp_path):
    c = scripted_run(tmp_path)
    report = check_log(tmp_path)
    assert report.ok, report.summary()
    assert report.incarnations == 2 and report.inputs >= 20 and report.decisions >= 5
    kinds = {line["event"] for line in lines_of(tmp_path)}
    assert {"input", "apply", "dead", "left", "stop"} <= kinds and c.stopped
    assert report.summary().startswith("OK:")


def test_a_machine_patched_to_apply_one_round_differently_is_caught(tmp_path, monkeypatch):
    real = RoundFSM.step
    state = {"patched": False}

    def patched(self, event):
        effects = real(self, event)
        out = []
        for e in effects:
            if isinstance(e, ApplyRound) and e.round_id == 1 and not state["patched"]:
                state["patched"] = True
                # One contributor swapped for another id (the driver sums as many as listed).
                e = ApplyRound(e.fragment_id, e.round_id, e.contributors[:-1] + ("intruder",), e.digest)
            out.append(e)
        return out

    monkeypatch.setattr(RoundFSM, "step", patched)
    scripted_run(tmp_path, restart=False)
    monkeypatch.setattr(RoundFSM, "step", real)
    report = check_log(tmp_path)
    assert not report.ok and state["patched"]
    assert "the pure machine answers" in str(report.divergence) and "ApplyRound" in str(report.divergence)
    assert report.divergence.context  # the lines before it


def test_a_driver_that_logs_a_decision_the_machine_did_not_make_is_caught(tmp_path):
    scripted_run(tmp_path, restart=False)
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    i = next(i for i, x in enumerate(lines) if json.loads(x)["event"] == "apply")
    line = json.loads(lines[i])
    line["contributors"] = line["contributors"][:1]
    lines[i] = json.dumps(line)
    (tmp_path / "events.jsonl").write_text("\n".join(lines) + "\n")
    report = check_log(tmp_path)
    assert not report.ok and f"line {i + 1}:" in str(report.divergence)
    assert "which the machine did not decide" in str(report.divergence)


def test_a_missing_decision_line_is_caught_but_a_torn_tail_is_not(tmp_path):
    scripted_run(tmp_path, restart=False)
    text = (tmp_path / "events.jsonl").read_text()
    assert check_log(tmp_path).ok
    (tmp_path / "events.jsonl").write_text(text + '{"incarnation":1,"event":"inp')  # a crash tore the last line
    report = check_log(tmp_path)
    assert report.ok and report.torn_lines == 1
    lines = text.splitlines()
    i = next(i for i, x in enumerate(lines) if json.loads(x)["event"] == "dead")
    (tmp_path / "events.jsonl").write_text("\n".join(lines[:i] + lines[i + 1:]) + "\n")
    report = check_log(tmp_path)
    assert not report.ok and "has no line for it" in str(report.divergence)


def test_check_log_command(tmp_path, capsys):
    scripted_run(tmp_path)
    assert cli.main(["check-log", str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith("OK:")
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    i = next(i for i, x in enumerate(lines) if json.loads(x)["event"] == "input" and json.loads(x)["out"])
    line = json.loads(lines[i])
    line["out"] = []
    lines[i] = json.dumps(line)
    (tmp_path / "events.jsonl").write_text("\n".join(lines) + "\n")
    assert cli.main(["check-log", str(tmp_path)]) == 1
    assert "DIVERGED" in capsys.readouterr().out
    assert cli.main(["check-log", str(tmp_path / "nothing")]) == 1


@pytest.mark.parametrize("record", [{"type": "Nope"}, {"type": "WorkerLeft", "worker_id": "w", "cause": "zzz"}, []])
def test_an_unreadable_input_record_is_a_divergence(tmp_path, record):
    scripted_run(tmp_path, restart=False)
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    i = next(i for i, x in enumerate(lines) if json.loads(x)["event"] == "input")
    line = json.loads(lines[i])
    line["in"] = record
    lines[i] = json.dumps(line)
    (tmp_path / "events.jsonl").write_text("\n".join(lines) + "\n")
    report = check_log(tmp_path)
    assert not report.ok and "cannot read" in str(report.divergence)


def test_the_servers_printer_shows_no_input_lines():
    """Inputs are for the audit log: the server's stdout keeps its one line per decision."""
    import io

    from diloco.deploy.events import EventPrinter

    out = io.StringIO()
    printer = EventPrinter(out=out)
    printer("input", 1.0, {"in": {"type": "Ticked", "now_s": 1.0}, "out": []})
    assert out.getvalue() == ""
