"""The trace checker: SPEC.md's invariants, judged from the trace alone.

It reads JSON records (see ``trace.py``) and nothing else: not the simulator's
objects, not the coordinator, not the core. It imports nothing from diloco.
From the records it rebuilds what an outside observer can know -- who is a
live member (joins, deaths and leaves the coordinator's observer reported,
reset by a coordinator restart), which contributions are pending (a
``Submit`` answered by ``Accepted`` in the same coordinator step), each
fragment's round and params, the outer optimizer's state -- and checks:

* **I1** quorum safety: every applied round happens with live members >=
  ``min_workers``, in phase RUNNING or DRAINING; sync: its contributors
  include every live member; async: exactly one contributor, or with a grace window
  (P5) every pending contribution of the fragment, in arrival order.
* **P5** the grace window: a merged step closes only when due (its deadline,
  every live member in it, a departure since it opened, a drain), and after
  every coordinator step no due window is left open while the quorum holds.
* **I2** at most one pending contribution per (worker, fragment, round); an
  apply never lists a worker twice; no (worker, fragment, round) applies twice.
* **I3** each fragment's rounds (versions) apply in order, each once.
* **I4** every accepted contribution is applied with its round (sync: an
  apply's contributors are *exactly* the pending contributions of that
  round; async: held contributions apply first in, first out), or discarded
  at a stop, or lost with a coordinator crash (counted as such: a crash loses
  what is pending, and a restart from the last snapshot rolls back every
  round applied after it); never silently dropped.
* **Outer step**: every apply's new params equal an independent
  recomputation: plain Nesterov (sync: ``torch.optim.SGD(nesterov=True)``'s
  formula) or Delayed Nesterov (async) on the mean of exactly its
  contributors' pseudo-gradients, from the previous params (``allclose``).
  An apply the coordinator reported ``step_refused`` first (the step made a
  parameter non-finite, SPEC.md section 12) must leave the params exactly
  as they were, and the optimizer state is not advanced.
* **Params**: every ``Welcome`` carries the params of the rounds it names;
  every ``Result(applied)`` carries the fragment's params after the apply and
  names the fragment's next round; every worker's params equal them once it
  installs them; snapshots, restarts and the save-and-stop checkpoint carry
  exactly the model the trace implies.
* **I5** nothing applies after the stop; at the stop every live member with
  a pending contribution gets ``Result(stop)`` (or ``applied_final``); every
  worker has stopped by the end of the run.
* **I6** ``below_min_workers`` in quorum events, heartbeat replies and
  welcomes equals live members < ``min_workers``.
* **I7** liveness: after the heal, every fragment applies another round
  within the bound the trace states.
* **I11** every ``Result`` answers an apply or a stop of the same step, for a
  contribution of that worker; every live contributor of an apply gets one.
* **I12** phase moves follow SPEC.md section 6, and RUNNING/DRAINING imply
  quorum, FORMING/PAUSED its absence.
* **net** the environment keeps its promise: on each connection, messages are
  delivered in the order they were sent (ZeroMQ over TCP); message ids grow
  in send order, so each link's delivered ids must grow.
* **W5, W6, W8** the workers keep their rules too (SPEC.md section 14; the
  simulator runs ``WorkerSession`` with one fragment closing per inner step):
  W5, a worker trains only while none of its contributions is pending; W6, a
  waiting worker pauses when the reply to a heartbeat it sent after its last
  ``Submit`` says ``below_min_workers`` -- judged once the worker got that
  Submit's ``Accepted`` (or a ``Welcome``): heartbeats carry no id, so before
  that fence a worker whose link lost messages cannot tell a fresh reply from
  a stale one; W8, a ``Submit`` answered ``held_limit`` is sent again one
  heartbeat interval later -- not sooner (no busy retry), and within two
  intervals unless the worker joined again, stopped, died or froze meanwhile.
  A ``worker`` record names one of ``WORKER_STATES``, the worker's vocabulary.
"""

from __future__ import annotations

import json
from typing import Iterable

from diloco.sim.checks.accumulators import AccumulatorChecks
from diloco.sim.checks.checkpoints import CheckpointChecks
from diloco.sim.checks.collective import CollectiveChecks
from diloco.sim.checks.liveness import LivenessChecks
from diloco.sim.checks.model import (  # noqa: F401 (re-exported: the checker's public names)
    ALLOWED_PHASE_MOVES,
    ATOL,
    RTOL,
    WORKER_STATES,
    Violation,
    _LINK_S,
    _Model,
    _Step,
    values_hash,
)
from diloco.sim.checks.params import ParamsChecks
from diloco.sim.checks.replies import ReplyChecks
from diloco.sim.checks.rounds import RoundChecks
from diloco.sim.checks.workers import WorkerChecks


