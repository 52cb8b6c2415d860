"""An in-memory network: one coordinator endpoint, any number of worker endpoints.

It hands message objects over as they are (any dataclass; it never looks
inside one except to clone the tensors it carries), so it implements
``diloco.wire.endpoints``' interfaces without encoding anything.

Messages are copied on send (tensors cloned), so a peer can never see a
tensor change under it after the fact -- the same semantics as bytes on a
wire. Fault knobs: ``partition(peer)`` drops everything to and from a peer
until ``heal(peer)``; ``close`` on a worker endpoint is what a crash looks like.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from typing import Any

import torch

from diloco.transport.arrival import Arrival
from diloco.transport.base import TransportClosed, TransportError

COORDINATOR = "coordinator"


def _copy(message: Any) -> Any:
    """Clone every tensor a message carries (params, tensors fields)."""
    changes = {}
    for f in dataclasses.fields(message):
        value = getattr(message, f.name)
        if isinstance(value, dict) and value and isinstance(next(iter(value.values())), torch.Tensor):
            changes[f.name] = {k: t.detach().clone() for k, t in value.items()}
    return dataclasses.replace(message, **changes) if changes else message


class InprocNetwork:
    """The switchboard. Thread-safe."""

    def __init__(self, max_queue: int = 10_000) -> None:
        self._lock = threading.Lock()
        self._max_queue = max_queue
        self._coordinator_inbox: queue.Queue = queue.Queue(max_queue)
        self._worker_inboxes: dict[str, queue.Queue] = {}
        self._partitioned: set[str] = set()
        self._coordinator: InprocCoordinatorEndpoint | None = None

    def coordinator(self) -> "InprocCoordinatorEndpoint":
        with self._lock:
            if self._coordinator is None:
                self._coordinator = InprocCoordinatorEndpoint(self)
            return self._coordinator

    def connect(self, peer: str) -> "InprocWorkerEndpoint":
        """A new endpoint named ``peer`` (a reconnect under the same name replaces the old one)."""
        with self._lock:
            inbox: queue.Queue = queue.Queue(self._max_queue)
            self._worker_inboxes[peer] = inbox
            return InprocWorkerEndpoint(self, peer, inbox)

    def partition(self, peer: str) -> None:
        with self._lock:
            self._partitioned.add(peer)

    def heal(self, peer: str) -> None:
        with self._lock:
            self._partitioned.discard(peer)

    # -- used by endpoints
    def _to_coordinator(self, peer: str, message: Any) -> None:
        if peer in self._partitioned:
            return
        try:
            self._coordinator_inbox.put_nowait((peer, _copy(message)))
        except queue.Full:
            raise TransportError(f"coordinator inbox full ({self._max_queue} messages)") from None

    def _to_worker(self, peer: str, message: Any) -> None:
        with self._lock:
            inbox = self._worker_inboxes.get(peer)
            if inbox is None or peer in self._partitioned:
                return  # like a datagram to a dead host: silently gone
        try:
            inbox.put_nowait(_copy(message))
        except queue.Full:
            pass  # a peer that never reads is a dead peer; heartbeats will tell

    def _disconnect(self, peer: str, inbox: queue.Queue) -> None:
        with self._lock:
            if self._worker_inboxes.get(peer) is inbox:
                del self._worker_inboxes[peer]


class InprocCoordinatorEndpoint:
    def __init__(self, network: InprocNetwork) -> None:
        self._net = network
        self._closed = False

    def recv(self, timeout_s: float) -> Arrival | None:
        if self._closed:
            raise TransportClosed("coordinator endpoint is closed")
        try:
            peer, message = self._net._coordinator_inbox.get(timeout=max(0.0, timeout_s))
        except queue.Empty:
            return None
        return Arrival(peer, message)

    def lost_peers(self) -> list[str]:
        """Always []: a queue cannot tell a closed peer from a quiet one (heartbeats tell)."""
        return []

    def arriving_peers(self) -> list[str]:
        """Always []: a message is handed over whole, never in parts."""
        return []

    def send(self, peer: str, message: Any) -> None:
        if self._closed:
            raise TransportClosed("coordinator endpoint is closed")
        self._net._to_worker(peer, message)

    def close(self) -> None:
        self._closed = True


#: Put in a worker's inbox by ``wake``: ends a blocked ``recv`` without a message.
_WAKE = object()


class InprocWorkerEndpoint:
    def __init__(self, network: InprocNetwork, peer: str, inbox: queue.Queue) -> None:
        self._net = network
        self.peer = peer
        self._inbox = inbox
        self._closed = False

    def send(self, message: Any) -> None:
        if self._closed:
            raise TransportClosed(f"endpoint {self.peer!r} is closed")
        self._net._to_coordinator(self.peer, message)

    def recv(self, timeout_s: float) -> Any | None:
        if self._closed:
            raise TransportClosed(f"endpoint {self.peer!r} is closed")
        try:
            message = self._inbox.get(timeout=max(0.0, timeout_s))
        except queue.Empty:
            return None
        return None if message is _WAKE else message

    def wake(self) -> None:
        """End a ``recv`` blocked in another thread now (it returns None). Thread-safe."""
        if not self._closed:
            try:
                self._inbox.put_nowait(_WAKE)
            except queue.Full:
                pass  # full of messages: recv returns at once anyway

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._net._disconnect(self.peer, self._inbox)
