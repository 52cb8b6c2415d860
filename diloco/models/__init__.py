"""Models for demos, tests and benchmarks (plain torch.nn)."""

from diloco.models.char_transformer import (
    CharTransformer,
    ModelConfig,
    build_model,
    count_params,
    eval_windows,
    evaluate_loss,
    param_bytes,
)

__all__ = [
    "CharTransformer",
    "ModelConfig",
    "build_model",
    "count_params",
    "eval_windows",
    "evaluate_loss",
    "param_bytes",
]
