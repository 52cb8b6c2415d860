"""The run as Prometheus series: a ``prometheus_client`` collector over the ``Observatory``'s last snapshot.

Nothing is counted here: every value is read from the published snapshot
(``Observatory.snapshot()``), so a scrape never touches the coordinator.
docs/watching.md lists the series.
"""

from __future__ import annotations

from typing import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)

PHASES = ("forming", "running", "paused", "draining", "stopped")


class RunCollector:
    """Yields the ``diloco_*`` families from ``observatory.snapshot()`` at every scrape."""

    def __init__(self, observatory) -> None:
        self.observatory = observatory

    def describe(self) -> list:
        return []  # unchecked: the families depend on the run (fragments, workers)

    def collect(self) -> Iterator[Metric]:
        s = self.observatory.snapshot()
        if not s:
            return
        info = InfoMetricFamily("diloco_run", "the run: id, diloco version, mode")
        info.add_metric([], {"run_id": str(s.get("run_id") or ""), "version": str(s.get("version", "")),
                             "mode": str(s.get("mode", ""))})
        yield info
        yield _gauge("diloco_uptime_seconds", "seconds since this server process started", s.get("uptime_s", 0))
        phase = GaugeMetricFamily("diloco_phase", "1 for the run's current phase", labels=["phase"])
        for p in PHASES:
            phase.add_metric([p], 1.0 if s.get("phase") == p else 0.0)
        yield phase
        yield _gauge("diloco_live_workers", "live members of the run", s.get("live_workers", 0))
        yield _gauge("diloco_min_workers", "the quorum: no outer step with fewer contributors",
                     s.get("min_workers", 0))
        yield _gauge("diloco_below_min_workers", "1 while the run is below min_workers (paused)",
                     1 if s.get("below_min_workers") else 0)
        yield _counter("diloco_paused_seconds", "seconds spent below quorum after the run formed",
                       s.get("paused_s", 0.0))
        yield _gauge("diloco_rounds_applied", "rounds applied over the whole run (all incarnations)",
                     s.get("rounds_applied", 0))
        if s.get("grace_window_s"):
            yield _gauge("diloco_grace_window_seconds", "async mode: the length of the next grace window (with "
                         "--grace-window auto, as the recent arrivals set it)", s["grace_window_s"])
        by_frag = CounterMetricFamily("diloco_fragment_rounds_applied",
                                      "rounds applied by this server process, per fragment", labels=["fragment"])
        for fid, n in s.get("rounds_by_fragment", {}).items():
            by_frag.add_metric([fid], n)
        yield by_frag
        rd = s.get("round_duration", {})
        if rd:
            cum, buckets = 0, []
            for le, n in zip(list(rd["buckets"]) + ["+Inf"], rd["counts"]):
                cum += n
                buckets.append([str(le) if le == "+Inf" else repr(float(le)), cum])
            yield HistogramMetricFamily("diloco_round_duration_seconds",
                                        "seconds from a fragment's previous applied round (or the run's start) "
                                        "to this one", buckets=buckets, sum_value=rd["sum_s"])
        if s.get("since_last_apply_s") is not None:
            yield _gauge("diloco_seconds_since_last_round", "seconds since the last applied round",
                         s["since_last_apply_s"])
        yield _counter("diloco_contributions_accepted", "contributions accepted", s.get("contributions_accepted", 0))
        yield _counter("diloco_payload_bytes_received", "tensor bytes received in accepted contributions",
                       s.get("bytes_received", 0))
        yield _counter("diloco_payload_bytes_sent", "tensor bytes sent in Welcomes and Results", s.get("bytes_sent", 0))
        t = s.get("transport") or {}
        yield _counter("diloco_transport_bytes_received", "bytes received on the coordinator's socket",
                       t.get("bytes_in", 0))
        yield _counter("diloco_transport_bytes_sent", "bytes sent on the coordinator's socket", t.get("bytes_out", 0))
        rej = CounterMetricFamily("diloco_rejections", "messages refused, by reason (the Error code) and by whom",
                                  labels=["reason", "by"])
        for code, n in sorted(s.get("rejections", {}).items()):
            rej.add_metric([code, "coordinator"], n)
        for code, n in sorted((t.get("malformed") or {}).items()):
            rej.add_metric([code, "transport"], n)
        yield rej
        yield _counter("diloco_worker_deaths", "workers declared dead (silent past the heartbeat timeout, or "
                                               "their connection closed)", s.get("deaths", 0))
        yield _counter("diloco_steps_refused", "outer steps undone because they made a parameter non-finite",
                       s.get("steps_refused", 0))
        members = s.get("members", [])
        for name, key, doc in (
                ("diloco_worker_step", "step", "a live worker's inner step (from its heartbeats)"),
                ("diloco_worker_steps_per_second", "steps_per_s", "a live worker's inner steps per second"),
                ("diloco_worker_loss", "loss", "a live worker's last training loss"),
                ("diloco_worker_eval_loss", "eval_loss", "a live worker's last evaluation loss"),
                ("diloco_worker_samples", "samples", "samples a live worker has trained on"),
                ("diloco_worker_heartbeat_age_seconds", "age_s", "seconds since a live worker's last heartbeat")):
            fam = GaugeMetricFamily(name, doc, labels=["worker"])
            for m in members:
                if m.get(key) is not None:
                    fam.add_metric([m["worker_id"]], float(m[key]))
            yield fam
        rounds = s.get("rounds") or []
        last = next((r for r in reversed(rounds) if r[3] is not None), None)
        if last is not None:
            yield _gauge("diloco_round_loss", "mean of the last applied round's contributors' latest losses", last[3])


def _gauge(name: str, doc: str, value) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=float(value or 0))


def _counter(name: str, doc: str, value) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=float(value or 0))


def make_registry(observatory) -> CollectorRegistry:
    """A registry of its own (not the process-global one) holding only the run's collector."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RunCollector(observatory))
    return registry
