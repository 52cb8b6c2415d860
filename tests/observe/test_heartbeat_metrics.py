"""Workers' training metrics on heartbeats: the wire field, the worker's side, the coordinator's histories."""

from __future__ import annotations

import msgpack
import pytest
import torch

from diloco.testing import joined, make_coordinator
from diloco.wire import codec
from diloco.wire.codec import CodecError
from diloco.wire.messages import HEARTBEAT_METRICS, PROTOCOL_VERSION, ErrorCode, Heartbeat
from diloco.worker.link import Link
from diloco.worker.metrics import TrainingMetrics, batch_size


def _header(metrics) -> list[bytes]:
    return [msgpack.packb({"v": PROTOCOL_VERSION, "type": "Heartbeat", "worker_id": "w1", "metrics": metrics, "tensors": []})]


def test_metrics_round_trip_and_are_left_out_of_the_header_when_none():
    m = Heartbeat("w1", {"step": 40, "steps_per_s": 12.5, "loss": 1.25, "eval_loss": 1.5, "samples": 1280})
    assert codec.decode(codec.encode(m)) == m
    plain = codec.encode(Heartbeat("w1"))
    assert b"metrics" not in bytes(plain[0])  # a peer that predates the field reads it as before
    assert codec.decode(plain) == Heartbeat("w1", None)


@pytest.mark.parametrize("metrics, words", [
    ({"step": -1}, "metric 'step' to be an integer >= 0"),
    ({"step": 1.5}, "metric 'step' to be an integer >= 0"),
    ({"loss": float("nan")}, "metric 'loss' to be a finite number"),
    ({"loss": float("inf")}, "metric 'loss' to be a finite number"),
    ({"loss": True}, "metric 'loss' to be a finite number"),
    ({"loss": "low"}, "metric 'loss' to be a finite number"),
    ({"steps_per_s": -2.0}, "'steps_per_s' to be >= 0"),
    ({"gpu_temp": 80}, "'gpu_temp' is not one"),
    ([1, 2], "a map of metrics"),
])
def test_a_bad_metrics_field_is_refused_with_a_precise_error(metrics, words):
    with pytest.raises(CodecError) as info:
        codec.decode(_header(metrics))
    assert info.value.code is ErrorCode.BAD_MESSAGE
    assert "field 'metrics'" in info.value.detail and words in info.value.detail
    assert info.value.in_reply_to == "Heartbeat"


def test_only_the_documented_keys_exist():
    assert set(HEARTBEAT_METRICS) == {"step", "steps_per_s", "loss", "eval_loss", "samples", "train_steps_per_s"}


def test_training_metrics_snapshot_rates_losses_and_samples():
    now = [100.0]
    tm = TrainingMetrics(lambda: now[0])
    assert tm.snapshot(0) == {"step": 0, "samples": 0}  # no samples reported: steps stand in
    tm.report(loss=2.0)
    now[0] = 102.0
    snap = tm.snapshot(20)
    assert snap == {"step": 20, "steps_per_s": 10.0, "loss": 2.0, "samples": 20}
    tm.report(loss=float("nan"), eval_loss=1.5, samples=32)  # a NaN loss is not sent; the last finite one is
    tm.report(samples=32)
    now[0] = 104.0
    assert tm.snapshot(40) == {"step": 40, "steps_per_s": 10.0, "loss": 2.0, "eval_loss": 1.5, "samples": 64}
    assert batch_size((torch.zeros(16, 3), torch.zeros(16))) == 16
    assert batch_size({"x": torch.zeros(8, 2)}) == 8
    assert batch_size("text") is None


class _Sent:
    def __init__(self):
        self.sent = []

    def send(self, message):
        self.sent.append(message)


def test_the_link_decorates_each_outgoing_heartbeat_and_nothing_else():
    ep = _Sent()
    link = Link(ep, "w1", threaded=False)
    link.send(Heartbeat("w1"))
    assert ep.sent[-1] == Heartbeat("w1")  # no metrics source: unchanged
    link.heartbeat_metrics = lambda: {"step": 7, "loss": 0.5}
    link.send(Heartbeat("w1"))
    assert ep.sent[-1] == Heartbeat("w1", {"step": 7, "loss": 0.5})
    from diloco.wire.messages import Leave
    link.send(Leave("w1"))
    assert ep.sent[-1] == Leave("w1")


def test_the_coordinator_keeps_bounded_histories_of_members_only():
    params = {"w": torch.zeros(4)}
    c = joined(make_coordinator(min_workers=1), params, "a")
    c.handle("a", Heartbeat("a", {"step": 5, "loss": 1.0}), 1.0)
    c.handle("stranger", Heartbeat("b", {"step": 9, "loss": 9.0}), 1.5)  # not a member: nothing kept
    assert list(c.metrics.workers) == ["a"]
    member = c.status()["members"][0]
    assert member["metrics"]["step"] == 5 and member["metrics"]["loss"] == 1.0
    for i in range(c.metrics.points + 10):
        c.handle("a", Heartbeat("a", {"step": 10 + i, "loss": 0.5}), 2.0 + i)
    assert len(c.metrics.workers["a"]) == c.metrics.points
    status = c.status()
    assert status["uptime_s"] > 0 and status["since_last_apply_s"] is None and status["config"]["fsm"]
