"""The outer optimizer: a ``torch.optim`` optimizer stepped on pseudo-gradients.

DiLoCo (Douillard et al. 2023, section 3) treats the averaged pseudo-gradient
(global - local) as a gradient and steps an outer optimizer on the global
params; Nesterov SGD with lr 0.7 is the paper's robust default. The paper
uses momentum 0.9; the default here is 0.8, which did better at both H = 10
and H = 50 in a sweep of outer lr and momentum on two seeds
(``bench_training.py --outer-sweep``, benchmarks/README.md). Each fragment gets its own optimizer instance so that stepping one
fragment never touches another's momentum (Streaming DiLoCo).

Async mode uses Delayed Nesterov (Liu et al. 2024, "Asynchronous Local-SGD
Training for Language Modeling", Algorithm 3): momentum is updated only once
every ``delay`` contributions, from their average, while each contribution's
own gradient term is applied as it arrives.

Momentum schedules (Pier: Fan and Zhang 2025, "Efficient Large Language
Model pretraining with Relaxed Global Communication"): the momentum may rise
linearly over the first ``momentum_warmup`` outer steps and fall linearly to
``momentum_final`` over ``momentum_decay_rounds`` steps from step
``momentum_decay_start`` (``OuterConfig.momentum_at``). The step count lives in
the optimizer's own param group (``outer_steps``), so it is saved, restored,
healed and undone (a refused step) with the rest of the optimizer's state,
and a replayed or healed replica takes the same momentum at the same step.

Who runs it: the coordinator on the hub plane; every member, on its own replica,
on the collective plane (``diloco.collective.replica``). So it lives below both.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass
from typing import Iterable

import torch

#: Names accepted by ``OuterConfig.name``.
OPTIMIZERS = ("nesterov", "sgd", "adam", "delayed_nesterov")


class OuterConfigError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class OuterConfig:
    #: "nesterov" (SGD, nesterov=True), "sgd" (plain averaging when lr=1, momentum=0:
    #: FedAvg), "adam", or "delayed_nesterov" (the async default).
    name: str = "nesterov"
    lr: float = 0.7
    #: 0.8, not the paper's 0.9: see the module doc.
    momentum: float = 0.8
    #: Delayed Nesterov: contributions per momentum update (0: use min_workers).
    delay: int = 0
    #: Momentum warm-up: outer steps over which the momentum rises linearly to ``momentum`` (0: none).
    momentum_warmup: int = 0
    #: Momentum decay: from outer step ``momentum_decay_start`` it falls linearly to ``momentum_final``
    #: over ``momentum_decay_rounds`` steps, then stays there (rounds 0: no decay).
    momentum_decay_start: int = 0
    momentum_decay_rounds: int = 0
    momentum_final: float = 0.0

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise OuterConfigError(f"outer optimizer {self.name!r} is unknown: expected one of {OPTIMIZERS}")
        if not isinstance(self.lr, (int, float)) or not 0 < self.lr < 100:
            raise OuterConfigError(f"outer lr={self.lr!r} is invalid: expected a number in (0, 100)")
        if not isinstance(self.momentum, (int, float)) or not 0 <= self.momentum < 1:
            raise OuterConfigError(f"outer momentum={self.momentum!r} is invalid: expected a number in [0, 1)")
        if isinstance(self.delay, bool) or not isinstance(self.delay, int) or self.delay < 0:
            raise OuterConfigError(f"outer delay={self.delay!r} is invalid: expected an integer >= 0")
        for name in ("momentum_warmup", "momentum_decay_start", "momentum_decay_rounds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 40:
                raise OuterConfigError(f"outer {name}={value!r} is invalid: expected an integer >= 0 (outer steps)")
        if not isinstance(self.momentum_final, (int, float)) or not 0 <= self.momentum_final < 1:
            raise OuterConfigError(f"outer momentum_final={self.momentum_final!r} is invalid: expected a number "
                                   f"in [0, 1)")
        if self.scheduled and self.name not in ("nesterov", "sgd", "delayed_nesterov"):
            raise OuterConfigError(f"a momentum schedule needs a momentum optimizer (nesterov, sgd, "
                                   f"delayed_nesterov), not {self.name!r}")

    @property
    def scheduled(self) -> bool:
        """True when the momentum changes from step to step (a warm-up or a decay)."""
        return self.momentum_warmup > 0 or self.momentum_decay_rounds > 0

    def momentum_at(self, step: int) -> float:
        """The momentum of the fragment's outer step number ``step`` (0 for the first).

        The warm-up gives step ``s`` ``momentum * (s + 1) / warmup`` (never 0: the first step
        already has some); the decay interpolates from ``momentum`` (before its start) to
        ``momentum_final`` (from ``start + rounds - 1`` on); where both apply, the smaller wins.
        """
        mu = self.momentum
        if self.momentum_warmup and step < self.momentum_warmup:
            mu = self.momentum * (step + 1) / self.momentum_warmup
        if self.momentum_decay_rounds and step >= self.momentum_decay_start:
            done = min(1.0, (step - self.momentum_decay_start + 1) / self.momentum_decay_rounds)
            mu = min(mu, self.momentum + (self.momentum_final - self.momentum) * done)
        return mu

    def to_dict(self) -> dict:
        """Every field; the schedule's only when one is set, so a run without one says what it always did."""
        d = asdict(self)
        if not self.scheduled:
            for name in ("momentum_warmup", "momentum_decay_start", "momentum_decay_rounds", "momentum_final"):
                del d[name]
        return d


