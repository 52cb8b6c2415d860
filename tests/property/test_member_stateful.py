"""Hypothesis runs the real ``Coordinator`` with three ``MemberMachine``s over a simulated data plane
(SPEC.md sections 7b and 7c).

Each member's replica is one number per fragment; a contribution is a number too, its norm its
absolute value. The data plane here is a model of gloo: a reduce completes only when every
member of the group is in it (then each proposes ``old - lr * mean`` and votes with its digest),
or times out; a heal copies the source's committed state if the source lives. The test plays
each member's session (join, say ready with a contribution, take a Result, join again when told)
and can, in any order: deliver or lose a message, finish a job, time a reduce out, change a mean
(a nondeterministic kernel: another digest), crash a member before, inside or after a reduce and
start it again, let the clock run past the reduce deadline, restart the coordinator from a
snapshot taken at any earlier moment (``restore_coordinator``; members' connections drop and
their sessions join again) -- and one member, ``w2``, may turn bad: its contributions huge or
NaN, declared honestly or not (a lie only the group can see).

After every step: no member adopts what the machine did not commit; members that adopt a
(fragment, round) under one coordinator hold the same digest (a coordinator restored from an
older snapshot numbers rounds from its record again, C6, so a round id names one state per
coordinator incarnation; M10 keeps such labels out of checkpoints); no commit has fewer than
``min_workers`` contributors; no committed step contains a contribution that fails the checks;
no honest member is evicted; every checkpoint a member writes at its sync point (M10: only once
its state is confirmed) holds, for its round label, a state a commit made for that label.
At the end, with the faults stopped: when at least ``min_workers`` honest members live, a round
commits within a bounded number of steps (or the run stopped with a reason).
"""

from __future__ import annotations

import collections
import copy
import hashlib
import math
import pickle

import pytest

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from diloco.coordinator.checkpoint import coordinator_state, restore_coordinator
from diloco.collective.member import (
    NORM_SLACK,
    CommitJob,
    Committed,
    HealFailed,
    Healed,
    HealJob,
    HealServed,
    MemberMachine,
    PlaneEvent,
    PlaneEventKind,
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
    judge_contributions,
    judge_mean,
)
from diloco.testing import make_coordinator
from diloco.wire.messages import (
    PROTOCOL_VERSION,
    Error,
    ErrorCode,
    Join,
    Leave,
    Result,
    Submit,
    TensorSpec,
    Welcome,
)

MEMBERS = ("w0", "w1", "w2")
BAD = "w2"
SPEC = (TensorSpec("x", (1,), "float32"),)
LR = 0.5
MAX_NORM = 100.0
REJOIN = {ErrorCode.STALE_ROUND, ErrorCode.FUTURE_ROUND, ErrorCode.UNKNOWN_WORKER, ErrorCode.EVICTED}


def _digest(fid: int, value: float) -> str:
    return f"{fid}:{value!r}"


class Member:
    """One worker incarnation: its machine, its toy replica and the session the test plays."""

    def __init__(self, wid: str, incarnation: int) -> None:
        self.wid = wid
        self.peer = f"{wid}#{incarnation}"
        self.machine = MemberMachine(wid)
        #: The replica: committed value, and an open proposal (round, value).
        self.value: float | None = None
        self.proposal: tuple[int, float] | None = None
        self.job = None
        self.job_generation = 0  # the coordinator generation whose message started the job
        self.inbox: collections.deque = collections.deque()
        self.welcomed = False
        self.round = 0
        self.stopped = False
        self.mismatch = False  # its next reduce proposes from a changed mean
        self.already = 0       # already_member answers since its last Welcome
        self.quiet = 0         # nudges since it last heard a Welcome or Result
        self.retry = False     # its ready met a reduce without it: submit again (W8)


