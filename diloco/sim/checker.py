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
  include every live member; async: exactly one contributor.
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

import copy
import hashlib
import json
import struct
from dataclasses import dataclass, field
from typing import Iterable

RTOL = 1e-4
ATOL = 1e-5

#: The states a ``worker`` record may name: ``diloco.worker.states.WorkerState``'s values (the
#: checker imports nothing from diloco; tests/sim/test_trace.py keeps the two equal).
WORKER_STATES = ("joining", "training", "waiting", "paused", "stopping", "stopped", "frozen", "dead")
#: States in which a worker has left whatever it was waiting for (a held_limit retry is off).
_LEFT_THE_WAIT = frozenset({"joining", "stopping", "stopped", "frozen", "dead"})
#: Seconds a worker's retry may take beyond its due time to show in the trace: the tick that
#: sends it (at most one heartbeat interval later) is counted separately; this covers link
#: delays (capped at 0.25 s) with room to spare.
_RETRY_SLACK_S = 1.0
#: A worker's message shows in the trace (delivered or dropped) within this of its sending:
#: the simulator caps link delays at 0.25 s.
_LINK_S = 0.3

ALLOWED_PHASE_MOVES = {
    ("forming", "running"), ("paused", "running"), ("running", "paused"), ("running", "draining"),
    ("forming", "stopped"), ("running", "stopped"), ("paused", "stopped"), ("draining", "stopped"),
}


def values_hash(items: Iterable[tuple[str, list[float]]]) -> str:
    """sha256 over each name, a NUL and its little-endian float32 bytes; 16 hex digits."""
    h = hashlib.sha256()
    for name, values in items:
        h.update(name.encode())
        h.update(b"\0")
        h.update(struct.pack(f"<{len(values)}f", *values))
    return h.hexdigest()[:16]


@dataclass
class Violation:
    t: float
    rule: str
    detail: str
    record: int

    def __str__(self) -> str:
        return f"[{self.rule}] t={self.t:.3f}s record #{self.record}: {self.detail}"


@dataclass
class _Model:
    """What the trace implies the coordinator holds: rounds, params, optimizer state, quorum."""

    fragments: list[list[str]]
    rounds: list[int]
    params: list[dict]
    hist: list[dict]
    opt: list[dict]
    delay: int

    def fhash(self, f: int) -> str:
        p = self.params[f]
        return values_hash((n, p[n]) for n in self.fragments[f])


@dataclass(slots=True)
class _Step:
    header: dict
    msg: dict | None
    recs: list = field(default_factory=list)
    #: (worker_id, fragment_id, round_id) -> (allowed outcomes of the Result it must get,
    #: the round its apply opened, or None for a stop).
    expect: dict = field(default_factory=dict)
    joins: dict = field(default_factory=dict)
    accept: tuple | None = None
    quorum_min: list = field(default_factory=list)
    #: (fragment_id, round_id) of the applies this step reported ``step_refused``.
    refused: set = field(default_factory=set)


