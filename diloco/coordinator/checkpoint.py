"""The coordinator's checkpoint: global params, outer optimizer state, the machine's snapshot.

Written on save-and-stop (SPEC.md P4) before any worker is told to stop, and
read by ``diloco server --resume``. One file, ``coordinator.ckpt``, in the
checkpoint directory; the format is ``diloco.tensorfile`` (no pickle).
"""

from __future__ import annotations

import os
import pathlib

from diloco.core import RoundFSM, SnapshotError
from diloco.coordinator.config import CoordinatorConfig
from diloco.coordinator.service import Coordinator, Observer
from diloco.tensorfile import CheckpointError, flatten, load_tensorfile, save_tensorfile, unflatten

FILENAME = "coordinator.ckpt"
KIND = "diloco.coordinator"


def save_coordinator(coordinator: Coordinator, directory: str | os.PathLike) -> pathlib.Path:
    if coordinator.store is None:
        raise CheckpointError("nothing to checkpoint: no worker ever joined, so the run has no params")
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {f"param/{name}": t for name, t in coordinator.store.params.items()}
    outer = flatten(coordinator.optimizer_states(), "outer", tensors)
    meta = {
        "kind": KIND,
        "config": coordinator.config.to_dict(),
        "fsm": coordinator.fsm.snapshot(),
        "outer": outer,
        "param_names": list(coordinator.store.params),
    }
    path = directory / FILENAME
    save_tensorfile(path, meta, tensors)
    return path


def load_coordinator(directory: str | os.PathLike, now_s: float, *, observer: Observer | None = None,
                     config: CoordinatorConfig | None = None) -> Coordinator:
    """A coordinator that resumes the checkpointed run: same params, optimizer state and counters.

    ``config`` may override settings (for example a new ``min_workers``); the mode
    and fragment count must match the checkpoint's.
    """
    path = pathlib.Path(directory) / FILENAME
    meta, tensors = load_tensorfile(path)
    if meta.get("kind") != KIND:
        raise CheckpointError(f"{path} is not a coordinator checkpoint (kind={meta.get('kind')!r})")
    try:
        saved = CoordinatorConfig.from_dict(meta["config"])
        snap = meta["fsm"]
        if config is not None:
            if (config.fsm.mode, config.fsm.num_fragments) != (saved.fsm.mode, saved.fsm.num_fragments):
                raise CheckpointError(
                    f"{path} was a {saved.fsm.mode.value} run with {saved.fsm.num_fragments} fragments; "
                    f"cannot resume it as {config.fsm.mode.value} with {config.fsm.num_fragments}")
            snap = dict(snap, config=config.fsm.to_dict(), min_workers=config.fsm.min_workers)
        fsm = RoundFSM.resume(snap, now_s=now_s)
        names = meta["param_names"]
        params = {name: tensors[f"param/{name}"] for name in names}
        outer = unflatten(meta["outer"], tensors)
    except (KeyError, TypeError) as exc:
        raise CheckpointError(f"{path}: checkpoint metadata is incomplete ({exc!r})") from None
    except SnapshotError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    coordinator = Coordinator(config or saved, now_s, fsm=fsm, observer=observer)
    coordinator.install_params(params, outer)
    return coordinator
