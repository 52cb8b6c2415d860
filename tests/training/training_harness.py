"""Harness for end-to-end training tests: a real coordinator loop, workers in threads.

``Run`` starts a ``CoordinatorThread`` over an ``InprocNetwork`` (real clock,
real ``Coordinator``) and runs ``run_training`` for each worker in its own
thread. Every thread is joined with a timeout; the autouse ``no_thread_leaks``
fixture fails a test that leaves one behind.

Data is synthetic and a pure function of (seed, step), so a worker resumed
from its checkpoint at step s sees exactly the batches it would have seen.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterable, Iterator

import torch

from diloco.core import Mode
from diloco.coordinator import Coordinator, OuterConfig
from diloco.coordinator.runner import CoordinatorThread
from diloco.testing import make_coordinator
from diloco.transport.inproc import InprocNetwork
from diloco.wire.messages import AdminReply, AdminRequest
from diloco.worker import DilocoWorker, WorkerReport, run_training

DIM = 8
#: The true weights of the synthetic regression problem.
W_TRUE = torch.linspace(-1.0, 1.0, DIM).reshape(DIM, 1)


def batch_at(seed: int, step: int, batch_size: int = 16, noise: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch number ``step`` of shard ``seed``: a pure function, so resumes see the same data."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    x = torch.randn(batch_size, DIM, generator=g)
    y = x @ W_TRUE + noise * torch.randn(batch_size, 1, generator=g)
    return x, y


def batches(seed: int, start: int = 0, stop: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    step = start
    while stop is None or step < stop:
        yield batch_at(seed, step)
        step += 1


def mse_loss(model: torch.nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def linear(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(DIM, 1)


def mlp(seed: int, hidden: int = 16) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(DIM, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))


def wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.005)


def in_thread(body: Callable[[], None], timeout_s: float = 60.0) -> None:
    """Run ``body`` (a worker's whole life: join, steps, leave) in a thread; re-raise what it raised."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            body()
        except BaseException as exc:  # surfaced below, in the test's thread
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), f"the worker thread did not finish within {timeout_s:g} s"
    if errors:
        raise errors[0]


class WorkerHandle:
    """A ``DilocoWorker`` running ``run_training`` in a thread."""

    def __init__(self, worker: DilocoWorker, batches_: Iterable[Any], max_steps: int | None,
                 loss_fn=mse_loss) -> None:
        self.worker = worker
        self.report: WorkerReport | None = None
        self.error: BaseException | None = None
        self.states: list[tuple[str, float]] = []
        self._thread = threading.Thread(target=self._run, args=(batches_, loss_fn, max_steps),
                                        name=f"worker-{worker.worker_id}", daemon=True)

    def _run(self, batches_, loss_fn, max_steps) -> None:
        try:
            self.report = run_training(self.worker, batches_, loss_fn, max_steps=max_steps)
        except BaseException as exc:  # surfaced by join()
            self.error = exc

    def start(self) -> "WorkerHandle":
        self._thread.start()
        return self

    def join(self, timeout_s: float = 30.0, expect_error: bool = False) -> WorkerReport | None:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), f"worker {self.worker.worker_id} did not finish in {timeout_s} s"
        if self.error is not None and not expect_error:
            raise AssertionError(f"worker {self.worker.worker_id} failed") from self.error
        return self.report

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


