"""A joiner copies the committed state from live members, each over a two-rank gloo group.

The coordinator never holds the model on the collective plane (SPEC.md C6), so a
joiner's params and outer-optimizer state come from members: the coordinator names
up to ``--heal-sources`` of them, each with a fresh store prefix. In each pair the
source is rank 0 and the joiner rank 1; the source broadcasts a msgpack header (round
ids, the optimizer states' plain parts, the tensor table) and then the tensors the
joiner asks for. The joiner asks source ``i`` of ``k`` for part ``i`` (``part_indices``:
contiguous runs of about equal bytes), all at once, so the state arrives k ways in
parallel and no source is held for longer than its share. Every source must send the
same header byte for byte (the same committed state); a source that dies, stalls or
sends another state has its part asked of the others, shared out, and the heal fails
only when none came through. A source serves the heal on its data-plane thread after
any reduce it is in has its verdict, so what it sends is always committed state, with
the round ids that go with it.

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
import threading
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


def _broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, timeout_s: float, root: int = 0) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    opts.timeout = datetime.timedelta(seconds=timeout_s)  # the group's own is the rendezvous's
    try:
        group.broadcast([tensor], opts).wait(datetime.timedelta(seconds=timeout_s))
    except Exception as exc:
        raise CollectiveError(f"the heal transfer failed: {exc}") from exc


def _nbytes(tensors: list[torch.Tensor]) -> list[int]:
    return [t.numel() * t.element_size() for t in tensors]


def part_indices(nbytes: list[int], parts: int) -> list[list[int]]:
    """The tensor indices each of ``parts`` sources sends: contiguous runs of the tensor table of
    about equal bytes. The sources and the joiner compute the same split from the same table."""
    if parts < 1:
        raise ValueError(f"a heal has at least one part, not {parts}")
    total = max(sum(nbytes), 1)
    out: list[list[int]] = [[] for _ in range(parts)]
    done = 0
    for i, size in enumerate(nbytes):
        out[min(parts - 1, int((done + size / 2) * parts // total))].append(i)  # where its middle byte falls
        done += size
    return out


def _send(group: dist.ProcessGroup, tensors: list[torch.Tensor], indices: list[int], timeout_s: float) -> int:
    for i in indices:
        _broadcast(group, tensors[i], timeout_s)
    return sum(_nbytes([tensors[i] for i in indices]))


def _ask(group: dist.ProcessGroup, indices: list[int], timeout_s: float) -> None:
    """The joiner's side of an ask: how many more tensors it wants and which (empty: it is done)."""
    _broadcast(group, torch.tensor([len(indices)], dtype=torch.int64), timeout_s, root=1)
    if indices:
        _broadcast(group, torch.tensor(indices, dtype=torch.int64), timeout_s, root=1)


def _asked(group: dist.ProcessGroup, count: int, timeout_s: float) -> list[int]:
    """The source's side of an ask: the indices the joiner wants next ([]: it is done)."""
    n = torch.zeros(1, dtype=torch.int64)
    _broadcast(group, n, timeout_s, root=1)
    wanted = int(n[0])
    if wanted == 0:
        return []
    if not 0 < wanted <= count:
        raise CollectiveError(f"the joiner asked for {wanted} tensors of {count}")
    indices = torch.zeros(wanted, dtype=torch.int64)
    _broadcast(group, indices, timeout_s, root=1)
    asked = indices.tolist()
    if len(set(asked)) != wanted or not all(0 <= i < count for i in asked):
        raise CollectiveError(f"the joiner asked for tensors outside the table of {count} (or twice)")
    return asked


#: Asks a source answers: its own part, then a share of the parts whose sources failed the joiner.
MAX_ASKS = 2


def send_state(store, prefix: str, interface: str, timeout_s: float, round_ids: list[int],
               params: dict[str, torch.Tensor], optimizer_states: list[dict], stop: StopCheck = _go_on,
               rendezvous_s: float | None = None) -> int:
    """Serve this member's committed state to the joiner at ``prefix``: the header whole, then the
    tensors the joiner asks for (its part of the state, then perhaps a share of the parts whose
    sources died or sent another state), until it says it is done. Returns the bytes sent."""
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
    sent = len(header)
    for _ in range(MAX_ASKS + 1):
        asked = _asked(group, len(tensors), timeout_s)
        if not asked:
            return sent
        sent += _send(group, tensors, asked, timeout_s)
    raise CollectiveError(f"the joiner asked more than {MAX_ASKS} times")


