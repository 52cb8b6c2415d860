"""What an operator sees of a run, gathered on the coordinator's own thread and published for readers.

``Observatory`` listens to the coordinator twice, both on the loop thread
(the only thread that touches the coordinator):

* as an observer (``obs(kind, now_s, info)``, in the server's ``Tee``): joins,
  deaths, leaves, quorum and phase changes, applied rounds, the stop;
* at every turn of the loop (``ObservedEndpoint.recv``): at most every
  ``sample_interval_s`` (at once after an event) it reads the coordinator's
  status dict (``Coordinator.status()``, built on the core's read-only
  ``status()`` view) and its bounded metric histories, derives each member's
  state for the membership timeline, and publishes one immutable snapshot.

Readers on other threads (the HTTP server: the dashboard, ``/api/status``,
``/metrics``) only ever read the last published snapshot: a plain dict
replaced whole, never changed after publication. Everything kept is bounded.
Times in the snapshot are seconds since the server started (``run_s``) or
ages; wall-clock times only in ``started_at``.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from typing import Any, Callable

from diloco.wire.messages import Error, Message

log = logging.getLogger("diloco.observe")

#: Upper bounds of the round-duration histogram, seconds (Prometheus ``le`` buckets; +Inf implied).
ROUND_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
#: Timeline segments kept per worker, and workers kept on the timeline.
TIMELINE_SEGMENTS = 200
TIMELINE_WORKERS = 64
#: Points per worker loss curve in a snapshot (the newest; the history itself keeps more).
CURVE_POINTS = 300
#: Run-level events kept for the dashboard's event list.
EVENTS_KEPT = 50


class Observatory:
    """See the module docstring. ``log`` (a ``MetricsLog`` or None) gets one line per round and sample."""

    def __init__(self, coordinator, *, version: str, clock: Callable[[], float] = time.monotonic,
                 sample_interval_s: float = 0.25, log=None, http_address: str | None = None) -> None:
        self.coordinator = coordinator
        self.version = version
        self.clock = clock
        self.sample_interval_s = sample_interval_s
        self.log = log
        self.http_address = http_address
        self.t0 = coordinator.started_s
        self.started_at = time.time()
        self._lock = threading.Lock()
        self._published: dict[str, Any] = {}
        self._next_sample = -math.inf
        self._dirty = True
        # counters (loop thread only)
        self.deaths = 0
        self.rounds_by_fragment: collections.Counter[int] = collections.Counter()
        self.rejections: collections.Counter[str] = collections.Counter()
        self.round_buckets = [0] * (len(ROUND_BUCKETS_S) + 1)
        self.round_sum_s = 0.0
        self.round_count = 0
        self._round_opened: dict[int, float] = {}
        self._events: collections.deque[dict] = collections.deque(maxlen=EVENTS_KEPT)
        # membership timeline: worker -> deque of [state, start, end-or-None]
        self._timeline: dict[str, collections.deque[list]] = {}
        self._quorum: collections.deque[list] = collections.deque(maxlen=TIMELINE_SEGMENTS)
        self._logged_samples = 0

    # ------------------------------------------------------------------ loop thread

    def rel(self, now_s: float) -> float:
        return round(now_s - self.t0, 3)

    def __call__(self, kind: str, now_s: float, info: dict) -> None:
        """The coordinator's observer (loop thread). Never raises: watching must not break the run."""
        try:
            self._on_event(kind, now_s, info)
        except Exception:
            log.exception("observatory: event %s not recorded", kind)

    def _on_event(self, kind: str, now_s: float, info: dict) -> None:
        if kind == "input":
            return  # the machine's inputs, for the audit log's trace validation
        t = self.rel(now_s)
        self._dirty = True
        if kind == "apply":
            fid = info["fragment_id"]
            self.rounds_by_fragment[fid] += 1
            opened = self._round_opened.get(fid)
            if opened is not None:
                self._observe_round(now_s - opened)
            self._round_opened[fid] = now_s
            if self.log is not None:
                hist = self.coordinator.metrics.rounds
                loss = hist[-1].loss if hist and hist[-1].round_id == info["round_id"] else None
                self.log.write("round", t, fragment_id=fid, round_id=info["round_id"],
                               contributors=list(info["contributors"]), loss=loss,
                               rounds_applied=self.coordinator.fsm.rounds_applied)
        elif kind == "dead":
            self.deaths += 1
            self._set_state(info["worker_id"], "dead", t)
        elif kind == "left":
            # A crash the transport saw (its connection closed, SPEC.md R7) is a death too.
            crashed = info.get("cause") == "crashed"
            self.deaths += crashed
            self._set_state(info["worker_id"], "dead" if crashed else None, t)
        elif kind == "join":
            self._set_state(info["worker_id"], "waiting" if info.get("parked") else "training", t)
        elif kind == "quorum":
            self._quorum.append([t, bool(info["below_min_workers"])])
        elif kind == "phase" and info.get("new") == "running":
            for fid in range(self.coordinator.config.fsm.num_fragments):
                self._round_opened.setdefault(fid, now_s)
        elif kind == "stop":
            for wid in list(self._timeline):
                self._set_state(wid, None, t)
        if kind in ("join", "dead", "left", "quorum", "phase", "stop", "step_refused", "reconciled"):
            self._events.append({"t": t, "event": kind, **{k: v for k, v in info.items() if k != "parked"}})
            if self.log is not None and kind != "phase":
                self.log.write("event", t, event=kind, **info)

    def count_sent(self, message: Message) -> None:
        """Every message the coordinator sends (loop thread): refusals are counted by reason."""
        if type(message) is Error:
            self.rejections[message.code.value] += 1

    def _observe_round(self, seconds: float) -> None:
        seconds = max(0.0, seconds)
        self.round_count += 1
        self.round_sum_s += seconds
        for i, le in enumerate(ROUND_BUCKETS_S):
            if seconds <= le:
                self.round_buckets[i] += 1
                return
        self.round_buckets[-1] += 1

    def _set_state(self, worker_id: str, state: str | None, t: float) -> None:
        lane = self._timeline.get(worker_id)
        open_ = lane is not None and lane and lane[-1][2] is None
        if open_:
            if lane[-1][0] == state:
                return
            lane[-1][2] = t
        if self.log is not None and (open_ or state is not None):
            self.log.write("state", t, worker_id=worker_id, state=state)
        if state is None:
            return
        if lane is None:
            while len(self._timeline) >= TIMELINE_WORKERS:
                del self._timeline[next(iter(self._timeline))]
            lane = self._timeline[worker_id] = collections.deque(maxlen=TIMELINE_SEGMENTS)
        lane.append([state, t, None])

    def maybe_sample(self) -> None:
        """At most every ``sample_interval_s`` (or after an event): read the coordinator, publish (loop thread)."""
        now = self.clock()
        if not self._dirty and now < self._next_sample:
            return
        self._dirty = False
        self._next_sample = now + self.sample_interval_s
        try:
            self.publish(now)
        except Exception:  # watching must not break the run
            log.exception("observatory: snapshot not published")

    def publish(self, now_s: float) -> None:
        c = self.coordinator
        status = c.status()
        t = self.rel(max(now_s, c.fsm.now_s))
        parked = set(status.get("parked_workers", []))
        below = bool(status.get("below_min_workers"))
        members = []
        for m in status.get("members", []):
            wid = m["worker_id"]
            if wid in parked:
                state = "paused" if below else "waiting"
            else:
                state = "training"
            if not c.stopped:
                self._set_state(wid, state, t)
            members.append({"worker_id": wid, "state": state, "age_s": round(m.get("age_s", 0.0), 3),
                            **m.get("metrics", {})})
        history = c.metrics
        self._log_new_samples(history)
        curves = {wid: [[self.rel(s.t_s), s.metrics["loss"]] for s in list(samples)[-CURVE_POINTS:]
                        if "loss" in s.metrics]
                  for wid, samples in history.workers.items()}
        rounds = [[self.rel(r.t_s), r.fragment_id, r.round_id, r.loss, len(r.contributors)]
                  for r in list(history.rounds)[-CURVE_POINTS:]]
        # ``diloco server`` has the coordinator's status carry the transport's counters (once per snapshot).
        transport = status.get("transport", {})
        snap = {
            **{k: v for k, v in status.items() if k != "members"},
            "members": members,
            "version": self.version,
            "run_s": t,
            "started_at": self.started_at,
            "http": self.http_address,
            "live_workers": len(members),
            "transport": transport,
            "deaths": self.deaths,
            "rejections": dict(self.rejections),
            "rounds_by_fragment": {str(k): v for k, v in sorted(self.rounds_by_fragment.items())},
            "round_duration": {"buckets": list(ROUND_BUCKETS_S), "counts": list(self.round_buckets),
                               "sum_s": self.round_sum_s, "count": self.round_count},
            "curves": curves,
            "rounds": rounds,
            "timeline": {wid: [list(seg) for seg in lane] for wid, lane in self._timeline.items()},
            "quorum_changes": [list(q) for q in self._quorum],
            "events": list(self._events),
        }
        with self._lock:
            self._published = snap

    def _log_new_samples(self, history) -> None:
        if self.log is None:
            self._logged_samples = history.samples_recorded
            return
        new = history.samples_recorded - self._logged_samples
        self._logged_samples = history.samples_recorded
        if new <= 0:
            return
        # The newest ``new`` samples, across workers (each worker's deque is in time order).
        latest = sorted(((s.t_s, wid, s) for wid, samples in history.workers.items()
                         for s in list(samples)[-new:]), key=lambda x: x[0])[-new:]
        for _, wid, s in latest:
            self.log.write("sample", self.rel(s.t_s), worker_id=wid, **s.metrics)

    # ------------------------------------------------------------------ any thread

    def snapshot(self) -> dict[str, Any]:
        """The last published snapshot (do not modify it)."""
        with self._lock:
            return self._published


class ObservedEndpoint:
    """Wraps the server's endpoint: samples the run each turn and counts what is sent (loop thread)."""

    def __init__(self, inner, observatory: Observatory) -> None:
        self.inner = inner
        self.observatory = observatory

    def recv(self, timeout_s: float):
        self.observatory.maybe_sample()
        return self.inner.recv(timeout_s)

    def lost_peers(self) -> list[str]:
        return self.inner.lost_peers()

    def arriving_peers(self) -> list[str]:
        return self.inner.arriving_peers()

    def send(self, peer: str, message: Message) -> None:
        self.observatory.count_sent(message)
        self.inner.send(peer, message)

    def close(self) -> None:
        self.inner.close()


__all__ = ["Observatory", "ObservedEndpoint", "ROUND_BUCKETS_S"]
