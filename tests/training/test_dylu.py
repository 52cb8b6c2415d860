"""DyLU (SPEC.md section 14, "DyLU"): H_w = max(1, floor(v_w / v_max * H)) per worker.

The formula and the speed table, the config, the coordinator's Welcome and heartbeat
replies, the wire fields, and an in-process run with one worker twice as slow: it is
told H_w = H/2, both keep contributing to every round, and the quorum gate still
pauses the run when one of the two dies with min_workers 2.
"""

from __future__ import annotations

import threading
import time

import msgpack
import pytest

from diloco.coordinator import Coordinator, CoordinatorConfig
from diloco.coordinator.dylu import SpeedTable, dylu_sync_every
from diloco.core import ConfigError, FSMConfig
from diloco.testing import join_message, joined, only
from diloco.wire import codec
from diloco.wire.codec import CodecError
from diloco.wire.messages import PROTOCOL_VERSION, Command, ErrorCode, Heartbeat, HeartbeatReply, Welcome
from training_harness import Run, batch_at, linear, mse_loss, wait_for

# ------------------------------------------------------------------ the formula


@pytest.mark.parametrize("speed,fastest,H,want", [
    (10.0, 10.0, 20, 20),        # the fastest keeps H
    (5.0, 10.0, 20, 10),         # half as fast: half the steps
    (5.1, 10.0, 20, 10),         # rounded down
    (4.99, 10.0, 20, 9),
    (3.0, 10.0, 10, 3),          # 0.3 * 10 is 2.9999... in floating point: not rounded down a step
    (0.01, 10.0, 20, 1),         # never below 1
    (None, 10.0, 20, 20),        # no measurement yet: keeps H
    (5.0, None, 20, 20),
    (0.0, 10.0, 20, 20),
    (12.0, 10.0, 20, 20),        # never above H
])
def test_h_w_is_the_floor_of_the_speed_ratio_times_h_at_least_1(speed, fastest, H, want):
    assert dylu_sync_every(speed, fastest, H) == want


def test_the_speed_table_smooths_ignores_zero_and_forgets():
    t = SpeedTable()
    t.report("a", 10.0)
    t.report("b", 0.0)                       # no measurement
    t.report("b", None)
    assert t.sync_every("b", 20) == 20 and t.sync_every("a", 20) == 20
    t.report("b", 4.0)
    t.report("b", 6.0)                       # 4 + 0.5 * (6 - 4)
    assert t.speeds["b"] == 5.0 and t.sync_every("b", 20) == 10
    t.forget("a")
    assert t.sync_every("b", 20) == 20       # now the fastest member


def test_dylu_needs_a_reference_h():
    with pytest.raises(ConfigError, match="sync_every"):
        CoordinatorConfig(dylu=True)
    with pytest.raises(ConfigError, match="sync_every"):
        CoordinatorConfig(dylu=True, sync_every=0)
    cfg = CoordinatorConfig(dylu=True, sync_every=8)
    assert CoordinatorConfig.from_dict(cfg.to_dict()) == cfg
    old = CoordinatorConfig().to_dict()
    del old["dylu"], old["sync_every"]       # a checkpoint from before DyLU
    assert CoordinatorConfig.from_dict(old).dylu is False


# ------------------------------------------------------------------ the coordinator, sans-IO


def _coordinator(dylu: bool) -> Coordinator:
    cfg = CoordinatorConfig(FSMConfig(min_workers=2), dylu=dylu, sync_every=20 if dylu else None)
    return Coordinator(cfg, 0.0)


def test_the_coordinator_tells_each_worker_its_h_w_in_welcome_and_heartbeat_replies():
    c = _coordinator(True)
    params = {"w": __import__("torch").zeros(3)}
    out = c.handle("a", join_message("a", params), 0.0)
    assert only(out, Welcome).sync_every == 20   # no measurement yet
    joined(c, params, "b")
    c.handle("a", Heartbeat("a", {"step": 5, "train_steps_per_s": 10.0}), 1.0)
    out = c.handle("b", Heartbeat("b", {"step": 2, "train_steps_per_s": 5.0}), 1.0)
    assert only(out, HeartbeatReply).sync_every == 10
    assert only(c.handle("a", Heartbeat("a"), 1.1), HeartbeatReply).sync_every == 20
    members = {m["worker_id"]: m for m in c.status()["members"]}
    assert members["a"]["sync_every"] == 20 and members["b"]["sync_every"] == 10
    c.handle("a", __import__("diloco.wire.messages", fromlist=["Leave"]).Leave("a"), 2.0)
    assert only(c.handle("b", Heartbeat("b"), 2.1), HeartbeatReply).sync_every == 20   # now the fastest
    # A non-member is told to re-join, with no H.
    assert only(c.handle("z", Heartbeat("z"), 2.2), HeartbeatReply).sync_every is None


def test_without_dylu_the_coordinator_names_no_h_and_ignores_the_speed():
    c = _coordinator(False)
    params = {"w": __import__("torch").zeros(3)}
    assert only(c.handle("a", join_message("a", params), 0.0), Welcome).sync_every is None
    out = c.handle("a", Heartbeat("a", {"train_steps_per_s": 5.0}), 1.0)
    assert only(out, HeartbeatReply).sync_every is None and "sync_every" not in c.status()["members"][0]


# ------------------------------------------------------------------ the wire