class MemberWorld(RuleBasedStateMachine):
    def __init__(self, members: tuple[str, ...] = MEMBERS) -> None:
        super().__init__()
        self.now = 1.0
        self.events: list[tuple[str, dict]] = []
        self.c = make_coordinator(self.now, min_workers=2, data_plane="collective", heartbeat_timeout_s=1e6,
                                  reduce_timeout_s=10.0, collective_timeout_s=1.0, max_update_norm=MAX_NORM,
                                  max_failed_attempts=1000, observer=self._observe)
        #: The coordinator's incarnation (restarts count up), and the snapshot a restart restores.
        self.generation = 0
        self.snapshot: tuple[dict, dict] | None = None
        #: generation -> (fragment, round) -> digest: what that coordinator committed, and the
        #: record of last commits it was restored with.
        self.commits: dict[int, dict[tuple[int, int], str]] = {0: {}}
        #: A member incarnation (its peer name) -> how many of its machine's adoptions are checked, and under which
        #: coordinator generation each was made.
        self.adoptions: dict[str, list[int]] = {}
        self.checkpoints_written = 0
        self.members: dict[str, Member] = {}
        self.incarnations = collections.Counter()
        #: (wid, fid, rid) -> (actual contribution, declared norm) of the Submits made.
        self.sent: dict[tuple[str, int, int], tuple[float, float]] = {}
        self.bad_mode = "honest"  # of w2: honest, huge, nan, lie_huge, lie_nan, blame_w0
        self.faults = True
        for wid in members:
            self._start(wid)

    # ------------------------------------------------------------------ plumbing

    def _start(self, wid: str) -> None:
        self.incarnations[wid] += 1
        m = self.members[wid] = Member(wid, self.incarnations[wid])
        self._session_send(m, Join(wid, PROTOCOL_VERSION, SPEC))

    def _observe(self, kind: str, _now: float, info: dict) -> None:
        self.events.append((kind, info))
        if kind == "apply":
            # Checked as it happens: contributions are what their senders submitted for this round
            # (a later submit for the same round id, after a restart, may differ).
            fid, rid, digest = info["fragment_id"], info["round_id"], info["digest"]
            contributors = tuple(info["contributors"])
            assert len(contributors) >= 2, f"a commit below min_workers: {contributors}"
            for wid in contributors:
                actual, declared = self.sent[(wid, fid, rid)]
                assert math.isfinite(actual) and math.isfinite(declared) and declared <= MAX_NORM
                assert abs(actual) <= declared * (1 + NORM_SLACK) + 1e-12, (wid, rid, actual, declared)
            known = self.commits[self.generation].setdefault((fid, rid), digest)
            assert known == digest, f"one coordinator committed {fid}/{rid} twice: {known} and {digest}"

    def _session_send(self, m: Member, message) -> None:
        self._carry_out(m, m.machine.session_sends(message))

    def _to_coordinator(self, m: Member, message) -> None:
        for peer, reply in self.c.handle(m.peer, message, self.now):
            self._deliver_later(peer, reply)

    def _deliver_later(self, peer: str, message) -> None:
        for m in self.members.values():
            if m.peer == peer and not m.stopped:
                m.inbox.append(message)

    def _carry_out(self, m: Member, actions) -> None:
        for action in actions:
            if m.stopped:
                return
            if isinstance(action, ToCoordinator):
                self._to_coordinator(m, action.message)
            elif isinstance(action, ToSession):
                self._session(m, action.item)
            elif isinstance(action, RunJob):
                assert m.job is None, "M2: one job at a time"
                m.job, m.job_generation = action.job, self.generation

    def _contribution(self, m: Member, fid: int, rid: int) -> tuple[float, float]:
        honest = 0.1 + 0.01 * (hash((m.wid, rid)) % 7)
        if m.wid != BAD or self.bad_mode in ("honest", "blame_w0"):
            return honest, abs(honest)
        return {"huge": (1e6, 1e6), "nan": (math.nan, math.nan), "lie_huge": (1e6, abs(honest)),
                "lie_nan": (math.nan, abs(honest))}[self.bad_mode]

    def _submit(self, m: Member) -> None:
        self._checkpoint(m)  # at the sync point, as --checkpoint-every 1
        value, norm = self._contribution(m, 0, m.round)
        self.sent[(m.wid, 0, m.round)] = (value, norm)
        self._session_send(m, Submit(m.wid, 0, m.round, {"x": value}, norm=norm))

    def _checkpoint(self, m: Member) -> None:
        """What the worker writes (M10): nothing while its state is unconfirmed; else the held round
        label with the replica's state, which must be one a commit made for that label."""
        held = m.machine.held
        if held is None or m.value is None or not m.machine.state_confirmed:
            return
        label, digest = held.round_ids[0], _digest(0, m.value)
        made = {commits.get((0, label - 1)) for commits in self.commits.values()} - {None}
        assert label == 0 or digest in made, (
            f"{m.wid} wrote a checkpoint of round {label} holding {digest}, a state no commit made for that "
            f"label ({sorted(made)})")
        self.checkpoints_written += 1

    def _session(self, m: Member, item) -> None:
        """The session's part, simplified: join, say ready, take Results, join again when told."""
        if isinstance(item, Welcome):
            m.welcomed, m.round, m.already, m.quiet = True, item.round_ids[0], 0, 0
            self._submit(m)
        elif isinstance(item, Result):
            m.quiet = 0
            if item.outcome in ("applied", "applied_final") and m.welcomed:
                m.round = item.next_round_id
                self._submit(m)
        elif isinstance(item, Error):
            if item.code in (ErrorCode.START_PARAMS_REQUIRED, ErrorCode.PARAMS_REQUIRED):
                self._session_send(m, Join(m.wid, PROTOCOL_VERSION, SPEC, {"x": 1.0}))
            elif item.code is ErrorCode.REDUCING and item.in_reply_to == "Submit":
                m.retry = True  # W8: ready again a heartbeat interval later (the next nudge)
            elif item.code in REJOIN and item.in_reply_to == "Submit":
                m.welcomed = False
                self._session_send(m, Join(m.wid, PROTOCOL_VERSION, SPEC))
            elif item.code is ErrorCode.ALREADY_MEMBER and m.already < 3:  # W1: leave, join again
                m.already += 1
                self._session_send(m, Leave(m.wid))
                self._session_send(m, Join(m.wid, PROTOCOL_VERSION, SPEC))
            elif item.code is ErrorCode.ALREADY_MEMBER:
                self._crash(m, leave=True)  # W1: a fourth one fails
            elif item.code in (ErrorCode.NON_FINITE, ErrorCode.UPDATE_TOO_LARGE, ErrorCode.BANNED):
                self._crash(m, leave=True)  # W14: the worker fails and says goodbye
        elif isinstance(item, PlaneEvent):
            if item.kind is PlaneEventKind.LOST_TRACK and m.welcomed:
                m.welcomed = False
                self._session_send(m, Join(m.wid, PROTOCOL_VERSION, SPEC))
            elif item.kind in (PlaneEventKind.HEAL_FAILED, PlaneEventKind.NO_START_STATE):
                self._crash(m, leave=True)

    def _crash(self, m: Member, leave: bool = False) -> None:
        if m.stopped:
            return
        m.stopped = True
        m.machine.close()
        m.job = None
        if leave:
            for peer, reply in self.c.handle(m.peer, Leave(m.wid), self.now):
                self._deliver_later(peer, reply)
        for peer, reply in self.c.peer_lost(m.peer, self.now):
            self._deliver_later(peer, reply)

    def _nudge(self, m: Member) -> None:
        """What a quiet session does: W1, a join left unanswered is sent again; W9, a Result waited
        for too long may be lost (the run moved past the round): join again."""
        m.quiet += 1
        if m.retry and m.welcomed:
            m.retry = False
            self._submit(m)
            return
        open_round = self.c.fsm.open_round_ids()[0]
        if not m.welcomed or m.round < open_round or m.quiet >= 3:
            m.welcomed, m.quiet = False, 0
            self._session_send(m, Join(m.wid, PROTOCOL_VERSION, SPEC))

    def _live(self) -> list[Member]:
        return [m for m in self.members.values() if not m.stopped]

    # ------------------------------------------------------------------ the data plane (toy gloo)

    def _finish(self, m: Member, timed_out: bool = False) -> bool:
        job = m.job
        if isinstance(job, ReduceJob):
            return self._finish_reduce(m, job, timed_out)
        if isinstance(job, CommitJob):
            assert m.proposal is not None and m.proposal[0] == job.round_id
            assert _digest(0, m.proposal[1]) == job.digest, "M3: a commit adopts the proposal voted for"
            m.value, m.proposal = m.proposal[1], None
            done = Committed({"x": m.value})
        elif isinstance(job, RollbackJob):
            m.proposal = None
            done = RolledBack()
        elif isinstance(job, StartJob):
            if job.keep:
                for fid in job.adopt:  # M4: an orphaned proposal is adopted only as what was committed
                    rid, digest = job.welcome.committed[fid]
                    assert m.proposal is not None and (m.proposal[0], _digest(fid, m.proposal[1])) == (rid, digest), (
                        f"{m.wid} adopts an orphaned proposal {m.proposal} as the commit {rid}/{digest}")
                    m.value, m.proposal = m.proposal[1], None
                if job.rollback:
                    m.proposal = None
            else:
                m.value = float(job.params["x"]) if isinstance(job.params, dict) else 1.0
            done = Started((_digest(0, m.value),), {"x": m.value})
        elif isinstance(job, HealJob):
            m.proposal = None
            source = self.members.get(job.welcome.heal_source)
            if timed_out or source is None or source.stopped or source.value is None:
                done = HealFailed("the source is gone")
            else:
                held = source.machine.held
                value = source.value
                m.value = value
                done = Healed((held.round_ids[0],), (_digest(0, value),), {"x": value})
        elif isinstance(job, ServeHealJob):
            done = HealServed(True)
        else:
            return False
        m.job = None
        self._tag_adoptions()
        generation = m.job_generation  # a commit heard before a restart is that coordinator's
        self._carry_out(m, m.machine.completed(done))
        self._tag_adoptions(m, generation)
        return True

    def _finish_reduce(self, m: Member, job: ReduceJob, timed_out: bool) -> bool:
        order = job.order
        key = (order.fragment_id, order.round_id, order.attempt)
        peers = [self.members.get(w) for w in order.group]
        together = all(p is not None and not p.stopped and isinstance(p.job, ReduceJob)
                       and (p.job.order.fragment_id, p.job.order.round_id, p.job.order.attempt) == key
                       for p in peers)
        if not together:
            if not timed_out:
                return False
            m.job = None
            self._carry_out(m, m.machine.completed(Reduced("", "timed out")))
            return True
        # The group meets: every member of it completes now, in rank order.
        contributions = [float(p.job.submit.tensors["x"]) for p in peers]
        norms = tuple(abs(x) for x in contributions)
        gather = order.gather
        mean = sum(contributions) / len(contributions)
        for p in peers:
            mismatch, p.mismatch = p.mismatch, False
            if p.wid == BAD and self.bad_mode == "blame_w0":
                # A liar's blame of an honest member, every attempt: it must never evict w0.
                p.job = None
                self._carry_out(p, p.machine.completed(Reduced("", "checks", blame=("w0",))))
                continue
            if gather:
                blamed = judge_contributions(order, norms)
                if blamed:
                    done = Reduced("", "checks", blame=blamed)
                    p.job = None
                    self._carry_out(p, p.machine.completed(done))
                    continue
            elif judge_mean(order, abs(mean)):
                p.job = None
                self._carry_out(p, p.machine.completed(Reduced("", "mean", mean_refused=True)))
                continue
            new = p.value - LR * (mean + (1e-3 if mismatch else 0.0))
            p.proposal = (order.round_id, new)
            p.job = None
            self._carry_out(p, p.machine.completed(Reduced(_digest(0, new))))
        return True

    # ------------------------------------------------------------------ rules

    def _pick(self, i: int) -> Member | None:
        live = self._live()
        return live[i % len(live)] if live else None

    @rule(i=st.integers(0, 5))
    def deliver(self, i):
        m = self._pick(i)
        if m is not None and m.inbox:
            self._carry_out(m, m.machine.received(m.inbox.popleft()))

    @rule(passes=st.integers(1, 10))
    def run_smoothly(self, passes):
        """A while without faults: every message arrives and every job that can finish does."""
        for _ in range(passes):
            self._pass()

    def _pass(self) -> bool:
        progressed = False
        for m in self._live():
            if m.retry and m.welcomed and m.job is None:  # W8: a heartbeat interval later
                m.retry = False
                self._submit(m)
                progressed = True
            while m.inbox and not m.stopped:
                self._carry_out(m, m.machine.received(m.inbox.popleft()))
                progressed = True
            if m.job is not None and not m.stopped and self._finish(m):
                progressed = True
        return progressed

    @precondition(lambda self: self.faults)
    @rule(i=st.integers(0, 5))
    def lose(self, i):
        m = self._pick(i)
        if m is not None and m.inbox:
            m.inbox.popleft()

    @rule(i=st.integers(0, 5))
    def finish_job(self, i):
        m = self._pick(i)
        if m is not None and m.job is not None:
            self._finish(m)

    @precondition(lambda self: self.faults)
    @rule(i=st.integers(0, 5))
    def time_out_job(self, i):
        m = self._pick(i)
        if m is not None and m.job is not None:
            self._finish(m, timed_out=True)

    @precondition(lambda self: self.faults)
    @rule(i=st.integers(0, 5))
    def change_a_mean(self, i):
        m = self._pick(i)
        if m is not None:
            m.mismatch = True

    @precondition(lambda self: self.faults)
    @rule(i=st.integers(0, 5))
    def crash(self, i):
        m = self._pick(i)
        if m is not None and len(self._live()) > 1:
            self._crash(m)

    @initialize(mode=st.sampled_from(["honest", "lie_huge", "lie_nan", "huge", "blame_w0"]), smooth=st.integers(0, 6))
    def begin(self, mode, smooth):
        """How w2 starts (it may turn later), and how far the run gets before the faults begin."""
        self.bad_mode = mode
        for _ in range(smooth):
            self._pass()

    @rule(i=st.integers(0, 5))
    def quiet_session(self, i):
        m = self._pick(i)
        if m is not None:
            self._nudge(m)

    @rule(wid=st.sampled_from(MEMBERS))
    def restart(self, wid):
        m = self.members.get(wid)
        if m is not None and m.stopped and wid not in self.c.access.banned_ids:
            self._start(wid)

    @precondition(lambda self: self.faults)
    @rule(dt=st.sampled_from([0.5, 11.0]))
    def clock(self, dt):
        self.now += dt
        for peer, reply in self.c.tick(self.now):
            self._deliver_later(peer, reply)

    @rule()
    def take_snapshot(self):
        if self.c.has_state and not self.c.stopped:
            self.snapshot = coordinator_state(self.c)

    @precondition(lambda self: self.faults and self.snapshot is not None)
    @rule()
    def restart_coordinator(self):
        """The coordinator's process dies and starts again from the last snapshot: messages in
        flight are lost, every member's session finds its connection gone and joins again."""
        self._tag_adoptions()
        meta, tensors = self.snapshot
        self.generation += 1
        self.c = restore_coordinator(meta, tensors, self.now, observer=self._observe)
        self.c.collective.incarnation = f"gen{self.generation}"
        self.commits[self.generation] = {(f, r): d for f, (r, d) in enumerate(self.c.collective.last_commit)
                                         if r >= 0}
        for m in self._live():
            m.inbox.clear()
            m.welcomed, m.retry, m.quiet = False, False, 0
            self._session_send(m, Join(m.wid, PROTOCOL_VERSION, SPEC))

    @precondition(lambda self: self.faults)
    @rule(mode=st.sampled_from(["honest", "huge", "nan", "lie_huge", "lie_nan", "blame_w0"]))
    def turn(self, mode):
        self.bad_mode = mode

    # ------------------------------------------------------------------ invariants

    def _tag_adoptions(self, only: Member | None = None, generation: int | None = None) -> None:
        """Note the coordinator generation of each adoption made since the last look: the one
        whose commit (or Welcome) the adopting job answered."""
        for m in [only] if only is not None else self.members.values():
            tags = self.adoptions.setdefault(m.peer, [])
            gen = self.generation if generation is None else generation
            tags.extend([gen] * (len(m.machine.adopted) - len(tags)))

    @invariant()
    def nothing_adopted_uncommitted_and_one_state_per_round(self):
        # With the commits' own checks in ``_observe`` (quorum, contributions, one digest per
        # round per coordinator): whatever a member adopts is what its coordinator committed.
        self._tag_adoptions()
        for m in self.members.values():
            for (fid, rid, digest), gen in zip(m.machine.adopted, self.adoptions[m.peer]):
                assert self.commits[gen].get((fid, rid)) == digest, (
                    f"{m.wid} adopted uncommitted {fid}/{rid} under coordinator {gen}")

    @invariant()
    def no_honest_member_evicted(self):
        evicted = {e["worker_id"] for k, e in self.events if k == "evicted"}
        assert evicted <= {BAD}, evicted

    def teardown(self):
        # Faults stop: w2 turns honest or stays out, messages arrive, jobs finish. With at least
        # min_workers honest members alive (started again if need be), a round commits soon.
        self.faults = False
        self.bad_mode = "honest"
        event(f"commits during the faults: {min(self.c.fsm.rounds_applied, 3)}{'+' if self.c.fsm.rounds_applied >= 3 else ''}")
        event(f"evictions: {sum(1 for k, _ in self.events if k == 'evicted')}")
        event(f"coordinator restarts: {min(self.generation, 2)}{'+' if self.generation >= 2 else ''}")
        event(f"checkpoints written: {min(self.checkpoints_written, 5)}{'+' if self.checkpoints_written >= 5 else ''}")
        if self.c.stopped:
            assert self.c.stop_reason, "the run stopped with no reason"
            return
        for wid in ("w0", "w1"):
            if self.members[wid].stopped:
                self._start(wid)
        before = self.c.fsm.rounds_applied
        for step in range(400):
            if self.c.fsm.rounds_applied > before or self.c.stopped:
                break
            self._pass()
            if step % 5 == 4:  # time passes: deadlines, timeouts, quiet sessions, a supervisor
                for m in self._live():
                    if isinstance(m.job, ReduceJob):
                        self._finish(m, timed_out=True)
                    elif m.job is None:
                        self._nudge(m)
                for wid in ("w0", "w1"):
                    if self.members[wid].stopped:
                        self._start(wid)
                self.now += 11.0
                for peer, reply in self.c.tick(self.now):
                    self._deliver_later(peer, reply)
        assert self.c.fsm.rounds_applied > before or self.c.stopped, (
            f"no commit within 400 steps after the faults stopped: phase {self.c.fsm.phase.value}, "
            f"members {[m.wid for m in self._live()]}, jobs {[type(m.job).__name__ for m in self._live()]}")


