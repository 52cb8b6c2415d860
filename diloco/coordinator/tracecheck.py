"""Trace validation: replay a run's audit log through the pure machine (``diloco check-log DIR``).

The audit log (``audit.py``) holds, per coordinator incarnation, a ``start`` line
with the machine's snapshot, then every event the live coordinator fed its
machine (``input`` lines: the event, with the driver's clock as ``Ticked``, and
the effects the machine answered) and the decisions it acted on (``apply``,
``dead``, ``discard``, ``stop`` lines). ``check_log`` restores a pure
``RoundFSM`` from each ``start`` snapshot, steps it through the logged inputs
in order and checks that

1. the effects it returns are exactly the logged ones (``diloco.core.trace``
   records): the live machine is the pure machine, and its driver fed it
   nothing it did not log;
2. every decision line is one the machine made for that input: an ``apply``
   line's fragment, round and contributors are an ``ApplyRound``'s, a ``dead``
   line a ``DeclareDead``'s, and so on, and no such effect lacks its line.

The first divergence is reported with its line number and context. The end of
an incarnation may be torn (a crash): a last line that does not parse, or the
decision lines of its last step missing, are not divergences.
"""

from __future__ import annotations

import json
import os
import pathlib
from dataclasses import dataclass, field

from diloco.core import ApplyRound, DeclareDead, DiscardContribution, RoundFSM, StopRun
from diloco.core import trace
from diloco.core.errors import DilocoCoreError, SnapshotError

#: Decision lines and the effect each must match: line -> (effect type, key of the line, key of the effect).
_DECISIONS = {
    "apply": ApplyRound,
    "dead": DeclareDead,
    "discard": DiscardContribution,
    "stop": StopRun,
}


def _line_key(line: dict) -> tuple:
    kind = line["event"]
    if kind == "apply":
        return (line.get("fragment_id"), line.get("round_id"), tuple(line.get("contributors") or ()))
    if kind == "dead":
        return (line.get("worker_id"),)
    if kind == "discard":
        return (line.get("worker_id"), line.get("fragment_id"), line.get("round_id"), line.get("reason"))
    return (line.get("kind"),)


def _effect_key(effect) -> tuple:
    if isinstance(effect, ApplyRound):
        return (effect.fragment_id, effect.round_id, tuple(effect.contributors))
    if isinstance(effect, DeclareDead):
        return (effect.worker_id,)
    if isinstance(effect, DiscardContribution):
        return (effect.worker_id, effect.fragment_id, effect.round_id, effect.reason.value)
    return (effect.kind.value,)


@dataclass
class Divergence:
    line_no: int
    what: str
    context: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        text = f"line {self.line_no}: {self.what}"
        if self.context:
            text += "\n  context (the lines before it):\n" + "\n".join(f"    {c}" for c in self.context)
        return text


@dataclass
class Report:
    path: pathlib.Path
    incarnations: int = 0
    inputs: int = 0
    decisions: int = 0
    #: Incarnations whose ``start`` line has no snapshot (logs written before trace validation): not checked.
    unchecked_incarnations: list[int] = field(default_factory=list)
    torn_lines: int = 0
    divergence: Divergence | None = None

    @property
    def ok(self) -> bool:
        return self.divergence is None and self.inputs > 0

    def summary(self) -> str:
        if self.divergence is not None:
            return f"DIVERGED: {self.path}: {self.divergence}"
        if not self.inputs:
            return (f"NOTHING CHECKED: {self.path} has no input lines (a log from before trace validation, "
                    f"or no run)")
        extra = ""
        if self.unchecked_incarnations:
            extra += f"; incarnations {self.unchecked_incarnations} have no snapshot and were not checked"
        if self.torn_lines:
            extra += f"; {self.torn_lines} torn line(s) skipped (a crash)"
        return (f"OK: {self.path}: {self.inputs} inputs replayed through the pure machine over "
                f"{self.incarnations} incarnation(s), every effect and {self.decisions} decision lines as "
                f"logged{extra}")


def check_log(location: str | os.PathLike) -> Report:
    """Replay the audit log at ``location`` (its directory or the file); the report says if it diverged."""
    path = pathlib.Path(location)
    if path.is_dir():
        path = path / "events.jsonl"
    report = Report(path)
    try:
        raw_lines = path.read_bytes().splitlines()
    except OSError as exc:
        report.divergence = Divergence(0, f"cannot read the audit log: {exc}")
        return report
    fsm: RoundFSM | None = None
    pending: list = []  # decision effects of the last input with no line yet
    pending_line = 0
    recent: list[str] = []
    incarnation = None

    def diverge(line_no: int, what: str) -> Report:
        report.divergence = Divergence(line_no, what, recent[-6:])
        return report

    for line_no, raw in enumerate(raw_lines, 1):
        try:
            line = json.loads(raw)
        except ValueError:
            report.torn_lines += 1  # a crash tore it; audit.py ends it with a newline
            continue
        if not isinstance(line, dict) or "event" not in line:
            report.torn_lines += 1
            continue
        kind = line["event"]
        if line.get("incarnation") != incarnation or kind == "start":
            # A new incarnation: what its predecessor's last step left unlogged is the crash's.
            pending = []
            incarnation = line.get("incarnation")
            if kind == "start":
                report.incarnations += 1
                fsm = None
                if "fsm" in line:
                    try:
                        fsm = RoundFSM.restore(line["fsm"])
                    except (SnapshotError, KeyError, TypeError, ValueError) as exc:
                        return diverge(line_no, f"the start line's snapshot does not restore: {exc}")
                else:
                    report.unchecked_incarnations.append(incarnation)
        if kind == "input" and fsm is not None:
            if pending:
                return diverge(pending_line, f"the machine decided {trace.effect_record(pending[0])} for the input "
                                             f"on this line, but the log has no line for it")
            try:
                event = trace.event_from_record(line.get("in"))
            except trace.TraceError as exc:
                return diverge(line_no, f"an input line the machine cannot read: {exc}")
            try:
                effects = fsm.step(event)
            except DilocoCoreError as exc:
                return diverge(line_no, f"the pure machine refuses input {line.get('in')}: {exc!r}")
            got = json.loads(json.dumps(trace.effect_records(effects)))
            report.inputs += 1
            if got != line.get("out"):
                return diverge(line_no, f"for input {line.get('in')} the pure machine answers {got}, the live "
                                        f"coordinator logged {line.get('out')}")
            pending = [e for e in effects if type(e) in _DECISIONS.values()]
            pending_line = line_no
        elif kind in _DECISIONS and fsm is not None:
            want = _DECISIONS[kind]
            match = next((e for e in pending if isinstance(e, want) and _effect_key(e) == _line_key(line)), None)
            if match is None:
                return diverge(line_no, f"the log says {kind} {_line_key(line)}, which the machine did not decide "
                                        f"for the input on line {pending_line} (it decided "
                                        f"{[trace.effect_record(e) for e in pending] or 'nothing of the kind'})")
            pending.remove(match)
            report.decisions += 1
        recent.append(f"{line_no}: {raw.decode(errors='replace')[:240]}")
    return report
