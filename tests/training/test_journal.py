"""The hub coordinator's write-ahead journal (``journal.py``, ``persist.py``; SPEC.md section 12, "The journal").

A run served with ``full_every`` > 1 writes a full checkpoint every few rounds and each
round's outer step input in between; resuming replays the journal. What must hold:

- persist before announce: no Result goes out before its round is in the checkpoint plus
  the journal;
- a resume comes back bit for bit: params and outer optimizer state equal those of the
  live coordinator (and of a run that wrote a full checkpoint every round);
- a kill during a journal append or a full checkpoint loses at most the open round;
- a journal with a hole in the middle is refused, naming the steps it cannot recover.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from diloco.coordinator import Coordinator, CoordinatorConfig
from diloco.coordinator import journal
from diloco.coordinator.audit import AuditLog, Tee
from diloco.coordinator.checkpoint import find_newest, list_checkpoints, load_coordinator
from diloco.coordinator.runner import serve
from diloco.core import FSMConfig, Mode
from diloco.outer import OuterConfig
from diloco.ckptio import CheckpointError
from diloco.testing import join_message
from diloco.transport import Arrival
from diloco.wire import compression
from diloco.wire.messages import Result, Submit

PARAMS = {"a.weight": (6, 5), "a.bias": (5,), "b.weight": (7,)}


class ScriptedEndpoint:
    """Plays a script of (peer, message); at every Result it sends, records what is durable then."""

    def __init__(self, items, ck, coordinator: Coordinator) -> None:
        self.items = list(items)
        self.ck = ck
        self.coordinator = coordinator
        self.sent: list[tuple[object, int]] = []
        #: rounds_applied -> (params, optimizer states) of the live coordinator, copied at a Result.
        self.live: dict[int, tuple[dict, list]] = {}

    def recv(self, timeout_s):
        return Arrival(*self.items.pop(0)) if self.items else None

    def lost_peers(self) -> list[str]:
        return []

    def arriving_peers(self) -> list[str]:
        return []

    def _durable(self):
        # The journal thread may delete segments and checkpoints (after a background full checkpoint)
        # while this reads, which a resume never does. Read again then: once the thread is idle
        # the directory is consistent, and an error that persists is a real one.
        for attempt in range(200):
            try:
                return find_newest(self.ck)
            except (FileNotFoundError, CheckpointError):
                if attempt == 199:
                    raise
                time.sleep(0.01)

    def send(self, peer, message) -> None:
        if isinstance(message, Result):
            found = self._durable()
            self.sent.append((message, found.meta["rounds_applied"] if found else 0))
            c = self.coordinator
            self.live[c.fsm.rounds_applied] = ({n: t.clone() for n, t in c.store.params.items()},
                                               _clone_states(c.optimizer_states()))


def _clone_states(states):
    def clone(x):
        if isinstance(x, torch.Tensor):
            return x.clone()
        if isinstance(x, dict):
            return {k: clone(v) for k, v in x.items()}
        if isinstance(x, list):
            return [clone(v) for v in x]
        return x
    return clone(states)


def _same_state(a: tuple[dict, list], b: tuple[dict, list]) -> None:
    (pa, oa), (pb, ob) = a, b
    assert list(pa) == list(pb)
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name
    assert len(oa) == len(ob)
    for sa, sb in zip(oa, ob):
        # (a checkpoint's JSON turns Adam's betas tuple into a list; torch accepts both)
        assert json.loads(json.dumps(sa["param_groups"])) == json.loads(json.dumps(sb["param_groups"]))
        assert set(sa["state"]) == set(sb["state"])
        for key in sa["state"]:
            for k, v in sa["state"][key].items():
                w = sb["state"][key][k]
                assert (torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w), (key, k)


def _state_of(c: Coordinator) -> tuple[dict, list]:
    return {n: t.clone() for n, t in c.store.params.items()}, _clone_states(c.optimizer_states())


class _StopWhenDone:
    def __init__(self, endpoint: ScriptedEndpoint, extra_turns: int = 2) -> None:
        self.endpoint, self.extra = endpoint, extra_turns

    def is_set(self) -> bool:
        if self.endpoint.items:
            return False
        self.extra -= 1
        return self.extra < 0


def make(mode: str = "sync", wire: str = "fp32", outer: str = "nesterov", fragments: int = 1,
         observer=None) -> Coordinator:
    fsm = FSMConfig(min_workers=1 if mode == "async" else 2, mode=Mode(mode), num_fragments=fragments,
                    heartbeat_timeout_s=1e9)
    config = CoordinatorConfig(fsm=fsm, outer=OuterConfig(name=outer, lr=0.7, momentum=0.8), wire_dtype=wire)
    return Coordinator(config, 0.0, observer=observer)


def script(rounds: int, fragments: int = 1, seed: int = 0, wire: str = "fp32") -> list:
    """Two workers join and submit every fragment's round ``rounds`` times (random pseudo-gradients)."""
    g = torch.Generator().manual_seed(seed)
    params = {n: torch.randn(*shape, generator=g) for n, shape in PARAMS.items()}
    items = [("p1", join_message("w1", params)), ("p2", join_message("w2", params))]
    c = make(fragments=fragments)
    c.hub.install_params(params)
    for r in range(rounds):
        for fid in range(fragments):
            names = c.store.fragments[fid]
            for peer, wid in (("p1", "w1"), ("p2", "w2")):
                grads = compression.encode({n: torch.randn(*PARAMS[n], generator=g) * 0.1 for n in names}, wire)
                items.append((peer, Submit(wid, fid, r, grads.values, wire, grads.scales)))
    return items


