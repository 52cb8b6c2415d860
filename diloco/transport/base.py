"""The one interface both transports implement.

A transport moves ``Message`` objects between named peers and knows nothing
about rounds. The coordinator side serves many peers; a worker side talks to
one coordinator. ``recv`` always takes a timeout: nothing in diloco blocks
forever (a paused worker must stay stoppable, SPEC.md R12).
"""

from __future__ import annotations

from typing import Protocol

from diloco.transport.messages import Message


class TransportError(Exception):
    """The transport cannot deliver: closed, peer unknown, or a limit exceeded."""


class TransportClosed(TransportError):
    """The endpoint was closed."""


class AuthRefused(TransportError):
    """The coordinator refused this client's key (or the handshake failed): retrying will not help."""


class CoordinatorEndpoint(Protocol):
    """What the coordinator's driver holds: receive from any peer, reply to one."""

    def recv(self, timeout_s: float) -> tuple[str, Message] | None:
        """The next (peer, message), or None when ``timeout_s`` passes with nothing."""

    def send(self, peer: str, message: Message) -> None:
        """Queue ``message`` for ``peer``; never blocks longer than the transport's send timeout."""

    def close(self) -> None: ...


class WorkerEndpoint(Protocol):
    """What a worker (or an admin client) holds: one conversation with the coordinator."""

    def send(self, message: Message) -> None: ...

    def recv(self, timeout_s: float) -> Message | None:
        """The next message from the coordinator, or None after ``timeout_s``.

        Both transports also offer ``wake()`` (optional: the worker checks for it), which
        ends a ``recv`` blocked in another thread at once, returning None.
        """

    def close(self) -> None: ...
