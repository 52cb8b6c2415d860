"""What each message's header fields must be: one checker per field kind, one schema per message type.

A checker takes the decoded msgpack value and returns the Python value for
the message's dataclass, or raises ``FieldError`` saying what was expected.
``SCHEMAS`` lists, per message type, its fields in dataclass order (SPEC.md
section 11 lists the same); importing this module checks the two agree.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

from diloco.wire.messages import (
    HEARTBEAT_METRICS,
    MAX_SYNC_EVERY,
    MESSAGE_TYPES,
    WIRE_DTYPE_NAMES,
    Command,
    ErrorCode,
    TensorSpec,
)

#: Longest string field (worker ids, names, details) the decoder accepts.
MAX_STR_LEN = 1 << 16
#: Most members a ``ReduceOrder`` may name (the core's ``max_workers`` ceiling).
MAX_GROUP = 1_000_000


class FieldError(Exception):
    """A field's value is not what its schema expects; the message says what was expected."""


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise FieldError("a string")
    if len(v) > MAX_STR_LEN:
        raise FieldError(f"a string of at most {MAX_STR_LEN} characters")
    return v


def _int(v: Any) -> int:
    if not is_int(v):
        raise FieldError("an integer")
    return v


def _bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise FieldError("a boolean")
    return v


def _float(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise FieldError("a finite number")
    return float(v)


def _any_float(v: Any) -> float | None:
    """A number that may be NaN or infinite (``Submit.norm``: the coordinator refuses those itself,
    with ``non_finite``), or nil."""
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise FieldError("a number, or nil")
    return float(v)


def _norms(v: Any) -> tuple[float, ...]:
    if not isinstance(v, (list, tuple)) or len(v) > MAX_GROUP:
        raise FieldError(f"a list of at most {MAX_GROUP} numbers")
    return tuple(_float(x) for x in v)


def _tokens(v: Any) -> int | None:
    """``Submit.tokens``: an integer in 1..2^53 (exact as a float weight), or nil."""
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 1 << 53:
        raise FieldError("an integer in 1..2^53 (tokens trained on), or nil")
    return v


def _unit(v: Any) -> int | None:
    """A data work unit (``epoch * units + index``) or a count of units: an integer in 0..2^62, or nil."""
    if v is None:
        return None
    if not is_int(v) or not 0 <= v < 1 << 62:
        raise FieldError("an integer >= 0 (a data work unit), or nil")
    return v


def _sync_every(v: Any) -> int | None:
    """DyLU's H_w (``Welcome``/``HeartbeatReply.sync_every``): an integer in 1..MAX_SYNC_EVERY, or nil."""
    if v is None:
        return None
    if not is_int(v) or not 1 <= v <= MAX_SYNC_EVERY:
        raise FieldError(f"an integer from 1 to {MAX_SYNC_EVERY} (inner steps per round)")
    return v


def _int_tuple(v: Any) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(is_int(x) for x in v):
        raise FieldError("a list of integers")
    return tuple(v)


def _pair_tuple(v: Any) -> tuple[tuple[int, int], ...]:
    if not isinstance(v, list) or not all(
            isinstance(p, list) and len(p) == 2 and is_int(p[0]) and is_int(p[1]) for p in v):
        raise FieldError("a list of [fragment_id, round_id] integer pairs")
    return tuple((p[0], p[1]) for p in v)


def _names_tuple(v: Any) -> tuple[tuple[str, ...], ...]:
    if not isinstance(v, list) or not all(
            isinstance(g, list) and all(isinstance(n, str) for n in g) for g in v):
        raise FieldError("a list of lists of tensor names (strings)")
    return tuple(tuple(g) for g in v)


def _str_tuple(v: Any) -> tuple[str, ...]:
    if not isinstance(v, (list, tuple)) or len(v) > MAX_GROUP:
        raise FieldError(f"a list of at most {MAX_GROUP} strings")
    return tuple(_str(x) for x in v)


def _commits(v: Any) -> tuple[tuple[int, str], ...]:
    if not isinstance(v, (list, tuple)) or len(v) > 1024:
        raise FieldError("a list of at most 1024 [round_id, digest] pairs")
    out = []
    for item in v:
        if not isinstance(item, (list, tuple)) or len(item) != 2 or not is_int(item[0]) or item[0] < -1:
            raise FieldError("[round_id, digest] pairs (round_id an integer >= -1)")
        out.append((item[0], _str(item[1])))
    return tuple(out)


def _data_plane(v: Any) -> str:
    if v not in ("hub", "collective"):
        raise FieldError("'hub' or 'collective'")
    return v


def _port(v: Any) -> int:
    if not is_int(v) or not 0 <= v <= 65535:
        raise FieldError("a port number in 0..65535")
    return v


def _spec(v: Any) -> tuple[TensorSpec, ...]:
    expected = "a list of [name, shape, dtype] entries (string, list of integers >= 0, string)"
    if not isinstance(v, list):
        raise FieldError(expected)
    out = []
    for entry in v:
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)
                and isinstance(entry[1], list) and all(is_int(d) and d >= 0 for d in entry[1])
                and isinstance(entry[2], str)):
            raise FieldError(expected)
        out.append(TensorSpec(entry[0], tuple(entry[1]), entry[2]))
    return tuple(out)


