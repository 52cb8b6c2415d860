"""``diloco export``: a run's global params as a plain safetensors file any tool loads.

The coordinator's checkpoint directory (``diloco server --checkpoint-dir``) holds
the global params of the newest checkpoint plus the journal's rounds after it;
``read_run_params`` replays those (the same replay as ``--resume``), so the
export is the params of the last applied round. A run on the collective data
plane keeps no params at the coordinator (SPEC.md C6): export a worker's
checkpoint file (``worker-<id>.safetensors``), whose copy of the global params
is the run's. A sharded member's checkpoint directory (``worker-<id>.dcp``,
``diloco.worker.sharded_checkpoint``) is read the same way, its shards of the
global copy joined into whole tensors, in one process without a group.

The file is ``model.safetensors`` with the model's own parameter names and the
``{"format": "pt"}`` metadata Hugging Face's ``from_pretrained`` expects; with
the model's ``config.json`` beside it (``model.config.save_pretrained(DIR)``,
or ``diloco.integrations.transformers.export_pretrained``) the directory loads
with ``from_pretrained(DIR)``.
"""

from __future__ import annotations

import argparse
import os
import pathlib
from dataclasses import dataclass

from diloco.exits import EXIT_OK, UsageError

EXPORT_NAME = "model.safetensors"


@dataclass
class RunParams:
    """The global params of a run's checkpoint, and where they came from."""

    params: dict  # name -> torch.Tensor
    #: The checkpoint file read (and, for a directory, the journal rounds replayed after it).
    source: pathlib.Path
    replayed: int
    #: Outer steps applied when these params were current (None: a worker checkpoint, which does not say).
    rounds_applied: int | None

    @property
    def num_elements(self) -> int:
        return sum(t.numel() for t in self.params.values())


def read_run_params(location: str | os.PathLike) -> RunParams:
    """The global params of the newest valid checkpoint in ``location`` (a coordinator checkpoint
    directory or file, or a worker checkpoint file). Raises ``CheckpointError`` saying what is wrong."""
    from diloco.coordinator import checkpoint as coordinator_ckpt
    from diloco.ckptio import CheckpointError
    from diloco.worker import checkpoint as worker_ckpt

    path = pathlib.Path(location)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    if path.is_file() and path.name.startswith("worker-"):
        ckpt = worker_ckpt.load_worker_checkpoint(path)
        return RunParams(dict(ckpt.global_params), path, 0, None)
    if path.is_dir() and path.name.startswith("worker-") and path.name.endswith(".dcp"):
        from diloco.worker.sharded_checkpoint import read_global_params

        return RunParams(read_global_params(path), path, 0, None)
    found = coordinator_ckpt.find_newest(path)
    if found is None:
        workers = sorted(path.glob("worker-*")) if path.is_dir() else []
        hint = f"; worker checkpoints there: export one of them ({workers[0].name}, ...)" if workers else ""
        raise CheckpointError(f"{path}: no coordinator checkpoint{hint}")
    params = {name[len("param/"):]: t for name, t in found.tensors.items() if name.startswith("param/")}
    if not params:
        raise CheckpointError(f"{found.path}: the coordinator of a collective run holds no params (the workers "
                              f"do): export a worker's checkpoint file, worker-<id>.safetensors")
    # A journal commit records the count; a checkpoint file's machine snapshot implies it.
    rounds = found.meta.get("rounds_applied")
    if rounds is None:
        from diloco.core import RoundFSM

        rounds = RoundFSM.restore(found.meta["fsm"]).rounds_applied
    return RunParams(params, found.path, found.replayed, int(rounds))


