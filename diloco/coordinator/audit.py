"""The coordinator's audit log: ``CHECKPOINT_DIR/events.jsonl``, one JSON object per line.

An observer of the ``Coordinator`` (``on_event(kind, now_s, info)``) that keeps
the lines of the current step in memory; the runner calls ``flush()`` after it
has made the step's rounds durable and before it sends any of the step's
messages (SPEC.md section 5), so a line describing a round is on disk (fsync'd)
before any worker hears of that round. The format is in SPEC.md section 12,
"Audit log". Only appended to; a torn last line left by a crash is ended with
a newline before the next line is written, so every later line parses.
"""

from __future__ import annotations

import json
import os
import pathlib
import time

from diloco.coordinator.service import Coordinator

FILENAME = "events.jsonl"
#: Coordinator events that get a line (membership, quorum, rounds, refusals, discards, the stop, data units), and
#: every input of the machine with its effects (trace validation, ``tracecheck.py``).
KINDS = frozenset({"join", "left", "dead", "quorum", "apply", "step_refused", "discard", "reconciled", "stop",
                   "outlier", "input", "unit", "unit_back", "unit_mismatch", "units_finished", "evicted",
                   "stuck"})


def last_incarnation(path: pathlib.Path) -> int:
    """The incarnation of the last well-formed line of an audit log (0 if none)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 65536))
            tail = f.read()
    except FileNotFoundError:
        return 0
    for raw in reversed(tail.splitlines()):
        try:
            value = json.loads(raw).get("incarnation")
        except (ValueError, AttributeError):
            continue
        if isinstance(value, int):
            return value
    return 0


def last_run_id(path: pathlib.Path) -> str | None:
    """The ``run_id`` of the last ``start`` line that has one (None if none): a resumed run keeps its id."""
    found = None
    try:
        with open(path, "rb") as f:
            for raw in f:
                if b'"run_id"' not in raw:
                    continue
                try:
                    value = json.loads(raw).get("run_id")
                except (ValueError, AttributeError):
                    continue
                if isinstance(value, str):
                    found = value
    except FileNotFoundError:
        return None
    return found


class AuditLog:
    """Owns ``events.jsonl``; call it as the coordinator's observer, ``flush()`` before sending."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = pathlib.Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / FILENAME
        self.coordinator: Coordinator | None = None
        self.incarnation = 0
        self._base_rounds = 0
        self._pending: list[str] = []
        #: A queued line other than an input: the flush fsyncs (inputs alone are only written, see ``flush``).
        self._decisions = False
        self._file = open(self.path, "ab")
        if self._file.tell() > 0:
            with open(self.path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    self._file.write(b"\n")  # a crash tore the last line: end it, keep the rest parseable

    def attach(self, coordinator: Coordinator) -> int:
        """Follow ``coordinator``; its incarnation becomes one more than any this log or its checkpoint saw."""
        self.coordinator = coordinator
        coordinator.incarnation = max(coordinator.incarnation, last_incarnation(self.path) + 1)
        self.incarnation = coordinator.incarnation
        self._base_rounds = coordinator.fsm.rounds_applied - coordinator.stats.rounds_applied
        coordinator.trace_inputs = True
        return self.incarnation

    def record(self, event: str, **info) -> None:
        """Queue one line (written by the next ``flush``)."""
        c = self.coordinator
        line = {"t": round(time.time(), 6), "incarnation": self.incarnation, "event": event,
                "rounds_applied": self._base_rounds + c.stats.rounds_applied if c is not None else 0}
        if event == "apply" and c is not None:
            line["min_workers"] = c.fsm.min_workers
        line.update(info)
        self._pending.append(json.dumps(line, default=str, separators=(",", ":")))
        self._decisions = self._decisions or event != "input"

    def record_start(self, **info) -> None:
        """The incarnation's first line: ``info`` and the machine's snapshot, where ``check-log`` starts
        replaying this incarnation's inputs (``tracecheck.py``)."""
        self.record("start", **info, fsm=self.coordinator.fsm.snapshot())

    def __call__(self, kind: str, now_s: float, info: dict) -> None:
        if kind in KINDS:
            self.record(kind, **info)

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def flush(self) -> None:
        """Append the queued lines; fsync the file when one of them is a decision (nothing to do when none
        is queued). A step of inputs alone (a heartbeat) is written but not fsync'd: the next decision's
        fsync covers it, and a crash before then loses only lines no decision depends on."""
        if not self._pending:
            return
        data = ("\n".join(self._pending) + "\n").encode()
        self._pending.clear()
        self._file.write(data)
        self._file.flush()
        if self._decisions:
            os.fsync(self._file.fileno())
        self._decisions = False

    def discard(self) -> None:
        """Drop the queued lines (their step could not be made durable)."""
        self._pending.clear()
        self._decisions = False

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self._file.close()


class Tee:
    """Calls several observers in order (the server's printer and its audit log)."""

    def __init__(self, *observers) -> None:
        self.observers = [o for o in observers if o is not None]

    def __call__(self, kind: str, now_s: float, info: dict) -> None:
        for observer in self.observers:
            observer(kind, now_s, info)
