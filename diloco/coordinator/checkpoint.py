"""The coordinator's checkpoints: global params, outer optimizer state, the machine's snapshot.

Format (SPEC.md section 12, "Checkpoints"): one safetensors file per durable
round, ``coordinator-<rounds_applied, 12 digits>.safetensors``, in the
checkpoint directory.

- The global params under their own names (the model's ``state_dict`` names),
  so ``model.load_state_dict(safetensors.torch.load_file(path), strict=False)``
  loads them without diloco.
- The outer optimizers' tensors under ``outer/<fragment>/...`` (a ``/`` never
  occurs in a ``state_dict`` name, so they cannot collide with a parameter).
- The header metadata (a str->str map): ``format`` (``diloco.coordinator``),
  ``version`` (``2``), ``diloco`` (JSON: the run config, the machine's
  snapshot, the outer optimizers' non-tensor state, the param names, the
  incarnation, ``rounds_applied``) and ``sha256``: a digest of every tensor
  (name, dtype, shape, bytes, in name order) checked on load, so a corrupt
  file is refused with a message naming it.

Writes are atomic (temporary name in the same folder, fsync of the file,
rename, fsync of the folder) and go straight from the live tensors (no copy):
the runner writes between two steps of the single-threaded loop, so nothing
changes them meanwhile. The newest ``keep`` files are kept.
"""

from __future__ import annotations

import copy
import json
import os
import pathlib
import re
from dataclasses import dataclass, field
from typing import Callable

import torch

from diloco.ckptio import CheckpointError, flatten_named, numbered_files, read_safetensors, unflatten_named, write_safetensors
from diloco.core import Mode, RoundFSM
from diloco.coordinator import journal
from diloco.coordinator.access import AccessList
from diloco.coordinator.config import CoordinatorConfig
from diloco.coordinator.params import check_tensors
from diloco.coordinator.budget import TokenBudget
from diloco.coordinator.units import UnitLedger
from diloco.coordinator.hub_rounds import held_tensors
from diloco.coordinator.service import Coordinator, Observer
from diloco.wire import compression
KIND = "diloco.coordinator"
PREFIX = "coordinator-"
SUFFIX = ".safetensors"
OUTER_PREFIX = "outer/"
DEFAULT_KEEP = 3
_NAME_RX = re.compile(rf"^{PREFIX}(\d+){re.escape(SUFFIX)}$")


def checkpoint_name(rounds_applied: int) -> str:
    return f"{PREFIX}{rounds_applied:012d}{SUFFIX}"


# ------------------------------------------------------------------ in memory


def coordinator_state(coordinator: Coordinator) -> tuple[dict, dict[str, torch.Tensor]]:
    """Everything needed to resume the run, as (plain meta, tensors): copies, no I/O.

    The simulator keeps this in memory to model a coordinator crash and restart.
    """
    if not coordinator.has_state:
        raise CheckpointError("nothing to checkpoint: no worker ever joined, so the run has no params")
    params = coordinator.store.params if coordinator.store is not None else {}
    tensors = {f"param/{name}": t.clone() for name, t in params.items()}
    outer = flatten_named(copy.deepcopy(coordinator.optimizer_states()), "outer", tensors)
    return _meta(coordinator, outer), tensors


def _meta(coordinator: Coordinator, outer: list) -> dict:
    """The non-tensor state of a checkpoint; ``outer`` is the optimizers' state with tensor references."""
    return {
        "kind": KIND,
        "config": coordinator.config.to_dict(),
        "fsm": coordinator.fsm.snapshot(),
        "outer": outer,
        # Collective plane: no params here (the workers hold them, SPEC.md C6).
        "param_names": list(coordinator.store.params) if coordinator.store is not None else [],
        "collective": coordinator.collective.to_dict() if coordinator.collective is not None else None,
        "incarnation": coordinator.incarnation,
        "run_id": coordinator.run_id,
        # Key bindings and bans outlive a restart (access.py); absent in older checkpoints.
        "access": coordinator.access.to_dict(),
        # The journal's steps this state holds (``persist.py``); a resume replays those after it.
        "journal_seq": coordinator.journal_seq,
        # The token budget and what applied rounds trained on (``budget.py``); absent in older checkpoints.
        "tokens": coordinator.budget.to_dict(),
        # Data work units: finished bitmaps and the shuffles' progress (``units.py``); absent: none.
        "units": coordinator.units.to_dict() if coordinator.units.enabled else None,
    }