class TraceChecker:
    """Feed records in order with ``feed``; ``finish`` returns the violations."""

    def __init__(self, max_violations: int = 200) -> None:
        self.violations: list[Violation] = []
        self.violation_count = 0
        self.max_violations = max_violations
        self.n = 0
        self.t = 0.0
        self.cfg: dict | None = None
        self.model: _Model | None = None
        self.snap: tuple[_Model, int] | None = None
        self.min_workers = 1
        self.up = True
        self.live: dict[str, str] = {}
        self.pending: list[dict] = []
        self.last_base: dict[tuple[str, int], int] = {}
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
                          ("config", "send", "recv", "worker", "adopt", "fault", "phase")}
        self.counts = dict(accepted=0, applied_rounds=0, applied_contributions=0, discarded_at_stop=0,
                           lost_with_crash=0, rolled_back_rounds=0, joins=0, deaths=0, leaves=0,
                           coordinator_crashes=0, snapshots=0, outer_steps_checked=0, results=0,
                           messages=0, drops=0, pending_at_end=0, steps_refused=0)

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
        if self.crash_error:
            self._violate("crash", f"the simulation raised: {self.crash_error}")
        if self.heal_t is not None:
            nfrag = len(self.model.rounds) if self.model else self.cfg["num_fragments"]
            late = [f for f in range(nfrag)
                    if f not in self.live_applied or self.live_applied[f] > self.heal_t + self.bound_s]
            if late:
                self._violate("I7", f"liveness: after the heal at t={self.heal_t:.3f}s fragments {late} applied "
                                    f"no round within the bound of {self.bound_s:.1f}s")
        if self.shutdown_requested and not self.stopped:
            self._violate("I5", "a shutdown was requested but the run never stopped")
        if self.stopped:
            # A worker still joining (say, retrying after too_many_workers) is not a member and
            # holds nothing: not parked. One training, waiting or paused missed the stop.
            for wid, state in sorted(self.wstate.items()):
                if state in ("training", "waiting", "paused", "stopping", "frozen"):
                    self._violate("I5", f"{wid} is still {state} at the end of the run, after the stop")
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

    def _on_send(self, rec: dict) -> None:  # a worker's send (a coordinator's carries "s")
        self.counts["messages"] += 1
        self.msgs[rec["m"]] = rec
        wid = rec.get("worker_id")
        if wid is not None:
            self.peer_wid[rec["src"]] = wid

    def _fifo(self, rec: dict) -> None:
        link = (rec["src"], rec["dst"])
        m = rec["m"]
        last = self.link_last.get(link, 0)
        if m < last:
            self._violate("net", f"message {m} on {link[0]} -> {link[1]} delivered after message {last}, "
                                 f"which was sent later: per-connection FIFO broken")
        self.link_last[link] = m

    def _on_recv(self, rec: dict) -> None:  # delivered to a worker
        self._fifo(rec)
        m = rec["m"]
        self._last_recv = self.msgs.pop(m, None)
        if self._last_recv is None:
            self._violate("trace", f"message {m} delivered but never sent")
        peer = rec["dst"]
        if self.below_reply_to:
            hb = self.below_reply_to.pop(m, None)
            if hb is not None and peer in self.fenced and hb > self.last_submit_m.get(peer, 0):
                wid = self.peer_wid.get(peer)
                if wid is not None and self.wstate.get(wid) == "waiting":
                    self._expect_pause = (wid, peer, hb, rec["t"])
        sent = self._last_recv
        if sent is not None:
            typ = sent["type"]
            if typ == "Welcome" or (typ == "Accepted" and self.last_submit.get(peer)
                                    == (sent["fragment_id"], sent["round_id"])):
                self.fenced.add(peer)
        if self.held_errors:
            held = self.held_errors.pop(m, None)
            if held is not None:
                self.retry_due[peer] = (held[1], rec["t"], self.peer_wid.get(peer, "?"))

    def _on_drop(self, rec: dict) -> None:
        self.counts["drops"] += 1
        m = rec["m"]
        self.msgs.pop(m, None)
        self.below_reply_to.pop(m, None)
        self.held_errors.pop(m, None)
        if rec.get("type") == "Submit" and "worker_id" in rec:
            self._worker_submitted(rec)

    def _on_worker(self, rec: dict) -> None:
        wid, state = rec["w"], rec["state"]
        if state not in WORKER_STATES:
            self._violate("trace", f"{wid} is in state {state!r}, which is not a worker state {WORKER_STATES}")
        self.wstate[wid] = state
        if state == "training":
            pending = [f for f, pend in enumerate(self.pending) if wid in pend]
            if pending:
                self._violate("W5", f"{wid} trains while its contribution to fragment(s) {pending} is "
                                    f"pending (round {self.pending[pending[0]][wid][0]})")
        elif state in _LEFT_THE_WAIT:
            self.retry_due.pop(rec["p"], None)

    # ------------------------------------------------------------ the workers' rules

    def _worker_submitted(self, rec: dict) -> None:
        """A worker's Submit, seen delivered or dropped (``ts``: when the worker sent it)."""
        peer, f = rec["src"], rec["fragment_id"]
        if rec["m"] > self.last_submit_m.get(peer, 0):
            self.last_submit_m[peer] = rec["m"]
            self.last_submit[peer] = (f, rec["round_id"])
            self.fenced.discard(peer)
        if self._pause_suspects:
            # Sent after the heartbeat and before the reply arrived: the reply was stale to it.
            m, ts = rec["m"], rec["ts"]
            self._pause_suspects = [x for x in self._pause_suspects
                                    if not (x[1] == peer and x[2] < m and ts <= x[3])]
        due = self.retry_due.get(peer)
        if due is not None and due[0] == f:
            del self.retry_due[peer]
            waited = rec["ts"] - due[1]
            if waited < self.hb_interval_s - 1e-6:
                self._violate("W8", f"{due[2]} sent fragment {f} again {waited:.3f}s after its held_limit; "
                                    f"a retry waits one heartbeat interval ({self.hb_interval_s:.3f}s)")

    def _check_retries(self) -> None:
        late = 2 * self.hb_interval_s + _RETRY_SLACK_S
        for peer, (f, t, wid) in list(self.retry_due.items()):
            if self.t > t + late:
                del self.retry_due[peer]
                self._violate("W8", f"{wid} got held_limit for fragment {f} at t={t:.3f}s and has not sent "
                                    f"it again {late:.3f}s later (still {self.wstate.get(wid)})")

    def _check_pause(self, rec: dict | None) -> None:
        """The record after a below-quorum heartbeat reply reached a waiting worker."""
        expect, self._expect_pause = self._expect_pause, None
        if rec is not None and rec["k"] == "worker" and rec["w"] == expect[0]:
            return  # it changed state: paused (or joined again, or stopped)
        if self.wstate.get(expect[0]) == "waiting":
            self._pause_suspects.append(expect)

    def _judge_pauses(self) -> None:
        """Suspects whose worker sent no Submit between the heartbeat and the reply: it had to pause."""
        keep = []
        for x in self._pause_suspects:
            if self.t <= x[3] + _LINK_S:
                keep.append(x)
                continue
            self._violate("W6", f"{x[0]} still waits after a heartbeat reply said below_min_workers at "
                                f"t={x[3]:.3f}s (the reply to a heartbeat sent after its last Submit): it "
                                f"must pause")
        self._pause_suspects = keep

    def _on_adopt(self, rec: dict) -> None:
        sent = self._last_recv
        if sent is None or sent["m"] != rec["m"]:
            self._violate("params", f"{rec['w']} installed params from message {rec['m']}, which it did not just receive")
            return
        want = sent["hf"][rec["f"]] if sent["type"] == "Welcome" else sent.get("h")
        if want != rec["h"]:
            self._violate("params", f"{rec['w']} installed fragment {rec['f']} params {rec['h']} but the "
                                    f"{sent['type']} carried {want}")

    def _on_fault(self, rec: dict) -> None:
        what = rec["what"]
        if what == "snapshot":
            self.counts["snapshots"] += 1
            self._check_state(rec, "snapshot")
            self.snap = (copy.deepcopy(self.model), self.min_workers)
        elif what == "coord_crash":
            self.counts["coordinator_crashes"] += 1
            self.counts["lost_with_crash"] += sum(len(p) for p in self.pending)
            self.pending = [{} for _ in self.pending]
            self.last_base.clear()
            self.live.clear()
            self.up = False
            self.phase = "down"
        elif what == "coord_restart":
            if self.snap is None:
                self._violate("snapshot", "the coordinator restarted but the trace shows no snapshot")
                return
            snap, snap_min_workers = self.snap
            rolled = sum(a - b for a, b in zip(self.model.rounds, snap.rounds))
            self.counts["rolled_back_rounds"] += rolled
            for key, f_round in list(self.applied_keys.items()):
                if f_round >= snap.rounds[key[1]]:
                    del self.applied_keys[key]
            self.model = copy.deepcopy(snap)
            self.min_workers = snap_min_workers
            self.up = True
            self.phase = "forming"
            self.live.clear()
            self._check_state(rec, "restart")

    def _check_state(self, rec: dict, what: str) -> None:
        m = self.model
        if m is None:
            self._violate("snapshot", f"a {what} before the run had params")
            return
        if rec["rounds"] != m.rounds:
            self._violate("snapshot", f"{what}: rounds {rec['rounds']} but the trace implies {m.rounds}")
        hf = [m.fhash(f) for f in range(len(m.rounds))]
        if rec["hf"] != hf:
            self._violate("snapshot", f"{what}: params {rec['hf']} but the trace implies {hf}")
        if rec["min_workers"] != self.min_workers:
            self._violate("snapshot", f"{what}: min_workers {rec['min_workers']} but the trace implies "
                                      f"{self.min_workers}")

    def _on_phase(self, rec: dict) -> None:
        what = rec["what"]
        if what == "heal":
            self.heal_t = rec["t"]
            self.bound_s = rec["bound_s"]
        elif what == "shutdown":
            self.shutdown_requested = True
        elif what == "crash":
            self.crash_error = rec.get("error", "?")
        elif what == "end":
            self.end = rec

    # ------------------------------------------------------------ steps

    def _finish_step(self) -> None:
        step, self._step = self._step, None
        self._step_id = None
        header, msg = step.header, step.msg
        recs = step.recs
        if len(recs) == 2 and recs[1]["k"] == "send" and recs[1]["type"] == "HeartbeatReply":
            self._send(recs[1], step)  # the commonest step: a heartbeat and its reply
            return
        sends = [r for r in step.recs if r["k"] == "send"]
        accepted = [r for r in sends if r["type"] == "Accepted"]
        if accepted:
            a = accepted[0]
            if len(accepted) > 1 or msg is None or msg["type"] != "Submit" or a["dst"] != header["src"] \
                    or (a["fragment_id"], a["round_id"]) != (msg["fragment_id"], msg["round_id"]):
                self._violate("I2", f"Accepted {[(x['fragment_id'], x['round_id']) for x in accepted]} does "
                                    f"not answer the Submit this step handled")
            else:
                step.accept = (msg["worker_id"], msg["fragment_id"], msg["round_id"], msg["v"], header["src"])
        for rec in step.recs[1:]:
            k = rec["k"]
            if k == "obs":
                self._obs(rec, step, sends)
            elif k == "fault":
                self._check_state(rec, rec["what"])
        if step.accept is not None:
            self._accept(step)
        for rec in sends:
            self._send(rec, step)
        for (wid, f, r), (outcomes, _next) in step.expect.items():
            self._violate("I11", f"{wid} has a pending contribution to fragment {f} round {r} released by "
                                 f"this step ({'/'.join(sorted(outcomes))}) but got no Result")

    def _accept(self, step: _Step) -> None:
        wid, f, r, values, peer = step.accept
        step.accept = None
        self.counts["accepted"] += 1
        m = self.model
        if m is None:
            self._violate("I4", f"{wid}'s contribution was accepted before the run had params")
            return
        if self.live.get(wid) != peer:
            self._violate("R4", f"accepted a contribution from {wid} on {peer}, not a live member there")
        pend = self.pending[f]
        if wid in pend:
            self._violate("I2", f"{wid} already has a pending contribution to fragment {f}; another was accepted")
        if self.cfg["mode"] == "sync":
            if r != m.rounds[f]:
                self._violate("R4", f"accepted {wid}'s contribution to fragment {f} round {r}; the open round is "
                                    f"{m.rounds[f]}")
        else:
            v = m.rounds[f]
            if not 0 <= v - r <= self.cfg["max_staleness"]:
                self._violate("P3", f"accepted {wid}'s contribution to fragment {f} from base {r} at version {v}")
            last = self.last_base.get((wid, f), -1)
            if r <= last:
                self._violate("P3", f"accepted {wid}'s contribution to fragment {f} from base {r}, not after its "
                                    f"last base {last}")
            self.last_base[(wid, f)] = r
        pend[wid] = (r, values)

    def _obs(self, rec: dict, step: _Step, sends: list) -> None:
        what = rec["what"]
        live = self.live
        if what == "join":
            wid = rec["worker_id"]
            if wid in live:
                self._violate("R6", f"{wid} joined while already a live member")
            peer = step.header.get("src")
            live[wid] = peer
            self.counts["joins"] += 1
            if self.model is None:
                self._install(step, sends, peer)
            m = self.model
            if m is None:
                return
            parked = []
            for f, pend in enumerate(self.pending):
                if wid in pend:
                    parked.append([f, pend[wid][0]])
                    if self.cfg["mode"] == "async":
                        self.last_base[(wid, f)] = pend[wid][0]
            if rec.get("parked", []) != parked:
                self._violate("P2", f"{wid} joined parked on {rec.get('parked')} but its pending contributions "
                                    f"are {parked}")
            step.joins[wid] = dict(rounds=list(m.rounds), parked=parked)
        elif what in ("dead", "left"):
            wid = rec["worker_id"]
            if wid not in live:
                self._violate("R7", f"{wid} {what} but was not a live member")
            live.pop(wid, None)
            for key in [k for k in self.last_base if k[0] == wid]:
                del self.last_base[key]
            self.counts["deaths" if what == "dead" else "leaves"] += 1
        elif what == "quorum":
            self.min_workers = rec["min_workers"]
            step.quorum_min.append(rec["min_workers"])
            below = len(live) < rec["min_workers"]
            if rec["live_workers"] != len(live) or rec["below_min_workers"] != below:
                self._violate("I6", f"quorum event says live_workers={rec['live_workers']} "
                                    f"below_min_workers={rec['below_min_workers']}; the trace's live members "
                                    f"are {len(live)} with min_workers {rec['min_workers']}")
        elif what == "phase":
            old, new = rec["old"], rec["new"]
            if old != self.phase:
                self._violate("I12", f"phase change from {old} but the run was {self.phase}")
            if (old, new) not in ALLOWED_PHASE_MOVES:
                self._violate("I12", f"phase change {old} -> {new} is not in SPEC.md section 6")
            mw = self.min_workers
            if new in ("running", "draining") and len(live) < mw:
                self._violate("I12", f"phase {new} with {len(live)} live members < min_workers {mw}")
            if new in ("forming", "paused") and len(live) >= mw:
                self._violate("I12", f"phase {new} with {len(live)} live members >= min_workers {mw}")
            self.phase = new
        elif what == "step_refused":
            step.refused.add((rec["fragment_id"], rec["round_id"]))
        elif what == "apply":
            self._apply(rec, step)
        elif what == "stop":
            if step.accept is not None:
                self._accept(step)
            self.stopped = True
            self.stop_kind = rec["kind"]
            for f, pend in enumerate(self.pending):
                for wid, (r, _v) in pend.items():
                    self.counts["discarded_at_stop"] += 1
                    if wid in live:
                        step.expect[(wid, f, r)] = ({"stop"}, None)
                pend.clear()

    def _install(self, step: _Step, sends: list, peer: str) -> None:
        msg = step.msg
        welcome = next((s for s in sends if s["type"] == "Welcome" and s["dst"] == peer), None)
        if msg is None or msg["type"] != "Join" or welcome is None:
            self._violate("params", "the first join has no Join with params or no Welcome")
            return
        fragments = welcome["fragments"]
        values = msg["v"]
        cfg = self.cfg
        nf = len(fragments)
        # The coordinator builds its optimizers when the first worker is welcomed; Delayed
        # Nesterov's default delay is the min_workers of that moment (coordinator/outer.py).
        delay = cfg["outer_delay"] or max(1, self.min_workers)
        opt = [{"buf": None} if cfg["mode"] == "sync" else {"m": None, "d": None, "step": 0} for _ in range(nf)]
        self.model = _Model(fragments=fragments, rounds=[0] * nf,
                            params=[{n: list(values[n]) for n in names} for names in fragments],
                            hist=[{} for _ in range(nf)], opt=opt, delay=delay)
        for f in range(nf):
            self.model.hist[f][0] = self.model.fhash(f)

    def _apply(self, rec: dict, step: _Step) -> None:
        f, r, contributors = rec["fragment_id"], rec["round_id"], rec["contributors"]
        m = self.model
        live = self.live
        cfg = self.cfg
        sync = cfg["mode"] == "sync"
        self.counts["applied_rounds"] += 1
        self.counts["applied_contributions"] += len(contributors)
        acc = step.accept
        if acc is not None and acc[1] == f and (acc[0] in contributors or (sync and acc[2] == r)):
            # The contribution this step accepted precedes an apply of its round (SPEC.md 5.2);
            # an apply that comes first (a tick's death completed the round) is of an older round.
            self._accept(step)
        if m is None:
            self._violate("I4", "a round applied before the run had params")
            return
        if self.stopped:
            self._violate("I5", f"fragment {f} round {r} applied after the stop")
        if r != m.rounds[f]:
            self._violate("I3", f"fragment {f} applied round {r}; the next round in order is {m.rounds[f]}")
        if len(set(contributors)) != len(contributors):
            self._violate("I2", f"fragment {f} round {r} lists a contributor twice: {contributors}")
        mw = self.min_workers
        if len(live) < mw:
            self._violate("I1", f"fragment {f} round {r} applied with {len(live)} live members < min_workers {mw} "
                                f"(contributors {contributors}, live {sorted(live)})")
        if self.phase not in ("running", "draining"):
            self._violate("I1", f"fragment {f} round {r} applied in phase {self.phase}")
        pend = self.pending[f]
        if sync:
            cset = set(contributors)
            missing = [w for w in live if w not in cset]
            if missing:
                self._violate("I1", f"fragment {f} round {r} applied without live members {missing}")
            if len(contributors) < mw:
                self._violate("I1", f"fragment {f} round {r} applied with {len(contributors)} contributors "
                                    f"< min_workers {mw}")
            unaccepted = [w for w in contributors if w not in pend]
            dropped = [w for w in pend if w not in cset]
            if unaccepted:
                self._violate("I4", f"fragment {f} round {r} lists {unaccepted}, whose contributions were never "
                                    f"accepted for it")
            if dropped:
                self._violate("I4", f"fragment {f} round {r} applied without the accepted contributions of "
                                    f"{dropped}: silently dropped")
            keys = [(w, r) for w in contributors if w in pend]
        else:
            if len(contributors) != 1:
                self._violate("I1", f"async fragment {f} version {r} applied {len(contributors)} contributions")
            head = next(iter(pend), None)
            if not contributors or contributors[0] != head:
                self._violate("I4", f"async fragment {f} version {r} applied {contributors}; the first held "
                                    f"contribution is {head!r} (P3: arrival order)")
            keys = [(w, pend[w][0]) for w in contributors if w in pend]
        for w, base in keys:
            key = (w, f, base)
            if key in self.applied_keys:
                self._violate("I2", f"{w}'s contribution to fragment {f} round {base} applied twice")
            self.applied_keys[key] = r
        grads = [pend.pop(w)[1] for w, _ in keys]
        if (f, r) in step.refused:
            # SPEC.md section 12, "Non-finite steps": params and optimizer state unchanged.
            self.counts["steps_refused"] += 1
            if rec["p"] != m.params[f]:
                self._violate("outer", f"fragment {f} round {r}: the step was refused but the params changed")
        elif grads:
            self._check_outer_step(f, r, grads, rec)
        m.params[f] = {n: list(v) for n, v in rec["p"].items()}
        m.rounds[f] = r + 1
        h = m.fhash(f)
        if h != rec["h"]:
            self._violate("params", f"fragment {f} round {r}: recorded hash {rec['h']} does not match its params")
        m.hist[f][r + 1] = h
        if len(m.hist[f]) > 64:
            del m.hist[f][min(m.hist[f])]
        outcome = {"applied_final"} if self.phase == "draining" else {"applied"}
        for w, base in keys:
            if w in live:
                step.expect[(w, f, base)] = (outcome, r + 1)
        if self.heal_t is not None and f not in self.live_applied:
            self.live_applied[f] = rec["t"]

    def _check_outer_step(self, f: int, r: int, grads: list[dict], rec: dict) -> None:
        m = self.model
        cfg = self.cfg
        lr, mu = cfg["outer_lr"], cfg["outer_momentum"]
        names = m.fragments[f]
        n = len(grads)
        mean = {name: [sum(g[name][i] for g in grads) / n for i in range(len(grads[0][name]))] for name in names}
        before = m.params[f]
        opt = m.opt[f]
        expected: dict[str, list[float]] = {}
        if cfg["mode"] == "sync":
            # torch.optim.SGD(lr, momentum=mu, nesterov=mu > 0), dampening 0, no weight decay.
            if mu > 0:
                if opt["buf"] is None:
                    opt["buf"] = {k: list(v) for k, v in mean.items()}
                else:
                    opt["buf"] = {k: [mu * b + g for b, g in zip(opt["buf"][k], mean[k])] for k in names}
                for k in names:
                    d = [g + mu * b for g, b in zip(mean[k], opt["buf"][k])]
                    expected[k] = [p - lr * x for p, x in zip(before[k], d)]
            else:
                for k in names:
                    expected[k] = [p - lr * g for p, g in zip(before[k], mean[k])]
        else:
            # Delayed Nesterov (Liu et al. 2024): the gradient term at once, momentum every `delay` steps.
            delay = m.delay
            if opt["m"] is None:
                opt["m"] = {k: [0.0] * len(before[k]) for k in names}
                opt["d"] = {k: [0.0] * len(before[k]) for k in names}
            opt["step"] += 1
            for k in names:
                p = [x - lr * g / delay for x, g in zip(before[k], mean[k])]
                opt["d"][k] = [d + g for d, g in zip(opt["d"][k], mean[k])]
                if opt["step"] % delay == 0:
                    opt["m"][k] = [mu * mm + d / delay for mm, d in zip(opt["m"][k], opt["d"][k])]
                    p = [x - lr * mu * mm for x, mm in zip(p, opt["m"][k])]
                    opt["d"][k] = [0.0] * len(before[k])
                expected[k] = p
        self.counts["outer_steps_checked"] += 1
        got = rec["p"]
        for k in names:
            for i, (e, g) in enumerate(zip(expected[k], got[k])):
                if abs(e - g) > ATOL + RTOL * abs(e):
                    self._violate("outer", f"fragment {f} round {r}: {k}[{i}] is {g!r}; the outer step on the mean "
                                           f"of its {n} contributions gives {e!r}")
                    return

    def _send(self, rec: dict, step: _Step) -> None:
        typ = rec["type"]
        m = self.model
        live = self.live
        if typ == "Welcome":
            wid = rec["worker_id"]
            join = step.joins.pop(wid, None)
            if join is None:
                self._violate("R6", f"Welcome to {wid} without a join in the same step")
                return
            if rec["round_ids"] != join["rounds"]:
                self._violate("params", f"Welcome to {wid} names rounds {rec['round_ids']}; they are {join['rounds']}")
            if rec["parked"] != join["parked"]:
                self._violate("P2", f"Welcome to {wid} parks {rec['parked']}; its pending contributions are "
                                    f"{join['parked']}")
            for f, h in enumerate(rec["hf"]):
                want = m.hist[f].get(rec["round_ids"][f])
                if h != want:
                    self._violate("params", f"Welcome to {wid}: fragment {f} params {h} are not the params of "
                                            f"round {rec['round_ids'][f]} ({want}); now {m.fhash(f)}")
            below = len(live) < self.min_workers
            if rec["below_min_workers"] != below or rec["min_workers"] != self.min_workers:
                self._violate("I6", f"Welcome to {wid} says below_min_workers={rec['below_min_workers']} "
                                    f"min_workers={rec['min_workers']}; live members {len(live)}, "
                                    f"min_workers {self.min_workers}")
        elif typ == "Result":
            self.counts["results"] += 1
            wid = self._wid_of(rec["dst"])
            key = (wid, rec["fragment_id"], rec["round_id"])
            expected = step.expect.pop(key, None)
            if expected is None:
                self._violate("I11", f"Result {rec['outcome']} to {wid} for fragment {rec['fragment_id']} round "
                                     f"{rec['round_id']} releases nothing this step applied or stopped")
                return
            outcomes, next_round = expected
            if rec["outcome"] not in outcomes:
                self._violate("I11", f"Result to {wid} for fragment {key[1]} round {key[2]} says {rec['outcome']}; "
                                     f"expected {'/'.join(sorted(outcomes))}")
            if rec["outcome"] != "stop":
                # The params right after the apply that released it, and the round after
                # that apply (async: several held contributions may apply in one step).
                f = rec["fragment_id"]
                if rec["next_round_id"] != next_round:
                    self._violate("params", f"Result to {wid} names next round {rec['next_round_id']}; the apply "
                                            f"that released it opened round {next_round}")
                if rec["h"] != m.hist[f].get(rec["next_round_id"]):
                    self._violate("params", f"Result to {wid}: fragment {f} params {rec['h']} are not the params of "
                                            f"round {rec['next_round_id']}")
        elif typ == "HeartbeatReply":
            msg = step.msg
            if rec["below_min_workers"] and rec["command"] == "continue" and msg is not None:
                self.below_reply_to[rec["m"]] = msg["m"]
            if self.stopped:
                want = "save_and_stop" if self.stop_kind == "save_and_stop" else "stop"
                if rec["command"] != want:
                    self._violate("I5", f"after a {self.stop_kind} stop a heartbeat reply says {rec['command']}")
                return
            wid = msg["worker_id"] if msg is not None else None
            member = wid is not None and live.get(wid) == step.header.get("src")
            want = "continue" if member else "rejoin"
            if rec["command"] != want:
                self._violate("R6", f"heartbeat reply to {wid} says {rec['command']}; it is "
                                    f"{'a live member' if member else 'not a live member on that connection'}")
            mw = self.min_workers
            if rec["below_min_workers"] != (len(live) < mw) or rec["min_workers"] != mw:
                self._violate("I6", f"heartbeat reply says below_min_workers={rec['below_min_workers']} "
                                    f"min_workers={rec['min_workers']}; live members {len(live)}, min_workers {mw}")
        elif typ == "Error":
            if rec["code"] == "stopped" and not self.stopped:
                self._violate("R12", "an Error says stopped but the run has not stopped")
            msg = step.msg
            if rec["code"] == "held_limit" and msg is not None and msg["type"] == "Submit":
                self.held_errors[rec["m"]] = (rec["dst"], msg["fragment_id"])
        elif typ == "AdminReply":
            header = step.header
            if header.get("command") == "set_min_workers" and rec["ok"]:
                value = header["args"].get("min_workers")
                if value not in step.quorum_min:
                    self._violate("R8", f"min_workers set to {value} without a quorum event announcing it")


def check_records(records: Iterable[dict]) -> tuple[list[Violation], TraceChecker]:
    checker = TraceChecker()
    for rec in records:
        checker.feed(rec)
    return checker.finish(), checker
