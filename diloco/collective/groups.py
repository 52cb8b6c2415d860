"""gloo process groups on the coordinator's store, rebuilt only when the group changes.

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


def build_group(store: dist.Store, prefix: str, rank: int, size: int, interface: str,
                timeout_s: float) -> dist.ProcessGroupGloo:
    """A gloo group of ``size`` ranks meeting under ``prefix``, with an eager barrier."""
    timeout = datetime.timedelta(seconds=timeout_s)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=interface)]
    try:
        pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, options)
        pg.barrier().wait(timeout)
    except Exception as exc:
        raise CollectiveError(f"group {prefix!r} (rank {rank} of {size}) did not form: {exc}") from exc
    return pg


class GroupCache:
    """At most one live reduce group: the one of the last prefix (membership epochs, SPEC.md C7)."""

    def __init__(self, store_factory, interface: str, timeout_s: float) -> None:
        self._store_factory = store_factory
        self._store: dist.Store | None = None
        self.interface = interface
        self.timeout_s = timeout_s
        self._prefix: str | None = None
        self._group: dist.ProcessGroupGloo | None = None
        #: Groups built so far (a benchmark and the tests read it: one per membership change).
        self.built = 0

    @property
    def store(self) -> dist.Store:
        if self._store is None:
            self._store = self._store_factory()
        return self._store

    def get(self, prefix: str, rank: int, size: int) -> dist.ProcessGroupGloo:
        if self._prefix == prefix and self._group is not None:
            return self._group
        self.drop()
        self._group = build_group(self.store, prefix, rank, size, self.interface, self.timeout_s)
        self._prefix = prefix
        self.built += 1
        return self._group

    def drop(self) -> None:
        """Forget the group (after a failure it is unusable; after a membership change, stale)."""
        self._group = None
        self._prefix = None