class DelayedNesterov(torch.optim.Optimizer):
    """Delayed Nesterov momentum for asynchronous outer steps.

    For each incoming pseudo-gradient g (in ``p.grad``)::

        p   -= lr * g / delay          # the gradient term, at once
        buf += g
        every delay-th step:
            m    = momentum * m + buf / delay
            p   -= lr * momentum * m   # the momentum term, delayed
            buf  = 0

    Over ``delay`` contributions this applies exactly
    ``lr * (mean(g) + momentum * m)``: the synchronous Nesterov step on their
    mean, which is why it matches sync DiLoCo when contributions arrive evenly
    (a test checks that equivalence).
    """

    def __init__(self, params: Iterable[torch.Tensor], lr: float = 0.7, momentum: float = 0.9,
                 delay: int = 1) -> None:
        if delay < 1:
            raise OuterConfigError(f"delay={delay!r}: expected an integer >= 1")
        super().__init__(params, dict(lr=lr, momentum=momentum, delay=delay))

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 - torch.optim signature
        for group in self.param_groups:
            lr, beta, delay = group["lr"], group["momentum"], group["delay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.int64)
                    state["momentum_buffer"] = torch.zeros_like(p)
                    state["delay_buffer"] = torch.zeros_like(p)
                g = p.grad
                p.add_(g, alpha=-lr / delay)
                state["delay_buffer"].add_(g)
                state["step"] += 1
                if int(state["step"]) % delay == 0:
                    m = state["momentum_buffer"]
                    m.mul_(beta).add_(state["delay_buffer"], alpha=1.0 / delay)
                    p.add_(m, alpha=-lr * beta)
                    state["delay_buffer"].zero_()
        return None


def build_outer_optimizer(params: list[torch.Tensor], config: OuterConfig, default_delay: int) -> torch.optim.Optimizer:
    """The torch optimizer for one fragment's params (with its momentum schedule, if the config has one)."""
    if config.name == "nesterov":
        opt = torch.optim.SGD(params, lr=config.lr, momentum=config.momentum, nesterov=config.momentum > 0)
    elif config.name == "sgd":
        opt = torch.optim.SGD(params, lr=config.lr, momentum=config.momentum)
    elif config.name == "adam":
        return torch.optim.Adam(params, lr=config.lr, betas=(config.momentum, 0.999))
    else:
        opt = DelayedNesterov(params, lr=config.lr, momentum=config.momentum,
                              delay=config.delay or max(1, default_delay))
    if config.scheduled:
        opt.register_step_pre_hook(_momentum_schedule(config))
    return opt


def _momentum_schedule(config: OuterConfig):
    """A step pre-hook: set this step's momentum, and count the step in the param group.

    The count is a param-group entry, not a Python attribute, because ``state_dict`` carries
    param groups whole: a checkpoint, a heal and ``OptimizerBackup`` (the undo of a refused step)
    keep it with the momentum buffers it belongs to.
    """
    def hook(opt: torch.optim.Optimizer, args, kwargs) -> None:
        for group in opt.param_groups:
            step = int(group.get("outer_steps", 0))
            group["momentum"] = config.momentum_at(step)
            group["outer_steps"] = step + 1
    return hook


class OptimizerBackup:
    """One optimizer's state copied into buffers kept from step to step, to undo a step exactly.

    ``torch.optim`` state is, per param, a dict of tensors (momentum, Adam's moments) and
    scalars; ``load_state_dict`` would make the live state alias what it loads, so the
    restore copies back in place instead. Kept buffers, not fresh copies (``deepcopy``): a
    model-sized tensor allocated and freed every step page-faults its memory in again (glibc
    hands large freed blocks back, or cannot reuse them for the next aligned request).
    """

    def __init__(self) -> None:
        self._state: dict[int, dict] = {}  # param position -> key -> buffer or value
        self._groups: list[dict] = []

    def take(self, opt: torch.optim.Optimizer) -> None:
        kept: dict[int, dict] = {}
        for i, p in enumerate(params_of(opt)):
            live = opt.state.get(p)
            if not live:
                continue
            old = self._state.get(i, {})
            entry = {}
            for k, v in live.items():
                if isinstance(v, torch.Tensor):
                    buf = old.get(k)
                    if not isinstance(buf, torch.Tensor) or buf.shape != v.shape or buf.dtype != v.dtype:
                        buf = torch.empty_like(v)
                    entry[k] = buf.copy_(v)
                else:
                    entry[k] = copy.deepcopy(v)
            kept[i] = entry
        self._state = kept
        self._groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in opt.param_groups]

    def tensors(self) -> list[torch.Tensor]:
        """The buffers this backup keeps."""
        return [v for entry in self._state.values() for v in entry.values() if isinstance(v, torch.Tensor)]

    def restore(self, opt: torch.optim.Optimizer) -> None:
        with torch.no_grad():
            for i, p in enumerate(params_of(opt)):
                saved = self._state.get(i)
                if saved is None:
                    opt.state.pop(p, None)
                    continue
                live = opt.state[p]
                for k in [k for k in live if k not in saved]:
                    del live[k]
                for k, v in saved.items():
                    if isinstance(v, torch.Tensor):
                        cur = live.get(k)
                        if isinstance(cur, torch.Tensor) and cur.shape == v.shape and cur.dtype == v.dtype:
                            cur.copy_(v)
                        else:
                            live[k] = v.clone()
                    else:
                        live[k] = copy.deepcopy(v)
        for g, saved in zip(opt.param_groups, self._groups):
            g.update(copy.deepcopy(saved))

    def state_dict(self, opt: torch.optim.Optimizer) -> dict:
        """What ``opt.state_dict()`` returned when the backup was taken (copies)."""
        groups = opt.state_dict()["param_groups"]
        for g, saved in zip(groups, self._groups):
            g.update(copy.deepcopy(saved))
        state = {i: {k: (v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)) for k, v in e.items()}
                 for i, e in self._state.items()}
        return {"state": state, "param_groups": groups}


def params_of(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every param of ``opt``, in its param groups' order (the order its state_dict numbers them)."""
    return [p for g in opt.param_groups for p in g["params"]]