def run(ck, items, c: Coordinator, full_every: int, **kw) -> ScriptedEndpoint:
    endpoint = ScriptedEndpoint(items, ck, c)
    clock = iter(range(1, 100000))
    serve(endpoint, c, checkpoint_dir=ck, full_every=full_every, clock=lambda: float(next(clock)),
          stop_event=_StopWhenDone(endpoint), **kw)
    return endpoint


@pytest.mark.parametrize("wire,outer,fragments", [("fp32", "nesterov", 1), ("int8", "nesterov", 2),
                                                  ("bf16", "adam", 1), ("int4", "nesterov", 1)])
def test_resume_replays_the_journal_bit_for_bit(tmp_path, wire, outer, fragments):
    ck = tmp_path / "ck"
    c = make(wire=wire, outer=outer, fragments=fragments)
    endpoint = run(ck, script(10, fragments, wire=wire), c, full_every=4)
    assert c.fsm.rounds_applied == 10 * fragments
    # Persist before announce: every Result went out after its round was durable.
    results = [(m, durable) for m, durable in endpoint.sent]
    assert results and all(durable >= (m.round_id + 1) * fragments - (fragments - 1 - m.fragment_id)
                           for m, durable in results)
    # Full checkpoints every 4 rounds, the journal in between: fewer files than rounds.
    assert 1 <= len(list_checkpoints(ck)) <= 3 and journal.list_segments(ck)
    assert c.stats.journal_records > 0 and c.stats.checkpoints_written < c.fsm.rounds_applied
    found = find_newest(ck)
    assert found.replayed > 0 and found.meta["rounds_applied"] == c.fsm.rounds_applied
    back = load_coordinator(ck, 0.0)
    _same_state(_state_of(back), _state_of(c))
    # ... and equal to a run that wrote a full checkpoint every round.
    every = make(wire=wire, outer=outer, fragments=fragments)
    run(tmp_path / "every", script(10, fragments, wire=wire), every, full_every=1)
    assert not journal.list_segments(tmp_path / "every")
    _same_state(_state_of(every), _state_of(back))
    assert back.fsm.open_round_ids() == c.fsm.open_round_ids() and back.incarnation == c.incarnation + 1


def test_async_held_contributions_replay(tmp_path):
    ck = tmp_path / "ck"
    c = make(mode="async", outer="delayed_nesterov")
    run(ck, script(6), c, full_every=3)
    assert c.fsm.rounds_applied >= 6
    _same_state(_state_of(load_coordinator(ck, 0.0)), _state_of(c))


