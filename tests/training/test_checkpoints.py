"""Durable checkpoints in process: keep-K rotation, corrupt-file fallback, persist before announce,
the audit log, the old format, reconciliation (SPEC.md sections 5 and 12)."""

from __future__ import annotations

import json

import pytest
import torch

from diloco.coordinator import Coordinator
from diloco.coordinator.audit import AuditLog, Tee
from diloco.coordinator.checkpoint import (
    coordinator_state,
    find_newest,
    list_checkpoints,
    load_coordinator,
    save_coordinator,
)
from diloco.coordinator.runner import serve
from diloco.ckptio import CheckpointError
from diloco.testing import join_message, make_coordinator
from diloco.transport import Arrival
from diloco.wire.messages import Error, Result, Submit


def run_rounds(n: int, c: Coordinator | None = None) -> Coordinator:
    c = c or make_coordinator(min_workers=1)
    params = {"layer.weight": torch.zeros(2, 3), "layer.bias": torch.zeros(3)}
    if not c.fsm.is_member("w1"):
        c.handle("p", join_message("w1", params), 1.0)
    for _ in range(n):
        rid = c.fsm.open_round_ids()[0]
        c.handle("p", Submit("w1", 0, rid, {k: torch.full_like(v, 0.1 * (rid + 1)) for k, v in params.items()}),
                 2.0 + rid)
    return c


def test_keep_k_rotation(tmp_path):
    c = run_rounds(0)
    for _ in range(6):
        run_rounds(1, c)
        save_coordinator(c, tmp_path, keep=3)
    names = [p.name for p in list_checkpoints(tmp_path)]
    assert names == [f"coordinator-{r:012d}.safetensors" for r in (6, 5, 4)]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary file left


def test_corrupt_or_torn_newest_falls_back_to_the_previous(tmp_path):
    c = run_rounds(0)
    for _ in range(3):
        run_rounds(1, c)
        save_coordinator(c, tmp_path)
    newest, middle, oldest = list_checkpoints(tmp_path)
    data = bytearray(newest.read_bytes())
    data[-3] ^= 0xFF  # a flipped bit in the payload: only the checksum sees it
    newest.write_bytes(bytes(data))
    found = find_newest(tmp_path)
    assert found.path == middle and found.meta["rounds_applied"] == 2
    assert found.skipped[0][0] == newest and "checksum mismatch" in found.skipped[0][1]
    middle.write_bytes(middle.read_bytes()[:100])  # torn
    found = find_newest(tmp_path)
    assert found.path == oldest and len(found.skipped) == 2 and str(middle) in found.skipped[1][1]
    oldest.write_bytes(b"")
    with pytest.raises(CheckpointError, match="no valid checkpoint") as info:
        load_coordinator(tmp_path, 0.0)
    assert str(oldest) in str(info.value)
    assert find_newest(tmp_path / "missing") is None


def test_resume_restores_params_momentum_and_counters(tmp_path):
    c = run_rounds(3)
    save_coordinator(c, tmp_path)
    back = load_coordinator(tmp_path, 5.0)
    assert back.fsm.open_round_ids() == (3,) and back.incarnation == 2
    for name, t in c.store.params.items():
        assert torch.equal(back.store.params[name], t)
    (s0,), (s1,) = c.optimizer_states(), back.optimizer_states()
    assert s0["param_groups"] == s1["param_groups"]
    for i, state in s0["state"].items():
        assert torch.equal(s1["state"][i]["momentum_buffer"], state["momentum_buffer"])
    # The next step is the same on both.
    run_rounds(1, c), run_rounds(1, back)
    for name, t in c.store.params.items():
        assert torch.equal(back.store.params[name], t)


class RecordingEndpoint:
    """Feeds a scripted list of messages; on every send, records what is on disk at that moment."""

    def __init__(self, items, ck) -> None:
        self.items = list(items)
        self.ck = ck
        self.sent: list[tuple[object, int, list[dict]]] = []

    def recv(self, timeout_s):
        return Arrival(*self.items.pop(0)) if self.items else None

    def lost_peers(self) -> list[str]:
        return []

    def arriving_peers(self) -> list[str]:
        return []

    def send(self, peer, message) -> None:
        found = find_newest(self.ck)
        durable = found.meta["rounds_applied"] if found else 0
        lines = [json.loads(x) for x in (self.ck / "events.jsonl").read_text().splitlines()]
        self.sent.append((message, durable, lines))


