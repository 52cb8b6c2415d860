"""The outer optimizer's old home: it lives in ``diloco.outer`` (the collective plane's members run it too)."""

from diloco.outer import DelayedNesterov, OPTIMIZERS, OuterConfig, OuterConfigError, build_outer_optimizer

__all__ = ["DelayedNesterov", "OPTIMIZERS", "OuterConfig", "OuterConfigError", "build_outer_optimizer"]
