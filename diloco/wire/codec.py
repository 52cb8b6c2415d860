"""The wire codec: a message <-> a list of frames, for any transport that moves bytes. Never pickle.

A message becomes one msgpack **header** frame followed by raw **tensor**
frames (SPEC.md section 11)::

    frame 0   msgpack {"v": PROTOCOL_VERSION, "type": "Submit", <fields>...,
                       "tensors": [[field, name, dtype, shape, nframes], ...]}
    frame 1.. the bytes of each tensor, in table order; a tensor larger than
              ``chunk_bytes`` is split over several frames of ``chunk_bytes``
              (the last one shorter)

Why chunks: on this machine pyzmq moves 2-3 GB/s for 0.5-4 MB frames but only
0.6-0.9 GB/s for 60 MB ones (measured on a 2-core machine); 16 MB frames are about as
fast as 4 MB ones, so a tensor of up to 16 MiB goes as one frame (decoded
without a copy) and a 100 MB one as seven frames.

Encoding is zero-copy: each frame is a ``memoryview`` of the contiguous
tensor's bytes (``tensor_bytes`` may substitute a snapshot; the ZeroMQ
transport does, so a tensor changed after ``send`` cannot tear a message
still queued). Decoding is zero-copy for a tensor that arrives in one frame
(``torch.frombuffer`` on the received buffer, which the tensor keeps alive);
a chunked tensor is assembled with one copy.

torch is imported on the first tensor encoded or decoded, not with this
module: the dtype table below is plain data, so a message without tensors
(an admin command and its reply) never loads torch.

Decoding trusts nothing: the header must be a msgpack map with a known
``type``; every field must be present with the right type, and no other; the
tensor table must name a tensor field of that type, an allowed dtype and a
sane shape, and the frames must match it exactly, byte for byte; the whole
message must fit ``max_message_bytes``. Anything else raises
``CodecError(code, detail)`` whose detail names the field, the value and what
was expected. A header whose ``"v"`` is not ours is refused with
``ErrorCode.PROTOCOL_VERSION`` before any other field is read, naming both
versions.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Sequence

import msgpack

from diloco.transport.limits import CHUNK_BYTES, MAX_HEADER_BYTES, MAX_MESSAGE_BYTES
from diloco.wire.messages import (
    PROTOCOL_VERSION,
    Command,
    Error,
    ErrorCode,
    Message,
    TensorSpec,
)

from diloco.wire.schemas import (
    MAX_STR_LEN,
    OPTIONAL_FIELDS,
    SCHEMAS,
    TENSOR_FIELD,
    FieldError,
    is_int,
    message_class,
)

if TYPE_CHECKING:
    import torch

#: Most dimensions a tensor may have, and the largest single dimension.
MAX_NDIM = 32
MAX_DIM = 1 << 40
#: Most tensors in one message.
MAX_TENSORS = 1 << 20

#: dtypes allowed on the wire: name on the wire (the torch dtype's name without
#: "torch.") -> bytes per element. Plain data: the torch dtypes are looked up on the
#: first tensor encoded or decoded (``_torch_dtypes``), so importing the codec does
#: not import torch.
WIRE_DTYPES: dict[str, int] = {
    "float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
    "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}
_ITEMSIZE = WIRE_DTYPES
_TORCH_DTYPES: dict[str, torch.dtype] | None = None


def _torch_dtypes() -> dict[str, torch.dtype]:
    """Wire name -> torch dtype; imports torch on the first call."""
    global _TORCH_DTYPES
    table = _TORCH_DTYPES
    if table is None:
        import torch

        table = {name: getattr(torch, name) for name in WIRE_DTYPES}
        for name, dt in table.items():
            assert dt.itemsize == WIRE_DTYPES[name], f"{name}: torch says {dt.itemsize} bytes per element"
        _TORCH_DTYPES = table  # one assignment: another thread sees no table or the whole one
    return table


def __getattr__(name: str) -> Any:
    if name == "DTYPES":  # wire name -> torch dtype, as before; imports torch
        return dict(_torch_dtypes())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

_RESERVED = ("v", "type", "tensors")


class CodecError(ValueError):
    """Frames that are not a valid message. ``code`` is the ``ErrorCode`` to answer with."""

    def __init__(self, code: ErrorCode, detail: str, *, in_reply_to: str = "",
                 peer_version: int | None = None) -> None:
        super().__init__(f"{code.value}: {detail}")
        self.code = code
        self.detail = detail
        #: The message type named by the header, when it could be read (for the Error reply).
        self.in_reply_to = in_reply_to
        #: The protocol version the header named, when it was not ours.
        self.peer_version = peer_version

    @property
    def reply_version(self) -> int:
        """The version to encode the ``Error`` reply in: an older peer's own (an ``Error`` has the
        same shape in every version, so it can read why it was refused), else ours."""
        v = self.peer_version
        return v if v is not None and 1 <= v < PROTOCOL_VERSION else PROTOCOL_VERSION


# ------------------------------------------------------------------ encode

def _wire_value(v: Any) -> Any:
    if isinstance(v, (Command, ErrorCode)):
        return v.value
    if isinstance(v, TensorSpec):
        return [v.name, list(v.shape), v.dtype]
    if isinstance(v, tuple):
        return [_wire_value(x) for x in v]
    return v


def tensor_view(t: torch.Tensor) -> memoryview:
    """The bytes of ``t`` as a flat memoryview, without a copy when ``t`` is a contiguous CPU tensor."""
    import torch

    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).numpy())


def encode(message: Message, *, chunk_bytes: int = CHUNK_BYTES,
           tensor_bytes: Callable[[torch.Tensor], memoryview] = tensor_view,
           version: int = PROTOCOL_VERSION) -> list:
    """``message`` as frames: a msgpack header (bytes), then memoryviews of tensor bytes.

    The frames alias the tensors' memory (unless ``tensor_bytes`` snapshots
    them): do not change a tensor until the frames are sent. ``version`` other
    than ours is for an ``Error`` to an older peer only (``CodecError.reply_version``).
    """
    name = type(message).__name__
    if version != PROTOCOL_VERSION and not isinstance(message, Error):
        raise ValueError(f"only an Error may be encoded in another protocol version ({version}), not {name}")
    schema = SCHEMAS.get(name)
    if schema is None:
        raise TypeError(f"cannot encode {name}: not a diloco message type")
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes={chunk_bytes!r}: expected an integer >= 1")
    header: dict[str, Any] = {"v": version, "type": name}
    table: list[list] = []
    frames: list = [b""]
    for fname, kind in schema.items():
        value = getattr(message, fname)
        if kind is not TENSOR_FIELD:
            if value is None and fname in OPTIONAL_FIELDS.get(name, ()):
                continue  # an optional field left out: peers that predate it still read the message
            header[fname] = _wire_value(value)
            continue
        for tname, t in value.items():
            dtype = str(t.dtype).removeprefix("torch.")
            if dtype not in WIRE_DTYPES:
                raise TypeError(f"{name}.{fname}[{tname!r}]: dtype {dtype} cannot be sent; "
                                f"allowed: {sorted(WIRE_DTYPES)}")
            view = tensor_view(t) if tensor_bytes is tensor_view else tensor_bytes(t)
            n = len(view)
            parts = [view[i:i + chunk_bytes] for i in range(0, n, chunk_bytes)]
            table.append([fname, tname, dtype, list(t.shape), len(parts)])
            frames.extend(parts)
    header["tensors"] = table
    frames[0] = msgpack.packb(header, use_bin_type=True)
    return frames


# ------------------------------------------------------------------ decode

def _nbytes(frame: Any) -> int:
    if isinstance(frame, (bytes, bytearray)):
        return len(frame)
    if isinstance(frame, memoryview):
        return frame.nbytes
    buf = getattr(frame, "buffer", None)  # zmq.Frame
    if buf is not None:
        return buf.nbytes
    return memoryview(frame).nbytes


def _buffer(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", None)  # zmq.Frame received with copy=False
    if buf is not None:
        return buf.cast("B") if buf.format != "B" else buf
    mv = memoryview(frame)
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def frame_buffer(frame: Any) -> memoryview:
    """A frame's bytes (bytes, a memoryview or a received ``zmq.Frame``) as a flat memoryview, no copy."""
    return _buffer(frame)