def test_every_round_is_durable_and_logged_before_its_result_is_sent(tmp_path):
    ck = tmp_path / "ck"
    audit = AuditLog(ck)
    c = make_coordinator(observer=Tee(audit), min_workers=1)
    audit.attach(c)
    params = {"w": torch.zeros(4)}
    items = [("p", join_message("w1", params))]
    items += [("p", Submit("w1", 0, r, {"w": torch.ones(4)})) for r in range(4)]
    items += [("p", Submit("w1", 0, 9, {"w": torch.ones(4)}))]  # ahead of the coordinator: reconciled
    endpoint = RecordingEndpoint(items, ck)
    clock = iter(range(1, 1000))
    serve(endpoint, c, checkpoint_dir=ck, audit=audit, clock=lambda: float(next(clock)), stop_event=_StopAfter(8))
    audit.close()
    results = [(m, durable, lines) for m, durable, lines in endpoint.sent if isinstance(m, Result)]
    assert [m.round_id for m, _, _ in results] == [0, 1, 2, 3]
    for m, durable, lines in results:
        assert durable >= m.round_id + 1
        applies = [x for x in lines if x["event"] == "apply"]
        assert applies[-1]["round_id"] == m.round_id and applies[-1]["min_workers"] == 1
        assert applies[-1]["rounds_applied"] == m.round_id + 1 and applies[-1]["incarnation"] == 1
    errors = [m for m, _, _ in endpoint.sent if isinstance(m, Error)]
    assert errors and errors[-1].code.value == "future_round"
    assert c.status()["reconciled"] == 1 and c.status()["checkpoints_written"] == 4
    lines = [json.loads(x) for x in (ck / "events.jsonl").read_text().splitlines()]
    assert [x for x in lines if x["event"] == "reconciled"][0]["round_id"] == 9


class _StopAfter:
    """A stop_event that is set after ``n`` loop turns."""

    def __init__(self, n: int) -> None:
        self.n = n

    def is_set(self) -> bool:
        self.n -= 1
        return self.n < 0


def test_audit_log_repairs_a_torn_last_line_and_continues_the_incarnation(tmp_path):
    (tmp_path / "events.jsonl").write_text('{"incarnation":4,"event":"start"}\n{"incarnation":4,"ev')
    audit = AuditLog(tmp_path)
    c = run_rounds(1)
    assert audit.attach(c) == 5 and c.incarnation == 5
    audit.record("start")
    audit.close()
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    assert lines[1] == '{"incarnation":4,"ev'
    assert json.loads(lines[2])["incarnation"] == 5 and json.loads(lines[2])["rounds_applied"] == 1


def test_a_failed_write_announces_nothing_and_logs_no_line(tmp_path, monkeypatch):
    import diloco.coordinator.persist as persist

    ck = tmp_path / "ck"
    audit = AuditLog(ck)
    c = make_coordinator(observer=Tee(audit), min_workers=1)
    audit.attach(c)
    params = {"w": torch.zeros(4)}
    items = [("p", join_message("w1", params)),
             ("p", Submit("w1", 0, 0, {"w": torch.ones(4)}))]
    endpoint = RecordingEndpoint(items, ck)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(persist, "save_coordinator", disk_full)
    clock = iter(range(1, 1000))
    with pytest.raises(OSError):
        serve(endpoint, c, checkpoint_dir=ck, audit=audit, clock=lambda: float(next(clock)),
              stop_event=_StopAfter(5))
    audit.close()
    assert not [m for m, _, _ in endpoint.sent if isinstance(m, Result)]
    assert "apply" not in (ck / "events.jsonl").read_text()


@pytest.mark.parametrize("override", [2, 3])
def test_resume_with_a_min_workers_above_the_saved_one_pauses_instead_of_failing(tmp_path, override):
    """Regression (chaos soak, seed 1): a run RUNNING with 1 member under set-min-workers 1 was saved;
    every restart with `--min-workers 2` failed with 'phase running contradicts 1 members'."""
    import io

    from diloco.deploy.server import EventPrinter, ServerSettings, make_coordinator

    c = run_rounds(3)
    assert c.fsm.phase.value == "running" and c.fsm.min_workers == 1
    save_coordinator(c, tmp_path)
    out = io.StringIO()
    resumed = make_coordinator(ServerSettings(resume=str(tmp_path), checkpoint_dir=str(tmp_path),
                                              min_workers=override), EventPrinter(out), 100.0, out=out)
    assert resumed.fsm.min_workers == override
    # A resumed run waits for its workers to re-join (FORMING), now under the new quorum.
    assert resumed.fsm.below_min_workers and resumed.fsm.phase.value == "forming"
    assert resumed.fsm.rounds_applied == 3 and resumed.fsm.open_round_ids() == (3,)
    assert f"min_workers 1 (saved) -> {override} (--min-workers)" in out.getvalue()
    # The same resume without an override keeps the quorum the run had.
    again = make_coordinator(ServerSettings(resume=str(tmp_path), checkpoint_dir=str(tmp_path)),
                             EventPrinter(io.StringIO()), 100.0, out=io.StringIO())
    assert again.fsm.min_workers == 1 and again.fsm.rounds_applied == 3