def load_run_params(location: str | os.PathLike, model) -> RunParams:
    """Copy the run's global params (``read_run_params``) into ``model``, in place.

    Every parameter of the model must be in the checkpoint with its shape, and
    nothing else may be: a ``ValueError`` names the first mismatches (the wrong
    architecture, or a checkpoint of another run)."""
    import torch

    run = read_run_params(location)
    own = dict(model.named_parameters())
    missing = [n for n in own if n not in run.params]
    extra = [n for n in run.params if n not in own]
    shapes = [f"{n} {tuple(run.params[n].shape)} != {tuple(p.shape)}"
              for n, p in own.items() if n in run.params and run.params[n].shape != p.shape]
    if missing or extra or shapes:
        problems = [f"missing in the checkpoint: {', '.join(missing[:3])}" if missing else "",
                    f"not in the model: {', '.join(extra[:3])}" if extra else "",
                    f"shapes differ: {'; '.join(shapes[:3])}" if shapes else ""]
        raise ValueError(f"{run.source}: its params do not fit {type(model).__name__} ("
                         + "; ".join(p for p in problems if p) + ")")
    with torch.no_grad():
        for name, p in own.items():
            p.copy_(run.params[name])
    return run


def write_export(run: RunParams, out: str | os.PathLike, *, force: bool = False) -> pathlib.Path:
    """Write ``run``'s params as safetensors: ``out`` is a directory (``out/model.safetensors``) or a
    ``.safetensors`` file. An existing file is kept unless ``force``."""
    from safetensors.torch import save_file

    out = pathlib.Path(out)
    target = out if out.suffix == ".safetensors" else out / EXPORT_NAME
    if target.exists() and not force:
        raise FileExistsError(f"{target} exists (--force replaces it)")
    target.parent.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().contiguous() for name, t in run.params.items()}
    tmp = target.with_name(target.name + ".tmp")
    save_file(tensors, os.fspath(tmp), metadata={"format": "pt"})
    os.replace(tmp, target)
    return target


# ------------------------------------------------------------------ the command

def register(subparsers) -> None:
    p = subparsers.add_parser(
        "export", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="write a run's global params as one safetensors file (from_pretrained loads it with a config)",
        description="Read the newest valid checkpoint of a run (replaying the journal's rounds after it, as\n"
                    "--resume does) and write its global params, under the model's own parameter names, to\n"
                    "OUT/model.safetensors (or to OUT itself when it ends in .safetensors). Any safetensors\n"
                    "reader loads it (safetensors.torch.load_file, then model.load_state_dict(..., strict=False)\n"
                    "for a model with tied weights); with the model's config.json beside it, Hugging Face's\n"
                    "from_pretrained(OUT) does.\n\n"
                    "A run on the collective data plane keeps no params at the coordinator: give a worker's\n"
                    "checkpoint file (worker-<id>.safetensors) instead. A sharded member's checkpoint\n"
                    "(the directory worker-<id>.dcp its ranks wrote) is read whole, in one process.",
        epilog="examples:\n"
               "  diloco export ckpt/server out/                       # out/model.safetensors\n"
               "  diloco export ckpt/w1/worker-w1.safetensors final.safetensors\n"
               "  diloco export ckpt/w1/worker-w1.dcp final.safetensors  # a sharded member's")
    p.add_argument("checkpoint", metavar="CHECKPOINT",
                   help="the server's --checkpoint-dir (or one coordinator checkpoint file), a worker checkpoint file, "
                        "or a sharded member's checkpoint directory (worker-<id>.dcp)")
    p.add_argument("out", metavar="OUT", help="a directory (written: OUT/model.safetensors) or a .safetensors file")
    p.add_argument("--force", action="store_true", help="replace an existing export")
    p.set_defaults(handler=cmd_export)


def cmd_export(args) -> int:
    from diloco.ckptio import CheckpointError

    try:
        run = read_run_params(args.checkpoint)
        target = write_export(run, args.out, force=args.force)
    except (CheckpointError, FileExistsError, OSError) as exc:
        raise UsageError(str(exc)) from None
    when = ("a worker's copy of the global params" if run.rounds_applied is None
            else f"{run.rounds_applied} outer steps applied"
            + (f", {run.replayed} of them replayed from the journal" if run.replayed else ""))
    print(f"exported {len(run.params)} tensors ({run.num_elements:,} params) from {run.source} ({when}) "
          f"to {target}")
    return EXIT_OK


__all__ = ["RunParams", "read_run_params", "load_run_params", "write_export", "register"]