def reject_ext(code: int, data: bytes) -> Any:
    """msgpack's ``ext_hook`` for a header: no extension type is allowed."""
    raise ValueError(f"msgpack extension type {code} is not allowed")


def _short(v: Any, limit: int = 60) -> str:
    r = repr(v)
    return r if len(r) <= limit else r[:limit] + "..."


def decode(frames: Sequence[Any], *, max_message_bytes: int = MAX_MESSAGE_BYTES) -> Message:
    """Frames (bytes, memoryviews or ``zmq.Frame``) -> a message. Raises ``CodecError``."""
    bad = ErrorCode.BAD_MESSAGE
    if not frames:
        raise CodecError(bad, "empty message: expected a msgpack header frame")
    sizes = [_nbytes(f) for f in frames]
    total = sum(sizes)
    if total > max_message_bytes:
        raise CodecError(ErrorCode.TOO_LARGE, f"message is {total} bytes in {len(frames)} frames; "
                                              f"the limit is max_message_bytes={max_message_bytes}")
    if sizes[0] > MAX_HEADER_BYTES:
        raise CodecError(ErrorCode.TOO_LARGE, f"header frame is {sizes[0]} bytes; the limit is {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(_buffer(frames[0]), raw=False, strict_map_key=True,
                                 ext_hook=reject_ext)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise CodecError(bad, f"frame 0 is not a valid msgpack header ({type(exc).__name__}: "
                              f"{_short(str(exc), 120)})") from None
    if not isinstance(header, dict):
        raise CodecError(bad, f"header is a msgpack {type(header).__name__}, expected a map")
    v = header.get("v")
    mtype = header.get("type")
    reply_to = mtype if isinstance(mtype, str) and mtype in SCHEMAS else ""
    if not is_int(v):
        raise CodecError(bad, f"header field 'v' is {_short(v)}, expected the protocol version "
                              f"(an integer; this side speaks {PROTOCOL_VERSION})", in_reply_to=reply_to)
    if v != PROTOCOL_VERSION:
        raise CodecError(ErrorCode.PROTOCOL_VERSION,
                         f"peer speaks protocol version {v}; this side speaks protocol version {PROTOCOL_VERSION}",
                         in_reply_to=reply_to, peer_version=v)
    if not isinstance(mtype, str) or mtype not in SCHEMAS:
        raise CodecError(bad, f"header field 'type' is {_short(mtype)}, expected one of {list(SCHEMAS)}")
    schema = SCHEMAS[mtype]

    def fail(detail: str, code: ErrorCode = bad) -> CodecError:
        return CodecError(code, f"{mtype}: {detail}", in_reply_to=mtype)

    extra = [k for k in header if k not in schema and k not in _RESERVED]
    if extra:
        raise fail(f"unknown field {_short(extra[0])}; {mtype} has fields {list(schema)}")
    values: dict[str, Any] = {}
    tensor_fields = []
    for fname, check in schema.items():
        if check is TENSOR_FIELD:
            if fname in header and fname != "tensors":  # Submit.tensors: the table's own key
                raise fail(f"field {fname!r} carries tensors and belongs in the 'tensors' table, not the header")
            values[fname] = {}
            tensor_fields.append(fname)
            continue
        if fname not in header:
            if fname in OPTIONAL_FIELDS.get(mtype, ()):
                values[fname] = None
                continue
            raise fail(f"field {fname!r} is missing")
        try:
            values[fname] = check(header[fname])
        except FieldError as exc:
            raise fail(f"field {fname!r} is {_short(header[fname])}, expected {exc}") from None

    table = header.get("tensors", [])
    if not isinstance(table, list):
        raise fail(f"field 'tensors' is {_short(table)}, expected a list of [field, name, dtype, shape, nframes]")
    if len(table) > MAX_TENSORS:
        raise fail(f"{len(table)} tensors; the limit is {MAX_TENSORS}", ErrorCode.TOO_LARGE)
    if table and not tensor_fields:
        raise fail("carries a tensor table but has no tensor fields")
    frame_i = 1
    declared = 0
    for i, entry in enumerate(table):
        where = f"tensors[{i}]"
        if not (isinstance(entry, list) and len(entry) == 5):
            raise fail(f"{where} is {_short(entry)}, expected [field, name, dtype, shape, nframes]")
        fname, tname, dtype, shape, nframes = entry
        if fname not in tensor_fields:
            raise fail(f"{where} field is {_short(fname)}, expected one of {tensor_fields}")
        if not isinstance(tname, str) or len(tname) > MAX_STR_LEN:
            raise fail(f"{where} name is {_short(tname)}, expected a string")
        if tname in values[fname]:
            raise fail(f"{where} repeats tensor {tname!r} of field {fname!r}")
        if not isinstance(dtype, str) or dtype not in WIRE_DTYPES:
            raise fail(f"{where} ({tname!r}) dtype is {_short(dtype)}, expected one of {sorted(WIRE_DTYPES)}")
        if not (isinstance(shape, list) and len(shape) <= MAX_NDIM
                and all(is_int(d) and 0 <= d <= MAX_DIM for d in shape)):
            raise fail(f"{where} ({tname!r}) shape is {_short(shape)}, expected a list of at most {MAX_NDIM} "
                       f"integers in [0, {MAX_DIM}]")
        if not is_int(nframes) or nframes < 0:
            raise fail(f"{where} ({tname!r}) nframes is {_short(nframes)}, expected an integer >= 0")
        nbytes = math.prod(shape) * _ITEMSIZE[dtype]
        declared += nbytes
        if declared > max_message_bytes:
            raise fail(f"the tensor table declares more than max_message_bytes={max_message_bytes} bytes "
                       f"(at {where}, {tname!r})", ErrorCode.TOO_LARGE)
        if (nbytes == 0) != (nframes == 0):
            raise fail(f"{where} ({tname!r}) is {nbytes} bytes in {nframes} frames")
        if frame_i + nframes > len(frames):
            raise fail(f"{where} ({tname!r}) needs frames {frame_i}..{frame_i + nframes - 1} but the message has "
                       f"only {len(frames)} frames")
        got = sum(sizes[frame_i:frame_i + nframes])
        if got != nbytes:
            raise fail(f"{where} ({tname!r}, {dtype}{shape}) needs {nbytes} bytes; frames "
                       f"{frame_i}..{frame_i + nframes - 1} hold {got}")
        values[fname][tname] = _tensor(frames[frame_i:frame_i + nframes], _torch_dtypes()[dtype], shape, nbytes)
        frame_i += nframes
    if frame_i != len(frames):
        raise fail(f"the tensor table accounts for {frame_i - 1} tensor frames but {len(frames) - 1} followed the "
                   f"header")
    return message_class(mtype)(**values)


