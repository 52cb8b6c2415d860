"""Checkpoint files in the safetensors format, written atomically and checked on load.

Shared by the coordinator's and the workers' checkpoints. A file is a plain
safetensors file (``safetensors.torch.load_file`` reads it without diloco);
its header metadata (a str->str map) holds:

- ``format``: what the file is (``diloco.coordinator``, ``diloco.worker``);
- ``version``: ``"2"`` (version 1, a format of its own, is no longer read);
- ``diloco``: the rest of the state as JSON (counters, snapshots, the
  optimizers' non-tensor state with ``{"__tensor__": NAME}`` references);
- ``sha256``: ``tensors_digest`` of the tensors, checked on load, so a
  corrupt file is refused with a message naming it.

Writes stream every tensor's memory straight to a temporary name in the same
folder (no copy, and without holding the interpreter lock, so a background
thread can write while the coordinator serves), hashing as they go; then
fsync of the file, rename, fsync of the folder (SPEC.md section 5: persist
before you send). The layout is safetensors' own: an 8-byte little-endian
header length, the JSON header (padded with spaces to 8 bytes), the data.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
from typing import Any

import torch


class CheckpointError(ValueError):
    """A checkpoint file is missing, corrupt, truncated or of an unknown version."""

FORMAT_VERSION = "2"
TENSOR_REF = "__tensor__"  # where a tensor stood in nested state: its name in the tensor table
ITEMS = "__items__"  # a dict with keys that are not strings, as [[key, value], ...]


def flatten_named(obj: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    """Move the tensors of nested state into ``tensors``, each named by its path (``outer/0/state/3/...``)."""
    if isinstance(obj, torch.Tensor):
        tensors[path] = obj
        return {TENSOR_REF: path}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {k: flatten_named(v, f"{path}/{k}", tensors) for k, v in obj.items()}
        # JSON keys are strings: keep other keys (an optimizer's per-parameter state is keyed by int).
        return {ITEMS: [[k, flatten_named(v, f"{path}/{k}", tensors)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return [flatten_named(v, f"{path}/{i}", tensors) for i, v in enumerate(obj)]
    return obj


def unflatten_named(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The inverse of ``flatten_named``."""
    if isinstance(obj, dict):
        if set(obj) == {TENSOR_REF}:
            try:
                return tensors[obj[TENSOR_REF]]
            except KeyError:
                raise CheckpointError(f"checkpoint refers to a missing tensor {obj[TENSOR_REF]!r}") from None
        if set(obj) == {ITEMS} and isinstance(obj[ITEMS], list):
            return {k: unflatten_named(v, tensors) for k, v in obj[ITEMS]}
        return {k: unflatten_named(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [unflatten_named(v, tensors) for v in obj]
    return obj


def _raw(t: torch.Tensor) -> memoryview:
    """The tensor's bytes, without a copy when it is contiguous on the CPU."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.dtype is torch.bfloat16:
        t = t.view(torch.int16)
    elif t.dtype is torch.bool:
        t = t.view(torch.uint8)
    return memoryview(t.numpy()).cast("B")


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes, in name order (independent of the file layout)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(json.dumps([name, str(t.dtype).removeprefix("torch."), list(t.shape)]).encode())
        h.update(_raw(t))
    return h.hexdigest()


def numbered_files(directory: str | os.PathLike, pattern: "re.Pattern[str]") -> list[tuple[int, pathlib.Path]]:
    """(number, path) of the files in ``directory`` whose name ``pattern`` matches with the number as its
    first group, lowest first (``coordinator-<n>.safetensors``, ``journal-<n>.log``); none for a missing folder."""
    directory = pathlib.Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for entry in directory.iterdir():
        m = pattern.match(entry.name)
        if m:
            found.append((int(m.group(1)), entry))
    return sorted(found)


def fsync_dir(directory: pathlib.Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU tensors; a tensor whose memory an earlier one already uses (tied weights) is copied."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in tensors.items():
        t = t.detach()
        if t.device.type != "cpu" or not t.is_contiguous():
            t = t.cpu().contiguous()
        ptr = t.untyped_storage().data_ptr() if t.numel() else None
        if ptr is not None and ptr in seen:
            t = t.clone()
            ptr = t.untyped_storage().data_ptr()
        if ptr is not None:
            seen.add(ptr)
        out[name] = t
    return out


#: safetensors' dtype codes.
_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
              torch.uint8: "U8", torch.bool: "BOOL"}
#: Bytes per ``os.write`` call: big enough to be cheap, small enough to interleave with a hash.
_WRITE_SLICE = 64 << 20
_DIGEST_PLACEHOLDER = "0" * 64


def write_all(fd: int, data: memoryview) -> None:
    """``os.write`` until every byte of ``data`` is written (it may write fewer)."""
    done = 0
    while done < len(data):
        done += os.write(fd, data[done:])


def write_safetensors(path: pathlib.Path, tensors: dict[str, torch.Tensor], meta: dict, kind: str) -> None:
    """Write ``tensors`` and ``meta`` (JSON) as a safetensors file at ``path``, atomically.

    Tensors go to the file in name order, straight from their memory; the sha256 in
    the header (``tensors_digest``) is computed on the way and written into the header's
    reserved place at the end.
    """
    path = pathlib.Path(path)
    tensors = _unshared(tensors)
    names = sorted(tensors)
    entries: dict[str, Any] = {}
    offset = 0
    for name in names:
        t = tensors[name]
        if t.dtype not in _ST_DTYPES:
            raise CheckpointError(f"tensor {name!r} has unsupported dtype {t.dtype}")
        nbytes = t.numel() * t.element_size()
        entries[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    metadata = {"format": kind, "version": FORMAT_VERSION, "diloco": json.dumps(meta, separators=(",", ":")),
                "sha256": _DIGEST_PLACEHOLDER}

    def header_bytes(digest: str) -> bytes:
        text = json.dumps({"__metadata__": dict(metadata, sha256=digest), **entries}, separators=(",", ":"))
        raw = text.encode()
        raw += b" " * (-(8 + len(raw)) % 8)
        return len(raw).to_bytes(8, "little") + raw

    head = header_bytes(_DIGEST_PLACEHOLDER)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        try:
            write_all(fd, memoryview(head))
            h = hashlib.sha256()
            for name in names:
                t = tensors[name]
                h.update(json.dumps([name, str(t.dtype).removeprefix("torch."), list(t.shape)]).encode())
                if t.numel():
                    raw = _raw(t)
                    for start in range(0, len(raw), _WRITE_SLICE):
                        piece = raw[start:start + _WRITE_SLICE]
                        h.update(piece)
                        write_all(fd, piece)
            final = header_bytes(h.hexdigest())
            assert len(final) == len(head)  # the digest has the placeholder's length
            os.pwrite(fd, final, 0)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def read_safetensors(path: pathlib.Path, kind: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(meta, tensors) of a file ``write_safetensors`` wrote; ``CheckpointError`` naming the file on any problem."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = pathlib.Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
        tensors = load_file(str(path))
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist") from None
    except Exception as exc:  # safetensors raises several types for a torn or foreign file
        raise CheckpointError(f"{path} is not a readable safetensors file (torn or corrupt): "
                              f"{str(exc).strip()[:200]}") from None
    if header.get("format") != kind:
        raise CheckpointError(f"{path}: not a {kind} checkpoint (format={header.get('format')!r})")
    if header.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: checkpoint version {header.get('version')!r} is not supported "
                              f"(this diloco reads version {FORMAT_VERSION})")
    if tensors_digest(tensors) != header.get("sha256"):
        raise CheckpointError(f"{path}: checksum mismatch (the file is corrupt)")
    try:
        meta = json.loads(header["diloco"])
    except (KeyError, ValueError) as exc:
        raise CheckpointError(f"{path}: the 'diloco' metadata is missing or not JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: the 'diloco' metadata is not an object")
    return meta, tensors
