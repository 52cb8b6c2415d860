"""A joiner copies the committed state from a live member, over a two-rank gloo group.

The coordinator never holds the model on the collective plane (SPEC.md C6), so a
joiner's params and outer-optimizer state come from a member: the coordinator
names a source and a fresh store prefix, the source is rank 0 and the joiner rank
1, and the source broadcasts a msgpack header (round ids, the optimizer states'
plain parts, the tensor table) followed by every tensor. The source serves the
heal on its data-plane thread after any reduce it is in has its verdict, so what
it sends is always committed state, with the round ids that go with it.

Before either side builds the group, each writes a presence key (``here/<rank>``) under the
prefix and waits for the other's, looking every ``POLL_S`` whether it must stop (the worker
closes, or the coordinator withdrew the order because the joiner is gone, M12). gloo's own
rendezvous cannot be interrupted: entered only once the peer is there, it does not hold a
source out of every reduce group until a heal to a dead joiner times out. Once both ranks are
here the group forms at once, so its rendezvous gets one collective timeout (``rendezvous_s``),
not the heal's: a rank frozen between the meeting and the rendezvous, whose peer gave up
meanwhile, learns it within that, not after the whole transfer's bound.
"""

from __future__ import annotations

import datetime
import time
from typing import Callable

import msgpack
import torch
import torch.distributed as dist

from diloco.collective.groups import CollectiveError, build_group

#: Largest header a joiner accepts (the tensor table of a very large model fits easily).
MAX_HEADER_BYTES = 64 << 20
_DTYPES = {"float32": torch.float32, "float64": torch.float64, "int64": torch.int64, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "int32": torch.int32}


#: How often a heal waiting for its peer looks whether it must stop.
POLL_S = 0.05

#: Why a heal must stop now, or "" (``CollectiveEndpoint`` passes one per job).
StopCheck = Callable[[], str]


def _go_on() -> str:
    return ""


def meet(store, prefix: str, rank: int, timeout_s: float, stop: StopCheck = _go_on) -> None:
    """Say this rank is here and wait, interruptibly, until the other rank of the heal is too.

    A rank that stops waiting takes its key back: a peer coming later must not take a rank that
    gave up for one that is there, and wait in gloo's rendezvous for it until its timeout."""
    mine, other = f"{prefix}/here/{rank}", f"{prefix}/here/{1 - rank}"
    store.set(mine, b"1")
    deadline = time.monotonic() + timeout_s
    why = ""
    while True:
        try:
            if store.check([other]):
                return
        except Exception as exc:  # the store's connection broke (a restarted coordinator)
            raise CollectiveError(f"the heal's store failed: {exc}") from exc
        why = stop()
        if why or time.monotonic() >= deadline:
            break
        time.sleep(POLL_S)
    try:
        store.delete_key(mine)
    except Exception:  # a store gone meanwhile forgets the key with everything else
        pass
    if why:
        raise CollectiveError(f"the heal at {prefix!r} stopped before its peer came: {why}")
    raise CollectiveError(f"the heal's peer (rank {1 - rank}) did not come within {timeout_s:.0f} s")


def _plain_state(state: dict, tensors: list[torch.Tensor]) -> dict:
    """An optimizer ``state_dict`` with each tensor replaced by its index in ``tensors``."""
    out = {}
    for idx, entries in state["state"].items():
        plain = {}
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                plain[key] = ["t", len(tensors), str(value.dtype).removeprefix("torch."), list(value.shape)]
                tensors.append(value.detach().to("cpu").contiguous())
            else:
                plain[key] = ["v", value]
        out[int(idx)] = plain
    return {"state": out, "param_groups": state["param_groups"]}


def _broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, timeout_s: float) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.timeout = datetime.timedelta(seconds=timeout_s)  # the group's own is the rendezvous's
    try:
        group.broadcast([tensor], opts).wait(datetime.timedelta(seconds=timeout_s))
    except Exception as exc:
        raise CollectiveError(f"the heal transfer failed: {exc}") from exc


def send_state(store, prefix: str, interface: str, timeout_s: float, round_ids: list[int],
               params: dict[str, torch.Tensor], optimizer_states: list[dict], stop: StopCheck = _go_on,
               rendezvous_s: float | None = None) -> None:
    meet(store, prefix, 0, timeout_s, stop)
    group = build_group(store, prefix, 0, 2, interface, rendezvous_s or timeout_s)
    tensors: list[torch.Tensor] = []
    names = list(params)
    for n in names:
        tensors.append(params[n].detach().contiguous())
    states = [_plain_state(s, tensors) for s in optimizer_states]
    table = [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors]
    header = msgpack.packb({"round_ids": round_ids, "names": names, "states": states, "table": table},
                           use_bin_type=True, strict_types=False)
    _broadcast(group, torch.tensor([len(header)], dtype=torch.int64), timeout_s)
    _broadcast(group, torch.frombuffer(bytearray(header), dtype=torch.uint8), timeout_s)
    for t in tensors:
        _broadcast(group, t, timeout_s)


def recv_state(store, prefix: str, interface: str, timeout_s: float, stop: StopCheck = _go_on,
               rendezvous_s: float | None = None):
    """(round_ids, params, optimizer_states) from the source at ``prefix``."""
    meet(store, prefix, 1, timeout_s, stop)
    group = build_group(store, prefix, 1, 2, interface, rendezvous_s or timeout_s)
    length = torch.zeros(1, dtype=torch.int64)
    _broadcast(group, length, timeout_s)
    n = int(length[0])
    if not 0 < n <= MAX_HEADER_BYTES:
        raise CollectiveError(f"the heal header is {n} bytes (at most {MAX_HEADER_BYTES})")
    raw = torch.empty(n, dtype=torch.uint8)
    _broadcast(group, raw, timeout_s)
    try:
        header = msgpack.unpackb(raw.numpy().tobytes(), raw=False, strict_map_key=False)
        tensors = []
        for dtype, shape in header["table"]:
            tensors.append(torch.empty(shape, dtype=_DTYPES[dtype]))
        names = header["names"]
        round_ids = [int(r) for r in header["round_ids"]]
    except (KeyError, TypeError, ValueError, msgpack.UnpackException) as exc:
        raise CollectiveError(f"the heal header is malformed: {exc}") from exc
    for t in tensors:
        _broadcast(group, t, timeout_s)
    params = {name: tensors[i] for i, name in enumerate(names)}
    states = []
    for plain in header["states"]:
        state = {}
        for idx, entries in plain["state"].items():
            state[int(idx)] = {k: (tensors[v[1]] if v[0] == "t" else v[1]) for k, v in entries.items()}
        states.append({"state": state, "param_groups": plain["param_groups"]})
    return round_ids, params, states
