"""A tensor sent in several frames is assembled into one buffer as its parts arrive (``framing.Coalescer``).

SPEC.md section 11, "Frames": the receiver copies each chunk of a chunked tensor into the
tensor's buffer as the part arrives and lets the part go, so ``codec.decode`` hands the tensor
out without a copy. The decoder still judges every byte: a run whose parts do not add up to what
the header declared is refused as before, and the limits count the run's buffer in full from its
first part.
"""

from __future__ import annotations

import msgpack
import pytest
import torch

from diloco.transport.zmq import framing
from diloco.transport.zmq.framing import PART_COST_BYTES, Assembler, Complete, Refused, parts
from diloco.wire import codec, frame_plan
from diloco.wire.messages import Result, Submit
from diloco.wire.zmq import _TENSOR_RUNS, ZmqCoordinatorEndpoint, ZmqOptions, ZmqWorkerEndpoint

LOOPBACK = "tcp://127.0.0.1:0"


def _feed(assembler, frames, peer="p", seq=1):
    got = None
    for part in parts(seq, [bytes(f) for f in frames]):
        assert got is None, "a message completed before its last part"
        got = assembler.add(peer, part, 0.0)
    return got


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {"big": torch.randn(300, 1000, generator=g), "small": torch.randn(7, generator=g),
            "odd": torch.randn(3, 100_003, generator=g).to(torch.bfloat16), "empty": torch.empty(0, 4)}


def test_chunked_tensors_arrive_contiguous_and_decode_to_the_same_values_without_a_copy():
    tensors = _tensors()
    frames = codec.encode(Submit("w", 0, 3, tensors, "fp32", {}), chunk_bytes=100_000)
    runs = frame_plan.plan_runs(frames[0])
    assert [(first, n) for first, n, _ in runs] == [(1, 12), (14, 7)]
    a = Assembler(1 << 30, coalescer=_TENSOR_RUNS)
    got = _feed(a, frames)
    assert isinstance(got, Complete)
    sizes = [framing.nbytes(f) for f in got.frames]
    assert sizes[1] == 1_200_000 and sizes[2:13] == [0] * 11  # one buffer, the rest empty
    assert a.partial_bytes == 0 and a.partial_count == 0
    decoded = codec.decode(got.frames)
    for name, t in tensors.items():
        assert decoded.tensors[name].dtype == t.dtype and torch.equal(decoded.tensors[name], t), name
    # The tensor is a view of the assembled buffer: no copy at decode.
    assert decoded.tensors["big"].data_ptr() == torch.frombuffer(got.frames[1], dtype=torch.uint8).data_ptr()


def test_without_a_coalescer_the_frames_arrive_as_they_came():
    frames = codec.encode(Submit("w", 0, 3, _tensors(), "fp32", {}), chunk_bytes=100_000)
    got = _feed(Assembler(1 << 30), frames)
    assert [framing.nbytes(f) for f in got.frames] == [len(f) for f in frames]


def test_the_run_is_counted_in_full_from_its_first_part_and_released_at_the_end():
    frames = codec.encode(Submit("w", 0, 3, {"t": torch.zeros(250_000)}, "fp32", {}), chunk_bytes=100_000)
    a = Assembler(1 << 30, coalescer=_TENSOR_RUNS)
    ps = list(parts(1, [bytes(f) for f in frames]))
    assert a.add("p", ps[0], 0.0) is None
    header_cost = a.partial_bytes
    assert a.add("p", ps[1], 0.0) is None
    assert a.partial_bytes == header_cost + 1_000_000 + PART_COST_BYTES
    assert a.add("p", ps[2], 0.0) is None
    assert a.partial_bytes == header_cost + 1_000_000 + 2 * PART_COST_BYTES
    assert len(ps) == 11
    assert all(a.add("p", p, 0.0) is None for p in ps[3:-1])
    assert a.partial_bytes == header_cost + 1_000_000 + 9 * PART_COST_BYTES
    assert isinstance(a.add("p", ps[-1], 0.0), Complete)
    assert a.partial_bytes == 0


def test_a_run_declared_past_the_limit_is_refused_at_its_first_part():
    frames = codec.encode(Submit("w", 0, 3, {"t": torch.zeros(250_000)}, "fp32", {}), chunk_bytes=100_000)
    a = Assembler(500_000, coalescer=_TENSOR_RUNS)
    ps = list(parts(1, [bytes(f) for f in frames]))
    assert a.add("p", ps[0], 0.0) is None
    got = a.add("p", ps[1], 0.0)
    assert isinstance(got, Refused) and got.code == "too_large"
    assert a.partial_bytes == 0
    assert all(a.add("p", p, 0.0) is None for p in ps[2:])  # the rest is skipped


def _lying(frames, declared_elems):
    """``frames`` with the header's first tensor declared as ``declared_elems`` fp32 elements."""
    header = msgpack.unpackb(frames[0], raw=False)
    header["tensors"][0][3] = [declared_elems]
    return [msgpack.packb(header, use_bin_type=True), *frames[1:]]


@pytest.mark.parametrize("declared", [200_000, 300_000])
def test_parts_that_do_not_match_the_declared_run_reach_the_decoder_which_refuses_them(declared):
    frames = codec.encode(Submit("w", 0, 3, {"t": torch.zeros(250_000)}, "fp32", {}), chunk_bytes=100_000)
    got = _feed(Assembler(1 << 30, coalescer=_TENSOR_RUNS), _lying(frames, declared))
    assert isinstance(got, Complete)
    assert sum(framing.nbytes(f) for f in got.frames[1:]) == 1_000_000  # every byte that came, kept
    with pytest.raises(codec.CodecError) as err:
        codec.decode(got.frames)
    assert err.value.code.value == "bad_message"


def test_an_unreadable_header_means_no_coalescing():
    frames = codec.encode(Submit("w", 0, 3, {"t": torch.zeros(250_000)}, "fp32", {}), chunk_bytes=100_000)
    got = _feed(Assembler(1 << 30, coalescer=_TENSOR_RUNS), [b"\xc1 not msgpack", *frames[1:]])
    assert [framing.nbytes(f) for f in got.frames[1:]] == [len(f) for f in frames[1:]]


def test_a_chunked_submit_and_result_cross_the_endpoints_intact():
    options = ZmqOptions(chunk_bytes=64 << 10)
    tensors = _tensors()
    with ZmqCoordinatorEndpoint(LOOPBACK, options=options, monitor=False) as coord, \
            ZmqWorkerEndpoint(coord.address, options=options) as worker:
        worker.send(Submit("w", 0, 3, tensors, "fp32", {}))
        got = None
        for _ in range(100):
            got = coord.recv(0.1)
            if got is not None:
                break
        peer, msg, *_ = got
        for name, t in tensors.items():
            assert torch.equal(msg.tensors[name], t), name
        coord.send(peer, Result(0, 3, "applied", 4, msg.tensors))
        back = None
        for _ in range(100):
            back = worker.recv(0.1)
            if back is not None:
                break
        assert isinstance(back, Result)
        for name, t in tensors.items():
            assert torch.equal(back.params[name], t), name