class TraceChecker(WorkerChecks, RoundChecks, ParamsChecks, ReplyChecks, LivenessChecks, CollectiveChecks,
                   CheckpointChecks, AccumulatorChecks):
    """Feed records in order with ``feed``; ``finish`` returns the violations.

    The families of invariants live in ``diloco.sim.checks`` (one mixin each); this
    class holds the state they share, routes each record and ends the run.
    """

    def __init__(self, max_violations: int = 200) -> None:
        self.violations: list[Violation] = []
        self.violation_count = 0
        self.max_violations = max_violations
        self.n = 0
        self.t = 0.0
        self.cfg: dict | None = None
        self.model: _Model | None = None
        self.snap: tuple[_Model, int] | None = None
        self.snap_window_s = 0.0
        self.min_workers = 1
        self.up = True
        self.live: dict[str, str] = {}
        self.pending: list[dict] = []
        self.last_base: dict[tuple[str, int], int] = {}
        #: Async grace window (SPEC.md P5): its length, and per fragment with pending contributions
        #: [the clock its window closes at, released by a departure].
        self.window_s = 0.0
        self.window: dict[int, list] = {}
        self.applied_keys: dict[tuple[str, int, int], int] = {}
        self.phase = "forming"
        self.stopped = False
        self.stop_kind = ""
        self.msgs: dict[int, dict] = {}
        self.peer_wid: dict[str, str] = {}
        #: (src, dst) -> the last message id delivered on that link (per-connection FIFO).
        self.link_last: dict[tuple[str, str], int] = {}
        self.wstate: dict[str, str] = {}
        #: peer -> id of the last Submit it sent (delivered or dropped), and its (fragment, round).
        self.last_submit_m: dict[str, int] = {}
        self.last_submit: dict[str, tuple[int, int]] = {}
        #: peers whose worker got the Accepted of its last Submit, or a Welcome since it: replies
        #: after that fence are known fresh to it, whatever the link lost before.
        self.fenced: set[str] = set()
        #: HeartbeatReply message id -> the id of the Heartbeat it answers (replies saying
        #: below_min_workers with command continue, until delivered or dropped).
        self.below_reply_to: dict[int, int] = {}
        #: (worker id, peer, heartbeat id, when) whose state must not stay "waiting" after the
        #: record just fed: a below-quorum reply to that heartbeat reached it then.
        self._expect_pause: tuple[str, str, int, float] | None = None
        #: The same, still waiting after that reply, until the trace shows whether the worker sent
        #: a Submit between the heartbeat and the reply (then the reply was stale to it).
        self._pause_suspects: list[tuple[str, str, int, float]] = []
        #: Error(held_limit) message id -> (peer, fragment) of the Submit it refused.
        self.held_errors: dict[int, tuple[str, int]] = {}
        #: peer -> (fragment, when the worker got the held_limit, worker id): a retry is due.
        self.retry_due: dict[str, tuple[int, float, str]] = {}
        self.hb_interval_s = 0.0
        self._step: _Step | None = None
        self._step_id = None
        self._last_recv: dict | None = None
        self.heal_t: float | None = None
        self.bound_s: float | None = None
        self.live_applied: dict[int, float] = {}
        self.shutdown_requested = False
        self.end: dict | None = None
        self.crash_error = ""
        self._handlers = {k: getattr(self, "_on_" + k) for k in
                          ("config", "send", "recv", "worker", "adopt", "fault", "phase", "ckpt", "acc")}
        self.counts = dict(accepted=0, applied_rounds=0, applied_contributions=0, discarded_at_stop=0,
                           lost_with_crash=0, rolled_back_rounds=0, joins=0, deaths=0, leaves=0,
                           coordinator_crashes=0, snapshots=0, outer_steps_checked=0, results=0,
                           messages=0, drops=0, pending_at_end=0, steps_refused=0, checkpoints_checked=0,
                           payloads_checked=0, windows_changed=0)
        self._init_collective()
        self._init_checkpoints()
        self._init_accumulators()

    # ------------------------------------------------------------------ API

    def feed(self, rec: dict) -> None:
        self.n += 1
        self.t = rec["t"]
        s = rec.get("s")
        k = rec["k"]
        if self._expect_pause is not None:
            self._check_pause(rec)
        if self._pause_suspects and self.t > self._pause_suspects[0][3] + _LINK_S:
            self._judge_pauses()
        if self.retry_due:
            self._check_retries()
        if s is None:
            if k == "drop":
                self._on_drop(rec)
                return
            if self._step is not None:
                self._finish_step()
            handler = self._handlers.get(k)
            if handler is None:
                self._violate("trace", f"unknown record kind {k!r}")
                return
            handler(rec)
            return
        if self._step is not None and s != self._step_id:
            self._finish_step()
        # A coordinator step: its header, then what the observer reported, then the sends.
        if self._step is None:
            self._step_id = s
            msg = None
            if k == "recv":
                # A worker's message: the record carries its fields (and ts, when it was sent).
                msg = rec
                self._fifo(rec)
                wid = rec.get("worker_id")
                if wid is not None:
                    self.peer_wid[rec["src"]] = wid
                if rec["type"] == "Submit":
                    self._worker_submitted(rec)
            self._step = _Step(rec, msg)
        self._step.recs.append(rec)
        if k == "send":
            self.counts["messages"] += 1
            self.msgs[rec["m"]] = rec

    def feed_line(self, line: str) -> None:
        self.feed(json.loads(line))

    def finish(self) -> list[Violation]:
        if self._step is not None:
            self._finish_step()
        if self._expect_pause is not None:
            self._check_pause(None)
        self.t = float("inf")
        self._judge_pauses()
        self._judge_end()
        self.counts["pending_at_end"] = sum(len(p) for p in self.pending)
        return self.violations

    # ------------------------------------------------------------ helpers

    def _violate(self, rule: str, detail: str) -> None:
        self.violation_count += 1
        if len(self.violations) < self.max_violations:
            self.violations.append(Violation(self.t, rule, detail, self.n))

    def _wid_of(self, peer: str) -> str | None:
        return self.peer_wid.get(peer)

    # ------------------------------------------------------- non-step records

    def _on_config(self, rec: dict) -> None:
        self.cfg = rec
        self.hb_interval_s = rec["heartbeat_interval_s"]
        self.min_workers = rec["min_workers"]
        self.pending = [{} for _ in range(rec["num_fragments"])]
        self.window_s = rec.get("grace_window_s", 0.0)
        self._collective_config(rec)


def check_records(records: Iterable[dict]) -> tuple[list[Violation], TraceChecker]:
    checker = TraceChecker()
    for rec in records:
        checker.feed(rec)
    return checker.finish(), checker