def _decode(header: dict):
    return codec.decode([msgpack.packb({"v": PROTOCOL_VERSION, **header, "tensors": []})])


REPLY = {"type": "HeartbeatReply", "below_min_workers": False, "min_workers": 2, "phase": "running",
         "command": "continue"}


def test_sync_every_round_trips_and_is_left_out_when_none():
    for msg in (HeartbeatReply(False, 2, "running", Command.CONTINUE, 7), HeartbeatReply(False, 2, "running")):
        frames = codec.encode(msg)
        header = msgpack.unpackb(bytes(frames[0]))
        assert ("sync_every" in header) == (msg.sync_every is not None)
        assert codec.decode(frames) == msg
    assert _decode(REPLY).sync_every is None                  # an older coordinator's reply


@pytest.mark.parametrize("bad", [0, -1, 1 << 31, True, 2.5, "10", [10]])
def test_a_bad_sync_every_is_refused(bad):
    with pytest.raises(CodecError) as info:
        _decode({**REPLY, "sync_every": bad})
    assert info.value.code is ErrorCode.BAD_MESSAGE and "sync_every" in info.value.detail


@pytest.mark.parametrize("bad", [-1.0, float("nan"), True])
def test_a_bad_train_speed_refuses_the_heartbeat(bad):
    with pytest.raises(CodecError) as info:
        _decode({"type": "Heartbeat", "worker_id": "w", "metrics": {"train_steps_per_s": bad}})
    assert info.value.code is ErrorCode.BAD_MESSAGE and "train_steps_per_s" in info.value.detail


# ------------------------------------------------------------------ in process: one worker 2x slower

H = 10
STEP_S = 0.01


class Killed(Exception):
    """The simulated crash of a worker process."""


def _slow_loss(seconds: float):
    def loss(model, batch):
        time.sleep(seconds)
        return mse_loss(model, batch)
    return loss


def _batches(seed: int, kill: threading.Event | None = None, endpoint=None):
    step = 0
    while True:
        if kill is not None and kill.is_set():
            endpoint.close()        # silent: no Leave, as a crashed process
            raise Killed("killed")
        yield batch_at(seed, step)
        step += 1


def _dylu_coordinator(run_observer=None) -> Coordinator:
    cfg = CoordinatorConfig(FSMConfig(min_workers=2, heartbeat_timeout_s=1.0), dylu=True, sync_every=H)
    return Coordinator(cfg, time.monotonic())


def test_a_worker_twice_as_slow_gets_half_the_steps_both_contribute_to_every_round_and_the_quorum_holds():
    kill = threading.Event()
    with Run(coordinator=_dylu_coordinator()) as run:
        fast = run.worker("fast", linear(1), sync_every=H)
        slow = run.worker("slow", linear(1), sync_every=H)
        run.start(fast, _batches(1), loss_fn=_slow_loss(STEP_S))
        run.start(slow, _batches(2, kill, slow.endpoint), loss_fn=_slow_loss(2 * STEP_S))
        wait_for(lambda: slow.effective_sync_every < H, 20.0, "the slow worker to adopt a smaller H")
        adopted_at = slow.rounds_synced
        wait_for(lambda: slow.rounds_synced >= adopted_at + 6, 20.0, "six more rounds")
        c = run.coordinator
        assert fast.effective_sync_every == H
        assert H // 2 - 1 <= slow.effective_sync_every <= H // 2 + 1
        assert c.sync_every_of("fast") == H and H // 2 - 1 <= c.sync_every_of("slow") <= H // 2 + 1
        # Both contribute to every round; the slow one after about H/2 steps.
        applies = [info for kind, info in list(run.events) if kind == "apply"]
        assert applies and all(sorted(a["contributors"]) == ["fast", "slow"] for a in applies)
        slow_steps = [b[0] - a[0] for a, b in zip(list(slow.sync_history)[-5:-1], list(slow.sync_history)[-4:])]
        fast_steps = [b[0] - a[0] for a, b in zip(list(fast.sync_history)[-5:-1], list(fast.sync_history)[-4:])]
        assert set(fast_steps) == {H} and all(H // 2 - 1 <= s <= H // 2 + 1 for s in slow_steps)

        # The quorum gate is untouched: with min_workers 2, killing one pauses the run.
        kill.set()
        wait_for(lambda: fast.state == "paused", 10.0, "the fast worker to pause")
        applied = c.fsm.rounds_applied
        time.sleep(0.5)
        assert c.fsm.rounds_applied == applied and fast.state == "paused"
        run.handles["slow"].join(10.0, expect_error=True)
        assert isinstance(run.handles["slow"].error, Killed)
        applies = [info for kind, info in list(run.events) if kind == "apply"]
        assert all(len(a["contributors"]) >= 2 for a in applies)


def test_the_cached_fastest_speed_always_equals_a_scan_of_the_members():
    """SpeedTable keeps the fastest speed without scanning every member on each heartbeat reply."""
    import random

    from diloco.coordinator.dylu import SpeedTable

    rng = random.Random(0)
    for _ in range(500):
        table = SpeedTable()
        for _ in range(30):
            wid = f"w{rng.randrange(6)}"
            if rng.random() < 0.2:
                table.forget(wid)
            else:
                table.report(wid, rng.choice([None, 0.0, rng.uniform(0.1, 10.0)]))
            assert table.fastest() == max(table.speeds.values(), default=None), table.speeds
