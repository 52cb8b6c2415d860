"""How big one message and one frame may be.

The transport enforces these as parts arrive (before a byte of a message is
decoded); the codec (``diloco.wire.codec``) enforces them again as it
decodes and splits large tensors at ``CHUNK_BYTES``. They live here, below
both, so that the two agree without the transport knowing what a message is.
"""

from __future__ import annotations

#: Tensors larger than this travel as several frames of this size (SPEC.md section 11, "Frames").
#: 16 MiB, not 4: on loopback 4-16 MiB frames move at about the same rate (1.3-1.6 GB/s
#: median on a loaded 2-core machine; 40 MiB frames 0.7), and a tensor that fits one frame
#: is decoded without a copy, where a chunked one is reassembled with one.
CHUNK_BYTES = 16 << 20
#: Default limit on a whole message (header + tensor frames).
MAX_MESSAGE_BYTES = 1 << 30
#: Limit on the header frame (it holds names and shapes, never tensor data).
MAX_HEADER_BYTES = 16 << 20

__all__ = ["CHUNK_BYTES", "MAX_MESSAGE_BYTES", "MAX_HEADER_BYTES"]