# Sized from the loaded profile (tests/conftest.py; ci runs 250 examples): 300 here under ci,
# fewer under mutation, more under long.
_SCALE = settings.default.max_examples / 250
MemberWorld.TestCase.settings = settings(max_examples=max(20, int(300 * _SCALE)), stateful_step_count=60,
                                         deadline=None)
TestMemberWorld = MemberWorld.TestCase


# --------------------------------------------------------------------------- every interleaving


def _key(world: MemberWorld) -> bytes:
    """The world's present (not its history of events), for deduplication."""
    observer, world.c._observer = world.c._observer, None
    try:
        return hashlib.sha1(pickle.dumps((world.c, world.members, world.now, world.generation, world.commits,
                                          world.sent, world.bad_mode, world.snapshot))).digest()
    finally:
        world.c._observer = observer


def _moves(world: MemberWorld) -> list[tuple[str, object]]:
    moves: list[tuple[str, object]] = []
    for i, m in enumerate(world._live()):
        if m.inbox:
            moves += [("deliver", i), ("lose", i)]
        if m.job is not None:
            moves += [("finish_job", i), ("time_out_job", i)]
        if not m.mismatch and isinstance(m.job, ReduceJob):
            moves.append(("change_a_mean", i))  # its reduce will propose another digest
        if len(world._live()) > 1:
            moves.append(("crash", i))
    moves += [("restart", wid) for wid, m in world.members.items() if m.stopped]
    moves.append(("clock", 11.0))
    if world.snapshot is None and world.c.has_state:
        moves.append(("take_snapshot", None))
    if world.generation == 0 and world.snapshot is not None:
        moves.append(("restart_coordinator", None))
    return moves


