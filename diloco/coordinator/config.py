"""The coordinator's configuration: the core's config plus what the driver owns."""

from __future__ import annotations

from dataclasses import dataclass, field

from diloco.core import ConfigError, FSMConfig, Mode
from diloco.coordinator.outer import OuterConfig


@dataclass(frozen=True, slots=True)
class CoordinatorConfig:
    fsm: FSMConfig = field(default_factory=FSMConfig)
    #: Outer optimizer; in async mode a "nesterov" default becomes delayed Nesterov.
    outer: OuterConfig = field(default_factory=OuterConfig)
    #: Workers heartbeat this often; a quarter of the timeout leaves room for three misses.
    heartbeat_interval_s: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.fsm, FSMConfig):
            raise ConfigError("fsm", self.fsm, "an FSMConfig")
        if not isinstance(self.outer, OuterConfig):
            raise ConfigError("outer", self.outer, "an OuterConfig")
        if self.heartbeat_interval_s == 0.0:
            object.__setattr__(self, "heartbeat_interval_s", self.fsm.heartbeat_timeout_s / 4)
        if not 0 < self.heartbeat_interval_s < self.fsm.heartbeat_timeout_s:
            raise ConfigError("heartbeat_interval_s", self.heartbeat_interval_s,
                              f"a number of seconds in (0, heartbeat_timeout_s={self.fsm.heartbeat_timeout_s})")
        if self.fsm.mode is Mode.ASYNC and self.outer.name == "nesterov":
            object.__setattr__(self, "outer", OuterConfig("delayed_nesterov", self.outer.lr,
                                                          self.outer.momentum, self.outer.delay))

    def to_dict(self) -> dict:
        return {"fsm": self.fsm.to_dict(), "outer": self.outer.to_dict(),
                "heartbeat_interval_s": self.heartbeat_interval_s}

    @classmethod
    def from_dict(cls, d: dict) -> "CoordinatorConfig":
        return cls(fsm=FSMConfig.from_dict(d["fsm"]), outer=OuterConfig(**d["outer"]),
                   heartbeat_interval_s=d["heartbeat_interval_s"])
