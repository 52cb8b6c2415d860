"""The coordinator's side of the collective plane: the long-lived store every group meets on.

One ``TCPStore`` master, hosted by the coordinator's process for the whole run, so a
group's rendezvous never depends on a member that may die (SPEC.md C7). Groups
meet under prefixes the coordinator hands out; ``forget`` deletes an old prefix's
rendezvous keys once the coordinator retired it.
"""

from __future__ import annotations

import datetime
import ipaddress

import torch.distributed as dist

from diloco.transport.zmq.address import address_host

#: The keys a group's rendezvous writes under its prefix, one per rank: gloo's (torch 2.x: context
#: 0, then the rank) and a heal's presence key (``heal.meet``): what ``forget`` deletes. A test
#: checks the store is empty after ``forget``.
_RENDEZVOUS_KEYS = ("0/{}", "here/{}")
#: The key a sharded member's leader sets under an attempt's prefix when it abandons it (S7, M13).
ABANDONED_KEY = "cancelled"


def rank_prefix(prefix: str, rank: int) -> str:
    """Where rank ``rank`` of every sharded member meets its peers for ``prefix``'s group or heal (S7, S9)."""
    return f"{prefix}/r{rank}"


class DataPlaneSecurityError(ValueError):
    """A non-loopback data plane without the operator's word that the network is trusted."""


def check_data_plane_host(host: str, trusted_network: bool) -> None:
    """gloo and NCCL traffic is neither authenticated nor encrypted: loopback only, unless told."""
    if trusted_network:
        return
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        raise DataPlaneSecurityError(
            f"--data-plane collective on {host!r}: the collective plane's tensors and its store travel "
            f"unauthenticated and unencrypted (gloo, NCCL); bind a loopback address, or say "
            f"--trusted-data-network if every host that can reach this network is yours")


class StoreHost:
    """A ``TCPStore`` master on ``host`` (port 0: any free one)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 60.0) -> None:
        self.store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=timeout_s), use_libuv=True)
        self.host = host
        self.port = self.store.port

    def forget(self, prefix: str, max_ranks: int) -> int:
        """Delete a retired group's rendezvous keys, its sharded members' per-rank ones (rank index 0,
        1, ... while there are any) and their leaders' abandon marks; returns how many existed."""
        deleted = self._forget_keys(prefix, max_ranks)
        for index in range(1 << 16):
            found = self._forget_keys(rank_prefix(prefix, index), max_ranks)
            if not found:
                break
            deleted += found
        return deleted + int(self.store.delete_key(f"{prefix}/{ABANDONED_KEY}"))

    def _forget_keys(self, prefix: str, max_ranks: int) -> int:
        deleted = 0
        for rank in range(max_ranks):
            for key in _RENDEZVOUS_KEYS:
                if self.store.delete_key(f"{prefix}/{key.format(rank)}"):
                    deleted += 1
        return deleted

    def num_keys(self) -> int:
        return self.store.num_keys()


def host_store(coordinator, bind: str, trusted_network: bool) -> StoreHost:
    """Host the run's store on the control plane's host and tell the coordinator its port (C7).

    Raises ``DataPlaneSecurityError`` for a non-loopback host without ``trusted_network``, and
    ``DataPlaneSecurityError`` too (with the cause) when the store cannot start there.
    """
    host = bind_host(bind)
    check_data_plane_host(host, trusted_network)
    try:
        store_host = StoreHost(host)
    except Exception as exc:  # torch raises RuntimeError subclasses (address in use, unknown host)
        raise DataPlaneSecurityError(f"cannot host the collective plane's store on {host!r}: {exc}") from None
    coordinator.collective.store_port = store_host.port
    coordinator.collective_store = store_host
    return store_host


def bind_host(bind: str) -> str:
    """The host of a ``--bind`` address (``ipc://`` binds are loopback)."""
    return address_host(bind)