def _move(world: MemberWorld, move: tuple[str, object]) -> None:
    name, arg = move
    if name == "clock":
        world.clock(dt=arg)
    elif name == "restart":
        world.restart(wid=arg)
    elif name in ("restart_coordinator", "take_snapshot"):
        getattr(world, name)()
    else:
        getattr(world, name)(i=arg)
    world.nothing_adopted_uncommitted_and_one_state_per_round()
    world.no_honest_member_evicted()


@pytest.mark.parametrize("members, mode, smooth, depth", [
    (("w0", "w1"), "honest", 0, 5),      # two members, from their first joins
    (("w0", "w1"), "honest", 3, 5),      # two members, a round under way
    (("w0", "w1", "w2"), "lie_huge", 2, 4),  # three, one lying about its contribution's norm
])
def test_every_interleaving_within_depth_keeps_the_invariants(members, mode, smooth, depth):
    """Two and three members: every sequence of ``depth`` moves (deliver or lose a message, finish
    or time out a job, change a running reduce's mean, crash or restart a member, the clock past the deadlines, the coordinator
    restarted from a snapshot taken at the start or once the run has state) from a state the
    run reached smoothly,
    breadth first, states deduplicated; the invariants above are checked after every move (the
    commit checks as each commit happens)."""
    root = MemberWorld(members)
    root.begin(mode=mode, smooth=smooth)
    root.take_snapshot()
    frontier, seen, explored = [root], {_key(root)}, 0
    for _depth in range(depth):
        following = []
        for world in frontier:
            for move in _moves(world):
                nxt = copy.deepcopy(world)
                _move(nxt, move)
                explored += 1
                k = _key(nxt)
                if k not in seen:
                    seen.add(k)
                    following.append(nxt)
        frontier = following
    print(f"{len(members)} members, {mode}, depth {depth}: {explored} moves, {len(seen)} states")
    assert explored > 1_000 and len(seen) > 500, (explored, len(seen))