def _enum(enum_type: type) -> Callable[[Any], Any]:
    values = [m.value for m in enum_type]

    def check(v: Any):
        try:
            return enum_type(v)
        except ValueError:
            raise FieldError(f"one of {values}") from None
    return check


def _wire_dtype(v: Any) -> str:
    if not isinstance(v, str) or v not in WIRE_DTYPE_NAMES:
        raise FieldError(f"a wire dtype, one of {list(WIRE_DTYPE_NAMES)}")
    return v


def _plain(v: Any, depth: int = 0) -> Any:
    """Admin arguments and replies: nil, bool, int, float, str, lists and str-keyed maps only."""
    if depth > 32:
        raise FieldError("plain data nested at most 32 deep")
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, list):
        return [_plain(x, depth + 1) for x in v]
    if isinstance(v, dict):
        if not all(isinstance(k, str) for k in v):
            raise FieldError("a map with string keys")
        return {k: _plain(x, depth + 1) for k, x in v.items()}
    raise FieldError(f"plain msgpack data (nil, bool, int, float, str, list, map), not {type(v).__name__}")


def _plain_map(v: Any) -> dict:
    if not isinstance(v, dict):
        raise FieldError("a map with string keys")
    return _plain(v)


def _metrics(v: Any) -> dict | None:
    """``Heartbeat.metrics``: a map of known keys (``HEARTBEAT_METRICS``) to finite numbers."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise FieldError(f"a map of metrics (keys {sorted(HEARTBEAT_METRICS)})")
    out = {}
    for key, value in v.items():
        kind = HEARTBEAT_METRICS.get(key) if isinstance(key, str) else None
        if kind is None:
            raise FieldError(f"a map of metrics with keys among {sorted(HEARTBEAT_METRICS)}; "
                             f"{key!r:.60} is not one")
        if kind[0] == "int":
            if not is_int(value) or value < 0 or value >= 1 << 62:
                raise FieldError(f"metric {key!r} to be an integer >= 0, not {value!r:.60}")
        else:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise FieldError(f"metric {key!r} to be a finite number, not {value!r:.60}")
            if key in ("steps_per_s", "train_steps_per_s") and value < 0:
                raise FieldError(f"metric {key!r} to be >= 0, not {value!r}")
            value = float(value)
        out[key] = value
    return out


#: Fields a sender may leave out (they are then None); encoders omit them when None.
OPTIONAL_FIELDS: dict[str, frozenset[str]] = {"Heartbeat": frozenset({"metrics"}),
                                               "Join": frozenset({"unit", "layout"}),
                                               "Submit": frozenset({"tokens", "unit", "norm"}),
                                               "Welcome": frozenset({"sync_every", "data_units", "unit", "layout"}),
                                               "Result": frozenset({"unit"}),
                                               "HeartbeatReply": frozenset({"sync_every"})}

#: Marks a field that carries tensors: its frames follow the header, listed in the tensor table.
TENSOR_FIELD = object()

#: Per message type: field name -> checker (or TENSOR_FIELD). SPEC.md section 11 lists the same.
SCHEMAS: dict[str, dict[str, Any]] = {
    "Join": {"worker_id": _str, "protocol_version": _int, "spec": _spec, "params": TENSOR_FIELD,
             "holds_params": _bool, "held_rounds": _int_tuple,
             "held_digests": _str_tuple, "unit": _unit, "layout": _str},
    "Heartbeat": {"worker_id": _str, "metrics": _metrics},
    "Submit": {"worker_id": _str, "fragment_id": _int, "round_id": _int, "tensors": TENSOR_FIELD,
               "wire_dtype": _wire_dtype, "scales": TENSOR_FIELD, "tokens": _tokens,
               "unit": _unit, "norm": _any_float},
    "Leave": {"worker_id": _str},
    "Welcome": {"worker_id": _str, "round_ids": _int_tuple, "parked": _pair_tuple, "mode": _str,
                "fragments": _names_tuple, "min_workers": _int, "below_min_workers": _bool,
                "heartbeat_interval_s": _float, "params": TENSOR_FIELD, "wire_dtype": _wire_dtype,
                "sync_every": _sync_every, "data_plane": _data_plane, "store_port": _port, "heal_source": _str,
                "heal_prefix": _str, "outer": _plain_map, "collective_timeout_s": _float,
                "committed": _commits, "data_units": _unit, "unit": _unit, "layout": _str,
                "more_heal_sources": _str_tuple, "more_heal_prefixes": _str_tuple, "wire_options": _plain_map},
    "HeartbeatReply": {"below_min_workers": _bool, "min_workers": _int, "phase": _str,
                       "command": _enum(Command), "sync_every": _sync_every},
    "Accepted": {"fragment_id": _int, "round_id": _int},
    "Result": {"fragment_id": _int, "round_id": _int, "outcome": _str, "next_round_id": _int,
               "params": TENSOR_FIELD, "delta": _bool, "wire_dtype": _wire_dtype, "scales": TENSOR_FIELD,
               "digest": _str, "unit": _unit},
    "Error": {"code": _enum(ErrorCode), "detail": _str, "in_reply_to": _str},
    "AdminRequest": {"command": _str, "args": _plain_map},
    "AdminReply": {"ok": _bool, "data": _plain_map, "error": _str},
    "ReduceOrder": {"fragment_id": _int, "round_id": _int, "attempt": _int, "group": _str_tuple, "prefix": _str,
                    "norms": _norms, "gather": _bool},
    "ReduceReport": {"worker_id": _str, "fragment_id": _int, "round_id": _int, "attempt": _int, "ok": _bool,
                     "digest": _str, "detail": _str, "blame": _str_tuple, "mean_refused": _bool},
    "ReduceAbort": {"fragment_id": _int, "round_id": _int, "attempt": _int, "reason": _str},
    "HealOrder": {"joiner": _str, "prefix": _str},
}
_CLASSES: dict[str, type] = {cls.__name__: cls for cls in MESSAGE_TYPES}
assert set(SCHEMAS) == set(_CLASSES), "every message type needs a wire schema"
for _name, _cls in _CLASSES.items():
    assert [f.name for f in dataclasses.fields(_cls)] == list(SCHEMAS[_name]), _name


def message_class(type_name: str) -> type:
    """The message dataclass a header's ``type`` names (one of ``SCHEMAS``)."""
    return _CLASSES[type_name]
