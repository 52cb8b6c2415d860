"""The worker's end of the connection: the endpoint, its errors, and the communication thread.

One thread owns a socket (ZeroMQ sockets are not thread-safe). With a
communication thread (the default) that thread sends, receives and ticks the
session -- so heartbeats go on while the training thread runs a step of any
length -- and the training thread hands it what to send through ``post``.
Without one, the training thread does it all itself between steps.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any, Callable

from diloco.transport.base import AuthRefused, TransportError
from diloco.wire.endpoints import WorkerEndpoint
from diloco.wire.messages import Heartbeat, Message
from diloco.worker.errors import DilocoWorkerError

#: How long the communication thread waits for a message before it ticks the session.
#: Sends do not wait for it (``post`` wakes the thread), so this only paces the ticks
#: (heartbeats are seconds apart): 50 ms costs ~0.5% of a core per idle worker
#: (benchmarks/bench_worker.py; 10 ms cost ~1.7%).
COMM_POLL_S = 0.05


class Link:
    """Sends and receives for one worker; maps transport failures to ``DilocoWorkerError``."""

    def __init__(self, endpoint: WorkerEndpoint, worker_id: str, threaded: bool) -> None:
        self.endpoint = endpoint
        self.worker_id = worker_id
        self.threaded = threaded
        self._outbox: collections.deque[Message] = collections.deque()
        self._outbox_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()
        #: Called for every outgoing ``Heartbeat``: the worker's latest training metrics (or None).
        self.heartbeat_metrics: Callable[[], dict[str, Any] | None] | None = None

    # -- the communication thread

    def start(self, turn: Callable[[float], None], done: Callable[[], bool],
              on_error: Callable[[BaseException], None]) -> None:
        """Run ``turn(timeout)`` on a thread until ``done()`` or ``stop()``; failures go to ``on_error``."""
        if not self.threaded:
            return

        def loop() -> None:
            try:
                while not self._closing.is_set():
                    self.flush()
                    turn(COMM_POLL_S)
                    if done():
                        self.flush()
                        return
            except BaseException as exc:  # the training thread must hear of it, not a dead thread
                on_error(exc)

        self._thread = threading.Thread(target=loop, name=f"diloco-comm-{self.worker_id}", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the communication thread (if any) and wait for it."""
        self._closing.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    @property
    def on_comm_thread(self) -> bool:
        return self._thread is not None and self._thread is threading.current_thread()

    # -- messages

    def post(self, message: Message) -> None:
        """Send from the training thread: queued for the communication thread while it runs."""
        if self._thread is not None and self._thread.is_alive() and not self._closing.is_set():
            with self._outbox_lock:
                self._outbox.append(message)
            wake = getattr(self.endpoint, "wake", None)
            if callable(wake):
                wake()  # the thread sends it now, not at the end of its poll
        else:
            self.send(message)

    def flush(self) -> None:
        """Send what ``post`` queued, in order."""
        for message in self.take_outbox():
            self.send(message)

    def take_outbox(self) -> list[Message]:
        with self._outbox_lock:
            out = list(self._outbox)
            self._outbox.clear()
        return out

    def send(self, message: Message) -> None:
        if self.heartbeat_metrics is not None and type(message) is Heartbeat and message.metrics is None:
            message = dataclasses.replace(message, metrics=self.heartbeat_metrics())
        try:
            self.endpoint.send(message)
        except AuthRefused as exc:
            raise DilocoWorkerError(f"worker {self.worker_id!r}: {exc}", "auth_refused") from exc
        except TransportError as exc:
            raise DilocoWorkerError(f"worker {self.worker_id!r}: cannot send {type(message).__name__}: {exc}",
                                    "transport") from exc

    def recv(self, timeout_s: float) -> Message | None:
        try:
            return self.endpoint.recv(timeout_s)
        except AuthRefused as exc:
            raise DilocoWorkerError(f"worker {self.worker_id!r}: {exc}", "auth_refused") from exc
        except TransportError as exc:
            raise DilocoWorkerError(f"worker {self.worker_id!r}: cannot receive: {exc}", "transport") from exc

    def transport_silence(self) -> float | None:
        """Seconds since the transport last received any part of a message, if it can tell."""
        probe = getattr(self.endpoint, "silence_s", None)
        if not callable(probe):
            return None
        try:
            return float(probe())
        except Exception:  # a transport's probe must never break training
            return None

    def transport_activity(self) -> tuple[bool, bool]:
        """(sending, receiving): whether the transport is still moving a message out / in part by part."""
        flags = []
        for name in ("sending", "receiving"):
            probe = getattr(self.endpoint, name, None)
            try:
                flags.append(bool(probe()) if callable(probe) else False)
            except Exception:  # a transport's probe must never break training
                flags.append(False)
        return flags[0], flags[1]

    def close(self, farewell: list[Message]) -> None:
        """Send ``farewell`` and what is still queued (best effort), then close the endpoint."""
        for message in self.take_outbox() + farewell:
            try:
                self.endpoint.send(message)
            except TransportError:
                pass
        try:
            self.endpoint.close()
        except TransportError:
            pass