class Run:
    """A coordinator in a thread plus any number of worker threads, over one InprocNetwork."""

    def __init__(self, *, min_workers: int = 1, mode: Mode = Mode.SYNC, num_fragments: int = 1,
                 heartbeat_timeout_s: float = 10.0, outer: OuterConfig | None = None,
                 checkpoint_dir=None, coordinator: Coordinator | None = None, linger_s: float = 30.0,
                 wire_dtype: str = "fp32") -> None:
        self.net = InprocNetwork()
        self.events: list[tuple[str, dict]] = []
        #: (fragment_id, round_id, params of that fragment right after the outer step)
        self.applied: list[tuple[int, int, dict[str, torch.Tensor]]] = []
        if coordinator is None:
            coordinator = make_coordinator(time.monotonic(), outer=outer, observer=self._observe,
                                           min_workers=min_workers, mode=mode, num_fragments=num_fragments,
                                           heartbeat_timeout_s=heartbeat_timeout_s, wire_dtype=wire_dtype)
        else:
            coordinator._observer = self._observe
        self.coordinator = coordinator
        self.thread = CoordinatorThread(self.net.coordinator(), coordinator, checkpoint_dir=checkpoint_dir,
                                        linger_s=linger_s)
        self.thread.start()
        self.handles: dict[str, WorkerHandle] = {}
        self._admin_n = 0

    def _observe(self, kind: str, now: float, info: dict) -> None:
        # Runs on the coordinator thread, so reading the store here is race-free.
        self.events.append((kind, dict(info)))
        if kind == "apply" and self.coordinator.store is not None:  # the hub plane holds the params
            fid = info["fragment_id"]
            self.applied.append((fid, info["round_id"], {
                n: t.clone() for n, t in self.coordinator.store.fragment_params(fid).items()}))

    def worker(self, worker_id: str, model: torch.nn.Module, *, sync_every: int, lr: float = 0.05,
               optimizer: torch.optim.Optimizer | None = None, **kwargs) -> DilocoWorker:
        opt = optimizer or torch.optim.SGD(model.parameters(), lr=lr)
        return DilocoWorker(model, opt, self.net.connect(worker_id), worker_id=worker_id, sync_every=sync_every,
                            **kwargs)

    def start(self, worker: DilocoWorker, batches_: Iterable[Any], max_steps: int | None = None,
              loss_fn=mse_loss) -> WorkerHandle:
        handle = WorkerHandle(worker, batches_, max_steps, loss_fn)
        self.handles[worker.worker_id] = handle
        return handle.start()

    def admin(self, command: str, **args) -> AdminReply:
        self._admin_n += 1
        ep = self.net.connect(f"admin-{self._admin_n}")
        try:
            ep.send(AdminRequest(command, args))
            reply = ep.recv(5.0)
        finally:
            ep.close()
        assert isinstance(reply, AdminReply), f"no AdminReply to {command}: {reply!r}"
        return reply

    def join_workers(self, timeout_s: float = 30.0) -> dict[str, WorkerReport | None]:
        return {wid: h.join(timeout_s) for wid, h in self.handles.items()}

    def close(self) -> None:
        for h in self.handles.values():
            if h.alive:
                h.worker.request_stop()
        for h in self.handles.values():
            h.join(10.0, expect_error=True)
        self.thread.stop(10.0)
        assert not self.thread.is_alive(), "coordinator thread did not stop"
        if self.thread.error is not None:
            raise AssertionError("the coordinator loop failed") from self.thread.error

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LoopbackEndpoint:
    """A ``WorkerEndpoint`` wired straight to a sans-IO ``Coordinator``, no threads.

    ``send`` runs ``coordinator.handle`` at once and queues what it answers to this
    peer (``tamper`` may rewrite a message on its way in). For single-worker tests of
    the worker's reactions, deterministic and instant.
    """

    def __init__(self, coordinator: Coordinator, peer: str, tamper=None) -> None:
        import collections
        self.coordinator = coordinator
        self.peer = peer
        self.tamper = tamper
        self.inbox: "collections.deque" = collections.deque()
        self.sent: list = []
        self.closed = False

    def send(self, message) -> None:
        from diloco.transport.base import TransportClosed
        if self.closed:
            raise TransportClosed("closed")
        if self.tamper is not None:
            message = self.tamper(message)
        self.sent.append(message)
        for peer, reply in self.coordinator.handle(self.peer, message, time.monotonic()):
            if peer == self.peer:
                self.inbox.append(reply)

    def recv(self, timeout_s: float):
        if self.inbox:
            return self.inbox.popleft()
        time.sleep(min(timeout_s, 0.001))
        return None

    def close(self) -> None:
        self.closed = True
