"""Events and effects as plain records, for trace validation (SPEC.md section 12, "Trace validation").

The coordinator's audit log records every event it feeds the machine (the
driver's clock included: time enters only as ``Ticked``) and the effects the
machine answered with. ``diloco check-log`` rebuilds each event from its
record, steps a pure ``RoundFSM`` restored from the run's logged snapshot,
and compares the effects it gets with the logged ones: the live coordinator
is proven to be the machine, run by run. Pure: no I/O; records are JSON-able.

An event record is ``{"type": NAME, FIELD: VALUE, ...}``. Values a peer chose
may be of any type the wire decodes (an id that is not a string is refused by
the machine, R3); bytes become ``{"__bytes__": HEX}`` and come back as bytes,
so the machine sees the same value on replay. An effect record is
``[NAME, FIELD VALUE, ...]`` in field order, enums as their values, tuples as
lists, and a ``Reject``'s human-readable ``detail`` left out (it quotes
values in Python's spelling).
"""

from __future__ import annotations

import enum
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from diloco.core import effects as _effects
from diloco.core.events import EVENT_TYPES, ShutdownRequested, WorkerLeft
from diloco.core.reasons import LeaveCause, ShutdownKind

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_EVENTS = {cls.__name__: cls for cls in EVENT_TYPES}
#: Event fields that are enums (every other field is a plain value).
_ENUM_FIELDS = {(WorkerLeft, "cause"): LeaveCause, (ShutdownRequested, "kind"): ShutdownKind}
#: Effect fields left out of a record.
_UNCOMPARED = {(_effects.Reject, "detail")}


class TraceError(ValueError):
    """A record that is not an event this machine knows."""


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (bytes, bytearray)):
        return {"__bytes__": bytes(value).hex()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {"__items__": [[_plain(k), _plain(v)] for k, v in value.items()]}
    return value


def _unplain(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__bytes__"}:
            return bytes.fromhex(value["__bytes__"])
        if set(value) == {"__items__"}:
            out = {}
            for k, v in value["__items__"]:
                k = _unplain(k)
                out[tuple(k) if isinstance(k, list) else k] = _unplain(v)
            return out
    if isinstance(value, list):
        return [_unplain(v) for v in value]
    return value


def event_record(event: DataclassInstance) -> dict:
    """``event`` as a JSON-able record."""
    record = {"type": type(event).__name__}
    for f in fields(event):
        record[f.name] = _plain(getattr(event, f.name))
    return record


def event_from_record(record: object) -> object:
    """The event ``record`` describes; ``TraceError`` if it is not one."""
    if not isinstance(record, dict) or record.get("type") not in _EVENTS:
        raise TraceError(f"not an event record: {record!r:.200}")
    cls = _EVENTS[record["type"]]
    kwargs = {}
    for f in fields(cls):
        if f.name not in record:
            continue  # a default
        value = _unplain(record[f.name])
        enum_type = _ENUM_FIELDS.get((cls, f.name))
        if enum_type is not None:
            try:
                value = enum_type(value)
            except ValueError:
                raise TraceError(f"{cls.__name__}.{f.name}={value!r} is not a {enum_type.__name__}") from None
        kwargs[f.name] = value
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise TraceError(f"{cls.__name__} record {record!r:.200}: {exc}") from None


def effect_record(effect: DataclassInstance) -> list:
    """``effect`` as a JSON-able record (see the module doc)."""
    cls = type(effect)
    return [cls.__name__] + [_plain(getattr(effect, f.name)) for f in fields(effect)
                             if (cls, f.name) not in _UNCOMPARED]


def effect_records(effects: list) -> list[list]:
    return [effect_record(e) for e in effects]
