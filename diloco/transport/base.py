"""The errors every transport raises.

A transport moves bytes (or, in process, objects) between named peers and
knows nothing about rounds or messages; ``diloco.wire.endpoints`` is the
message-level interface the coordinator and the worker hold.
"""

from __future__ import annotations


class TransportError(Exception):
    """The transport cannot deliver: closed, peer unknown, or a limit exceeded."""


class TransportClosed(TransportError):
    """The endpoint was closed."""


class AuthRefused(TransportError):
    """The coordinator refused this client's key (or the handshake failed): retrying will not help."""
