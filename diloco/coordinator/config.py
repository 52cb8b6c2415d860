"""The coordinator's configuration: the core's config plus what the driver owns."""

from __future__ import annotations

import dataclasses

import math
from dataclasses import dataclass, field

from diloco.core import ConfigError, DataPlane, FSMConfig, Mode
from diloco.coordinator.blame import DEFAULT_MAX_FAILED_ATTEMPTS
from diloco.coordinator.budget import check_budget
from diloco.coordinator.units import check_units
from diloco.outer import OuterConfig
from diloco.wire.sparse import DEFAULT_BETA, DEFAULT_CHUNK, DEFAULT_DENSITY, SparseFormat, SparseWire

#: ``CoordinatorConfig.merge`` values (``diloco server --merge``).
MERGES = ("auto", "uniform", "tokens")
#: Most members one heal may draw on at once (``heal_sources``).
MAX_HEAL_SOURCES = 8
from diloco.wire.messages import MAX_SYNC_EVERY, WIRE_DTYPE_NAMES


@dataclass(frozen=True, slots=True)
class CoordinatorConfig:
    fsm: FSMConfig = field(default_factory=FSMConfig)
    #: Outer optimizer; in async mode a "nesterov" default becomes delayed Nesterov.
    outer: OuterConfig = field(default_factory=OuterConfig)
    #: Workers heartbeat this often; a quarter of the timeout leaves room for three misses.
    heartbeat_interval_s: float = 0.0
    #: Refuse a contribution whose L2 norm (over all its tensors) exceeds this with
    #: ``update_too_large``; None: no limit (SPEC.md section 12, ``--max-update-norm``).
    max_update_norm: float | None = None
    #: Refuse a contribution whose L2 norm exceeds this many times the median of the fragment's
    #: recent accepted ones (``outliers.py``, ``--outlier-factor``); 0: off.
    outlier_factor: float = 10.0
    #: How pseudo-gradients (Submit) and sync Results travel: "fp32", "bf16" or "int8"
    #: (``diloco.wire.compression``; SPEC.md section 11, "Wire dtypes"). The outer step is
    #: fp32 whatever it is. ``diloco server`` defaults to ``DEFAULT_SERVER_WIRE_DTYPE``.
    wire_dtype: str = "fp32"
    #: DyLU (SPEC.md section 14, "DyLU"): tell each worker to take H_w = max(1, floor(v_w / v_max * H))
    #: inner steps per round, H = ``sync_every`` (required with it), v its measured speed.
    dylu: bool = False
    #: The reference H of DyLU: the fastest worker's inner steps per round (``diloco server --sync-every``).
    sync_every: int | None = None
    #: Collective plane: every group creation, collective and heal transfer on a worker is bounded
    #: by this (``--collective-timeout``); below the heartbeat timeout and the core's reduce
    #: timeout (SPEC.md C7). 0: a third of the heartbeat timeout.
    collective_timeout_s: float = 0.0
    #: How a round's contributions merge (``--merge``): "uniform" (their mean), "tokens" (weighted by the
    #: tokens each Submit says it trained on) or "auto" (tokens with DyLU, where workers take different
    #: numbers of inner steps; else uniform). SPEC.md section 12, "Token-weighted merging".
    merge: str = "auto"
    #: ``--token-budget``: stop as ``shutdown --save`` does once applied rounds trained on this many
    #: tokens (``budget.py``); None: no budget. The live budget (``set-token-budget``) is the coordinator's.
    token_budget: int | None = None
    #: ``--data-units N``: hand out the data as N work units per epoch, each finished exactly once
    #: (``units.py``; SPEC.md section 12, "Data work units"); 0: off. The hub, one fragment.
    data_units: int = 0
    #: ``--grace-window auto`` (SPEC.md P5): each window's length set from the recent arrivals
    #: (``grace_auto.py``), at most ``fsm.grace_window_s`` (``--grace-window-max``), where it starts.
    grace_auto: bool = False
    #: ``--wire-dtype sparse`` (SPEC.md section 11, "The sparse wire"): kept entries over a chunk's
    #: size (``--sparsity``), elements a chunk (``--sparse-chunk``) and the workers' accumulator decay
    #: (``--sparse-beta``). The outer step is the method's: plain SGD, momentum 0, ``outer.lr``.
    sparsity: float = DEFAULT_DENSITY
    sparse_chunk: int = DEFAULT_CHUNK
    sparse_beta: float = DEFAULT_BETA
    #: Collective plane: a joiner copies the run's state from up to this many members at once, each
    #: sending a part (``--heal-sources``; SPEC.md C6, "Heals from several sources").
    heal_sources: int = 1
    #: Collective plane: failed attempts in a row of one round by one group after which the run stops
    #: with a checkpoint instead of retrying forever (``blame.py``; ``--max-failed-attempts``).
    max_failed_attempts: int = DEFAULT_MAX_FAILED_ATTEMPTS

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
        m = self.max_update_norm
        if m is not None and (isinstance(m, bool) or not isinstance(m, (int, float)) or not math.isfinite(m)
                              or m <= 0):
            raise ConfigError("max_update_norm", m, "a finite number > 0, or None for no limit")
        if m is not None:
            object.__setattr__(self, "max_update_norm", float(m))
        f = self.outlier_factor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f) or (0 < f < 2) or f < 0:
            raise ConfigError("outlier_factor", f, "0 (off) or a finite number >= 2")
        object.__setattr__(self, "outlier_factor", float(f))
        try:
            check_budget(self.token_budget)
        except ValueError as exc:
            raise ConfigError("token_budget", self.token_budget, "an integer >= 1, or None") from exc
        try:
            check_units(self.data_units)
        except ValueError as exc:
            raise ConfigError("data_units", self.data_units, "an integer >= 0 (0: off)") from exc
        if self.data_units and (self.fsm.data_plane is DataPlane.COLLECTIVE or self.fsm.num_fragments != 1):
            raise ConfigError("data_units", self.data_units, "0 with the collective plane or several fragments "
                              "(a unit is one round's data of the whole model: use the hub, one fragment)")
        n = self.max_failed_attempts
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 1_000_000:
            raise ConfigError("max_failed_attempts", n, "an integer from 1 to 1,000,000")
        k = self.heal_sources
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_HEAL_SOURCES:
            raise ConfigError("heal_sources", k, f"an integer from 1 to {MAX_HEAL_SOURCES}")
        if self.merge not in MERGES:
            raise ConfigError("merge", self.merge, f"one of {list(MERGES)}")
        if self.merge == "tokens" and self.fsm.data_plane is DataPlane.COLLECTIVE:
            raise ConfigError("merge", self.merge, "uniform or auto on the collective plane (its members average "
                              "their pseudo-gradients themselves: use the hub for a token-weighted merge)")
        if not isinstance(self.wire_dtype, str) or self.wire_dtype not in WIRE_DTYPE_NAMES:
            raise ConfigError("wire_dtype", self.wire_dtype, f"one of {list(WIRE_DTYPE_NAMES)}")
        if not isinstance(self.dylu, bool):
            raise ConfigError("dylu", self.dylu, "true or false")
        h = self.sync_every
        if h is not None and (isinstance(h, bool) or not isinstance(h, int) or not 1 <= h <= MAX_SYNC_EVERY):
            raise ConfigError("sync_every", h, f"an integer from 1 to {MAX_SYNC_EVERY}, or None")
        if self.dylu and h is None:
            raise ConfigError("sync_every", h, "the reference H (inner steps per round of the fastest worker): "
                                               "DyLU needs it")
        ct = self.collective_timeout_s
        if isinstance(ct, bool) or not isinstance(ct, (int, float)) or not math.isfinite(ct) or ct < 0:
            raise ConfigError("collective_timeout_s", ct, "a finite number of seconds > 0 (0: the default)")
        if ct == 0:
            object.__setattr__(self, "collective_timeout_s", self.fsm.heartbeat_timeout_s / 3)
        if self.fsm.data_plane is DataPlane.COLLECTIVE:
            if not self.collective_timeout_s < self.fsm.heartbeat_timeout_s:
                raise ConfigError("collective_timeout_s", ct, f"less than the heartbeat timeout "
                                  f"({self.fsm.heartbeat_timeout_s} s): a collective that outlives it would "
                                  f"get healthy members declared dead")
            if not self.collective_timeout_s < self.fsm.reduce_timeout_s:
                raise ConfigError("collective_timeout_s", ct, f"less than the core's reduce timeout "
                                  f"({self.fsm.reduce_timeout_s} s)")
            if self.wire_dtype == "int4":
                raise ConfigError("wire_dtype", self.wire_dtype, "fp32, bf16, int8 or sparse on the collective plane "
                                  "(its all-gather of encoded pseudo-gradients knows no int4 yet: use the hub)")
        if self.wire_dtype == "sparse":
            self._check_sparse()
        if not isinstance(self.grace_auto, bool):
            raise ConfigError("grace_auto", self.grace_auto, "true or false")
        if self.grace_auto and not self.fsm.grace_window_s:
            raise ConfigError("grace_auto", self.grace_auto, "false without a grace window: auto sets each "
                              "window's length within grace_window_s (the ceiling), which is 0 (--mode async "
                              "with --grace-window auto sets one)")
        if self.fsm.mode is Mode.ASYNC and self.outer.name == "nesterov":
            object.__setattr__(self, "outer", dataclasses.replace(self.outer, name="delayed_nesterov"))

    def _check_sparse(self) -> None:
        """What the sparse wire composes with (SPEC.md section 11, "The sparse wire"), refused at startup."""
        try:
            self.sparse_wire
        except ValueError as exc:
            raise ConfigError("wire_dtype", self.wire_dtype, f"valid sparse settings ({exc})") from None
        if self.fsm.mode is not Mode.SYNC:
            raise ConfigError("wire_dtype", self.wire_dtype, "a sync run's wire (sparse rounds average every "
                              "member's payload once; in async mode each contribution is its own outer step)")
        if self.outer.name != "sgd" or self.outer.momentum != 0:
            raise ConfigError("outer", f"{self.outer.name} momentum {self.outer.momentum:g}",
                              "sgd with momentum 0 with --wire-dtype sparse: the method has no global momentum "
                              "(each worker's accumulator takes its place; leave --outer-optimizer out)")
        if self.token_weighted:
            raise ConfigError("merge", self.merge, "uniform with --wire-dtype sparse (the method averages its "
                              "payloads; --merge auto is uniform without --dylu)")

    @property
    def sparse_wire(self) -> SparseWire | None:
        """The sparse wire's settings, as every Welcome carries them; None for another wire dtype."""
        if self.wire_dtype != "sparse":
            return None
        return SparseWire(SparseFormat.of(self.sparsity, self.sparse_chunk), self.sparse_beta, self.outer.lr)

    def to_dict(self) -> dict:
        return {"fsm": self.fsm.to_dict(), "outer": self.outer.to_dict(),
                "heartbeat_interval_s": self.heartbeat_interval_s, "max_update_norm": self.max_update_norm,
                "outlier_factor": self.outlier_factor, "wire_dtype": self.wire_dtype, "dylu": self.dylu, "sync_every": self.sync_every,
                "collective_timeout_s": self.collective_timeout_s, "merge": self.merge,
                "token_budget": self.token_budget, "data_units": self.data_units,
                "max_failed_attempts": self.max_failed_attempts, "heal_sources": self.heal_sources,
                "sparsity": self.sparsity, "sparse_chunk": self.sparse_chunk, "sparse_beta": self.sparse_beta,
                "grace_auto": self.grace_auto}

    @property
    def token_weighted(self) -> bool:
        """True when contributions merge weighted by their tokens (``merge``; the hub plane only)."""
        if self.fsm.data_plane is DataPlane.COLLECTIVE:
            return False
        return self.merge == "tokens" or (self.merge == "auto" and self.dylu)

    @classmethod
    def from_dict(cls, d: dict) -> "CoordinatorConfig":
        # ``max_update_norm``, ``wire_dtype``, ``dylu`` and ``sync_every`` are newer than some
        # checkpoints: absent means no limit, fp32 (what those runs sent), no DyLU.
        return cls(fsm=FSMConfig.from_dict(d["fsm"]), outer=OuterConfig(**d["outer"]),
                   heartbeat_interval_s=d["heartbeat_interval_s"], max_update_norm=d.get("max_update_norm"),
                   outlier_factor=d.get("outlier_factor", 10.0), wire_dtype=d.get("wire_dtype", "fp32"), dylu=d.get("dylu", False),
                   sync_every=d.get("sync_every"), collective_timeout_s=d.get("collective_timeout_s", 0.0),
                   merge=d.get("merge", "uniform"), token_budget=d.get("token_budget"),
                   data_units=d.get("data_units", 0),
                   max_failed_attempts=d.get("max_failed_attempts", DEFAULT_MAX_FAILED_ATTEMPTS),
                   heal_sources=d.get("heal_sources", 1), sparsity=d.get("sparsity", DEFAULT_DENSITY),
                   sparse_chunk=d.get("sparse_chunk", DEFAULT_CHUNK), sparse_beta=d.get("sparse_beta", DEFAULT_BETA),
                   grace_auto=d.get("grace_auto", False))
