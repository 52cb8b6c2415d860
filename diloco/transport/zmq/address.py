"""The host in a ZeroMQ address: the one parser every part that needs it shares."""

from __future__ import annotations


def address_host(address: str) -> str:
    """The host of ``tcp://HOST:PORT`` (an IPv6 host without its brackets; ``*`` as written); ``ipc://``
    addresses are on this machine: ``127.0.0.1``. A bare ``HOST:PORT`` is read as TCP."""
    if address.startswith("ipc://"):
        return "127.0.0.1"
    rest = address.split("://", 1)[1] if "://" in address else address
    return rest.rsplit(":", 1)[0].strip("[]")


def is_loopback_address(address: str) -> bool:
    """True for ``ipc://`` and for a TCP address on loopback (127.0.0.0/8, ::1, localhost)."""
    host = address_host(address)
    return address.startswith("ipc://") or host == "localhost" or host == "::1" or host.startswith("127.")
