"""A Submit's fp32 tensors are measured as they arrive, and the coordinator's checks use that measure.

SPEC.md section 11, "Frames": the coordinator's receiver measures each fp32 tensor of a Submit
(its sum of squares) as soon as the tensor's bytes are whole, while the rest of the round's
Submits arrive (``framing.FrameWatch``, ``diloco.wire.measure``). The checks then find the value
they would have computed (``ParamStore.check_submission``): the same function on the same memory,
so the same bits. A measure answers only for the very memory it measured.
"""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch
import zmq

from diloco.coordinator import Coordinator, CoordinatorConfig
from diloco.coordinator.params import NonFinite, ParamStore
from diloco.core import FSMConfig
from diloco.transport.zmq import framing
from diloco.transport.zmq.framing import Assembler, Complete, parts
from diloco.wire import codec, frame_plan
from diloco.wire.measure import SubmitSquares
from diloco.wire.messages import PROTOCOL_VERSION, Join, Result, Submit, Welcome, spec_of
from diloco.wire.zmq import _TENSOR_RUNS, ZmqCoordinatorEndpoint, ZmqOptions, ZmqWorkerEndpoint

LOOPBACK = "tcp://127.0.0.1:0"


def _arrive(frames, coalescer=_TENSOR_RUNS) -> Complete:
    """Frames through the receiver's assembly as libzmq hands them over (``zmq.Frame``s)."""
    assembler = Assembler(1 << 30, coalescer=coalescer)
    got = None
    for part in parts(1, frames):
        assert got is None
        got = assembler.add("p", [zmq.Frame(bytes(f)) for f in part], 0.0)
    assert isinstance(got, Complete)
    return got


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"matrix": torch.randn(31, 1009, generator=g) * 3,  # several frames: coalesced
            "vector": torch.randn(100_003, generator=g),  # several frames, an odd size
            "cube": torch.randn(2, 3, 5, generator=g),  # one frame
            "empty": torch.empty(0, 4)}


def _checked_square(t: torch.Tensor) -> float:
    """What ``check_submission`` computes of a tensor without a measure."""
    return float(torch.linalg.vector_norm(t.detach().float())) ** 2


def test_each_fp32_tensor_is_measured_as_it_arrives_to_the_bits_the_checks_compute():
    tensors = _tensors()
    frames = codec.encode(Submit("w", 0, 1, tensors, "fp32", {}), chunk_bytes=40_000)
    assert len(frames) > 6  # the two large tensors came in several frames each
    got = _arrive(frames)
    assert isinstance(got.watch, SubmitSquares)
    decoded = codec.decode(got.frames).tensors
    assert len(got.watch) == 3  # every non-empty tensor
    for name, t in decoded.items():
        if not t.numel():
            assert got.watch.square(t) is None
            continue
        assert got.watch.square(t) == _checked_square(t), name  # bit for bit


def test_a_measure_answers_only_for_the_memory_it_measured():
    got = _arrive(codec.encode(Submit("w", 0, 1, _tensors(), "fp32", {}), chunk_bytes=40_000))
    t = codec.decode(got.frames).tensors["matrix"]
    assert got.watch.square(t) is not None
    assert got.watch.square(t.clone()) is None  # a copy: other memory, maybe other values
    assert got.watch.square(t[:5]) is None  # part of it
    assert got.watch.square(t.t()) is None  # not contiguous
    assert got.watch.square(t.to(torch.float64)) is None


def test_only_submits_are_measured_and_only_their_fp32_tensors():
    tensors = _tensors()
    join = codec.encode(Join("w", PROTOCOL_VERSION, spec_of(tensors), tensors), chunk_bytes=40_000)
    assert _arrive(join).watch is None
    result = codec.encode(Result(0, 1, "applied", 2, tensors), chunk_bytes=40_000)
    assert _arrive(result).watch is None
    bf16 = {n: t.to(torch.bfloat16) for n, t in tensors.items()}
    assert _arrive(codec.encode(Submit("w", 0, 1, bf16, "bf16", {}), chunk_bytes=40_000)).watch is None
    mixed = {"a": tensors["cube"], "b": tensors["vector"].to(torch.bfloat16)}
    got = _arrive(codec.encode(Submit("w", 0, 1, mixed, "fp32", {}), chunk_bytes=40_000))
    decoded = codec.decode(got.frames).tensors
    assert got.watch.square(decoded["a"]) == _checked_square(decoded["a"])
    assert got.watch.square(decoded["b"]) is None