class _Received:
    """What a joiner holds while its sources send: the first header that came (every other source
    must send the same bytes: the same committed state) and the tensors it lays out."""

    def __init__(self, parts: int) -> None:
        self.parts = parts
        self.header: bytes | None = None
        self.parsed: dict = {}
        self.tensors: list[torch.Tensor] = []
        self.split: list[list[int]] = []
        self._lock = threading.Lock()

    def adopt(self, raw: bytes) -> bool:
        """True when ``raw`` is the heal's header (the first, or the same bytes again)."""
        with self._lock:
            if self.header is not None:
                return raw == self.header
            try:
                parsed = msgpack.unpackb(raw, raw=False, strict_map_key=False)
                tensors = [torch.empty(shape, dtype=_DTYPES[dtype]) for dtype, shape in parsed["table"]]
                parsed["round_ids"] = [int(r) for r in parsed["round_ids"]]
                missing = {"names", "states"} - set(parsed)
                if missing:
                    raise KeyError(sorted(missing))
            except (KeyError, TypeError, ValueError, msgpack.UnpackException) as exc:
                raise CollectiveError(f"the heal header is malformed: {exc}") from exc
            self.header, self.parsed, self.tensors = raw, parsed, tensors
            self.split = part_indices(_nbytes(tensors), self.parts)
            return True


def _recv_header(group: dist.ProcessGroup, timeout_s: float) -> bytes:
    length = torch.zeros(1, dtype=torch.int64)
    _broadcast(group, length, timeout_s)
    n = int(length[0])
    if not 0 < n <= MAX_HEADER_BYTES:
        raise CollectiveError(f"the heal header is {n} bytes (at most {MAX_HEADER_BYTES})")
    raw = torch.empty(n, dtype=torch.uint8)
    _broadcast(group, raw, timeout_s)
    return raw.numpy().tobytes()


def _let_go(group: dist.ProcessGroup, timeout_s: float) -> None:
    """Tell a source whose state is not taken that the joiner is done with it (if it still listens)."""
    try:
        _ask(group, [], timeout_s)
    except CollectiveError:
        pass  # gone already: nothing waits


def _each(jobs: list[Callable[[], None]]) -> None:
    """Run ``jobs`` at once, one thread each (each bounds its own waits), and wait for all."""
    threads = [threading.Thread(target=job, daemon=True) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def recv_state(store, prefixes: str | list[str], interface: str, timeout_s: float, stop: StopCheck = _go_on,
               rendezvous_s: float | None = None):
    """(round_ids, params, optimizer_states), source ``i`` at ``prefixes[i]`` sending part ``i``,
    all at once. A part whose source fails (dies, stalls past the timeout, or sends another state
    than the first header's) is asked of the sources that did not, shared out among them; the heal
    fails only when no source sent its part whole."""
    prefixes = [prefixes] if isinstance(prefixes, str) else list(prefixes)
    got = _Received(len(prefixes))
    groups: dict[int, dist.ProcessGroup] = {}
    done: set[int] = set()
    errors: dict[int, str] = {}

    def fetch(i: int) -> None:
        try:
            meet(store, prefixes[i], 1, timeout_s, stop)
            groups[i] = group = build_group(store, prefixes[i], 1, 2, interface, rendezvous_s or timeout_s)
            raw = _recv_header(group, timeout_s)
            try:
                same = got.adopt(raw)
            except CollectiveError:
                _let_go(group, timeout_s)  # a malformed header: the source need not wait out its bound
                raise
            if not same:
                errors[i] = "it sent another state than the heal's other sources"
                _let_go(group, timeout_s)
                groups.pop(i)
                return
            if got.split[i]:  # (an empty ask would say it is done)
                _ask(group, got.split[i], timeout_s)
            for index in got.split[i]:
                _broadcast(group, got.tensors[index], timeout_s)
            done.add(i)
        except CollectiveError as exc:
            groups.pop(i, None)
            errors[i] = str(exc)

    _each([lambda i=i: fetch(i) for i in range(len(prefixes))])
    if not done:
        raise CollectiveError("; ".join(f"source {i + 1} of {len(prefixes)}: {e}" for i, e in sorted(errors.items())))
    missing = [index for i in range(len(prefixes)) if i not in done for index in got.split[i]]
    live = sorted(done)
    shares = part_indices([got.tensors[m].numel() * got.tensors[m].element_size() for m in missing], len(live))
    failed: list[str] = []

    def finish(i: int, share: list[int]) -> None:
        try:
            if share:
                _ask(groups[i], share, timeout_s)
                for index in share:
                    _broadcast(groups[i], got.tensors[index], timeout_s)
            _ask(groups[i], [], timeout_s)
        except CollectiveError as exc:
            if share:
                failed.append(f"source {i + 1} of {len(prefixes)}, sending a failed source's part: {exc}")

    _each([lambda i=i, k=k: finish(i, [missing[j] for j in shares[k]]) for k, i in enumerate(live)])
    if failed:
        raise CollectiveError("; ".join(failed))
    header, tensors = got.parsed, got.tensors
    params = {name: tensors[i] for i, name in enumerate(header["names"])}
    states = []
    try:
        for plain in header["states"]:
            state = {}
            for idx, entries in plain["state"].items():
                state[int(idx)] = {k: (tensors[v[1]] if v[0] == "t" else v[1]) for k, v in entries.items()}
            states.append({"state": state, "param_groups": plain["param_groups"]})
    except (KeyError, TypeError, IndexError, ValueError) as exc:
        raise CollectiveError(f"the heal header is malformed: {exc}") from exc
    return header["round_ids"], params, states