def journal_meta(coordinator: Coordinator) -> dict:
    """The small state a journal commit records: a checkpoint's metadata without the optimizers' layout
    (a replay steps the optimizers, and takes their layout from them)."""
    return {**_meta(coordinator, []), "rounds_applied": coordinator.fsm.rounds_applied,
            "open_rounds": list(coordinator.fsm.open_round_ids())}


def restore_coordinator(meta: dict, tensors: dict[str, torch.Tensor], now_s: float, *,
                        observer: Observer | None = None,
                        config: CoordinatorConfig | None = None) -> Coordinator:
    """A coordinator that resumes the saved run: same params, optimizer state and counters.

    ``tensors`` names params ``param/<name>`` (``coordinator_state``, the old file
    format). Members and anything in flight are not restored (``RoundFSM.resume``):
    workers re-join. ``config`` may override settings such as ``min_workers``; the
    mode and fragment count must match the saved run's.
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
            if not 0 < snap.get("window_s", 0) < config.fsm.grace_window_s:
                # P5: the length the run had set, if the new ceiling still allows it; else the ceiling.
                snap.pop("window_s", None)
        fsm = RoundFSM.resume(snap, now_s=now_s)
        params = {name: tensors[f"param/{name}"].clone() for name in meta["param_names"]}
        outer = unflatten_named(meta["outer"], {k: t.clone() for k, t in tensors.items()})
        incarnation = int(meta.get("incarnation", 0))
        access = AccessList.from_dict(meta.get("access", {}))
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"checkpoint metadata is incomplete or invalid ({exc!r})") from None
    coordinator = Coordinator(config or saved, now_s, fsm=fsm, observer=observer)
    if coordinator.collective is not None:
        try:
            coordinator.collective.restore(meta.get("collective") or {})
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"checkpoint metadata: the collective plane's record is invalid ({exc!r})") from None
    else:
        coordinator.hub.install_params(params, outer)
    coordinator.incarnation = incarnation + 1
    coordinator.access = access
    coordinator.journal_seq = _int(meta.get("journal_seq", 0), "journal_seq")
    try:
        coordinator.budget = TokenBudget.from_dict(meta.get("tokens", {"budget": coordinator.config.token_budget}))
    except ValueError as exc:
        raise CheckpointError(f"checkpoint metadata is invalid: {exc}") from None
    saved_units = meta.get("units")
    if saved_units:
        try:
            coordinator.units = UnitLedger.from_dict(saved_units)
        except ValueError as exc:
            raise CheckpointError(f"checkpoint metadata is invalid: {exc}") from None
        wanted = coordinator.config.data_units
        if wanted != coordinator.units.units:
            raise CheckpointError(f"the checkpoint's run hands out {coordinator.units.units} data units per "
                                  f"epoch; it cannot resume with {wanted} (its finished units would not map)")
    coordinator.resumed = True
    run_id = meta.get("run_id")
    coordinator.run_id = run_id if isinstance(run_id, str) else None
    return coordinator


def _int(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CheckpointError(f"checkpoint metadata: {what}={value!r} is not a count")
    return value


# --------------------------------------------------------------------- files


def save_coordinator(coordinator: Coordinator, directory: str | os.PathLike, *,
                     keep: int | None = DEFAULT_KEEP) -> pathlib.Path:
    """Write ``coordinator-<rounds_applied>.safetensors`` atomically; keep the newest ``keep`` files."""
    return prepare_save(coordinator)(directory, keep)


def prepare_save(coordinator: Coordinator) -> Callable[[str | os.PathLike, int | None], pathlib.Path]:
    """``save_coordinator`` in two halves: the state's description now, and a function that writes it.

    The function reads the live tensors (no copy): until it returns, nothing may change
    them (``persist.py`` runs it on a background thread and holds the next outer step).
    """
    if not coordinator.has_state:
        raise CheckpointError("nothing to checkpoint: no worker ever joined, so the run has no params")
    tensors: dict[str, torch.Tensor] = dict(coordinator.store.params) if coordinator.store is not None else {}
    outer = [flatten_named(state, f"{OUTER_PREFIX}{fid}", tensors)
             for fid, state in enumerate(coordinator.optimizer_states())]
    rounds = coordinator.fsm.rounds_applied
    meta = {**_meta(coordinator, outer), "rounds_applied": rounds,
            "open_rounds": list(coordinator.fsm.open_round_ids())}

    def write(directory: str | os.PathLike, keep: int | None = DEFAULT_KEEP) -> pathlib.Path:
        directory = pathlib.Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / checkpoint_name(rounds)
        write_safetensors(path, tensors, meta, KIND)
        if keep is not None:
            rotate(directory, keep)
        return path

    return write


def rotate(directory: pathlib.Path, keep: int) -> list[pathlib.Path]:
    """Delete all but the newest ``keep`` checkpoint files (and stale temporary files of this process)."""
    removed = []
    for path in list_checkpoints(directory)[max(1, keep):]:
        path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def list_checkpoints(directory: str | os.PathLike) -> list[pathlib.Path]:
    """The checkpoint files in ``directory``, newest first."""
    return [p for _, p in reversed(numbered_files(pathlib.Path(directory), _NAME_RX))]


def read_checkpoint(path: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor]]:
    """(meta, tensors) of one checkpoint file; tensors named as ``restore_coordinator`` wants."""
    path = pathlib.Path(path)
    meta, raw = read_safetensors(path, KIND)
    try:
        names = meta["param_names"]
        missing = [n for n in names if n not in raw]
        if missing:
            raise CheckpointError(f"{path}: tensor {missing[0]!r} is missing")
        tensors = {f"param/{n}": raw[n] for n in names}
        tensors.update((k, t) for k, t in raw.items() if k.startswith(OUTER_PREFIX))
    except (KeyError, TypeError) as exc:
        raise CheckpointError(f"{path}: checkpoint metadata is incomplete or invalid ({exc!r})") from None
    return meta, tensors


@dataclass
class Found:
    """The newest valid checkpoint of a directory, and the newer ones that were refused.

    ``meta`` and ``tensors`` include the journal's steps after the file (``replayed`` of them).
    """

    path: pathlib.Path
    meta: dict
    tensors: dict[str, torch.Tensor]
    skipped: list[tuple[pathlib.Path, str]] = field(default_factory=list)
    replayed: int = 0
    #: The journal's torn tails (an interrupted append: the open round), as (segment, offset, why).
    torn: list = field(default_factory=list)


def find_newest(location: str | os.PathLike) -> Found | None:
    """The newest checkpoint in a directory (or the given file) that reads and checks; None if there is none.

    In a directory, the journal's steps after it are replayed onto it (``journal.py``); a
    given file is taken as it is. Raises ``CheckpointError`` when there are checkpoints but
    none is valid (the message lists why each was refused), when a given file is invalid,
    or when the journal cannot be replayed.
    """
    location = pathlib.Path(location)
    if location.is_file():
        meta, tensors = read_checkpoint(location)
        return Found(location, meta, tensors)
    candidates = list_checkpoints(location)
    skipped: list[tuple[pathlib.Path, str]] = []
    for path in candidates:
        try:
            meta, tensors = read_checkpoint(path)
        except CheckpointError as exc:
            skipped.append((path, str(exc)))
            continue
        return replay_journal(Found(path, meta, tensors, skipped), location)
    if skipped:
        raise CheckpointError("no valid checkpoint in " + str(location) + ": "
                              + "; ".join(reason for _, reason in skipped))
    return None


def replay_journal(found: Found, directory: pathlib.Path) -> Found:
    """``found`` with the journal's committed steps after it applied, through the same outer step."""
    try:
        after = _int(found.meta.get("journal_seq", 0), "journal_seq")
        reading = journal.read_steps(directory, after)
    except CheckpointError as exc:
        raise CheckpointError(f"{found.path}: {exc}") from None
    found.torn = reading.torn
    if not reading.steps or found.meta.get("collective") is not None:
        return found
    try:
        c = restore_coordinator(found.meta, found.tensors, 0.0)
        for step in reading.steps:
            # The config the step ran under (a resume may change the wire dtype).
            c.config = CoordinatorConfig.from_dict(step.meta["config"])
            for step_input in step.inputs:
                c.hub.outer_step(step_input.fragment_id, _replayed_grad(c, step_input, step.seq))
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"{directory}: the journal after {found.path.name} cannot be replayed ({exc!r})") from None
    tensors = {f"param/{n}": t for n, t in c.store.params.items()}
    outer = [flatten_named(state, f"{OUTER_PREFIX}{fid}", tensors) for fid, state in enumerate(c.optimizer_states())]
    meta = {**reading.steps[-1].meta, "outer": outer, "param_names": list(c.store.params)}
    return Found(found.path, meta, tensors, found.skipped, replayed=len(reading.steps), torn=reading.torn)


