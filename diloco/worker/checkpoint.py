"""A worker's own checkpoint: what the coordinator's checkpoint cannot hold.

The coordinator saves the global params and the outer optimizer (SPEC.md P4);
each worker saves what only it has: its model's state (local params, which
may be up to H inner steps away from the global ones, and buffers), its inner
optimizer's state (DiLoCo keeps each worker's AdamW moments across rounds),
its inner-step and schedule counters, its copy of the global params and the
round ids it holds. One file per worker, ``worker-<id>.safetensors``
(``diloco.ckptio``: safetensors, the model's state under ``model/<name>``, the
global copy under ``global/<name>``, the inner optimizer's tensors under
``optim/...``, the rest as JSON in the header metadata, a sha256 checked on
load; written atomically).

A pseudo-gradient that was pending when the run stopped was discarded by the
coordinator (P4); nothing is lost, because the local params and the global
copy are both here: after resume the worker recomputes the same
pseudo-gradient and submits it again for the same round.
"""

from __future__ import annotations

import os
import pathlib
import urllib.parse
from dataclasses import dataclass, field

import torch

from diloco.ckptio import CheckpointError, flatten_named, read_safetensors, unflatten_named, write_safetensors

KIND = "diloco.worker"
VERSION = 1


SUFFIX = ".safetensors"


def checkpoint_path(directory: str | os.PathLike, worker_id: str) -> pathlib.Path:
    """``<directory>/worker-<id>.safetensors``; the id is percent-quoted so it can never leave the directory."""
    return pathlib.Path(directory) / f"worker-{urllib.parse.quote(worker_id, safe='')}{SUFFIX}"


@dataclass
class WorkerCheckpoint:
    """The plain data of a worker checkpoint (tensors already unflattened)."""

    worker_id: str
    sync_every: int
    inner_step: int
    sched_step: int
    next_close: list[int]
    round_ids: list[int]
    rounds_synced: int
    mode: str | None
    fragments: tuple[tuple[str, ...], ...]
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict
    global_params: dict[str, torch.Tensor]
    #: Collective plane: the outer optimizers' committed state per fragment (the worker holds the run's,
    #: SPEC.md C6); None on the hub, where the coordinator's checkpoint holds it.
    outer_states: list[dict] | None = None
    #: Error feedback: what quantization left out of the pseudo-gradients sent so far, per param (added
    #: to the next one); empty without error feedback.
    residual: dict[str, torch.Tensor] = field(default_factory=dict)
    #: Per fragment, the round its residual's next Submit is for (one after the Submit that made it,
    #: which may still wait for its Result); None: the round ids (a checkpoint from before it was kept).
    residual_rounds: dict[int, int] | None = None


