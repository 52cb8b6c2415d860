"""Wire dtypes (diloco.wire.compression, SPEC.md section 11 "Wire dtypes"): encode, decode, refusals, codec."""

from __future__ import annotations

import msgpack
import pytest
import torch

from diloco.wire import codec, compression
from diloco.wire.codec import CodecError, decode, encode
from diloco.wire.compression import (
    BLOCK,
    DeltaParams,
    EncodedMismatch,
    EncodingError,
    apply_delta,
    dequantize_int8,
    mark_delta,
    quantize_int8,
    quantized_update,
    scale_count,
)
from diloco.wire.messages import PROTOCOL_VERSION, WIRE_DTYPE_NAMES, Error, ErrorCode, Result, Submit, Welcome

SHAPES = [(0,), (1,), (255,), (256,), (257,), (3, 700), (4, 4, 33)]


def _expected(tensors):
    return [(n, tuple(t.shape)) for n, t in tensors.items()]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_int8_error_is_at_most_half_a_block_scale_per_element(shape):
    g = torch.Generator().manual_seed(len(shape) * 1000 + sum(shape))
    numel = int(torch.tensor(shape).prod())
    # Magnitudes from 1e-6 to 1e3 across the tensor: blocks of very different scales.
    x = torch.randn(shape, generator=g) * torch.logspace(-6, 3, numel).reshape(shape)
    q, s = quantize_int8(x)
    assert q.dtype == torch.int8 and q.shape == x.shape and (numel == 0 or int(q.min()) >= -127)
    assert s.dtype == torch.float32 and s.shape == (scale_count(numel),)
    y = dequantize_int8(q, s)
    assert y.dtype == torch.float32 and y.shape == x.shape
    if x.numel():
        per_elem_scale = s.repeat_interleave(BLOCK)[: x.numel()].reshape(shape)
        # s/2 from rounding, plus fp32 rounding of the divide and the multiply (relative 2^-23 each).
        bound = per_elem_scale / 2 + x.abs() * 2.0 ** -21
        assert bool(((x - y).abs() <= bound).all()), float(((x - y).abs() - bound).max())


def test_int8_is_exact_for_zeros_and_for_zero_blocks_inside_a_tensor():
    z = torch.zeros(3, 300)
    q, s = quantize_int8(z)
    assert torch.equal(dequantize_int8(q, s), z) and bool((s == 0).all())
    x = torch.randn(4 * BLOCK)
    x[BLOCK:2 * BLOCK] = 0.0  # the second block is all zeros
    q, s = quantize_int8(x)
    y = dequantize_int8(q, s)
    assert float(s[1]) == 0.0 and torch.equal(y[BLOCK:2 * BLOCK], torch.zeros(BLOCK))
    # Zeros in a non-zero block decode to exact zeros too (0 / s rounds to 0).
    x = torch.tensor([0.0, 1.0, -0.5, 0.0])
    assert dequantize_int8(*quantize_int8(x))[0].item() == 0.0


def test_int8_max_element_of_each_block_is_exact_up_to_rounding_and_payload_is_a_quarter():
    x = torch.randn(10_000)
    enc = compression.encode({"x": x}, "int8")
    assert enc.values["x"].dtype == torch.int8 and enc.scales["x"].numel() == 40
    assert enc.nbytes == 10_000 + 40 * 4  # 1.016 bytes per element
    assert int(enc.values["x"].abs().max()) == 127


def test_bf16_is_a_cast_and_fp32_is_as_is():
    x = {"a": torch.randn(5, 7), "b": torch.randn(3)}
    enc = compression.encode(x, "bf16")
    assert all(t.dtype == torch.bfloat16 for t in enc.values.values()) and enc.scales == {}
    dec = compression.decode(enc.values, enc.scales, "bf16", _expected(x), "t")
    assert all(torch.equal(dec[n], x[n].to(torch.bfloat16).to(torch.float32)) for n in x)
    enc = compression.encode(x, "fp32")
    assert all(enc.values[n] is x[n] for n in x) and enc.scales == {}
    assert compression.decode(enc.values, {}, "fp32", _expected(x), "t") == enc.values


def _int8(**tensors):
    enc = compression.encode(tensors, "int8")
    return dict(enc.values), dict(enc.scales), _expected(tensors)


def _refused(values, scales, expected, wire_dtype="int8", kind=EncodingError) -> str:
    with pytest.raises(kind) as info:
        compression.decode(values, scales, wire_dtype, expected, "fragment 0 submission")
    assert str(info.value).startswith("fragment 0 submission: ")
    return str(info.value)


