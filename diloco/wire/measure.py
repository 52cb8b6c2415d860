"""A Submit's fp32 tensors measured as they arrive, for the coordinator's checks.

The coordinator checks every contribution before the core sees it: finiteness, and the L2 norm the
outlier bound and the in-place outer step need (``ParamStore.check_submission``): a pass over the
whole contribution, memory-bound, once the message is whole. The Submits of a round arrive
together, interleaved part by part, and the coordinator's thread mostly waits while they do; once
they are in, it checks and sums them one after another, and the round's step waits for the last.
So the receiver measures each fp32 tensor of a Submit as soon as its bytes are whole
(``framing.FrameWatch``), while the rest arrives: the same computation on the same memory
(``torch.linalg.vector_norm``, squared), so the checks find the same value they would compute.

``SubmitSquares.square(t)`` answers only for the very memory it measured (address, size, fp32,
contiguous): a tensor the decoder copied, or decoded from another wire dtype, is measured by the
checks as before. Nothing here decides anything: a bad value is the checks' to find.
"""

from __future__ import annotations

from typing import Any

from diloco.wire import codec, frame_plan


def all_finite(t: Any) -> bool:
    """True when every element of ``t`` is finite.

    A finite sum proves it (a NaN or an infinity makes the sum non-finite), and
    a sum is one fast pass with no temporary; ``isfinite(t).all()`` is ~30x
    slower on 10M floats (it materialises a mask), which made it the largest
    cost of a coordinator's round. Only when the sum is not finite (a bad
    element, or finite values whose sum overflows) is the exact check run.
    """
    import torch

    if t.numel() == 0 or not (t.is_floating_point() or t.is_complex()):
        return True
    if bool(torch.isfinite(t.sum())):
        return True
    return bool(torch.isfinite(t).all())


def square_sum(t: Any) -> float:
    """The sum of the squares of ``t``'s elements, as fp32's ``torch.linalg.vector_norm`` squared: the one
    definition the receiver's measure and the coordinator's checks share, so that they agree bit for bit
    (inf when the squares overflow, NaN for a NaN)."""
    import torch

    return float(torch.linalg.vector_norm(t.detach().float())) ** 2


#: The message type whose tensors are measured: the only one the coordinator checks by norm.
MEASURED_TYPE = "Submit"


class SubmitSquares:
    """The ``framing.FrameWatch`` of one Submit: each fp32 tensor's ``square_sum``, keyed by the memory
    measured."""

    def __init__(self, frames: dict[int, int]) -> None:
        #: frame index -> bytes of the fp32 tensor it will hold whole.
        self._frames = frames
        self._squares: dict[tuple[int, int], float] = {}

    @classmethod
    def for_header(cls, header: Any) -> "SubmitSquares | None":
        """A watch for a Submit with fp32 tensors, from its header frame; None for anything else."""
        read = frame_plan.whole_tensor_frames(header, "float32")
        if read is None or read[0] != MEASURED_TYPE or not read[1]:
            return None
        return cls(read[1])

    def frame(self, index: int, buffer: Any) -> None:
        nbytes = self._frames.get(index)
        if nbytes is None:
            return
        import torch

        view = codec.frame_buffer(buffer)
        # The decoder copies a read-only or misaligned buffer: that copy is not what is measured here.
        if view.nbytes != nbytes or view.readonly:
            return
        t = torch.frombuffer(view, dtype=torch.float32)
        if t.data_ptr() % t.element_size():
            return
        self._squares[(t.data_ptr(), t.numel())] = square_sum(t)

    def square(self, t: Any) -> float | None:
        """``t``'s sum of squares if ``t`` is exactly a tensor measured here (the same memory, whole,
        fp32), else None."""
        import torch

        if t.dtype != torch.float32 or not t.is_contiguous() or not t.numel():
            return None
        return self._squares.get((t.data_ptr(), t.numel()))

    def __len__(self) -> int:
        return len(self._squares)


__all__ = ["MEASURED_TYPE", "SubmitSquares", "square_sum"]
