"""Run one seed (or many), check its trace, replay a recorded one.

``run_seed`` is what ``diloco sim`` calls: it builds the run from the seed,
streams every trace record to the file (if any), the checker, the timeline
(if a plot is wanted) and, for ``--replay``, a comparator that stops at the
first record that differs from the recorded trace.
"""

from __future__ import annotations

import gc
import json
import time
from dataclasses import dataclass, field

from diloco.sim.checker import TraceChecker, Violation
from diloco.sim.config import OVERRIDE_NAMES, SimConfig, config_from_dict, derive_config
from diloco.sim.simulation import Simulation
from diloco.sim.stats import SimStats
from diloco.sim.trace import TRACE_FORMAT, ConsumerAbort, TraceWriter


class Divergence(ConsumerAbort):
    def __init__(self, index: int, expected: str | None, got: str | None) -> None:
        super().__init__(f"record {index}")
        self.index = index
        self.expected = expected
        self.got = got

    def describe(self) -> str:
        return (f"the replay diverges at record {self.index} (line {self.index}):\n"
                f"  recorded: {self.expected if self.expected is not None else '<end of trace>'}\n"
                f"  replayed: {self.got if self.got is not None else '<end of run>'}")


@dataclass
class RunResult:
    cfg: SimConfig
    stats: SimStats
    violations: list[Violation]
    violation_count: int
    counts: dict
    trace_sha256: str
    records: int
    wall_s: float
    divergence: Divergence | None = None
    plot_path: str | None = None
    extra: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.violation_count == 0 and self.divergence is None

    @property
    def applied_rounds(self) -> int:
        return self.counts.get("applied_rounds", self.stats.applied)


class _Comparator:
    def __init__(self, lines) -> None:
        self._it = iter(lines)
        self.index = 0

    def __call__(self, record: dict, line: str) -> None:
        self.index += 1
        expected = next(self._it, None)
        if expected != line:
            raise Divergence(self.index, expected, line)

    def finish(self) -> None:
        extra = next(self._it, None)
        if extra is not None:
            raise Divergence(self.index + 1, extra, None)


_warm = False


def _warm_up() -> None:
    """Build one torch optimizer before the clock starts: the first costs seconds of imports."""
    global _warm
    if not _warm:
        import torch

        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        _warm = True


def run_config(cfg: SimConfig, *, trace_path: str | None = None, plot_path: str | None = None,
               check: bool = True, parse: bool = False, replay_lines=None,
               max_events: int = 50_000_000) -> RunResult:
    """Simulate ``cfg``; check the trace as it is written; optionally write it and plot it.

    The checker is fed each record as the dict the line was made from (``parse=False``,
    faster) or as ``json.loads`` of the line (``parse=True``); the records hold JSON
    types only, so both are the same (``tests/sim/test_trace.py`` checks it, and that
    hand-formatted hot lines equal ``json.dumps``).
    """
    checker = TraceChecker() if check else None
    timeline = None
    consumers = []
    record_consumers = []
    comparator = _Comparator(replay_lines) if replay_lines is not None else None
    if comparator is not None:
        consumers.append(comparator)
    if checker is not None:
        if parse:
            loads = json.loads
            feed = checker.feed
            consumers.append(lambda record, line: feed(loads(line)))
        else:
            record_consumers.append(checker.feed)
    if plot_path:
        from diloco.sim.timeline import TimelineBuilder

        timeline = TimelineBuilder()
        record_consumers.append(timeline.feed)
    writer = TraceWriter(trace_path, consumers, record_consumers)
    sim = Simulation(cfg, writer, max_events=max_events)
    divergence = None
    # A big run keeps many objects alive (workers, queued events, in-flight messages);
    # the default thresholds make the collector rescan them all every few thousand
    # allocations (about 20% of the run at 1,000 workers). Collect rarely, restore after.
    _warm_up()
    thresholds = gc.get_threshold()
    gc.set_threshold(100_000, 50, 100)
    start = time.perf_counter()
    try:
        stats = sim.run()
        if comparator is not None:
            comparator.finish()
    except Divergence as exc:
        divergence = exc
        stats = sim.stats
    finally:
        gc.set_threshold(*thresholds)
        writer.close()
    wall = time.perf_counter() - start
    violations: list[Violation] = []
    count = 0
    counts: dict = {}
    if checker is not None:
        violations = checker.finish()
        count = checker.violation_count
        counts = checker.counts
    result = RunResult(cfg, stats, violations, count, counts, writer.sha256(), writer.count, wall, divergence)
    if timeline is not None and divergence is None:
        result.plot_path = str(timeline.plot(plot_path))
    return result


def run_seed(seed: int, **kwargs) -> RunResult:
    overrides = {k: kwargs.pop(k) for k in OVERRIDE_NAMES if k in kwargs}
    return run_config(derive_config(seed, **overrides), **kwargs)


def replay_trace(path: str, *, check: bool = True) -> RunResult:
    """Re-run the seed and overrides the trace at ``path`` records; compare record by record."""
    from diloco.sim.trace import read_lines

    with open(path, encoding="ascii") as f:
        first = f.readline()
    if not first.strip():
        raise ValueError(f"{path}: empty file, not a diloco sim trace")
    try:
        head = json.loads(first)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: the first line is not JSON ({exc})") from None
    if not isinstance(head, dict) or head.get("k") != "config" or head.get("format") != TRACE_FORMAT:
        raise ValueError(f"{path}: the first record is not a {TRACE_FORMAT} config record")
    recorded = config_from_dict(head)
    cfg = derive_config(recorded.seed, **recorded.overrides)
    return run_config(cfg, check=check, replay_lines=read_lines(path))
