"""The old checkpoint file format (version 1): msgpack metadata plus raw tensor bytes, no pickle.

Checkpoints are now written in safetensors (``diloco.ckptio``); this module stays
to read files written before (``coordinator.ckpt``, ``worker-<id>.ckpt``), for
``CheckpointError``, and for ``flatten``/``unflatten`` of in-memory state (the
simulator's coordinator snapshots).

Layout::

    b"DILOCOTF"  8-byte little-endian header length  header  payload

The header is msgpack: ``{"version", "meta", "tensors": [[name, dtype, shape,
offset, nbytes], ...], "payload_sha256"}``. Loading checks the magic, the
version, the header's types, every tensor's bounds and dtype, and the
payload's sha256, and raises ``CheckpointError`` naming the problem: a
corrupt or truncated file is refused, never half-loaded.

Writes are atomic (SPEC.md section 5: persist before you send):
write to a temporary name in the same directory, fsync the file, rename over
the target, fsync the directory.

``flatten``/``unflatten`` move the tensors out of nested state (such as a
``torch.optim`` state dict) so that the rest can be plain msgpack.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import struct
from typing import Any

import msgpack
import torch

MAGIC = b"DILOCOTF"
VERSION = 1
_DTYPES = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32,
    "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}
_TENSOR_REF = "__tensor__"


class CheckpointError(ValueError):
    """A checkpoint file is missing, corrupt, truncated or of an unknown version."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def save_tensorfile(path: str | os.PathLike, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
    path = pathlib.Path(path)
    entries, chunks, offset = [], [], 0
    digest = hashlib.sha256()
    for name, t in tensors.items():
        t = t.detach().contiguous().cpu()
        if dtype_name(t.dtype) not in _DTYPES:
            raise CheckpointError(f"tensor {name!r} has unsupported dtype {t.dtype}")
        # reshape(-1): a 0-dim tensor (an optimizer's step count) cannot be viewed as bytes directly
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        entries.append([name, dtype_name(t.dtype), list(t.shape), offset, len(data)])
        chunks.append(data)
        digest.update(data)
        offset += len(data)
    header = msgpack.packb({"version": VERSION, "meta": meta, "tensors": entries,
                            "payload_sha256": digest.hexdigest()}, use_bin_type=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for data in chunks:
            f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load_tensorfile(path: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor]]:
    path = pathlib.Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist") from None
    except OSError as exc:
        raise CheckpointError(f"checkpoint {path} cannot be read: {exc}") from None
    if len(raw) < 16 or raw[:8] != MAGIC:
        raise CheckpointError(f"{path} is not a diloco checkpoint (bad magic)")
    (hlen,) = struct.unpack("<Q", raw[8:16])
    if 16 + hlen > len(raw):
        raise CheckpointError(f"{path} is truncated: header claims {hlen} bytes, file has {len(raw) - 16}")
    try:
        header = msgpack.unpackb(raw[16:16 + hlen], raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise CheckpointError(f"{path}: header is not valid msgpack ({exc})") from None
    if not isinstance(header, dict) or header.get("version") != VERSION:
        raise CheckpointError(f"{path}: checkpoint version {header.get('version') if isinstance(header, dict) else '?'}"
                              f" is not supported (this diloco reads version {VERSION})")
    payload = memoryview(raw)[16 + hlen:]
    if hashlib.sha256(payload).hexdigest() != header.get("payload_sha256"):
        raise CheckpointError(f"{path}: payload checksum mismatch (the file is corrupt or truncated)")
    tensors: dict[str, torch.Tensor] = {}
    entries = header.get("tensors")
    if not isinstance(entries, list):
        raise CheckpointError(f"{path}: header.tensors must be a list")
    for i, entry in enumerate(entries):
        try:
            name, dtype, shape, offset, nbytes = entry
            torch_dtype = _DTYPES[dtype]
            shape = [int(d) for d in shape]
        except (TypeError, ValueError, KeyError):
            raise CheckpointError(f"{path}: header.tensors[{i}] is malformed: {entry!r}") from None
        numel = 1
        for d in shape:
            numel *= d
        itemsize = torch.empty((), dtype=torch_dtype).element_size()
        if nbytes != numel * itemsize or offset < 0 or offset + nbytes > len(payload):
            raise CheckpointError(f"{path}: tensor {name!r} ({dtype}{shape}) does not fit its byte range")
        buf = bytearray(payload[offset:offset + nbytes])
        t = torch.frombuffer(buf, dtype=torch_dtype) if nbytes else torch.empty(0, dtype=torch_dtype)
        tensors[name] = t.reshape(shape)
    meta = header.get("meta")
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: header.meta must be a dict")
    return meta, tensors


def flatten(obj: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """Replace every tensor in nested dicts/lists with a reference, collecting it in ``tensors``."""
    if isinstance(obj, torch.Tensor):
        key = f"{prefix}#{len(tensors)}"
        tensors[key] = obj
        return {_TENSOR_REF: key}
    if isinstance(obj, dict):
        return {k: flatten(v, prefix, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [flatten(v, prefix, tensors) for v in obj]
    return obj


def unflatten(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {_TENSOR_REF}:
            try:
                return tensors[obj[_TENSOR_REF]]
            except KeyError:
                raise CheckpointError(f"checkpoint refers to a missing tensor {obj[_TENSOR_REF]!r}") from None
        return {k: unflatten(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [unflatten(v, tensors) for v in obj]
    return obj
