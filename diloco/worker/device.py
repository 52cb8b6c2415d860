"""Where a worker trains: ``--device auto|cpu|cuda[:N]``, and moving batches there.

``auto`` is the local rank's GPU when CUDA is present (rank ``LOCAL_RANK``
of a ``torchrun`` group takes GPU ``LOCAL_RANK``), else the CPU. The model
trains on its device; the driver copies what goes on the wire to the CPU
(``DilocoWorker``: pseudo-gradients and Join params) and what comes back
onto the device (``copy_`` into the parameters). The CUDA path is this
module and those copies; it is not exercised by the tests (they run on CPU).
"""

from __future__ import annotations

import re
from typing import Any, Callable, Mapping

import torch

_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def resolve_device(spec: str, local_rank: int = 0) -> torch.device:
    """The device a ``--device`` value names for this rank. Raises ``ValueError`` with what is allowed."""
    if not isinstance(spec, str) or not _DEVICE.match(spec):
        raise ValueError(f"--device {spec!r}: expected auto, cpu, cuda or cuda:N")
    if spec == "cpu":
        return torch.device("cpu")
    cuda = torch.cuda.is_available()
    if spec == "auto":
        return torch.device("cuda", local_rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if not cuda:
        raise ValueError(f"--device {spec}: this machine has no CUDA device (torch.cuda.is_available() is False); "
                         f"use --device cpu or auto")
    index = int(spec.split(":")[1]) if ":" in spec else local_rank % torch.cuda.device_count()
    if index >= torch.cuda.device_count():
        raise ValueError(f"--device {spec}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return torch.device("cuda", index)


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor in it (inside tuples, lists and dicts) on ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple
        return type(batch)(*(to_device(x, device) for x in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(x, device) for x in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def loss_on_device(loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
                   device: torch.device) -> Callable[[torch.nn.Module, Any], torch.Tensor]:
    """``loss_fn`` fed batches moved to ``device`` first (the CPU needs no move)."""
    if device.type == "cpu":
        return loss_fn

    def on_device(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        return loss_fn(model, to_device(batch, device))
    return on_device


class DeviceGlobal:
    """The global params' copy on the model's device, so that pseudo-gradients are computed there.

    Kept only when a parameter lives off the CPU (the fp32 CPU copy stays the master: checkpoints,
    deltas and the bit-for-bit agreement with the coordinator are computed from it). A
    pseudo-gradient ``global - local`` is then one subtraction on the device and one copy to the
    CPU for the wire, into pinned memory where CUDA is (an asynchronous copy, waited for once).
    On the CPU it is exactly ``global - local`` in fp32, as before.
    """

    def __init__(self, params: Mapping[str, torch.Tensor]) -> None:
        self.active = any(p.device.type != "cpu" for p in params.values())
        self._copy: dict[str, torch.Tensor] = {}

    def set(self, name: str, cpu_value: torch.Tensor, device: torch.device) -> None:
        """The global value of ``name`` changed (an install, a merge, a restore): mirror it on ``device``."""
        if self.active:
            self._copy[name] = cpu_value.to(device, torch.float32)

    def pseudo_gradients(self, names, params: Mapping[str, torch.Tensor],
                         global_cpu: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``global - local`` for ``names``, as fp32 CPU tensors ready for the wire."""
        if not self.active:
            return {n: global_cpu[n] - params[n].detach().to("cpu", torch.float32) for n in names}
        pin = torch.cuda.is_available()
        out = {}
        for n in names:
            diff = self._copy[n] - params[n].detach().to(torch.float32)
            buf = torch.empty(diff.shape, dtype=torch.float32, pin_memory=pin)
            out[n] = buf.copy_(diff, non_blocking=pin)
        if pin:
            torch.cuda.synchronize()
        return out
