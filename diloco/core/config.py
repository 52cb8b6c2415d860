"""The round state machine's configuration: one validated, frozen dataclass.

Every limit on something that grows is named here ("a
limit on everything that grows").
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass

from diloco.core.errors import ConfigError


class Mode(str, enum.Enum):
    """How contributions become outer steps."""

    #: All live members contribute to a round; the round applies once, as one outer step (DiLoCo).
    SYNC = "sync"
    #: Each contribution applies on its own as it arrives (Async Local-SGD, Liu et al. 2024).
    ASYNC = "async"


class DataPlane(str, enum.Enum):
    """How a round's pseudo-gradients are combined, and where the outer step runs (SPEC.md C1)."""

    #: Every pseudo-gradient goes to the coordinator, which runs the outer step and sends params back.
    HUB = "hub"
    #: Members all-reduce among themselves and each runs the same outer step; the coordinator only
    #: orders the reduce and commits on a unanimous vote (no model on the coordinator).
    COLLECTIVE = "collective"


# Hard ceilings: a config above these is a mistake, not a big run.
MAX_WORKERS_CEILING = 1_000_000
MAX_FRAGMENTS_CEILING = 1024


@dataclass(frozen=True, slots=True)
class FSMConfig:
    """Configuration of one run's round state machine. Validated on construction."""

    #: The quorum: no outer step applies with fewer contributors than this (SPEC.md R5).
    min_workers: int = 1
    #: ``sync`` (rounds with a barrier) or ``async`` (each contribution applies on its own).
    mode: Mode = Mode.SYNC
    #: Streaming DiLoCo fragments F; each has its own round counter and barrier (SPEC.md R11).
    num_fragments: int = 1
    #: A member not heard from for longer than this is declared dead on the next tick (SPEC.md R9).
    heartbeat_timeout_s: float = 30.0
    #: Most live members at once; further joins are rejected with TOO_MANY_WORKERS.
    max_workers: int = 10_000
    #: Async: a contribution based on a version more than this many versions old is rejected STALE.
    max_staleness: int = 8
    #: Async: most contributions held (below quorum) per fragment; more are rejected HELD_LIMIT.
    max_held_per_fragment: int = 1024
    #: Longest accepted ``worker_id`` in characters.
    max_worker_id_len: int = 128
    #: ``hub`` or ``collective`` (SPEC.md C1); collective runs in sync mode only.
    data_plane: DataPlane = DataPlane.HUB
    #: Collective: an attempt whose group has not all reported this long after the order aborts (C5).
    reduce_timeout_s: float = 120.0
    #: Async: contributions accepted within this many seconds of the first pending one are merged into
    #: one outer step (SPEC.md P5); 0: one outer step per contribution. Async mode only.
    grace_window_s: float = 0.0

    def __post_init__(self) -> None:
        try:
            mode = Mode(self.mode)
        except ValueError:
            raise ConfigError("mode", self.mode, "'sync' or 'async'") from None
        object.__setattr__(self, "mode", mode)
        try:
            plane = DataPlane(self.data_plane)
        except ValueError:
            raise ConfigError("data_plane", self.data_plane, "'hub' or 'collective'") from None
        if plane is DataPlane.COLLECTIVE and mode is not Mode.SYNC:
            raise ConfigError("data_plane", plane.value, "'hub' in async mode (each async contribution "
                              "is its own outer step on the coordinator; the collective plane reduces rounds)")
        object.__setattr__(self, "data_plane", plane)
        _check_int("max_workers", self.max_workers, 1, MAX_WORKERS_CEILING)
        _check_int("min_workers", self.min_workers, 1, self.max_workers)
        _check_int("num_fragments", self.num_fragments, 1, MAX_FRAGMENTS_CEILING)
        _check_int("max_staleness", self.max_staleness, 0, 1_000_000)
        _check_int("max_held_per_fragment", self.max_held_per_fragment, 1, 1_000_000)
        _check_int("max_worker_id_len", self.max_worker_id_len, 1, 4096)
        timeout = self.heartbeat_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0 or timeout == float("inf"):
            raise ConfigError("heartbeat_timeout_s", timeout, "a finite number of seconds > 0")
        object.__setattr__(self, "heartbeat_timeout_s", float(timeout))
        reduce_timeout = self.reduce_timeout_s
        if (isinstance(reduce_timeout, bool) or not isinstance(reduce_timeout, (int, float))
                or not reduce_timeout > 0 or reduce_timeout == float("inf")):
            raise ConfigError("reduce_timeout_s", reduce_timeout, "a finite number of seconds > 0")
        object.__setattr__(self, "reduce_timeout_s", float(reduce_timeout))
        window = self.grace_window_s
        if (isinstance(window, bool) or not isinstance(window, (int, float)) or not window >= 0
                or window == float("inf")):
            raise ConfigError("grace_window_s", window, "a finite number of seconds >= 0 (0: no window)")
        if window > 0 and mode is not Mode.ASYNC:
            raise ConfigError("grace_window_s", window, "0 in sync mode (a sync round already merges every "
                              "member's contribution; the grace window is for --mode async)")
        if window > self.heartbeat_timeout_s:
            raise ConfigError("grace_window_s", window, f"at most heartbeat_timeout_s={self.heartbeat_timeout_s:g} "
                              f"(a window holds every fast worker idle; past the heartbeat timeout it would hold "
                              f"them longer than a death takes to notice)")
        object.__setattr__(self, "grace_window_s", float(window))

    def to_dict(self) -> dict:
        """Plain, msgpack-serialisable form (used by snapshots)."""
        d = asdict(self)
        d["mode"] = self.mode.value
        d["data_plane"] = self.data_plane.value
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "FSMConfig":
        """Inverse of :meth:`to_dict`; unknown keys are an error, not silently ignored."""
        if not isinstance(d, dict):
            raise ConfigError("config", d, "a dict of FSMConfig fields")
        known = set(cls.__dataclass_fields__)
        # repr-sorted: keys from a corrupt snapshot may be of mixed, unorderable types.
        unknown = sorted((k for k in d if not (isinstance(k, str) and k in known)), key=repr)
        if unknown:
            raise ConfigError(repr(unknown[0]) if not isinstance(unknown[0], str) else unknown[0],
                              d[unknown[0]], f"one of the fields {sorted(known)}")
        return cls(**d)


def validate_min_workers(value: object, max_workers: int) -> int:
    """The one check for a ``min_workers`` value, used by the config and by run-time changes."""
    _check_int("min_workers", value, 1, max_workers)
    return value  # type: ignore[return-value]


def _check_int(field: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(field, value, f"an integer in {low}..{high}")
