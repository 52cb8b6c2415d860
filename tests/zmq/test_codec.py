"""The wire codec in-process: round trips, chunking, and strict refusal of bad frames (SPEC.md section 11).

Hypothesis generates valid messages (every type, random tensors) that must
round-trip exactly, and hostile frames (random bytes, truncated or mutated
headers, wrong field types, tensor frames that do not match the table) that
must raise ``CodecError`` -- never anything else, never a half-built message.
"""

from __future__ import annotations

import math

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco.wire import codec
from diloco.wire.codec import CodecError, decode, encode
from diloco.wire.messages import (
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    Accepted,
    AdminReply,
    AdminRequest,
    Command,
    Error,
    ErrorCode,
    Heartbeat,
    HeartbeatReply,
    Join,
    Leave,
    Result,
    Submit,
    TensorSpec,
    Welcome,
    spec_of,
)

# ------------------------------------------------------------------ strategies

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool]
ids = st.text(min_size=1, max_size=20)
ints = st.integers(min_value=-(2**63), max_value=2**63 - 1)
small = st.integers(min_value=0, max_value=1000)


@st.composite
def tensors(draw, max_tensors=4):
    n = draw(st.integers(0, max_tensors))
    names = draw(st.lists(st.text(min_size=1, max_size=12), min_size=n, max_size=n, unique=True))
    out = {}
    for name in names:
        dtype = draw(st.sampled_from(DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
        seed = draw(st.integers(0, 2**31))
        g = torch.Generator().manual_seed(seed)
        t = (torch.rand(shape, generator=g) * 100 - 50).to(dtype)
        out[name] = t
    return out


plain = st.recursive(
    st.none() | st.booleans() | ints | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3),
    max_leaves=10,
)


@st.composite
def messages(draw):
    kind = draw(st.sampled_from([cls.__name__ for cls in MESSAGE_TYPES]))
    if kind == "Join":
        t = draw(tensors())
        return Join(draw(ids), draw(ints), spec_of(t), t)
    if kind == "Heartbeat":
        return Heartbeat(draw(ids))
    if kind == "Submit":
        return Submit(draw(ids), draw(ints), draw(ints), draw(tensors()))
    if kind == "Leave":
        return Leave(draw(ids))
    if kind == "Welcome":
        return Welcome(draw(ids), tuple(draw(st.lists(small, max_size=3))),
                       tuple(draw(st.lists(st.tuples(small, small), max_size=3))),
                       draw(st.sampled_from(["sync", "async"])),
                       tuple(tuple(g) for g in draw(st.lists(st.lists(st.text(max_size=5), max_size=3), max_size=3))),
                       draw(small), draw(st.booleans()), draw(st.floats(0.001, 100)), draw(tensors()))
    if kind == "HeartbeatReply":
        return HeartbeatReply(draw(st.booleans()), draw(small), draw(st.text(max_size=10)),
                              draw(st.sampled_from(list(Command))))
    if kind == "Accepted":
        return Accepted(draw(ints), draw(ints))
    if kind == "Result":
        return Result(draw(ints), draw(ints), draw(st.sampled_from(["applied", "applied_final", "stop"])),
                      draw(ints), draw(tensors()))
    if kind == "Error":
        return Error(draw(st.sampled_from(list(ErrorCode))), draw(st.text(max_size=30)), draw(st.text(max_size=10)))
    if kind == "AdminRequest":
        return AdminRequest(draw(st.text(max_size=10)), draw(st.dictionaries(st.text(max_size=5), plain, max_size=3)))
    return AdminReply(draw(st.booleans()), draw(st.dictionaries(st.text(max_size=5), plain, max_size=3)),
                      draw(st.text(max_size=10)))


def assert_same(a, b) -> None:
    assert type(a) is type(b)
    for f in a.__dataclass_fields__:
        x, y = getattr(a, f), getattr(b, f)
        if isinstance(x, dict) and x and all(isinstance(v, torch.Tensor) for v in x.values()):
            assert list(x) == list(y), f
            for k in x:
                assert x[k].dtype == y[k].dtype and x[k].shape == y[k].shape, (f, k)
                assert torch.equal(x[k], y[k]), (f, k)
        else:
            assert x == y, f


def frames_bytes(frames) -> list[bytes]:
    return [bytes(f) for f in frames]


# ------------------------------------------------------------------ round trips


@settings(max_examples=300)
@given(messages(), st.integers(1, 64))
def test_every_message_round_trips(message, chunk_bytes):
    frames = encode(message, chunk_bytes=chunk_bytes)
    assert isinstance(frames[0], bytes)
    assert all(codec._nbytes(f) <= chunk_bytes for f in frames[1:])
    assert_same(message, decode(frames_bytes(frames)))


def test_large_tensor_is_chunked_and_reassembled():
    t = torch.randn(3_000_000)  # 12 MB: three 4 MiB frames
    frames = encode(Submit("w", 0, 0, {"t": t, "s": torch.tensor(2.0)}), chunk_bytes=4 << 20)
    assert [codec._nbytes(f) for f in frames[1:]] == [4 << 20, 4 << 20, 12_000_000 - (8 << 20), 4]
    back = decode(frames)
    assert torch.equal(back.tensors["t"], t) and back.tensors["s"].item() == 2.0
    # The default frame size is 16 MiB: this tensor goes whole.
    assert len(encode(Submit("w", 0, 0, {"t": t}))) == 2


def test_encode_does_not_copy_tensor_bytes():
    t = torch.arange(1000, dtype=torch.float32)
    frames = encode(Submit("w", 0, 0, {"t": t}))
    t[0] = 42.0  # the frame aliases the tensor's memory
    assert decode(frames).tensors["t"][0].item() == 42.0


def test_decode_single_frame_tensor_shares_the_receive_buffer():
    buf = bytearray(torch.arange(16, dtype=torch.float32).numpy().tobytes())
    header = msgpack.packb({"v": PROTOCOL_VERSION, "type": "Submit", "worker_id": "w", "fragment_id": 0,
                            "round_id": 0, "wire_dtype": "fp32", "tensors": [["tensors", "t", "float32", [4, 4], 1]]})
    t = decode([header, buf]).tensors["t"]
    buf[0:4] = torch.tensor([7.0]).numpy().tobytes()
    assert t[0, 0].item() == 7.0  # zero-copy: frombuffer on the frame


def test_spec_round_trips_as_tensor_specs():
    msg = decode(encode(Join("w", PROTOCOL_VERSION, (TensorSpec("a", (2, 3), "float32"),), {})))
    assert msg.spec == (TensorSpec("a", (2, 3), "float32"),)


def test_encode_refuses_an_unsendable_dtype():
    with pytest.raises(TypeError, match="complex64"):
        encode(Submit("w", 0, 0, {"c": torch.zeros(2, dtype=torch.complex64)}))


# ------------------------------------------------------------------ refusals, one per rule


def header(**fields):
    base = {"v": PROTOCOL_VERSION, "type": "Submit", "worker_id": "w1", "fragment_id": 0, "round_id": 0,
            "wire_dtype": "fp32", "tensors": [["tensors", "t", "float32", [2], 1]]}
    base.update(fields)
    return msgpack.packb({k: v for k, v in base.items() if v is not ...})


def refused(frames, code=ErrorCode.BAD_MESSAGE, *, max_message_bytes=codec.MAX_MESSAGE_BYTES) -> str:
    with pytest.raises(CodecError) as info:
        decode(frames, max_message_bytes=max_message_bytes)
    assert info.value.code is code, info.value
    return info.value.detail


EIGHT = bytes(8)


def test_a_valid_hand_made_message_decodes():
    assert decode([header(), EIGHT]).tensors["t"].tolist() == [0.0, 0.0]


def test_wrong_protocol_version_names_both_versions():
    detail = refused([header(v=PROTOCOL_VERSION + 1), EIGHT], ErrorCode.PROTOCOL_VERSION)
    assert f"version {PROTOCOL_VERSION + 1}" in detail and f"version {PROTOCOL_VERSION}" in detail


def test_wrong_version_is_refused_before_anything_else_is_read():
    # A future version may change every other field: only "v" is read.
    detail = refused([msgpack.packb({"v": 99, "type": "SomethingNew", "x": [1, 2]})], ErrorCode.PROTOCOL_VERSION)
    assert "99" in detail


@pytest.mark.parametrize("frames, words", [
    ([], "empty"),
    ([b"\xc1"], "not a valid msgpack"),
    ([msgpack.packb([1, 2])], "expected a map"),
    ([header(v="1"), EIGHT], "'v'"),
    ([header(v=...), EIGHT], "'v'"),
    ([header(type="Nope"), EIGHT], "Nope"),
    ([header(type=...), EIGHT], "'type'"),
    ([header(worker_id=5), EIGHT], "'worker_id' is 5, expected a string"),
    ([header(fragment_id="0"), EIGHT], "'fragment_id' is '0', expected an integer"),
    ([header(round_id=True), EIGHT], "'round_id' is True, expected an integer"),
    ([header(round_id=1.5), EIGHT], "'round_id' is 1.5"),
    ([header(round_id=...), EIGHT], "'round_id' is missing"),
    ([header(extra=1), EIGHT], "unknown field 'extra'"),
    ([header(tensors="x"), EIGHT], "'tensors'"),
    ([header(tensors=[["tensors", "t", "float32", [2]]]), EIGHT], "tensors[0]"),
    ([header(tensors=[["params", "t", "float32", [2], 1]]), EIGHT], "field is 'params'"),
    ([header(tensors=[["tensors", "t", "complex64", [2], 1]]), EIGHT], "dtype is 'complex64'"),
    ([header(tensors=[["tensors", "t", "float32", [-2], 1]]), EIGHT], "shape is [-2]"),
    ([header(tensors=[["tensors", "t", "float32", [1] * 40, 1]]), EIGHT], "shape"),
    ([header(tensors=[["tensors", "t", "float32", [2], 1], ["tensors", "t", "float32", [2], 1]]), EIGHT, EIGHT],
     "repeats tensor 't'"),
    ([header(), bytes(7)], "needs 8 bytes"),
    ([header(), bytes(9)], "needs 8 bytes"),
    ([header()], "only 1 frames"),
    ([header(), EIGHT, EIGHT], "2 followed the header"),
    ([header(tensors=[["tensors", "t", "float32", [2], 2]]), bytes(4), bytes(4), EIGHT], "3 followed"),
    ([header(tensors=[["tensors", "t", "float32", [0], 1]]), b""], "0 bytes in 1 frames"),
    ([msgpack.packb({"v": PROTOCOL_VERSION, "type": "Heartbeat", "worker_id": "w", "tensors": [["x", "t", "float32", [1], 1]]}),
      bytes(4)], "no tensor fields"),
    ([msgpack.packb({"v": PROTOCOL_VERSION, "type": "HeartbeatReply", "below_min_workers": 1, "min_workers": 1, "phase": "x",
                     "command": "continue"})], "'below_min_workers' is 1, expected a boolean"),
    ([msgpack.packb({"v": PROTOCOL_VERSION, "type": "HeartbeatReply", "below_min_workers": True, "min_workers": 1,
                     "phase": "x", "command": "dance"})], "expected one of ['continue'"),
    ([msgpack.packb({"v": PROTOCOL_VERSION, "type": "AdminRequest", "command": "status", "args": [1]})], "'args' is [1]"),
    ([msgpack.packb({"v": PROTOCOL_VERSION, "type": "AdminRequest", "command": "status", "args": {"a": b"\x00"}}, use_bin_type=True)],
     "not bytes"),
    ([msgpack.packb({"v": PROTOCOL_VERSION, "type": "Join", "worker_id": "w", "protocol_version": 1, "spec": [["a", [1]]],
                     "tensors": []})], "'spec'"),
    ([msgpack.packb({"v": PROTOCOL_VERSION, "type": "Welcome", "worker_id": "w", "round_ids": [0], "parked": [[0]],
                     "mode": "sync", "fragments": [["a"]], "min_workers": 1, "below_min_workers": False,
                     "heartbeat_interval_s": 1.0, "tensors": []})], "'parked'"),
    ([msgpack.packb({"v": PROTOCOL_VERSION, "type": "Welcome", "worker_id": "w", "round_ids": [0], "parked": [],
                     "mode": "sync", "fragments": [["a"]], "min_workers": 1, "below_min_workers": False,
                     "heartbeat_interval_s": float("nan"), "tensors": []})], "finite number"),
    ([msgpack.packb({"v": PROTOCOL_VERSION, "type": "Leave", "worker_id": msgpack.ExtType(5, b"x")})], "extension type 5"),
    ([msgpack.packb({"v": PROTOCOL_VERSION, 2: "x"})], "not a valid msgpack"),  # non-string map keys
])
def test_bad_frames_are_refused_with_a_precise_detail(frames, words):
    assert words in refused(frames)


def test_a_message_over_the_limit_is_too_large():
    detail = refused([header(), EIGHT], ErrorCode.TOO_LARGE, max_message_bytes=40)
    assert "max_message_bytes=40" in detail


def test_a_table_declaring_more_than_the_limit_is_too_large_before_any_frame_is_touched():
    frames = [header(tensors=[["tensors", "t", "float32", [1 << 30], 1]]), EIGHT]
    assert "declares more than" in refused(frames, ErrorCode.TOO_LARGE, max_message_bytes=1 << 20)


def test_errors_name_the_message_type_for_the_reply():
    with pytest.raises(CodecError) as info:
        decode([header(round_id="x"), EIGHT])
    assert info.value.in_reply_to == "Submit"
    reply = codec.error_for(info.value)
    assert reply.code is ErrorCode.BAD_MESSAGE and reply.in_reply_to == "Submit"
    assert "round_id" in reply.detail


# ------------------------------------------------------------------ fuzzing: only CodecError, ever


def _decode_outcome(frames) -> str:
    """Decode hostile frames: "message" (a well-typed message) or "refused" (a CodecError that
    explains itself). Any other exception propagates and fails the test."""
    try:
        message = decode(frames, max_message_bytes=1 << 16)
    except CodecError as exc:
        return "refused" if str(exc) else "refused silently"
    return "message" if isinstance(message, MESSAGE_TYPES) else f"decoded a {type(message).__name__}"


@settings(max_examples=500)
@given(st.lists(st.binary(max_size=64), min_size=1, max_size=4))
def test_random_bytes_raise_only_codec_errors(frames):
    assert _decode_outcome(frames) in ("message", "refused")


@settings(max_examples=400)
@given(messages(), st.data())
def test_mutated_valid_messages_raise_only_codec_errors(message, data):
    frames = frames_bytes(encode(message, chunk_bytes=16))
    how = data.draw(st.sampled_from(["truncate_header", "flip_header", "drop_frame", "add_frame", "resize_frame",
                                     "swap_frames"]))
    if how == "truncate_header":
        frames[0] = frames[0][: data.draw(st.integers(0, max(0, len(frames[0]) - 1)))]
    elif how == "flip_header":
        i = data.draw(st.integers(0, len(frames[0]) - 1))
        frames[0] = frames[0][:i] + bytes([frames[0][i] ^ data.draw(st.integers(1, 255))]) + frames[0][i + 1:]
    elif how == "drop_frame" and len(frames) > 1:
        del frames[data.draw(st.integers(1, len(frames) - 1))]
    elif how == "add_frame":
        frames.append(data.draw(st.binary(max_size=16)))
    elif how == "resize_frame" and len(frames) > 1:
        i = data.draw(st.integers(1, len(frames) - 1))
        frames[i] = frames[i] + b"\x00" if data.draw(st.booleans()) else frames[i][:-1]
    elif how == "swap_frames" and len(frames) > 2:
        frames[1], frames[-1] = frames[-1], frames[1]
    assert _decode_outcome(frames) in ("message", "refused")


@settings(max_examples=150)
@given(st.dictionaries(st.sampled_from(["v", "type", "worker_id", "fragment_id", "round_id", "tensors", "params",
                                        "code", "detail", "command", "args", "spec"]),
                       plain | st.lists(st.lists(plain, max_size=5), max_size=3), max_size=8),
       st.sampled_from([cls.__name__ for cls in MESSAGE_TYPES]), st.booleans())
def test_headers_with_wrong_field_types_raise_only_codec_errors(fields, mtype, set_version):
    fields = dict(fields)
    fields["type"] = mtype
    if set_version:
        fields["v"] = PROTOCOL_VERSION
    assert _decode_outcome([msgpack.packb(fields), bytes(8)]) in ("message", "refused")


def test_nan_free_floats_only_where_expected():
    # heartbeat_interval_s must be finite; other floats never appear in typed fields.
    assert math.isfinite(decode(encode(Welcome("w", (0,), (), "sync", (("a",),), 1, False, 0.25, {}))).heartbeat_interval_s)
