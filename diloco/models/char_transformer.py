"""A small causal character (byte) transformer for demos, tests and benchmarks.

The default configuration (d_model 64, 2 layers, 4 heads, seq_len 128, vocab
256, tied input/output embeddings) has ~117k parameters, close to the 116k
calibration model of benchmarks/README.md (bench_training), and runs one AdamW inner step at
batch 32 in well under 0.15 s on one CPU thread.

Architecture: token + learned position embeddings, ``n_layers`` pre-LayerNorm
blocks (causal multi-head self-attention via
``nn.functional.scaled_dot_product_attention(is_causal=True)``, then a GELU
MLP), a final LayerNorm, and a linear head tied to the token embedding.

Determinism: :func:`build_model` initialises from a private
``torch.Generator`` seeded by ``seed``; it neither reads nor advances the
global RNG, and dropout is not used, so training is deterministic given the
data order.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["ModelConfig", "CharTransformer", "build_model", "count_params", "param_bytes", "evaluate_loss", "eval_windows"]


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a :class:`CharTransformer`. Validated on construction (``ValueError`` naming the field)."""

    #: Vocabulary size; 256 = raw bytes (diloco.data.VOCAB_SIZE).
    vocab_size: int = 256
    #: Longest context (tokens); also the size of the position table.
    seq_len: int = 128
    #: Width of the residual stream.
    d_model: int = 64
    #: Number of transformer blocks.
    n_layers: int = 2
    #: Attention heads per block; must divide ``d_model``.
    n_heads: int = 4
    #: MLP hidden width as a multiple of ``d_model``.
    mlp_ratio: int = 4
    #: Share the token embedding with the output head (saves vocab*d_model params).
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        for name, lo, hi in (
            ("vocab_size", 2, 1 << 20),
            ("seq_len", 1, 1 << 16),
            ("d_model", 1, 1 << 14),
            ("n_layers", 1, 256),
            ("n_heads", 1, 1024),
            ("mlp_ratio", 1, 64),
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ValueError(f"ModelConfig.{name}={v!r} is invalid: expected an int in [{lo}, {hi}]")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"ModelConfig.n_heads={self.n_heads!r} is invalid: expected a divisor of d_model={self.d_model}"
            )
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"ModelConfig.tie_embeddings={self.tie_embeddings!r} is invalid: expected a bool")

    def to_dict(self) -> dict:
        """Plain dict form (for logs and checkpoints)."""
        return asdict(self)


class _Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.fc_out = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.n_heads
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))


class CharTransformer(nn.Module):
    """Causal byte-level transformer: ``forward(tokens [B, T]) -> logits [B, T, vocab]``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
        self.blocks = nn.ModuleList(_Block(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.head.weight = self.tok_emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [batch, seq_len], got shape {tuple(tokens.shape)}")
        t = tokens.shape[1]
        if t > self.config.seq_len:
            raise ValueError(f"sequence length {t} exceeds ModelConfig.seq_len={self.config.seq_len}")
        x = self.tok_emb(tokens) + self.pos_emb.weight[:t]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy (nats per token)."""
        logits = self(inputs)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@torch.no_grad()
def _init_weights(model: CharTransformer, gen: torch.Generator) -> None:
    # GPT-2 style: N(0, 0.02) for embeddings and linears, residual output
    # projections scaled by 1/sqrt(2 * n_layers), zero biases, unit LayerNorms.
    resid_std = 0.02 / math.sqrt(2 * model.config.n_layers)
    for name, p in model.named_parameters():  # named_parameters() yields tied weights once
        if name.endswith(".bias"):
            p.zero_()
        elif ".ln" in name or name.startswith("ln_"):
            p.fill_(1.0)
        else:
            std = resid_std if name.endswith(("proj.weight", "fc_out.weight")) else 0.02
            p.copy_(torch.randn(p.shape, generator=gen) * std)


def build_model(config: ModelConfig | None = None, seed: int = 0) -> CharTransformer:
    """A freshly initialised model; the same ``(config, seed)`` gives bit-identical parameters."""
    config = config if config is not None else ModelConfig()
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
    # nn.Linear/nn.Embedding constructors draw from the global RNG; fork it so
    # building a model never perturbs the caller's random stream.
    with torch.random.fork_rng(devices=[]):
        model = CharTransformer(config)
    _init_weights(model, torch.Generator().manual_seed(int(seed)))
    return model


def count_params(model: nn.Module) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())


def param_bytes(model: nn.Module) -> int:
    """Bytes of all distinct parameters (what one full-model pseudo-gradient or gradient weighs)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def eval_windows(eval_tokens: torch.Tensor, seq_len: int, n_windows: int) -> torch.Tensor:
    """Start offsets of ``n_windows`` evenly spaced windows covering ``eval_tokens`` (no RNG)."""
    high = int(eval_tokens.numel()) - seq_len - 1  # last valid start
    if high < 0:
        raise ValueError(f"eval set has {eval_tokens.numel()} tokens; need at least seq_len + 1 = {seq_len + 1}")
    return torch.linspace(0, high, n_windows).round().long()


@torch.no_grad()
def evaluate_loss(
    model: CharTransformer,
    eval_tokens: torch.Tensor,
    *,
    seq_len: int | None = None,
    batch_size: int = 32,
    num_batches: int = 8,
) -> float:
    """Mean held-out cross-entropy (nats/token) over a fixed set of windows.

    The windows are ``batch_size * num_batches`` evenly spaced offsets across
    ``eval_tokens`` (:func:`eval_windows`), so the same model and eval set
    always give the same number and the whole held-out text is covered.
    Runs in eval mode without gradients and restores the model's mode.
    """
    seq_len = seq_len if seq_len is not None else model.config.seq_len
    starts = eval_windows(eval_tokens, seq_len, batch_size * num_batches)
    offsets = torch.arange(seq_len + 1)
    was_training = model.training
    model.eval()
    try:
        total = 0.0
        for i in range(num_batches):
            w = eval_tokens[starts[i * batch_size : (i + 1) * batch_size, None] + offsets].long()
            total += float(model.loss(w[:, :-1], w[:, 1:]))
        return total / num_batches
    finally:
        model.train(was_training)