def test_bans_and_key_bindings_survive_a_restart(tmp_path):
    """A ban and an id's key binding are the run's, not the process's: ``--resume`` keeps them."""
    from diloco.coordinator.checkpoint import restore_coordinator
    from diloco.transport.zmq.auth import KeyIdentity, Role
    from diloco.wire.messages import AdminRequest, ErrorCode

    k1, k2, k3 = (KeyIdentity(f"PUB{i}" * 8, f"k{i}", Role.WORKER) for i in (1, 2, 3))
    c = make_coordinator(min_workers=1)
    params = {"w": torch.zeros(2)}
    c.handle("p1", join_message("w1", params), 1.0, identity=k1)
    c.handle("p2", join_message("w2", params), 1.0, identity=k2)

    def admin(coordinator, cmd, args, now):
        (reply,) = [m for peer, m in coordinator.handle("admin", AdminRequest(cmd, args), now) if peer == "admin"]
        return reply

    assert admin(c, "kick", {"worker_id": "w2", "ban": True}, 2.0).ok
    save_coordinator(c, tmp_path)

    def refused(coordinator, wid, identity):
        out = coordinator.handle("p9", join_message(wid, params), 4.0, identity=identity)
        return [m.code for _, m in out if isinstance(m, Error)]

    r = load_coordinator(tmp_path, 3.0)
    assert r.status()["banned_workers"] == ["w2"] and r.status()["banned_keys"] == ["k2"]
    assert refused(r, "w2", k3) == [ErrorCode.BANNED]       # the banned id
    assert refused(r, "w9", k2) == [ErrorCode.BANNED]       # the banned key under a new id
    assert refused(r, "w1", k3) == [ErrorCode.WRONG_KEY]    # w1 stays bound to k1
    assert refused(r, "w1", k1) == []                       # its own key gets back in
    assert admin(r, "unban", {"worker_id": "w2"}, 5.0).ok
    assert refused(r, "w2", k2) == []

    # A checkpoint written before bans were saved resumes with none; a malformed one is refused.
    meta, tensors = coordinator_state(c)
    old = {k: v for k, v in meta.items() if k != "access"}
    assert restore_coordinator(old, tensors, 3.0).status()["banned_workers"] == []
    for bad in ({"banned_ids": "w2"}, {"keys": {"w1": 7}}, ["w2"]):
        with pytest.raises(CheckpointError, match="access state"):
            restore_coordinator({**meta, "access": bad}, tensors, 3.0)


def test_the_coordinator_says_which_steps_a_restart_must_keep():
    """``take_durable_change``: True once after an applied round, a ban or an unban; not for a join."""
    from diloco.wire.messages import AdminRequest

    c = make_coordinator(min_workers=1)
    assert c.take_durable_change() is False
    c.handle("p", join_message("w1", {"w": torch.zeros(4)}), 1.0)
    assert c.take_durable_change() is False
    c.handle("p", Submit("w1", 0, 0, {"w": torch.ones(4)}), 2.0)
    assert c.fsm.rounds_applied == 1
    assert c.take_durable_change() is True
    assert c.take_durable_change() is False          # said once
    c.handle("admin", AdminRequest("kick", {"worker_id": "w2", "ban": True}), 3.0)
    assert c.take_durable_change() is True
    c.handle("admin", AdminRequest("unban", {"worker_id": "w2"}), 4.0)
    assert c.take_durable_change() is True
    c.handle("admin", AdminRequest("unban", {"worker_id": "w2"}), 5.0)   # not banned: nothing changed
    assert c.take_durable_change() is False


def test_a_ban_and_an_unban_are_on_disk_before_the_operator_hears_of_them(tmp_path):
    from diloco.wire.messages import AdminReply, AdminRequest

    ck = tmp_path / "ck"
    audit = AuditLog(ck)
    c = make_coordinator(observer=Tee(audit), min_workers=1)
    audit.attach(c)
    items = [("p", join_message("w1", {"w": torch.zeros(4)})),
             ("admin", AdminRequest("kick", {"worker_id": "w2", "ban": True})),
             ("admin", AdminRequest("unban", {"worker_id": "w2"})),
             ("admin", AdminRequest("unban", {"worker_id": "w2"}))]    # not banned: nothing to write

    class BansOnDisk(RecordingEndpoint):
        def send(self, peer, message) -> None:
            if isinstance(message, AdminReply):
                found = find_newest(self.ck)
                self.sent.append((message.ok, found and found.meta["access"]["banned_ids"], found and found.path))

    endpoint = BansOnDisk(items, ck)
    clock = iter(range(1, 1000))
    serve(endpoint, c, checkpoint_dir=ck, audit=audit, clock=lambda: float(next(clock)), stop_event=_StopAfter(6))
    (ok1, banned1, path1), (ok2, banned2, path2), (ok3, banned3, path3) = endpoint.sent
    assert (ok1, banned1) == (True, ["w2"])         # written before "banned" was answered
    assert (ok2, banned2) == (True, [])             # and the unban too
    assert (ok3, banned3) == (False, [])
    assert path1.name == path2.name == "coordinator-000000000000.safetensors"  # the same round, rewritten
    assert c.stats.checkpoints_written == 2
