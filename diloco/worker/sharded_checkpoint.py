"""A sharded member's checkpoint: one ``torch.distributed.checkpoint`` directory, each rank its shards.

``<checkpoint_dir>/worker-<id>.dcp/`` holds, written by every rank of the member
at once (DCP, so no rank gathers the model): the model's and the inner
optimizer's sharded state (``get_model_state_dict`` / ``get_optimizer_state_dict``),
and the worker's own per-shard keeping -- the fp32 global copy under
``global/<name>`` and the error-feedback residual under ``residual/<name>``.
The leader adds ``diloco.json``: the session's counters and round ids (what a
replicated worker's checkpoint holds in its header) and the member's layout.

Whole or absent: the ranks write into ``worker-<id>.dcp.partial``; the leader
seals it with ``diloco.json`` (written last) and only then swaps it in for the
previous one (previous -> ``.old``, partial -> final, ``.old`` removed). A
reader takes the final directory if it is sealed, else a sealed ``.old`` (a
crash between the two renames), else nothing. A member resumes only with the
layout that wrote it: another world size or placement is refused, naming both.

All ranks must see the directory (one filesystem, or a shared one across nodes).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import urllib.parse
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from diloco.ckptio import CheckpointError

KIND = "diloco.worker.sharded"
VERSION = 1
SUFFIX = ".dcp"
SEAL = "diloco.json"


def sharded_checkpoint_path(directory: str | os.PathLike, worker_id: str) -> pathlib.Path:
    """``<directory>/worker-<id>.dcp`` (the id percent-quoted, as for a replicated worker's file)."""
    return pathlib.Path(directory) / f"worker-{urllib.parse.quote(worker_id, safe='')}{SUFFIX}"


def _aside(path: pathlib.Path, tag: str) -> pathlib.Path:
    return path.with_name(f"{path.name}.{tag}")


def sealed(path: pathlib.Path) -> pathlib.Path | None:
    """The sealed checkpoint to read for ``path``: itself, or the previous one a crash left aside; or None."""
    for candidate in (path, _aside(path, "old")):
        if (candidate / SEAL).is_file():
            return candidate
    return None


def _state(shards, names_with_residual) -> dict:
    state = {"model": get_model_state_dict(shards.model),
             "optim": get_optimizer_state_dict(shards.model, shards.optimizer)}
    for n, t in shards.global_shards.items():
        state[f"global/{n}"] = shards.as_dtensor(n, t)
    for n in names_with_residual:
        state[f"residual/{n}"] = shards.as_dtensor(n, shards.residual[n])
    return state


def write_shards(shards, directory: str | os.PathLike) -> None:
    """Every rank: write this rank's shards into ``directory`` (collective)."""
    dcp.save(_state(shards, list(shards.residual)), checkpoint_id=str(directory))


def read_shards(shards, directory: str | os.PathLike) -> None:
    """Every rank: read this rank's shards from ``directory`` into the model, the optimizer and ``shards``."""
    keys = dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    for n, p in shards.params.items():
        if f"global/{n}" not in keys:
            raise CheckpointError(f"{directory}: no global copy of parameter {n!r}")
        shards.global_shards[n] = torch.empty_like(p.to_local(), dtype=torch.float32)
    residual = [n for n in shards.params if f"residual/{n}" in keys]
    for n in residual:
        shards.residual[n] = torch.empty_like(shards.params[n].to_local(), dtype=torch.float32)
    state = _state(shards, residual)
    dcp.load(state, checkpoint_id=str(directory))
    set_model_state_dict(shards.model, state["model"])
    set_optimizer_state_dict(shards.model, shards.optimizer, state["optim"])
    for n in shards.global_shards:
        shards.global_shards[n] = state[f"global/{n}"].to_local()
    for n in residual:
        shards.residual[n] = state[f"residual/{n}"].to_local()


def save_sharded(path: pathlib.Path, shards, meta: dict) -> None:
    """The leader: have every rank write its shards aside, seal them with ``meta``, swap them in."""
    partial = _aside(path, "partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    shards.save(str(partial))  # every rank writes its shards (DCP; its leader writes the metadata last)
    tmp = partial / (SEAL + ".tmp")
    tmp.write_text(json.dumps({"kind": KIND, "version": VERSION, **meta}, indent=1))
    os.replace(tmp, partial / SEAL)
    old = _aside(path, "old")
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        os.replace(path, old)
    os.replace(partial, path)
    shutil.rmtree(old, ignore_errors=True)


def read_meta(path: pathlib.Path) -> dict:
    """The seal's contents, checked; raises ``CheckpointError`` naming what is wrong."""
    try:
        meta = json.loads((path / SEAL).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: its seal {SEAL} cannot be read: {exc}") from None
    if not isinstance(meta, dict) or meta.get("kind") != KIND:
        raise CheckpointError(f"{path}: not a sharded worker checkpoint (kind={meta.get('kind') if isinstance(meta, dict) else None!r})")
    if meta.get("version") != VERSION:
        raise CheckpointError(f"{path}: sharded checkpoint version {meta.get('version')!r} is not supported "
                              f"(this diloco reads version {VERSION})")
    for key, kind in (("worker_id", str), ("sync_every", int), ("inner_step", int), ("sched_step", int),
                      ("rounds_synced", int), ("next_close", list), ("round_ids", list), ("fragments", list),
                      ("layout", dict)):
        value = meta.get(key)
        if isinstance(value, bool) or not isinstance(value, kind):
            raise CheckpointError(f"{path}: field {key!r} is {value!r}; expected {kind.__name__}")
    return meta


def read_global_params(path: pathlib.Path) -> dict[str, torch.Tensor]:
    """The global copy of a sealed sharded checkpoint, whole, read in one process (``diloco export``)."""
    found = sealed(pathlib.Path(path))
    if found is None:
        raise CheckpointError(f"{path}: not a sealed sharded checkpoint (no {SEAL}: it was never finished)")
    read_meta(found)
    try:
        keys = dcp.FileSystemReader(str(found)).read_metadata().state_dict_metadata
    except Exception as exc:  # DCP's own reader errors are of many kinds
        raise CheckpointError(f"{found}: its DCP metadata cannot be read: {exc}") from None
    state = {}
    for key, meta in keys.items():
        if key.startswith("global/"):
            size = getattr(meta, "size", None)
            if size is None:
                raise CheckpointError(f"{found}: {key} is not a tensor")
            state[key] = torch.empty(tuple(size), dtype=torch.float32)
    if not state:
        raise CheckpointError(f"{found}: it holds no global copy")
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, checkpoint_id=str(found), no_dist=True)
    except Exception as exc:
        raise CheckpointError(f"{found}: its shards cannot be read: {exc}") from None
    return {key[len("global/"):]: t for key, t in state.items()}


def seal_of(session, worker_id: str, sync_every: int, model) -> dict:
    """What the seal holds beside its kind: the session's counters and round ids, and the layout."""
    from diloco.worker.shards import layout_of

    s = session
    return {"worker_id": worker_id, "sync_every": sync_every, "inner_step": s.inner_step,
            "sched_step": s.sched_step, "next_close": list(s.next_close), "round_ids": list(s.round_ids),
            "rounds_synced": s.rounds_synced, "mode": s.mode, "fragments": [list(f) for f in s.fragments],
            "layout": layout_of(model)}


def restore_member(path: pathlib.Path, shards, worker_id: str, sync_every: int) -> dict:
    """Check the sealed checkpoint ``path`` is this member's (id, H, layout), have every rank read its
    shards, and return the seal. ``DilocoWorkerError`` (``bad_checkpoint``) names what does not fit."""
    from diloco.worker.errors import DilocoWorkerError
    from diloco.worker.shards import layout_of

    try:
        meta = read_meta(path)
    except CheckpointError as exc:
        raise DilocoWorkerError(str(exc), "bad_checkpoint") from None
    if meta["worker_id"] != worker_id:
        raise DilocoWorkerError(f"{path} belongs to worker {meta['worker_id']!r}, not {worker_id!r}", "bad_checkpoint")
    if meta["sync_every"] != sync_every:
        raise DilocoWorkerError(f"{path} was saved with sync_every={meta['sync_every']}; this worker has "
                                f"sync_every={sync_every}", "bad_checkpoint")
    layout = layout_of(shards.model)
    if meta["layout"] != layout:
        raise DilocoWorkerError(f"{path} was written by a member laid out as {meta['layout']}; this one is "
                                f"{layout}: resume it with the layout that wrote it", "bad_checkpoint")
    try:
        shards.load(str(path))
    except (CheckpointError, RuntimeError, ValueError, KeyError) as exc:
        raise DilocoWorkerError(f"{path}: the shards do not fit this member: {exc}", "bad_checkpoint") from None
    return meta
