"""Helpers the tests share: build a Join, a sans-IO coordinator, one torch thread.

The tests drive ``Coordinator.handle`` by hand in many files, and each used to
spell out ``Join(worker_id, PROTOCOL_VERSION, spec_of(params), params)`` and
``Coordinator(CoordinatorConfig(FSMConfig(...), ...), ...)`` itself. They are
here once:

* :func:`fsm_after` -- a ``RoundFSM`` after some events (the core's tests);
* :func:`join_message` -- a ``Join`` from a worker's params (spec and params) or
  from a spec alone (a spec-only join, ``params={}``);
* :func:`make_coordinator` -- a ``Coordinator`` from ``FSMConfig`` keywords plus
  the few ``CoordinatorConfig`` fields tests set;
* :func:`joined` -- a coordinator with some workers joined and welcomed;
* :func:`only` / :func:`replies` -- pick messages of one type out of what
  ``handle`` returned;
* :func:`params_of` -- detached copies of a model's parameters;
* :func:`one_torch_thread` -- torch uses one intra-op thread inside the block.
* :class:`QuietDemoUI` -- a silent ``diloco demo`` UI that keeps its notes.

Importing this module is cheap: it imports only the message types (which do not
load torch); a helper that needs torch or the coordinator imports it when called.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

from diloco.wire.messages import PROTOCOL_VERSION, Join, TensorSpec, Welcome, spec_of

if TYPE_CHECKING:
    import torch

    from diloco.coordinator import Coordinator, OuterConfig
    from diloco.coordinator.service import Observer

__all__ = [
    "fsm_after",
    "join_message",
    "make_coordinator",
    "joined",
    "only",
    "replies",
    "params_of",
    "one_torch_thread",
]

#: What ``Coordinator.handle`` returns: ``(peer, message)`` pairs.
Outbox = list[tuple[str, Any]]

_FROM_FIRST = object()


def fsm_after(*events: Any, **config: Any):
    """A ``RoundFSM(FSMConfig(**config))`` that has stepped through ``events`` (their effects dropped)."""
    from diloco.core import FSMConfig, RoundFSM

    fsm = RoundFSM(FSMConfig(**config))
    for event in events:
        fsm.step(event)
    return fsm


def join_message(
    worker_id: str,
    params_or_spec: Mapping[str, torch.Tensor] | Sequence[TensorSpec],
    *,
    params: Any = _FROM_FIRST,
    version: int = PROTOCOL_VERSION,
) -> Join:
    """``Join(worker_id, version, spec, params)``.

    ``params_or_spec`` is either a worker's params (a name -> tensor mapping: the
    join carries their spec and the tensors) or a spec (a spec-only join,
    ``params={}``, as a worker sends before the run asks for its params).
    ``params=`` sends other tensors under that spec (non-finite values, say).
    """
    if isinstance(params_or_spec, Mapping):
        spec, sent = spec_of(params_or_spec), dict(params_or_spec)
    else:
        spec, sent = tuple(params_or_spec), {}
    if params is not _FROM_FIRST:
        sent = params
    return Join(worker_id, version, spec, sent)


def make_coordinator(
    now_s: float = 0.0,
    *,
    outer: OuterConfig | None = None,
    max_update_norm: float | None = None,
    observer: Observer | None = None,
    wire_dtype: str = "fp32",
    collective_timeout_s: float = 0.0,
    outlier_factor: float = 10.0,
    max_failed_attempts: int | None = None,
    heal_sources: int = 1,
    **fsm: Any,
) -> Coordinator:
    """``Coordinator(CoordinatorConfig(FSMConfig(**fsm), outer=..., max_update_norm=..., wire_dtype=...), now_s,
    observer=...)``.

    ``outer=None`` is the default outer optimizer (Nesterov, lr 0.7, momentum 0.8);
    ``outlier_factor`` the default bound on contributions out of line (0: off);
    ``max_failed_attempts`` None the default, ``heal_sources`` one (collective plane).
    """
    from diloco.coordinator import Coordinator, CoordinatorConfig, OuterConfig
    from diloco.core import FSMConfig

    extra = {} if max_failed_attempts is None else {"max_failed_attempts": max_failed_attempts}
    config = CoordinatorConfig(FSMConfig(**fsm), outer=outer if outer is not None else OuterConfig(),
                               max_update_norm=max_update_norm, wire_dtype=wire_dtype,
                               collective_timeout_s=collective_timeout_s, outlier_factor=outlier_factor,
                               heal_sources=heal_sources, **extra)
    return Coordinator(config, now_s, observer=observer)


def joined(c: Coordinator, params: Mapping[str, torch.Tensor], *worker_ids: str,
           now_s: float = 0.0) -> Coordinator:
    """``c`` after each of ``worker_ids`` joined with ``params`` (each its own peer) and was welcomed."""
    for wid in worker_ids:
        out = c.handle(wid, join_message(wid, params), now_s)
        assert any(isinstance(m, Welcome) for _, m in out), out
    return c


def replies(out: Outbox, kind: type) -> list[tuple[str, Any]]:
    """The ``(peer, message)`` pairs in ``out`` whose message is a ``kind``."""
    return [(peer, m) for peer, m in out if isinstance(m, kind)]


def only(out: Outbox, kind: type) -> Any:
    """The one message of type ``kind`` in ``out`` (asserts there is exactly one)."""
    found = replies(out, kind)
    assert len(found) == 1, out
    return found[0][1]


def params_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Detached copies of ``model``'s parameters, by name."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """Torch uses one intra-op thread inside the block; the previous count is restored after.

    Tests on a shared 2-core machine: one thread is deterministic and does not
    oversubscribe the cores when several worker threads train at once.
    """
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


class QuietDemoUI:
    """A ``diloco.demo.run.DemoUI`` that shows nothing and keeps the demo's notes in ``notes``."""

    def __init__(self) -> None:
        self.notes: list[str] = []

    def phase(self, name: str, total: int) -> None:
        pass

    def advance(self, name: str, step: int, loss: float) -> None:
        pass

    def finish(self, name: str, text: str) -> None:
        pass

    def note(self, text: str) -> None:
        self.notes.append(text)


class PlainSGD:
    """Plain SGD with the ``torch.optim`` interface a worker uses (``step``, ``zero_grad``,
    ``state_dict``, ``load_state_dict``), for test and benchmark entries that start many worker
    processes: the first ``torch.optim`` optimizer a process builds imports ``torch._dynamo``,
    seconds of start-up per process on a 2-core machine."""

    def __init__(self, params, lr: float = 0.05) -> None:
        self.params = list(params)
        self.lr = lr
        self.steps = 0

    def step(self) -> None:
        import torch

        with torch.no_grad():
            for p in self.params:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-self.lr)
        self.steps += 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def state_dict(self) -> dict:
        return {"lr": self.lr, "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.lr = float(state["lr"])
        self.steps = int(state["steps"])
