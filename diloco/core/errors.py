"""Errors the core raises.

The core splits bad input at exactly one boundary (as h11 does):

* Remote mistakes -- a worker submitting a stale round, an unknown worker
  sending a heartbeat -- are *not* exceptions. They come back as a ``Reject``
  effect with a reason code, and the state does not change (SPEC.md R2).
* Driver mistakes -- the program embedding the core feeding it an impossible
  sequence (time going backwards, events after STOPPED, a config that makes
  no sense) -- raise a ``DriverError`` subclass, because only a bug in the
  driver can cause them and carrying on would hide it.
"""


class DilocoCoreError(Exception):
    """Base class of every error raised by ``diloco.core``."""


class ConfigError(DilocoCoreError, ValueError):
    """A configuration value is out of range: names the field, the value and what is allowed."""

    def __init__(self, field: str, value: object, allowed: str) -> None:
        self.field = field
        self.value = value
        self.allowed = allowed
        super().__init__(f"{field}={value!r} is invalid: expected {allowed}")


class DriverError(DilocoCoreError):
    """The driver used the machine in a way SPEC.md forbids (a bug in the caller)."""


class MachineStoppedError(DriverError):
    """An event was stepped into a machine that is already STOPPED (SPEC.md R12)."""


class ClockWentBackwardsError(DriverError):
    """``Ticked(now_s)`` carried a time earlier than the machine's clock (SPEC.md R9)."""


class UnknownEventError(DriverError):
    """``step`` was given something that is not one of the core's events."""


class InvalidEventError(UnknownEventError):
    """An event of a known type with a field only a driver bug could produce.

    ``Ticked(nan)``, ``Ticked(inf)``, ``WorkerLeft(cause="x")``, ``ShutdownRequested(kind="x")``:
    the driver builds these fields itself, unlike ids and round numbers, which a remote peer
    chose and which get a ``Reject`` instead (SPEC.md R2, R3). A subclass of
    ``UnknownEventError`` so that code catching that keeps working.
    """


class SnapshotError(DilocoCoreError, ValueError):
    """A snapshot is corrupt, from an unknown format version, or inconsistent."""