def test_a_watch_that_fails_ends_but_the_message_is_assembled_as_ever():
    class Failing:
        plan = staticmethod(frame_plan.plan_runs)
        allocate = staticmethod(_TENSOR_RUNS.allocate)

        class _Watch:
            def frame(self, index, buffer):
                raise RuntimeError("a broken watch")

        def watch(self, header):
            return self._Watch()

    tensors = _tensors()
    got = _arrive(codec.encode(Submit("w", 0, 1, tensors, "fp32", {}), chunk_bytes=40_000), Failing())
    assert got.watch is None
    decoded = codec.decode(got.frames).tensors
    assert all(torch.equal(decoded[n], t) for n, t in tensors.items())


class _Told:
    """A ``Measured`` that answers a fixed square for one tensor's memory."""

    def __init__(self, t: torch.Tensor, square: float) -> None:
        self.ptr, self.value = t.data_ptr(), square

    def square(self, t: torch.Tensor) -> float | None:
        return self.value if t.data_ptr() == self.ptr else None


def test_the_checks_take_the_measure_and_compute_only_what_was_not_measured():
    params = {"a": torch.zeros(10), "b": torch.zeros(20)}
    store = ParamStore(params, 1)
    sub = {"a": torch.full((10,), 2.0), "b": torch.full((20,), 1.0)}
    assert store.check_submission(0, sub, norm=True) == pytest.approx(math.sqrt(40 + 20))
    # The measure is taken as given: 1.0 for "a" instead of 40, and "b" computed (20).
    assert store.check_submission(0, sub, norm=True, measured=_Told(sub["a"], 1.0)) == pytest.approx(math.sqrt(21))


def test_a_measure_that_is_not_finite_still_gets_the_exact_finiteness_check():
    store = ParamStore({"a": torch.zeros(4)}, 1)
    bad = {"a": torch.tensor([1.0, float("nan"), 0.0, 0.0])}
    with pytest.raises(NonFinite):
        store.check_submission(0, bad, norm=True, measured=_Told(bad["a"], float("nan")))
    # Finite values whose squares overflow: not refused, the norm is infinite (no outlier bound lets it in).
    big = {"a": torch.full((4,), 3e38)}
    assert store.check_submission(0, big, norm=True, measured=_Told(big["a"], math.inf)) == math.inf


def test_a_nan_submit_over_zmq_is_measured_and_still_refused():
    tensors = _tensors()
    tensors["vector"][77_777] = float("nan")
    got = _arrive(codec.encode(Submit("w", 0, 1, tensors, "fp32", {}), chunk_bytes=40_000))
    decoded = codec.decode(got.frames).tensors
    assert math.isnan(got.watch.square(decoded["vector"]))
    store = ParamStore({n: torch.zeros_like(t) for n, t in tensors.items()}, 1)
    with pytest.raises(NonFinite, match="vector"):
        store.check_submission(0, decoded, norm=True, measured=got.watch)


