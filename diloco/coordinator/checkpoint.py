"""The coordinator's checkpoint: global params, outer optimizer state, the machine's snapshot.

Written on save-and-stop (SPEC.md P4) before any worker is told to stop, and
read by ``diloco server --resume``. One file, ``coordinator.ckpt``, in the
checkpoint directory; the format is ``diloco.tensorfile`` (no pickle).
"""

from __future__ import annotations

import copy
import os
import pathlib

import torch

from diloco.core import RoundFSM
from diloco.coordinator.config import CoordinatorConfig
from diloco.coordinator.service import Coordinator, Observer
from diloco.tensorfile import CheckpointError, flatten, load_tensorfile, save_tensorfile, unflatten

FILENAME = "coordinator.ckpt"
KIND = "diloco.coordinator"


def coordinator_state(coordinator: Coordinator) -> tuple[dict, dict[str, torch.Tensor]]:
    """Everything needed to resume the run, as (msgpack-able meta, tensors). No I/O.

    The simulator keeps this in memory to model a coordinator crash and restart.
    """
    if coordinator.store is None:
        raise CheckpointError("nothing to checkpoint: no worker ever joined, so the run has no params")
    tensors = {f"param/{name}": t.clone() for name, t in coordinator.store.params.items()}
    outer = flatten(copy.deepcopy(coordinator.optimizer_states()), "outer", tensors)
    meta = {
        "kind": KIND,
        "config": coordinator.config.to_dict(),
        "fsm": coordinator.fsm.snapshot(),
        "outer": outer,
        "param_names": list(coordinator.store.params),
    }
    return meta, tensors


def save_coordinator(coordinator: Coordinator, directory: str | os.PathLike) -> pathlib.Path:
    """Write ``coordinator.ckpt`` atomically into ``directory``."""
    meta, tensors = coordinator_state(coordinator)
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / FILENAME
    save_tensorfile(path, meta, tensors)
    return path


def load_coordinator(directory: str | os.PathLike, now_s: float, *, observer: Observer | None = None,
                     config: CoordinatorConfig | None = None) -> Coordinator:
    """Read ``coordinator.ckpt`` from ``directory`` and resume the run it holds."""
    path = pathlib.Path(directory) / FILENAME
    meta, tensors = load_tensorfile(path)
    try:
        return restore_coordinator(meta, tensors, now_s, observer=observer, config=config)
    except CheckpointError as exc:
        raise CheckpointError(f"{path}: {exc}") from None


def restore_coordinator(meta: dict, tensors: dict[str, torch.Tensor], now_s: float, *,
                        observer: Observer | None = None,
                        config: CoordinatorConfig | None = None) -> Coordinator:
    """A coordinator that resumes the saved run: same params, optimizer state and counters.

    Members and anything in flight are not restored (``RoundFSM.resume``): workers
    re-join. ``config`` may override settings such as ``min_workers``; the mode and
    fragment count must match the saved run's.
    """
    if meta.get("kind") != KIND:
        raise CheckpointError(f"not a coordinator checkpoint (kind={meta.get('kind')!r})")
    try:
        saved = CoordinatorConfig.from_dict(meta["config"])
        snap = meta["fsm"]
        if config is not None:
            if (config.fsm.mode, config.fsm.num_fragments) != (saved.fsm.mode, saved.fsm.num_fragments):
                raise CheckpointError(
                    f"the checkpoint is a {saved.fsm.mode.value} run with {saved.fsm.num_fragments} "
                    f"fragments; cannot resume it as {config.fsm.mode.value} with {config.fsm.num_fragments}")
            snap = dict(snap, config=config.fsm.to_dict(), min_workers=config.fsm.min_workers)
        fsm = RoundFSM.resume(snap, now_s=now_s)
        params = {name: tensors[f"param/{name}"].clone() for name in meta["param_names"]}
        outer = unflatten(meta["outer"], {k: t.clone() for k, t in tensors.items()})
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"checkpoint metadata is incomplete or invalid ({exc!r})") from None
    coordinator = Coordinator(config or saved, now_s, fsm=fsm, observer=observer)
    coordinator.install_params(params, outer)
    return coordinator