def test_decode_refuses_every_bad_int8_encoding_precisely():
    v, s, exp = _int8(w=torch.randn(3, 200), b=torch.randn(3))
    assert "'w'" in _refused({**v, "w": v["w"].to(torch.bfloat16)}, s, exp) and "int8" in _refused(
        {**v, "w": v["w"].float()}, s, exp)
    msg = _refused(v, {"w": s["w"]}, exp)  # scales of b missing
    assert "scales" in msg and "'b'" in msg
    msg = _refused(v, {**s, "x": torch.zeros(1)}, exp)
    assert "unexpected ['x']" in msg
    msg = _refused(v, {**s, "w": torch.zeros(2)}, exp)  # 600 elements need 3 scales
    assert "'w'" in msg and "[3]" in msg and "600" in msg
    msg = _refused(v, {**s, "w": s["w"].double()}, exp)
    assert "float64" in msg
    msg = _refused(v, {**s, "w": s["w"].reshape(3, 1)}, exp)
    assert "[3, 1]" in msg
    for bad, what in ((float("nan"), "nan"), (float("inf"), "inf"), (-1.0, "is -1;"), (3e38, "3e+38")):
        scales = s["w"].clone()
        scales[2] = bad
        msg = _refused(v, {**s, "w": scales}, exp)
        assert "scale 2 of tensor 'w'" in msg and what in msg, msg
    q = v["b"].clone()
    q[1] = -128
    assert "-128" in _refused({**v, "b": q}, s, exp)


def test_decode_refuses_names_and_shapes_as_a_mismatch_and_scales_outside_int8():
    v, s, exp = _int8(w=torch.randn(3, 2), b=torch.randn(3))
    msg = _refused({"w": v["w"], "bias": v["b"]}, s, exp, kind=EncodedMismatch)
    assert "'b'" in msg and "'bias'" in msg
    msg = _refused({"b": v["b"], "w": v["w"]}, s, exp, kind=EncodedMismatch)
    assert "out of order" in msg
    msg = _refused({**v, "w": v["w"].reshape(2, 3)}, s, exp, kind=EncodedMismatch)
    assert "[2, 3]" in msg and "[3, 2]" in msg
    bf = {n: t.to(torch.bfloat16) for n, t in {"w": torch.ones(3, 2), "b": torch.ones(3)}.items()}
    assert "only int8" in _refused(bf, {"w": torch.ones(1)}, exp, wire_dtype="bf16")
    assert "bfloat16" in _refused({**bf, "w": torch.ones(3, 2)}, {}, exp, wire_dtype="bf16")
    assert "'fp8'" in _refused(bf, {}, exp, wire_dtype="fp8")


def test_quantized_update_and_a_worker_resolving_the_delta_hold_the_same_bits():
    g = torch.Generator().manual_seed(3)
    before = {"w": torch.randn(40, 30, generator=g), "b": torch.randn(7, generator=g)}
    after = {n: t - 0.01 * torch.randn(t.shape, generator=g) for n, t in before.items()}
    for dt in ("bf16", "int8"):
        enc, new = quantized_update(before, after, dt)
        assert all(new[n].dtype == torch.float32 for n in new)
        assert all(bool(((new[n] - after[n]).abs() <= 1e-3).all()) for n in new)
        held = DeltaParams(enc.values, enc.scales, dt).resolve(
            {n: t.clone() for n, t in before.items()}, ["w", "b"], "Result for fragment 0")
        assert all(torch.equal(held[n], new[n]) for n in new), dt
        assert torch.equal(apply_delta(before["b"], torch.zeros(7)), before["b"])


def test_a_delta_that_would_make_a_param_non_finite_is_refused_by_the_worker():
    base = {"w": torch.full((4,), 3e38)}
    values = {"w": torch.full((4,), 3e38).to(torch.bfloat16)}
    with pytest.raises(EncodingError, match="non-finite"):
        DeltaParams(values, {}, "bf16").resolve(base, ["w"], "Result for fragment 0")


def test_mark_delta_wraps_only_delta_results():
    plain = Result(0, 3, "applied", 4, {"w": torch.zeros(2)})
    assert mark_delta(plain) is plain
    enc = compression.encode({"w": torch.ones(300)}, "int8")
    delta = Result(0, 3, "applied", 4, enc.values, True, "int8", enc.scales)
    marked = mark_delta(delta)
    assert isinstance(marked.params, DeltaParams) and marked.params.wire_dtype == "int8"
    assert marked.params.scales.keys() == {"w"} and marked.params.nbytes == 300 + 2 * 4
    assert mark_delta(marked) is marked


# ------------------------------------------------------------------ on the wire