def _replayed_grad(c: Coordinator, step_input: journal.StepInput, seq: int) -> dict[str, torch.Tensor]:
    """The outer step input a journal step records, rebuilt as the live coordinator built it."""
    fid = step_input.fragment_id
    spec = c.store.fragment_spec(fid)
    what = f"journal step {seq}, fragment {fid}"
    if step_input.mean is not None:
        grad, _ = step_input.mean.load()
        check_tensors(grad, spec, what)
        return grad
    decoded, weights = [], []
    for chunk in step_input.contributions:
        values, scales = chunk.load()
        decoded.append(compression.decode(values, scales, chunk.header["wire"], [(s.name, s.shape) for s in spec],
                                          f"{what}, worker {chunk.header['worker']!r}"))
        weights.append(chunk.header.get("tokens") if c.config.token_weighted else None)
    if c.config.fsm.mode is not Mode.SYNC and len(decoded) == 1:
        (tensors,) = decoded
        return held_tensors(tensors)
    # Summed in the order the live coordinator summed them (a sync round, or an async grace
    # window's merged step, SPEC.md P5: its held fp32 copies hold the decoded values).
    for tensors, tokens in zip(decoded, weights):
        c.store.accumulate(fid, tensors, tokens)
    return c.store.take_mean(fid, len(decoded))


def oldest_kept_seq(directory: str | os.PathLike) -> int:
    """The journal step the oldest kept checkpoint holds (0 when one cannot be read: keep every segment)."""
    from safetensors import safe_open

    paths = [p for p in list_checkpoints(directory) if p.suffix == SUFFIX]
    if not paths:
        return 0
    try:
        with safe_open(str(paths[-1]), framework="pt") as f:
            meta = json.loads((f.metadata() or {})["diloco"])
        return _int(meta.get("journal_seq", 0), "journal_seq")
    except Exception:  # an unreadable oldest file: keeping the journal is the safe answer
        return 0


def load_coordinator(location: str | os.PathLike, now_s: float, *, observer: Observer | None = None,
                     config: CoordinatorConfig | None = None) -> Coordinator:
    """Resume the run of the newest valid checkpoint in ``location`` (a directory or a file)."""
    found = find_newest(location)
    if found is None:
        raise CheckpointError(f"no checkpoint in {location}")
    try:
        return restore_coordinator(found.meta, found.tensors, now_s, observer=observer, config=config)
    except CheckpointError as exc:
        raise CheckpointError(f"{found.path}: {exc}") from None
