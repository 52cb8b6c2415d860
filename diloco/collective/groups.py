"""Process groups (gloo; NCCL for workers on CUDA) on the coordinator's store, rebuilt only when the group changes.

The recipe (SPEC.md C7): one ``TCPStore`` client per worker, connected to the store the
coordinator hosts; a group is ``ProcessGroupGloo(PrefixStore(prefix, store), rank, size)``
built directly on it (``dist.new_group`` would need every process of one default world,
which churn never gives us); ranks are the index in the sorted group; an eager barrier right
after creation, so a dead peer shows up there and not inside the reduce (gloo's lazy path
can hang); every operation bounded by the collective timeout. The coordinator names a new
prefix whenever the group changes or an attempt failed, so a group object is reused across
rounds and fragments and dropped as soon as the prefix moves on.
"""

from __future__ import annotations

import datetime
import socket
import threading
from typing import Callable

import torch.distributed as dist


class CollectiveError(RuntimeError):
    """A collective, a group's creation or a heal failed or timed out (the attempt is reported failed)."""


def local_address_towards(host: str) -> str:
    """The address of this host's interface that routes to ``host`` (what the peers must dial).

    A UDP ``connect`` sends nothing; it only picks the route. gloo would otherwise bind the
    address the host name resolves to, which need not be the network the data travels on.
    """
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((host, 9))
        return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"
    finally:
        probe.close()


def connect_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    try:
        return dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=timeout_s))
    except Exception as exc:  # torch raises RuntimeError/DistStoreError subclasses
        raise CollectiveError(f"cannot reach the coordinator's store at {host}:{port}: {exc}") from exc


def backend_for(device) -> str:
    """``nccl`` for a worker that trains on a CUDA device (its reduce runs there), else ``gloo``."""
    return "nccl" if getattr(device, "type", str(device)).startswith("cuda") else "gloo"


def build_group(store: dist.Store, prefix: str, rank: int, size: int, interface: str,
                timeout_s: float, backend: str = "gloo", device=None) -> dist.ProcessGroup:
    """A group of ``size`` ranks meeting under ``prefix``, with an eager barrier: gloo on the CPU,
    or NCCL on ``device`` (a CUDA device of this worker's; same store, same recipe)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        if backend == "nccl":
            pg = _nccl_group(dist.PrefixStore(prefix, store), rank, size, timeout, device)
        elif backend == "gloo":
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=interface)]
            pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, options)
            pg.barrier().wait(timeout)
        else:
            raise ValueError(f"unknown backend {backend!r}: expected gloo or nccl")
    except Exception as exc:
        raise CollectiveError(f"group {prefix!r} (rank {rank} of {size}, {backend}) did not form: {exc}") from exc
    return pg


def _nccl_group(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta, device):
    import torch

    if not torch.cuda.is_available() or not dist.is_nccl_available():
        raise RuntimeError("NCCL needs CUDA and a torch built with NCCL; this process has neither")
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    pg = dist.ProcessGroupNCCL(store, rank, size, options)
    # The eager barrier: a one-element all-reduce on this worker's device (NCCL's own barrier
    # guesses the device from the rank).
    probe = torch.zeros(1, device=device)
    pg.allreduce([probe]).wait(timeout)
    return pg


#: How often a group forming on its helper thread looks whether it must be abandoned.
ABANDON_POLL_S = 0.05


def build_group_or_abandon(store_factory: Callable[[], dist.Store], prefix: str, rank: int, size: int,
                           interface: str, timeout_s: float, stop: Callable[[], str], backend: str = "gloo",
                           device=None) -> dist.ProcessGroup:
    """``build_group`` on a helper thread (its own store client: a store client serves one call at a
    time, and the abandoned formation may still be waiting in it), left behind when ``stop`` gives a
    reason. The helper ends on its own within gloo's bounds; what it builds then is dropped.

    Only a failure's message crosses back, never the exception: its traceback holds the frames of
    the formation, and with them gloo's device (a listening socket) and the store client, which a
    reference cycle through this function's state would keep open until a garbage collection."""
    outcome: list = []
    lock = threading.Lock()
    done = threading.Event()
    abandoned = False

    def form() -> None:
        try:
            result = ("group", build_group(store_factory(), prefix, rank, size, interface, timeout_s, backend, device))
        except Exception as exc:
            result = ("error", str(exc))
        with lock:
            if not abandoned:
                outcome.append(result)
        done.set()

    threading.Thread(target=form, name=f"diloco-group-{prefix[-24:]}", daemon=True).start()
    while not done.wait(ABANDON_POLL_S):
        why = stop()
        if why:
            with lock:
                abandoned = True
                outcome.clear()
            raise CollectiveError(f"group {prefix!r} (rank {rank} of {size}) abandoned while it formed: {why}")
    kind, value = outcome.pop()
    if kind == "error":
        raise CollectiveError(value if value.startswith(f"group {prefix!r}")
                              else f"group {prefix!r} (rank {rank} of {size}) did not form: {value}")
    return value


class GroupCache:
    """At most one live reduce group: the one of the last prefix (membership epochs, SPEC.md C7)."""

    def __init__(self, store_factory, interface: str, timeout_s: float, device=None) -> None:
        self._store_factory = store_factory
        #: Where the reduce runs: a CUDA device (NCCL) or None (gloo, on the CPU).
        self.device = device if backend_for(device) == "nccl" else None
        self._store: dist.Store | None = None
        self.interface = interface
        self.timeout_s = timeout_s
        self._prefix: str | None = None
        self._group: dist.ProcessGroupGloo | None = None
        #: Groups built so far (a benchmark and the tests read it: one per membership change).
        self.built = 0

    @property
    def backend(self) -> str:
        return "nccl" if self.device is not None else "gloo"

    @property
    def store(self) -> dist.Store:
        if self._store is None:
            self._store = self._store_factory()
        return self._store

    def get(self, prefix: str, rank: int, size: int, stop: Callable[[], str] | None = None) -> dist.ProcessGroupGloo:
        """The group of ``prefix``: the cached one, or a new one. With ``stop``, a new group forms on a
        helper thread, over a store client of its own, and is abandoned as soon as ``stop`` says why
        (M13): gloo cannot be interrupted, and a peer that died after it registered holds the others
        in gloo's connect for five timeouts."""
        if self._prefix == prefix and self._group is not None:
            return self._group
        self.drop()
        if stop is None:
            self._group = build_group(self.store, prefix, rank, size, self.interface, self.timeout_s, self.backend,
                                      self.device)
        else:
            self._group = build_group_or_abandon(self._store_factory, prefix, rank, size, self.interface,
                                                 self.timeout_s, stop, self.backend, self.device)
        self._prefix = prefix
        self.built += 1
        return self._group

    def drop(self) -> None:
        """Forget the group (after a failure it is unusable; after a membership change, stale)."""
        self._group = None
        self._prefix = None