def test_the_served_coordinator_checks_each_submit_with_what_its_receiver_measured(monkeypatch):
    """The real path: worker endpoint -> ROUTER -> ``serve`` -> ``Coordinator`` -> its checks."""
    from diloco.coordinator.runner import serve

    seen: list = []
    original = ParamStore.check_submission

    def spy(self, fragment_id, tensors, *, norm=False, measured=None):
        seen.append((norm, {n: None if measured is None else measured.square(t) for n, t in tensors.items()},
                     {n: _checked_square(t) for n, t in tensors.items() if t.numel()}))
        return original(self, fragment_id, tensors, norm=norm, measured=measured)

    monkeypatch.setattr(ParamStore, "check_submission", spy)
    params = {"w": torch.zeros(64, 1000), "b": torch.zeros(10)}
    coordinator = Coordinator(CoordinatorConfig(fsm=FSMConfig(min_workers=1)), time.monotonic())
    options = ZmqOptions(chunk_bytes=50_000)
    endpoint = ZmqCoordinatorEndpoint(LOOPBACK, options=options)
    stop = threading.Event()
    server = threading.Thread(target=serve, args=(endpoint, coordinator), kwargs=dict(stop_event=stop,
                              tick_interval_s=0.02), daemon=True)
    server.start()
    worker = ZmqWorkerEndpoint(endpoint.address, label="w1", options=options)
    try:
        worker.send(Join("w1", PROTOCOL_VERSION, spec_of(params), params))
        deadline = time.monotonic() + 30
        while not isinstance(worker.recv(1.0), Welcome):
            assert time.monotonic() < deadline, "no Welcome"
        grad = {"w": torch.randn(64, 1000), "b": torch.randn(10)}
        worker.send(Submit("w1", 0, 0, grad, "fp32", {}))
        while not isinstance(reply := worker.recv(1.0), Result):
            assert time.monotonic() < deadline, "no Result"
        assert reply.outcome == "applied"
    finally:
        worker.close()
        stop.set()
        server.join(10)
        endpoint.close()
    assert len(seen) == 1
    norm, measured, computed = seen[0]
    assert norm is True
    # The chunked tensor is assembled into a buffer the receiver allocates (aligned): always measured on
    # arrival, to the checks' own bits. A small one-frame tensor is measured where libzmq's receive buffer
    # left it aligned; that depends on how the stream's reads fell, so only its bits are asserted.
    assert measured["w"] == computed["w"]
    assert measured["b"] in (None, computed["b"])


def _received_submit(wid: str, tensors: dict[str, torch.Tensor]):
    """``tensors`` as the coordinator's receiver hands a Submit over: decoded from its receive buffers,
    with what it measured as they arrived."""
    got = _arrive(codec.encode(Submit(wid, 0, 0, tensors, "fp32", {}), chunk_bytes=40_000))
    return codec.decode(got.frames), got.watch


@pytest.mark.parametrize("journal", [False, True])
def test_the_rounds_sum_starts_in_the_first_submits_receive_buffers_unless_a_journal_reads_them(journal):
    """The receive buffers are the Submit's own: the round's running sum may start in them, scaled in
    place (``ParamStore.accumulate(owned=True)``), with no copy. A journal writes the Submit as it came,
    so then the sum is a copy and the Submit keeps its values."""
    from diloco.testing import joined, make_coordinator

    params = {"a": torch.zeros(31, 1009), "b": torch.zeros(10)}
    c = joined(make_coordinator(min_workers=2), params, "w1", "w2")
    plain = joined(make_coordinator(min_workers=2), params, "w1", "w2")  # the same Submits, not measured
    recorded = []

    class Journal:
        def contribution(self, fragment_id, round_id, worker_id, submit):
            recorded.append({n: t.clone() for n, t in submit.tensors.items()})

        def step(self, fragment_id, inputs, grad):
            pass

    if journal:
        c.hub.recorder = plain.hub.recorder = Journal()
    g = torch.Generator().manual_seed(5)
    sent = {w: {n: torch.randn(t.shape, generator=g) for n, t in params.items()} for w in ("w1", "w2")}
    first, watch = _received_submit("w1", sent["w1"])
    c.handle("w1", first, 1.0, measured=watch)
    plain.handle("w1", Submit("w1", 0, 0, {n: t.clone() for n, t in sent["w1"].items()}, "fp32", {}), 1.0)
    sums = c.store._sums[0]
    in_buffers = all(sums[n].data_ptr() == first.tensors[n].data_ptr() for n in params)
    assert in_buffers is not journal
    if journal:
        assert all(torch.equal(recorded[0][n], sent["w1"][n]) for n in params)  # as it came
        assert all(torch.equal(first.tensors[n], sent["w1"][n]) for n in params)
    second, watch = _received_submit("w2", sent["w2"])
    c.handle("w2", second, 2.0, measured=watch)
    plain.handle("w2", Submit("w2", 0, 0, sent["w2"], "fp32", {}), 2.0)
    for n in params:  # the same bits either way
        assert torch.equal(c.store.params[n], plain.store.params[n]), n
