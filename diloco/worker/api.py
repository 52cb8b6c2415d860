"""``diloco.Worker``: DiLoCo in your own training loop, in about five added lines.

::

    with diloco.Worker(model, optimizer, connect="tcp://127.0.0.1:5555", sync_every=100) as w:
        for x, y in data:
            loss = loss_fn(model(x), y); loss.backward(); optimizer.step(); optimizer.zero_grad()
            if not w.step():      # counts the step; at a sync point submits and waits
                break

Entering joins the run (the global params are copied into ``model``);
leaving -- at the end, on ``break``, or on an exception -- sends ``Leave`` so
the coordinator hears of it at once, and closes the connection. With
``hook=True`` the step is counted by a post-step hook on ``optimizer``
instead of ``w.step()``; check ``w.stopped`` to end your loop.

A model FSDP2 shards across the ranks of a ``torchrun`` group (``fully_shard``)
is one member: every rank builds the ``Worker`` the same way; rank 0 talks to
the coordinator and the others follow it (``diloco.worker.group``; the id is
rank 0's). See ``diloco.worker.shards``.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Literal

import torch

from diloco.wire.endpoints import WorkerEndpoint
from diloco.worker.worker import DilocoWorker


class Worker:
    """A DiLoCo worker as a context manager around your model and inner optimizer.

    ``connect`` is the coordinator's address (``tcp://HOST:PORT``, as ``diloco server``
    prints it) or an endpoint object. ``key``/``server_key`` (or ``DILOCO_KEY`` /
    ``DILOCO_SERVER_KEY``) authenticate against a server started with ``--auth``.
    ``worker_id`` defaults to ``HOSTNAME-PID``. The other keyword arguments are
    ``DilocoWorker``'s (``checkpoint_dir``, ``coordinator_timeout_s``, ``on_state``,
    ``overlap_steps``/``overlap_alpha`` to keep training while a round is decided, ...).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 connect: str | WorkerEndpoint, sync_every: int, worker_id: str | None = None,
                 key: str | os.PathLike | None = None, server_key: str | os.PathLike | None = None,
                 hook: bool = False, **options) -> None:
        worker_id = worker_id or f"{socket.gethostname()}-{os.getpid()}"
        info = _sharded_group(model)
        #: What the loop drives: the worker, or a sharded member's GroupLeader / GroupFollower.
        self._driver: Any = None
        #: The DilocoWorker (a follower rank: its GroupFollower); its attributes are this one's.
        self.worker: Any
        if info is not None:  # every rank of the member names it as its rank 0 does
            from diloco.worker.group import GroupFollower, GroupLeader, share_worker_id

            worker_id = share_worker_id(worker_id)
            if not info.is_leader:
                self.worker = self._driver = GroupFollower(model, optimizer, worker_id, info)
        if self._driver is None:
            endpoint = _endpoint(connect, worker_id, key, server_key)
            try:
                self.worker = DilocoWorker(model, optimizer, endpoint, worker_id=worker_id, sync_every=sync_every,
                                           **options)
            except BaseException:
                endpoint.close()
                raise
            self._driver = GroupLeader(self.worker, info) if info is not None else self.worker
        self._hook = optimizer.register_step_post_hook(self._after_optimizer_step) if hook else None

    # -- the loop

    def step(self, tokens: int | None = None) -> bool:
        """Count one inner step (``tokens``: what it trained on, for ``--merge tokens``; None: one step); at a
        sync point submit and wait. False: stop training."""
        return self._driver.step_done(tokens)

    @property
    def stopped(self) -> bool:
        """True once the run told this worker to stop (or it gave up on the coordinator)."""
        return self.worker.stopped

    @property
    def data_unit(self) -> tuple[int, int] | None:
        """``(epoch, index)`` of the data unit to train on now, in a run with ``diloco server --data-units N``
        (``index`` in 0..N-1 names the data); None otherwise. It changes only at a sync point, so read
        it after each ``step()``: the coordinator marks it trained once this round applies."""
        return self.worker.data_unit

    def request_stop(self, save: bool = False) -> None:
        """Stop at the next step (thread- and signal-safe)."""
        self.worker.request_stop(save=save)

    def __getattr__(self, name: str):
        # inner_step, rounds_synced, stop_reason, round_ids, state, ...: the driver's.
        if name == "worker":
            raise AttributeError(name)
        return getattr(self.worker, name)

    # -- the context

    def __enter__(self) -> "Worker":
        try:
            self._driver.join()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> Literal[False]:
        abandon = getattr(self._driver, "abandon", None)
        if exc_type is not None and abandon is not None:
            abandon()  # a rank failing on its own does not wait for its leader's leave
        self.close()
        return False  # an exception in the loop propagates, after the clean leave

    def close(self) -> None:
        """Leave the run and close the connection (idempotent)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._driver.leave()

    def _after_optimizer_step(self, _optimizer, _args, _kwargs) -> None:
        if not self.worker.stopped:
            self._driver.step_done()


def _sharded_group(model: torch.nn.Module):
    """This rank's place in its member when the model is sharded across a group of ranks, else None."""
    import torch.distributed as dist

    from diloco.worker.shards import is_sharded

    if not dist.is_initialized() or dist.get_world_size() == 1 or not is_sharded(model):
        return None
    from diloco.worker.group import RankInfo

    return RankInfo(dist.get_rank(), dist.get_world_size(), dist.get_rank())


def _endpoint(connect, worker_id: str, key, server_key) -> WorkerEndpoint:
    if not isinstance(connect, str):
        for method in ("send", "recv", "close"):
            if not callable(getattr(connect, method, None)):
                raise TypeError(f"connect={connect!r}: expected an address such as 'tcp://127.0.0.1:5555' "
                                f"or an endpoint with send/recv/close")
        return connect
    if not connect.startswith(("tcp://", "ipc://")):
        raise ValueError(f"connect={connect!r}: expected tcp://HOST:PORT (or ipc://PATH)")
    from diloco.wire.zmq import ZmqWorkerEndpoint
    from diloco.transport.zmq.auth import ClientAuth

    auth = ClientAuth.from_options(None if key is None else os.fspath(key),
                                   None if server_key is None else os.fspath(server_key))
    return ZmqWorkerEndpoint(connect, label=worker_id, auth=auth)


__all__ = ["Worker"]
