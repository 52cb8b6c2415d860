"""Every state a member's machine reaches in a bounded number of events, checked (SPEC.md M1-M4, M9).

One ``MemberMachine`` that has started a run (one fragment), fed every event of a small alphabet
in every order -- the coordinator's orders (two attempts), aborts, commits (its own digest or
another), a Welcome that starts it again, a heal order, a Submit, and the completion of the job
it runs (a proposal, a failure, a blame) -- breadth first, states deduplicated, to ``DEPTH``
events. In every state reached:

* at most one job runs, and none starts while a reported proposal awaits its verdict (M2);
* a commit job is only ever started for the open proposal's round and digest, after a commit
  Result with that digest (M3);
* the session is handed a Result only with the params of a commit job's completion (M3, M7);
* an attempt is reported at most once (per coordinator: a Welcome may come from a restarted one,
  which numbers its attempts anew), and a proposal is reported only if it was made (M9);
* the held state's round only moves forward by commits (M3) or a Welcome (M4).
"""

from __future__ import annotations

import copy

from hypothesis import settings

from diloco.collective.member import (
    CommitJob,
    Committed,
    HealJob,
    HealServed,
    MemberMachine,
    Reduced,
    ReduceJob,
    RollbackJob,
    RolledBack,
    RunJob,
    ServeHealJob,
    Started,
    StartJob,
    ToCoordinator,
    ToSession,
)
from diloco.wire.messages import (
    PROTOCOL_VERSION,
    Error,
    ErrorCode,
    HealOrder,
    Join,
    ReduceAbort,
    ReduceOrder,
    ReduceReport,
    Result,
    Submit,
    TensorSpec,
    Welcome,
)

WID = "w1"
FRAGMENTS = (("a",),)
SPEC = (TensorSpec("a", (2,), "float32"),)
#: 7 under the ci profile; 6 under mutation (tests/conftest.py), where every mutant reruns it.
DEPTH = 7 if settings.default.max_examples >= 250 else 6


def _welcome(rounds=(0,), committed=((-1, ""),)) -> Welcome:
    return Welcome(WID, rounds, (), "sync", FRAGMENTS, 2, False, 1.0, {}, data_plane="collective", store_port=1,
                   collective_timeout_s=1.0, committed=committed)


def _started() -> MemberMachine:
    m = MemberMachine(WID)
    m.received(Error(ErrorCode.START_PARAMS_REQUIRED, "start", "Join"))
    m.session_sends(Join(WID, PROTOCOL_VERSION, SPEC, {"a": "p"}))
    m.received(_welcome())
    m.completed(Started(("d0",), {"a": "p"}))
    return m


class World:
    """The machine and what the test remembers of its outputs."""

    def __init__(self) -> None:
        self.m = _started()
        self.running = None
        self.reported: set[tuple[int, int, int]] = set()
        self.commits_heard: set[tuple[int, int, str]] = set()
        self.proposals_made: set[tuple[int, int, int, str]] = set()
        self.path: list = []  # the events so far, for a failure's message

    def key(self) -> tuple:
        m = self.m
        return (repr(self.running), repr(sorted(self.reported)), repr(sorted(self.commits_heard)),
                m.held, tuple(m.proposals.items()), tuple(sorted(m._orders.items())), m._awaiting,
                tuple(repr(j) for j in m._queue), m.welcome_withheld, tuple(sorted(m._voided)),
                tuple(sorted((f, s.round_id) for f, s in m._pending.items())))

    def apply(self, event) -> None:
        kind, arg = event
        m = self.m
        self.path.append((kind, type(arg).__name__ if kind != "done" else arg,
                          getattr(arg, "attempt", getattr(arg, "digest", ""))))
        if kind == "recv":
            if isinstance(arg, Welcome):
                self.reported.clear()  # a restarted coordinator numbers its attempts from 0 again
            if isinstance(arg, Result) and arg.digest:
                self.commits_heard.add((arg.fragment_id, arg.round_id, arg.digest))
            actions = m.received(arg)
        elif kind == "send":
            actions = m.session_sends(arg)
        else:  # "done": the running job completes as ``arg`` says
            job = self.running
            if job is None:
                return
            self.running = None
            actions = m.completed(self._completion(job, arg))
        self._check(actions)

    def _completion(self, job, how: str):
        if isinstance(job, ReduceJob):
            if how == "ok":
                digest = f"D{job.order.round_id}.{job.order.attempt}"
                self.proposals_made.add((job.order.fragment_id, job.order.round_id, job.order.attempt, digest))
                return Reduced(digest)
            return Reduced("", "failed") if how == "fail" else Reduced("", "blame", blame=("w2",))
        if isinstance(job, CommitJob):
            return Committed({"a": f"r{job.round_id}"})
        if isinstance(job, RollbackJob):
            return RolledBack()
        if isinstance(job, StartJob):
            return Started(("d",), {"a": "s"})
        if isinstance(job, ServeHealJob):
            return HealServed(how == "ok")
        raise AssertionError(f"unexpected job {job!r}")

    def _check(self, actions) -> None:
        m = self.m
        for a in actions:
            if isinstance(a, RunJob):
                assert self.running is None, "M2: a second job while one runs"
                assert m._awaiting is None, "M2: a job while a reported proposal awaits its verdict"
                if isinstance(a.job, CommitJob):
                    j = a.job
                    assert (j.fragment_id, j.round_id, j.digest) in self.commits_heard, "M3: commit unheard"
                    assert any(p[:2] == (j.fragment_id, j.round_id) and p[3] == j.digest
                               for p in self.proposals_made), "M3: a commit of something not proposed"
                self.running = a.job
            elif isinstance(a, ToCoordinator) and isinstance(a.message, ReduceReport):
                r = a.message
                key = (r.fragment_id, r.round_id, r.attempt)
                assert key not in self.reported, f"M9: an attempt reported twice: {self.path}"
                self.reported.add(key)
                if r.ok:
                    assert (r.fragment_id, r.round_id, r.attempt, r.digest) in self.proposals_made
            elif isinstance(a, ToSession) and isinstance(a.item, Result) and a.item.outcome == "applied":
                assert a.item.params and not a.item.digest, "M7: a commit reaches the session with params"


def _alphabet() -> list:
    orders = [ReduceOrder(0, 0, attempt, (WID, "w2"), f"g{attempt}", (1.0, 1.0)) for attempt in (0, 1)]
    return ([("recv", o) for o in orders]
            + [("recv", ReduceAbort(0, 0, 0, "timeout")), ("recv", ReduceAbort(0, 0, 1, "timeout"))]
            + [("recv", Result(0, 0, "applied", 1, digest=d)) for d in ("D0.0", "D0.1", "OTHER")]
            + [("recv", _welcome(rounds=(1,), committed=((0, "D0.0"),))), ("recv", HealOrder("w3", "h1"))]
            + [("send", Submit(WID, 0, 0, {"a": "g"}, norm=1.0))]
            + [("done", how) for how in ("ok", "fail", "blame")])


def test_every_state_within_depth_keeps_the_member_rules():
    alphabet = _alphabet()
    frontier = [World()]
    seen = {frontier[0].key()}
    explored = 0
    for _depth in range(DEPTH):
        nxt = []
        for world in frontier:
            for event in alphabet:
                w = copy.deepcopy(world)
                w.apply(event)
                explored += 1
                k = w.key()
                if k not in seen:
                    seen.add(k)
                    nxt.append(w)
        frontier = nxt
    assert explored > 10_000 and len(seen) > 1_000, (explored, len(seen))
