"""What the reference trainers take and return, and the checks on their arguments.

:class:`TrainSettings` (the hyperparameters all three trainers share),
:class:`BaselineResult` (what each returns), the communication accounting
(:func:`comm_bytes_per_sync`) and the default corpus. See :mod:`diloco.baselines`.
"""

from __future__ import annotations

import copy
import functools
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

import torch

from diloco.data.corpus import Corpus
from diloco.models.char_transformer import ModelConfig

#: ``progress(step, total, loss)``: called after every (inner) step with that step's mean train loss.
ProgressFn = Callable[[int, int, float], None]


@dataclass(frozen=True)
class TrainSettings:
    """Hyperparameters shared by all three trainers. Validated on construction."""

    #: The model to train.
    model: ModelConfig = field(default_factory=ModelConfig)
    #: Sequences per worker per (inner) step.
    batch_size: int = 32
    #: Peak AdamW learning rate (inner optimizer).
    lr: float = 1e-3
    #: AdamW decoupled weight decay.
    weight_decay: float = 0.1
    #: AdamW betas.
    betas: tuple[float, float] = (0.9, 0.95)
    #: Linear warmup steps (from lr/warmup_steps up to lr).
    warmup_steps: int = 50
    #: ``"cosine"`` (decay to ``min_lr_ratio * lr`` at the last step) or ``"constant"``.
    schedule: str = "cosine"
    #: Floor of the cosine schedule as a fraction of ``lr``.
    min_lr_ratio: float = 0.1
    #: Clip each optimizer step's gradient to this global L2 norm; ``None`` disables.
    grad_clip: float | None = 1.0
    #: Evaluate held-out loss every this many (inner) steps (DiLoCo: at the first sync at or after).
    eval_every: int = 100
    #: Held-out batches per evaluation.
    eval_batches: int = 8
    #: Sequences per held-out batch.
    eval_batch_size: int = 32
    #: i.i.d. shards (True) or contiguous ranges (False); see diloco.data.make_shards.
    iid_shards: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.model, ModelConfig):
            raise ValueError(f"TrainSettings.model={self.model!r} is invalid: expected a ModelConfig")
        for name in ("batch_size", "eval_every", "eval_batches", "eval_batch_size"):
            check_int(f"TrainSettings.{name}", getattr(self, name), 1)
        check_int("TrainSettings.warmup_steps", self.warmup_steps, 0)
        check_float("TrainSettings.lr", self.lr, 0.0, math.inf, lo_open=True)
        check_float("TrainSettings.weight_decay", self.weight_decay, 0.0, math.inf)
        check_float("TrainSettings.min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        if self.grad_clip is not None:
            check_float("TrainSettings.grad_clip", self.grad_clip, 0.0, math.inf, lo_open=True)
        if self.schedule not in ("cosine", "constant"):
            raise ValueError(f"TrainSettings.schedule={self.schedule!r} is invalid: expected 'cosine' or 'constant'")
        b = self.betas
        if not (isinstance(b, tuple) and len(b) == 2 and all(isinstance(x, float) and 0.0 <= x < 1.0 for x in b)):
            raise ValueError(f"TrainSettings.betas={b!r} is invalid: expected a pair of floats in [0, 1)")

    def with_(self, **changes) -> "TrainSettings":
        """A copy with some fields changed (validated)."""
        return replace(self, **changes)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["betas"] = list(self.betas)
        return d


@dataclass
class BaselineResult:
    """What a reference trainer returns."""

    #: ``"single"``, ``"sync_dp"`` or ``"diloco"``.
    name: str
    #: Human-readable label for plots, e.g. ``"DiLoCo k=4 H=10"``.
    label: str
    #: Inner steps 1..steps.
    steps: list[int]
    #: Train loss at each step (mean over workers for k > 1).
    train_losses: list[float]
    #: Steps at which held-out loss was measured (step 0 = initial model).
    eval_steps: list[int]
    #: Held-out loss at ``eval_steps``.
    eval_losses: list[float]
    #: Held-out loss of the final model (DiLoCo: the final *global* model).
    final_eval_loss: float
    #: Number of synchronisations (sync DP: steps; DiLoCo: outer rounds; single: 0).
    syncs: int
    #: Bytes moved over all syncs: ``syncs * 2 * k * param_bytes``.
    bytes_moved: int
    #: Workers k.
    k: int
    #: DiLoCo inner steps per round (None for the others).
    H: int | None
    #: Distinct model parameters.
    num_params: int
    #: Wall-clock seconds of the run (not deterministic, unlike everything else).
    wall_s: float
    #: The settings and arguments used.
    config: dict
    #: Final model parameters (DiLoCo: the global model), detached copies; not in ``to_dict()``.
    final_state: dict[str, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)

    def to_dict(self) -> dict:
        """JSON-serialisable summary (everything except ``final_state``)."""
        d = {f: getattr(self, f) for f in self.__dataclass_fields__ if f != "final_state"}
        return copy.deepcopy(d)

    def loss_curve(self, smooth: int = 1) -> tuple[list[int], list[float]]:
        """``(steps, train_losses)``, optionally a trailing moving average over ``smooth`` steps."""
        if smooth <= 1:
            return list(self.steps), list(self.train_losses)
        out, acc = [], 0.0
        for i, v in enumerate(self.train_losses):
            acc += v
            if i >= smooth:
                acc -= self.train_losses[i - smooth]
            out.append(acc / min(i + 1, smooth))
        return list(self.steps), out

    def eval_curve(self) -> tuple[list[int], list[float]]:
        """``(eval_steps, eval_losses)``."""
        return list(self.eval_steps), list(self.eval_losses)


def comm_bytes_per_sync(k: int, num_param_bytes: int) -> int:
    """Bytes one sync moves: every worker sends one model-sized tensor and receives one."""
    return 2 * k * num_param_bytes


@functools.lru_cache(maxsize=2)
def default_corpus() -> Corpus:
    """The standard-library corpus (default size), built once per process."""
    return Corpus.from_stdlib()


def prepare(settings: TrainSettings | None, corpus: Corpus | None) -> tuple[TrainSettings, Corpus]:
    """The settings and corpus a trainer runs with: the defaults for ``None``, checked types otherwise."""
    s = settings if settings is not None else TrainSettings()
    if not isinstance(s, TrainSettings):
        raise TypeError(f"settings must be a TrainSettings, got {type(s).__name__}")
    c = corpus if corpus is not None else default_corpus()
    if not isinstance(c, Corpus):
        raise TypeError(f"corpus must be a diloco.data.Corpus, got {type(c).__name__}")
    return s, c


def check_int(name: str, value: object, minimum: int) -> None:
    """Raise ``ValueError`` unless ``value`` is an int (not a bool) ``>= minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} is invalid: expected an int >= {minimum}")


def check_float(
    name: str, value: object, lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False
) -> None:
    """Raise ``ValueError`` unless ``value`` is a finite number in the (half-)open or closed range."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if ok:
        ok = (value > lo if lo_open else value >= lo) and (value < hi if hi_open else value <= hi)
    if not ok:
        rng = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
        raise ValueError(f"{name}={value!r} is invalid: expected a finite number in {rng}")
