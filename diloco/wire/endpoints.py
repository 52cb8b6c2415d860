"""The interface both endpoints implement: what the coordinator and a worker hold.

An endpoint moves ``Message`` objects between named peers: in process
(``diloco.transport.inproc``, which hands the objects over) or over ZeroMQ
(``diloco.wire.zmq``, which encodes them to frames). The coordinator side
serves many peers; a worker side talks to one coordinator. ``recv`` always
takes a timeout: nothing in diloco blocks forever (a paused worker must stay
stoppable, SPEC.md R12).
"""

from __future__ import annotations

from typing import Protocol

from diloco.transport.arrival import Arrival
from diloco.wire.messages import Message


class CoordinatorEndpoint(Protocol):
    """What the coordinator's driver holds: receive from any peer, reply to one."""

    def recv(self, timeout_s: float) -> Arrival | None:
        """The next ``Arrival`` (peer, message, identity), or None when ``timeout_s`` passes with nothing.

        ``identity`` is None unless the transport authenticates its peers.
        """

    def lost_peers(self) -> list[str]:
        """Peers whose connection is gone for good; a transport that cannot tell returns []."""

    def arriving_peers(self) -> list[str]:
        """Peers whose message is arriving, a part since the last call: alive, however long one message takes
        on their link. A transport that delivers messages whole returns []."""

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


__all__ = ["Arrival", "CoordinatorEndpoint", "WorkerEndpoint"]