def test_a_kill_during_a_journal_append_loses_at_most_the_open_round(tmp_path):
    ck = tmp_path / "ck"
    c = make()
    endpoint = run(ck, script(7), c, full_every=100)  # one full checkpoint (the first round), then the journal
    (first, segment), = journal.list_segments(ck)
    data = segment.read_bytes()
    total = c.fsm.rounds_applied
    assert total == 7 and len(list_checkpoints(ck)) == 1
    # Cut the segment at many points: each cut is a crash in the middle of an append.
    cuts = sorted({len(data) - k for k in (1, 2, 5, 17, 60, 200, 700)} | set(range(0, len(data), len(data) // 40)))
    seen = set()
    for cut in cuts:
        segment.write_bytes(data[:cut])
        found = find_newest(ck)
        rounds = found.meta["rounds_applied"]
        seen.add(rounds)
        back = load_coordinator(ck, 0.0)
        _same_state(_state_of(back), endpoint.live[rounds])  # exactly the state announced with that round
        if cut >= len(data) - 5:
            assert rounds == total - 1  # the last commit is torn: only the open round is lost
    assert len(seen) >= 5 and min(seen) == 1
    segment.write_bytes(data)
    assert find_newest(ck).meta["rounds_applied"] == total


def test_a_kill_during_a_full_checkpoint_falls_back_and_replays(tmp_path):
    ck = tmp_path / "ck"
    c = make()
    run(ck, script(9), c, full_every=3)
    files = list_checkpoints(ck)
    assert len(files) == 3
    # The newest full checkpoint torn as a crash mid-write of a non-atomic writer would leave it,
    # plus a leftover temporary file: the previous one and the journal give the same state.
    newest = files[0]
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    (ck / f".{newest.name}.tmp-12345").write_bytes(b"partial")
    found = find_newest(ck)
    assert found.path == files[1] and found.skipped and found.replayed > 0
    _same_state(_state_of(load_coordinator(ck, 0.0)), _state_of(c))


def test_a_hole_in_the_journal_is_refused(tmp_path):
    ck = tmp_path / "ck"
    c = make()
    run(ck, script(6), c, full_every=100)
    (_, segment), = journal.list_segments(ck)
    data = bytearray(segment.read_bytes())
    # Flip a byte in the middle: the chunks after it are unreadable, so the steps they commit are lost.
    data[len(data) // 2] ^= 0xFF
    segment.write_bytes(bytes(data))
    # A later segment holding later steps makes it a hole, not a torn tail.
    later = ck / journal.segment_name(10_000)
    good = journal.Segment(ck, 10_000)
    good.append_commit(c.journal_seq + 5, [], {"rounds_applied": 99, "incarnation": 1})
    good.close()
    assert later.exists()
    with pytest.raises(CheckpointError, match="jumps from step"):
        find_newest(ck)


def test_a_failed_journal_write_announces_nothing(tmp_path, monkeypatch):
    ck = tmp_path / "ck"
    audit = AuditLog(ck)
    c = Coordinator(make().config, 0.0, observer=Tee(audit))
    audit.attach(c)
    items = script(4)
    calls = {"n": 0}
    real = journal.Segment.append_commit

    def flaky(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(28, "No space left on device")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(journal.Segment, "append_commit", flaky)
    endpoint = ScriptedEndpoint(items, ck, c)
    clock = iter(range(1, 100000))
    with pytest.raises(OSError):
        serve(endpoint, c, checkpoint_dir=ck, full_every=5, audit=audit, clock=lambda: float(next(clock)),
              stop_event=_StopWhenDone(endpoint))
    audit.close()
    # Round 0: a full checkpoint; round 1: the first commit; round 2's commit failed: no Result for it.
    assert sorted({m.round_id for m, _ in endpoint.sent}) == [0, 1]
    applies = [json.loads(x) for x in (ck / "events.jsonl").read_text().splitlines()]
    assert max(x["rounds_applied"] for x in applies if x["event"] == "apply") == 2
    assert find_newest(ck).meta["rounds_applied"] == 2


def test_segments_no_kept_checkpoint_needs_are_deleted(tmp_path):
    ck = tmp_path / "ck"
    c = make()
    run(ck, script(20), c, full_every=2, keep=2)
    files = list_checkpoints(ck)
    assert len(files) == 2
    segments = journal.list_segments(ck)
    # Only segments after the oldest kept checkpoint remain (a few, not one per full checkpoint).
    assert 1 <= len(segments) <= 3, [p.name for _, p in segments]
    _same_state(_state_of(load_coordinator(ck, 0.0)), _state_of(c))


def interleaved_script(rounds: int, seed: int = 0) -> list:
    """Two fragments whose rounds overlap: w1 submits both, then w2 closes fragment 0 (a full checkpoint may
    follow) and then fragment 1, whose sum holds w1's contribution from before that checkpoint."""
    g = torch.Generator().manual_seed(seed)
    params = {n: torch.randn(*shape, generator=g) for n, shape in PARAMS.items()}
    items = [("p1", join_message("w1", params)), ("p2", join_message("w2", params))]
    c = make(fragments=2)
    c.hub.install_params(params)

    def submit(peer, wid, fid, r):
        names = c.store.fragments[fid]
        enc = compression.encode({n: torch.randn(*PARAMS[n], generator=g) * 0.1 for n in names}, "int8")
        return (peer, Submit(wid, fid, r, enc.values, "int8", enc.scales))

    for r in range(rounds):
        items += [submit("p1", "w1", 0, r), submit("p1", "w1", 1, r), submit("p2", "w2", 0, r),
                  submit("p2", "w2", 1, r)]
    return items


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_contributions_journaled_before_a_full_checkpoint_stay_for_their_round(tmp_path, mode):
    ck = tmp_path / "ck"
    c = make(mode=mode, wire="int8", fragments=2)
    run(ck, interleaved_script(9), c, full_every=2, keep=1)
    assert c.stats.checkpoints_written >= 4 and c.stats.journal_records > 0
    found = find_newest(ck)
    assert found.meta["rounds_applied"] == c.fsm.rounds_applied
    _same_state(_state_of(load_coordinator(ck, 0.0)), _state_of(c))


@pytest.mark.parametrize("value", ["0", "-3", "x", "1.5"])
def test_a_bad_full_checkpoint_every_is_a_usage_error(value, capsys):
    from diloco import cli

    with pytest.raises(SystemExit) as info:
        cli.main(["server", "--full-checkpoint-every", value])
    assert info.value.code == 2
    assert f"--full-checkpoint-every: {value!r} is not a number of rounds >= 1 or 'auto'" in capsys.readouterr().err


def test_auto_journals_only_a_big_state(tmp_path):
    from diloco.coordinator.persist import AUTO, AUTO_FULL_EVERY, Durability

    small = make()
    small.hub.install_params({"w": torch.zeros(1000)})
    d = Durability(tmp_path / "small", 3, AUTO)
    d.attach(small)
    assert d.full_every == 1 and not d.journaling
    big = make()
    big.hub.install_params({"w": torch.zeros(17 << 20)})  # 68 MB of params + as much momentum: 136 MB
    d = Durability(tmp_path / "big", 3, AUTO)
    d.attach(big)
    try:
        assert d.full_every == AUTO_FULL_EVERY and d.journaling and big.hub.recorder is d
    finally:
        d.close()


def test_a_commit_while_a_full_checkpoint_is_written_goes_to_the_new_segment(tmp_path, monkeypatch):
    """A ban's commit does not wait for a background full checkpoint (no outer step runs): it must land
    in the segment that follows that checkpoint, not in the one the checkpoint closes."""
    import diloco.coordinator.persist as persist
    from diloco.coordinator.persist import Durability

    real = persist.prepare_save

    def slow_prepare(c):
        write = real(c)

        def slow(directory, keep):
            time.sleep(0.3)
            return write(directory, keep)
        return slow

    monkeypatch.setattr(persist, "prepare_save", slow_prepare)
    ck = tmp_path / "ck"
    c = make()
    d = Durability(ck, 3, 2)
    d.attach(c)
    banned_during_full = 0
    for peer, message in script(4):
        c.handle(peer, message, 1.0)
        d.after_step(isinstance(message, Submit) and message.worker_id == "w2")
        if d._full is not None and not d._full.done():
            d.after_step(True)  # a ban's commit, while a background full checkpoint is being written
            banned_during_full += 1
    d.close()
    assert c.fsm.rounds_applied == 4 and banned_during_full >= 1
    _same_state(_state_of(load_coordinator(ck, 0.0)), _state_of(c))
    assert find_newest(ck).meta["journal_seq"] == c.journal_seq