def _tensor(parts: Sequence[Any], dtype: torch.dtype, shape: list[int], nbytes: int) -> torch.Tensor:
    import torch

    from diloco.wire import buffers

    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    if len(parts) > 1 and _nbytes(parts[0]) == nbytes:
        parts = parts[:1]  # assembled as it arrived (``frame_plan.plan_runs``): the first frame holds it all
    if len(parts) == 1:
        buf = _buffer(parts[0])
        if buf.readonly:  # e.g. bytes: copy rather than hand out a tensor over immutable memory
            buf = bytearray(buf)
        t = torch.frombuffer(buf, dtype=dtype)
        if t.data_ptr() % t.element_size():
            t = t.clone()  # a misaligned receive buffer: copy rather than hand out unaligned memory
        return t.reshape(shape)
    # Reassembled into memory glibc reuses next round (``buffers``): a fresh torch.empty of a tensor's
    # size faults its pages in every time.
    out = buffers.empty((nbytes,), torch.uint8)
    pos = 0
    for part in parts:
        buf = _buffer(part)
        n = buf.nbytes
        if n:
            out[pos:pos + n].copy_(torch.frombuffer(buf if not buf.readonly else bytearray(buf), dtype=torch.uint8))
        pos += n
    return out.view(dtype).reshape(shape)


def error_for(exc: CodecError) -> Error:
    """The ``Error`` reply to frames that failed to decode."""
    return Error(exc.code, exc.detail, exc.in_reply_to)


__all__ = [
    "CHUNK_BYTES", "MAX_MESSAGE_BYTES", "MAX_HEADER_BYTES", "WIRE_DTYPES", "SCHEMAS", "CodecError",
    "encode", "decode", "error_for", "frame_buffer", "tensor_view",
]