def test_int8_submit_bf16_result_and_welcome_round_trip_through_the_codec():
    enc = compression.encode({"w": torch.randn(3, 300), "b": torch.randn(3)}, "int8")
    sub = decode(encode(Submit("w1", 0, 5, enc.values, "int8", enc.scales)))
    assert sub.wire_dtype == "int8" and list(sub.tensors) == ["w", "b"] and list(sub.scales) == ["w", "b"]
    assert all(torch.equal(sub.tensors[n], enc.values[n]) and torch.equal(sub.scales[n], enc.scales[n])
               for n in enc.values)
    bf = compression.encode({"w": torch.randn(3)}, "bf16")
    res = decode(encode(Result(0, 5, "applied", 6, bf.values, True, "bf16")))
    assert res.delta is True and res.wire_dtype == "bf16" and res.params["w"].dtype == torch.bfloat16
    assert res.scales == {}
    wel = decode(encode(Welcome("w", (0,), (), "sync", (("a",),), 1, False, 0.25, {}, "int8")))
    assert wel.wire_dtype == "int8"
    assert set(WIRE_DTYPE_NAMES) == {"fp32", "bf16", "int8", "int4", "sparse"}
    # int4: packed bytes (uint8, half the elements) and a scale per 64 travel as they are.
    four = compression.encode({"w": torch.randn(5, 3)}, "int4")
    sub = decode(encode(Submit("w1", 0, 5, four.values, "int4", four.scales)))
    assert sub.wire_dtype == "int4" and sub.tensors["w"].dtype == torch.uint8
    assert torch.equal(sub.tensors["w"], four.values["w"]) and torch.equal(sub.scales["w"], four.scales["w"])


def test_a_header_with_an_unknown_wire_dtype_is_refused_naming_the_choices():
    header = msgpack.packb({"v": PROTOCOL_VERSION, "type": "Submit", "worker_id": "w", "fragment_id": 0,
                            "round_id": 0, "wire_dtype": "fp8", "tensors": []})
    with pytest.raises(CodecError) as info:
        decode([header])
    assert info.value.code is ErrorCode.BAD_MESSAGE
    assert "'wire_dtype' is 'fp8'" in info.value.detail and "int8" in info.value.detail
    header = msgpack.packb({"v": PROTOCOL_VERSION, "type": "Submit", "worker_id": "w", "fragment_id": 0,
                            "round_id": 0, "tensors": []})
    with pytest.raises(CodecError, match="'wire_dtype' is missing"):
        decode([header])


def test_an_older_peer_is_answered_in_its_own_version_so_it_can_read_the_refusal(monkeypatch):
    old = PROTOCOL_VERSION - 1
    join = msgpack.packb({"v": old, "type": "Join", "worker_id": "w", "protocol_version": old, "spec": [],
                          "tensors": []})
    with pytest.raises(CodecError) as info:
        decode([join])
    exc = info.value
    assert exc.code is ErrorCode.PROTOCOL_VERSION and exc.reply_version == old and exc.in_reply_to == "Join"
    frames = encode(codec.error_for(exc), version=exc.reply_version)
    assert msgpack.unpackb(frames[0])["v"] == old
    monkeypatch.setattr(codec, "PROTOCOL_VERSION", old)  # the old peer's decoder
    reply = decode(frames)
    assert isinstance(reply, Error) and reply.code is ErrorCode.PROTOCOL_VERSION and reply.in_reply_to == "Join"
    assert f"peer speaks protocol version {old}" in reply.detail
    assert f"this side speaks protocol version {PROTOCOL_VERSION}" in reply.detail


def test_a_newer_peer_is_answered_in_ours_and_only_errors_may_take_another_version():
    with pytest.raises(CodecError) as info:
        decode([msgpack.packb({"v": PROTOCOL_VERSION + 5, "type": "Join"})])
    assert info.value.reply_version == PROTOCOL_VERSION
    with pytest.raises(ValueError, match="only an Error"):
        encode(Submit("w", 0, 0, {}), version=PROTOCOL_VERSION - 1)


def test_a_sparse_submit_result_and_welcome_round_trip_through_the_codec():
    from diloco.wire import sparse

    wire = sparse.SparseWire(sparse.SparseFormat(16, 4), 0.9, 1.0)
    values, scales = sparse.encode({"w": torch.randn(5, 7)}, wire.fmt)
    sub = decode(encode(Submit("w1", 0, 5, values, "sparse", scales)))
    assert sub.wire_dtype == "sparse" and sub.tensors["w"].dtype == torch.int16
    assert torch.equal(sub.tensors["w"], values["w"]) and torch.equal(sub.scales["w"], scales["w"])
    res = decode(encode(Result(0, 5, "applied", 6, values, True, "sparse", scales)))
    assert res.wire_dtype == "sparse" and torch.equal(res.params["w"], values["w"])
    wel = decode(encode(Welcome("w", (0,), (), "sync", (("w",),), 1, False, 0.25, {}, "sparse",
                                wire_options=wire.to_dict())))
    assert sparse.SparseWire.from_dict(wel.wire_options) == wire
