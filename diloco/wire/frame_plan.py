"""What a receiver can learn of a message from its header frame alone, before the rest arrives.

Hints for the transport's receiver (``diloco.transport.zmq.framing``): which frames make one tensor,
to be assembled into one buffer as they arrive (``plan_runs``, the ``Coalescer``), and which frame
will hold each whole tensor of a dtype (``whole_tensor_frames``, for ``diloco.wire.measure``).
Only hints: whatever is wrong with a header, they answer None, and ``codec.decode`` judges the
message as it always does.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack

from diloco.transport.limits import MAX_HEADER_BYTES
from diloco.wire.codec import MAX_DIM, MAX_NDIM, MAX_TENSORS, PROTOCOL_VERSION, WIRE_DTYPES, frame_buffer, reject_ext
from diloco.wire.schemas import is_int


def _tensor_table(header_frame: Any) -> tuple[str, list[tuple[int, str, int, int]]] | None:
    """A message's type and, of each tensor in order, ``(first frame index, dtype, bytes, frames)``, from
    its header frame alone; None if the header cannot be read. A hint only (``plan_runs``)."""
    try:
        buf = frame_buffer(header_frame)
        if buf.nbytes > MAX_HEADER_BYTES:
            return None
        header = msgpack.unpackb(buf, raw=False, strict_map_key=True, ext_hook=reject_ext)
        if not isinstance(header, dict) or header.get("v") != PROTOCOL_VERSION:
            return None
        table = header.get("tensors", [])
        if not isinstance(table, list) or len(table) > MAX_TENSORS:
            return None
        tensors = []
        frame_i = 1
        for entry in table:
            _f, _n, dtype, shape, nframes = entry
            if not (is_int(nframes) and nframes >= 0 and isinstance(shape, list) and len(shape) <= MAX_NDIM
                    and all(is_int(d) and 0 <= d <= MAX_DIM for d in shape) and dtype in WIRE_DTYPES):
                return None
            tensors.append((frame_i, dtype, math.prod(shape) * WIRE_DTYPES[dtype], nframes))
            frame_i += nframes
        return header.get("type"), tensors
    except Exception:  # a hint only: whatever is wrong, ``decode`` says so
        return None


def plan_runs(header_frame: Any) -> list[tuple[int, int, int]] | None:
    """The chunked tensors of a message, from its header frame alone: ``(first frame index, frames,
    bytes)`` of each tensor sent in more than one frame, in order; None if the header cannot be read.

    For a receiver that assembles each such tensor's frames into one buffer as they arrive
    (``diloco.transport.zmq.framing.Coalescer``), so that ``decode`` gets it whole and copies
    nothing. Only a hint: ``decode`` checks the message as it always does.
    """
    read = _tensor_table(header_frame)
    if read is None:
        return None
    return [(first, nframes, nbytes) for first, _dtype, nbytes, nframes in read[1] if nframes > 1]


def whole_tensor_frames(header_frame: Any, dtype: str) -> tuple[str, dict[int, int]] | None:
    """A message's type and, of each of its tensors of ``dtype``, ``{frame index: bytes}``: the frame
    that holds the whole tensor once its frames are assembled (``plan_runs``: a chunked tensor's
    buffer takes its first frame's place). None if the header cannot be read. A hint only."""
    read = _tensor_table(header_frame)
    if read is None:
        return None
    mtype, tensors = read
    return mtype, {first: nbytes for first, d, nbytes, nframes in tensors if d == dtype and nframes}


__all__ = ["plan_runs", "whole_tensor_frames"]