def save_worker_checkpoint(path: pathlib.Path, ckpt: WorkerCheckpoint) -> None:
    """Write the checkpoint to ``path`` atomically, in the safetensors format."""
    path = pathlib.Path(path)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in ckpt.model_state.items():
        tensors[f"model/{name}"] = t
    for name, t in ckpt.global_params.items():
        tensors[f"global/{name}"] = t
    for name, t in ckpt.residual.items():
        tensors[f"residual/{name}"] = t
    optimizer = flatten_named(ckpt.optimizer_state, "optim", tensors)
    outer = None if ckpt.outer_states is None else [
        flatten_named(state, f"outer/{fid}", tensors) for fid, state in enumerate(ckpt.outer_states)]
    meta = {
        "kind": KIND,
        "version": VERSION,
        "worker_id": ckpt.worker_id,
        "sync_every": ckpt.sync_every,
        "inner_step": ckpt.inner_step,
        "sched_step": ckpt.sched_step,
        "next_close": list(ckpt.next_close),
        "round_ids": list(ckpt.round_ids),
        "rounds_synced": ckpt.rounds_synced,
        "mode": ckpt.mode,
        "fragments": [list(f) for f in ckpt.fragments],
        "model_keys": list(ckpt.model_state),
        "global_names": list(ckpt.global_params),
        "residual_names": list(ckpt.residual),
        "residual_rounds": None if ckpt.residual_rounds is None else
        [[int(f), int(r)] for f, r in sorted(ckpt.residual_rounds.items())],
        "optimizer": optimizer,
        "outer": outer,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    write_safetensors(path, tensors, meta, KIND)


def load_worker_checkpoint(path: pathlib.Path) -> WorkerCheckpoint:
    """Read and check a worker checkpoint; raises ``CheckpointError`` naming what is wrong."""
    path = pathlib.Path(path)
    meta, tensors = read_safetensors(path, KIND)
    if meta.get("kind") != KIND:
        raise CheckpointError(f"{path}: not a worker checkpoint (kind={meta.get('kind')!r})")
    if meta.get("version") != VERSION:
        raise CheckpointError(f"{path}: worker checkpoint version {meta.get('version')!r} is not supported "
                              f"(this diloco reads version {VERSION})")
    try:
        ckpt = WorkerCheckpoint(
            worker_id=_typed(meta, "worker_id", str),
            sync_every=_typed(meta, "sync_every", int),
            inner_step=_typed(meta, "inner_step", int),
            sched_step=_typed(meta, "sched_step", int),
            next_close=[int(x) for x in meta["next_close"]],
            round_ids=[int(x) for x in meta["round_ids"]],
            rounds_synced=_typed(meta, "rounds_synced", int),
            mode=meta.get("mode"),
            fragments=tuple(tuple(str(n) for n in f) for f in meta["fragments"]),
            model_state={k: tensors[f"model/{k}"] for k in meta["model_keys"]},
            optimizer_state=unflatten_named(meta["optimizer"], tensors),
            global_params={n: tensors[f"global/{n}"] for n in meta["global_names"]},
            outer_states=(None if meta.get("outer") is None
                          else [unflatten_named(state, tensors) for state in meta["outer"]]),
            residual={n: tensors[f"residual/{n}"] for n in meta.get("residual_names", [])},
            residual_rounds=(None if meta.get("residual_rounds") is None
                             else {int(f): int(r) for f, r in meta["residual_rounds"]}),
        )
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: worker checkpoint metadata is incomplete or invalid ({exc!r})") from None
    if len(ckpt.next_close) != len(ckpt.fragments) or len(ckpt.round_ids) != len(ckpt.fragments):
        raise CheckpointError(f"{path}: {len(ckpt.fragments)} fragments but {len(ckpt.round_ids)} round ids "
                              f"and {len(ckpt.next_close)} sync points")
    return ckpt



def _typed(meta: dict, key: str, kind: type):
    value = meta[key]
    if isinstance(value, bool) or not isinstance(value, kind):
        raise CheckpointError(f"field {key!r} is {value!r}; expected {kind.__name__}")
    return value


def restore_worker(path: pathlib.Path, worker_id: str, sync_every: int, model: torch.nn.Module,
                   optimizer: torch.optim.Optimizer) -> WorkerCheckpoint:
    """Load ``path`` into ``model`` and ``optimizer`` after checking it is this worker's and fits.

    Returns the checkpoint (its schedule and global copy are the caller's to take);
    raises ``DilocoWorkerError`` with code ``bad_checkpoint`` naming what does not fit.
    """
    from diloco.worker.errors import DilocoWorkerError

    try:
        ckpt = load_worker_checkpoint(path)
    except CheckpointError as exc:
        raise DilocoWorkerError(str(exc), "bad_checkpoint") from None
    if ckpt.worker_id != worker_id:
        raise DilocoWorkerError(f"{path} belongs to worker {ckpt.worker_id!r}, not {worker_id!r}", "bad_checkpoint")
    if ckpt.sync_every != sync_every:
        raise DilocoWorkerError(f"{path} was saved with sync_every={ckpt.sync_every}; this worker has "
                                f"sync_every={sync_every}", "bad_checkpoint")
    params = dict(model.named_parameters())
    for n, t in ckpt.global_params.items():
        p = params.get(n)
        if p is None or tuple(p.shape) != tuple(t.shape):
            raise DilocoWorkerError(f"{path}: global copy of {n!r} does not fit this model", "bad_checkpoint")
    for n, t in ckpt.residual.items():
        p = params.get(n)
        if p is None or tuple(p.shape) != tuple(t.shape) or not t.is_floating_point():
            raise DilocoWorkerError(f"{path}: the error-feedback residual {n!r} ({list(t.shape)}, {t.dtype}) "
                                    f"does not fit this model", "bad_checkpoint")
    try:
        model.load_state_dict(ckpt.model_state)
    except (RuntimeError, KeyError, ValueError) as exc:
        raise DilocoWorkerError(f"{path}: the model state does not fit this model: {exc}", "bad_checkpoint") from None
    try:
        optimizer.load_state_dict(ckpt.optimizer_state)
    except (RuntimeError, KeyError, ValueError, TypeError) as exc:
        raise DilocoWorkerError(f"{path}: the inner optimizer state does not fit this optimizer: {exc}",
                                "bad_checkpoint") from None
    return ckpt
