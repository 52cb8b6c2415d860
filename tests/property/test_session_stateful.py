"""Hypothesis drives a WorkerSession and the reference model side by side (SPEC.md section 14).

Rules model what the world can do to a worker: time passes (monotonic), the
driver finishes inner steps and ticks (``overlap_steps`` 0, 1 or 2: W15-W18), the
coordinator sends Welcomes (any round
ids, parked lists, quorum flag, mode, 1-3 fragments, heartbeat interval; now and
then a bad one), heartbeat replies with every command, Accepted, Results for the
awaited (fragment, round) and for anything else with every outcome (and one the
worker does not know), Errors with every ``ErrorCode`` in reply to Join, Submit,
Heartbeat or nothing; the driver asks to stop (saving or not), leaves, reports
the Stop done or fails. Tensors are placeholder strings: the session never
touches them.

After every event: the session's protocol actions equal the model's, in order,
and so do the observables (state, waiting, retries, merge steps and held Results,
round ids, schedule, inner_step, rounds_synced, stop_reason, seconds_paused).
Independently of the model: W5/W16 (TRAINING implies nothing retrying and every
awaited or held Result within its overlap window; ``may_train`` only in
TRAINING), no ``SubmitFragment`` for a fragment already waiting or merging, a
``MergeParams`` only for a fragment whose ``applied`` Result came, no heartbeat
while joining (W3), nothing emitted once STOPPED (but the one ``Leave`` of W13),
at most one ``Stop`` per session, the state is one of ``SESSION_STATES``, and
``seconds_paused`` never decreases.
"""

from __future__ import annotations

import math

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from diloco.wire.messages import (
    Accepted,
    Command,
    Error,
    ErrorCode,
    Heartbeat,
    HeartbeatReply,
    Join,
    Leave,
    Result,
    TensorSpec,
    Welcome,
)
from diloco.worker.actions import InstallParams, MergeParams, Send, StateChanged, Stop, SubmitFragment
from diloco.worker.session import WorkerSession
from diloco.worker.states import SESSION_STATES, WorkerState
from session_model import SessionModel, observe, session_observables

WID = "w"
NAMES = ("a", "b", "c")
SPEC = tuple(TensorSpec(n, (2,), "float32") for n in NAMES)
PARAMS = {n: f"global-{n}" for n in NAMES}   # placeholders: the session never looks inside
#: Fragment layouts a coordinator may announce (two different ones with two fragments).
LAYOUTS = (
    (("a", "b", "c"),),
    (("a",), ("b", "c")),
    (("a", "b"), ("c",)),
    (("a",), ("b",), ("c",)),
)
BAD_LAYOUTS = ((("a", "b"),), (("a",), ("b", "c", "d")))
#: Quarter seconds: exact in binary, so boundaries (">= 16 intervals") are hit exactly.
STEPS_S = (0.0, 0.25, 0.5, 1.0, 2.5, 4.0, 5.0, 10.0)
INTERVALS_S = (0.25, 0.5, 1.0, 2.0)
OUTCOMES = ("applied",) * 6 + ("applied_final", "stop", "lost_in_translation")
COMMANDS = (Command.CONTINUE,) * 12 + tuple(Command)
#: Refusals a worker acts on without failing, with the message they answer (W1, W10; the rest ignored).
PROTOCOL_ERRORS = (
    ("params_required", "Join"), ("start_params_required", "Join"), ("already_member", "Join"), ("already_member", "Join"),
    ("unknown_worker", "Heartbeat"), ("stale_round", "Leave"), ("duplicate", "Accepted"))
#: A Submit's refusals that do not end the session (W8, W10; duplicate: its Result will come).
SUBMIT_ERRORS = ("held_limit", "held_limit", "held_limit", "duplicate", "stale_round", "future_round", "reducing",
                 "unknown_worker", "stopped", "shutting_down")
IN_REPLY_TO = ("Join", "Submit", "Heartbeat", "", "Leave")


class SessionMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.stops = 0
        self.last_paused = 0.0
        self.state_before: WorkerState | None = None
        #: Fragments whose applied Result came and has not been merged yet (W16), seen from outside.
        self.applied_unmerged: set[int] = set()

    @initialize(sync_every=st.integers(1, 4), timeout=st.sampled_from((12.0, 45.0, 600.0)),
                restore=st.one_of(st.none(), st.tuples(st.sampled_from(LAYOUTS), st.sampled_from(("sync", "async")),
                                                       st.integers(0, 3), st.integers(0, 9))),
                welcome=st.one_of(st.none(), st.tuples(st.sampled_from(LAYOUTS), st.sampled_from(("sync", "async")),
                                                       st.sampled_from(INTERVALS_S), st.booleans())),
                overlap=st.sampled_from((0, 1, 1, 2)), alpha=st.sampled_from((0.0, 0.5, 0.875)))
    def start(self, sync_every, timeout, restore, welcome, overlap, alpha):
        overlap = min(overlap, sync_every - 1)   # W15: T < H
        self.session = WorkerSession(WID, sync_every, SPEC, coordinator_timeout_s=timeout, overlap_steps=overlap,
                                     overlap_alpha=alpha)
        self.model = SessionModel(sync_every, NAMES, timeout, overlap, alpha)
        if restore is not None:
            layout, mode, rnd, step = restore
            F = len(layout)
            kw = dict(fragments=layout, round_ids=[rnd] * F, next_close=[step + f + 1 for f in range(F)],
                      sched_step=step, inner_step=step + 2, rounds_synced=rnd * F, mode=mode)
            self.session.restore(**kw)
            self.model.restore(**kw)
        self.check("start", self.session.start(self.now), self.model.start(self.now))
        if welcome is not None:   # most runs: welcomed at once, fresh (rounds 0) or onto the restored rounds
            layout, mode, interval, below = welcome
            rnd = restore[2] if restore is not None else 0
            self.deliver(Welcome(WID, (rnd,) * len(layout), (), mode, layout, 2, below, interval, PARAMS), "Welcome")

    # ------------------------------------------------------------ the comparison

    def check(self, what, actions, expected) -> None:
        before_state = self.state_before
        got = observe(actions)
        assert got == expected, f"{what} at t={self.now}: session {got} != model {expected}"
        assert session_observables(self.session) == self.model.observables(), (
            f"{what} at t={self.now}: session {session_observables(self.session)} != "
            f"model {self.model.observables()}")
        for a in actions:
            if isinstance(a, Send) and isinstance(a.message, Join):
                assert a.message.worker_id == WID and tuple(a.message.spec) == SPEC and not a.message.params
            if isinstance(a, Send):
                assert isinstance(a.message, (Join, Leave, Heartbeat)), a
            if isinstance(a, InstallParams):
                assert a.params is PARAMS or a.params == {n: f"{a.source}-{n}" for n in a.names} or \
                    a.params == {}, a
            if isinstance(a, MergeParams):
                # W16: only what an applied Result brought, once, and only with overlap
                assert self.session.overlap_steps and a.alpha == self.session.overlap_alpha, a
                assert a.fragment_id in self.applied_unmerged, f"a merge without its applied Result: {actions}"
                assert a.params == {n: f"Result-{n}" for n in a.names}, a
                self.applied_unmerged.discard(a.fragment_id)
        # W3: no heartbeat while joining (or stopped); in STOPPING only the one that asks (W12).
        state = before_state
        for a in actions:
            if isinstance(a, StateChanged):
                state = a.state
            elif isinstance(a, Send) and isinstance(a.message, Heartbeat):
                assert state not in (WorkerState.JOINING, WorkerState.STOPPED), f"W3: heartbeat in {state}: {actions}"
                if state is WorkerState.STOPPING:
                    assert before_state is not WorkerState.STOPPING, f"W3: a second heartbeat stopping: {actions}"
        # STOPPED emits nothing further, but the one Leave of W13.
        if before_state is WorkerState.STOPPED:
            assert all(isinstance(a, Send) and isinstance(a.message, Leave) for a in actions), (what, actions)
        self.stops += sum(isinstance(a, Stop) for a in actions)
        assert self.stops <= 1, f"{what}: a second Stop: {actions}"
        self.state_before = self.session.state

    def submits_respect_waiting(self, before: dict[int, int], actions, welcome: Welcome | None = None,
                                merging: frozenset = frozenset()) -> None:
        """No SubmitFragment for a fragment already waiting or merging (released and merged ones may be)."""
        waiting = dict(before)
        merging = set(merging)
        for a in actions:
            if isinstance(a, MergeParams):
                merging.discard(a.fragment_id)
                waiting.pop(a.fragment_id, None)
            if isinstance(a, SubmitFragment):
                assert a.fragment_id not in merging, f"submitted fragment {a.fragment_id} before its merge: {actions}"
            if isinstance(a, InstallParams):
                if a.source == "Welcome" and welcome is not None:
                    waiting = {f: r for f, r in welcome.parked}
                elif a.source == "Result":
                    waiting.pop(a.fragment_id, None)
            if isinstance(a, SubmitFragment):
                assert a.fragment_id not in waiting, f"submitted fragment {a.fragment_id} while waiting: {actions}"
                waiting[a.fragment_id] = a.round_id

    def deliver(self, msg, what: str) -> None:
        before, merging = dict(self.session.waiting), frozenset(self.session.held)
        joining = self.session.state is WorkerState.JOINING
        if isinstance(msg, Result) and before.get(msg.fragment_id) == msg.round_id \
                and msg.outcome in ("applied", "applied_final") and self.session.state not in (
                    None, WorkerState.JOINING, WorkerState.STOPPED):
            self.applied_unmerged.add(msg.fragment_id)
        actions = self.session.on_message(msg, self.now)
        self.check(what, actions, self.model.message(msg, self.now))
        self.submits_respect_waiting(before, actions, msg if isinstance(msg, Welcome) else None, merging)
        if isinstance(msg, Welcome) and joining:
            self.applied_unmerged.clear()

    # ------------------------------------------------------------ time and the driver

    @rule(dt=st.sampled_from(STEPS_S))
    def advance(self, dt):
        self.now += dt

    @rule(dt=st.sampled_from(STEPS_S), transport=st.one_of(st.none(), st.sampled_from((0.0, 0.5, 3.0, 1e9))))
    def tick(self, dt, transport):
        self.now += dt
        before, merging = dict(self.session.waiting), frozenset(self.session.held)
        actions = self.session.tick(self.now, transport)
        self.check(f"tick({transport})", actions, self.model.tick(self.now, transport))
        self.submits_respect_waiting(before, actions, merging=merging)

    @rule(dt=st.sampled_from(STEPS_S), n=st.integers(1, 3))
    def step_done(self, dt, n):
        self.now += dt
        for _ in range(n):
            before, merging = dict(self.session.waiting), frozenset(self.session.held)
            actions = self.session.step_done(self.now)
            self.check("step_done", actions, self.model.step_done(self.now))
            self.submits_respect_waiting(before, actions, merging=merging)

    @rule(roll=st.integers(0, 20), save=st.booleans())
    def request_stop(self, roll, save):
        if roll == 0:
            self.check(f"request_stop({save})", self.session.request_stop(self.now, save),
                       self.model.request_stop(self.now, save))

    @rule(roll=st.integers(0, 20))
    def leave(self, roll):
        """Rarely while running; a driver whose session stopped always leaves (W13)."""
        if roll == 0 or self.session.stopped:
            self.check("leave", self.session.leave(self.now), self.model.leave(self.now))

    @rule()
    def stopped_done(self):
        self.check("stopped_done", self.session.stopped_done(self.now), self.model.stopped_done(self.now))

    @rule(roll=st.integers(0, 30))
    def driver_fail(self, roll):
        if roll == 0:
            self.check("fail", self.session.fail("transport", "broken", self.now),
                       self.model.driver_fail("transport", self.now))

    # ------------------------------------------------------------ the coordinator

    @rule(layout=st.sampled_from(LAYOUTS), base=st.integers(0, 5), ahead=st.integers(0, 3),
          shape=st.integers(0, 30), rounds=st.lists(st.integers(0, 6), min_size=3, max_size=3),
          parked=st.lists(st.booleans(), min_size=3, max_size=3), below=st.booleans(),
          mode=st.sampled_from(("sync", "async")), interval=st.sampled_from(INTERVALS_S))
    def welcome(self, layout, base, ahead, shape, rounds, parked, below, mode, interval):
        if shape == 0:
            layout = BAD_LAYOUTS[base % 2]
        F = len(layout)
        if shape > 2:   # a run's own rounds: the first `ahead` fragments one round ahead of the rest
            rounds = [base + (f < ahead) for f in range(F)]
        msg = Welcome(WID, tuple(rounds[:F]), tuple((f, rounds[f]) for f in range(F) if parked[f] and shape % 3),
                      mode, layout, 2, below, interval, PARAMS)
        self.deliver(msg, "Welcome")

    @rule(n=st.integers(1, 40), below=st.booleans())
    def wait_answered(self, n, below):
        """Ticks exactly one heartbeat interval apart, each heartbeat answered at once (W3, W6, W9 boundaries)."""
        for _ in range(n):
            if self.session.state in (WorkerState.JOINING, WorkerState.STOPPED):
                break
            self.tick_and_answer(self.session.heartbeat_interval_s, below)

    @rule(dt=st.sampled_from(STEPS_S), below=st.booleans())
    def tick_and_answer(self, dt, below):
        """The common case: a tick, and a coordinator answering its heartbeats at once."""
        self.tick(dt, None)
        for _ in range(8):
            if not self.session.awaiting_replies or self.session.state in (WorkerState.JOINING, WorkerState.STOPPED):
                break
            self.deliver(HeartbeatReply(below, 2, "running", Command.CONTINUE), f"HeartbeatReply({below})")

    @rule(below=st.booleans(), command=st.sampled_from(COMMANDS))
    def heartbeat_reply(self, below, command):
        self.deliver(HeartbeatReply(below, 2, "running", command), f"HeartbeatReply({below}, {command.value})")

    @rule(f=st.integers(0, 2), r=st.integers(0, 6))
    def accepted(self, f, r):
        self.deliver(Accepted(f, r), "Accepted")

    @precondition(lambda self: self.session.waiting)
    @rule(data=st.data(), outcome=st.sampled_from(OUTCOMES), bump=st.integers(0, 2))
    def result_awaited(self, data, outcome, bump):
        f, r = data.draw(st.sampled_from(sorted(self.session.waiting.items())))
        self.result(f, r, outcome, r + bump)

    @precondition(lambda self: self.session.state is WorkerState.TRAINING and self.session.waiting)
    @rule(data=st.data(), outcome=st.sampled_from(("applied",) * 4 + ("applied_final", "stop")))
    def result_within_the_window(self, data, outcome):
        """Overlap (W16): the Result comes while the worker trains on."""
        f, r = data.draw(st.sampled_from(sorted(self.session.waiting.items())))
        self.result(f, r, outcome, r + 1)

    @rule(f=st.integers(0, 2), r=st.integers(0, 6), outcome=st.sampled_from(OUTCOMES), nxt=st.integers(0, 7))
    def result_any(self, f, r, outcome, nxt):
        self.result(f, r, outcome, nxt)

    def result(self, f, r, outcome, nxt):
        names = self.session.fragments[f] if f < len(self.session.fragments) else ()
        params = {n: f"Result-{n}" for n in names} if outcome != "stop" else {}
        self.deliver(Result(f, r, outcome, nxt, params), f"Result({f}, {r}, {outcome}, next {nxt})")

    @rule(error=st.sampled_from(PROTOCOL_ERRORS))
    def error(self, error):
        code, in_reply_to = error
        self.deliver(Error(ErrorCode(code), "refused", in_reply_to), f"Error({code}, {in_reply_to!r})")

    @precondition(lambda self: self.model.unanswered_submits)
    @rule(code=st.sampled_from(SUBMIT_ERRORS))
    def submit_refused(self, code):
        self.deliver(Error(ErrorCode(code), "refused", "Submit"), f"Error({code}, 'Submit')")

    @rule(roll=st.integers(0, 5), code=st.sampled_from(tuple(ErrorCode)), in_reply_to=st.sampled_from(IN_REPLY_TO))
    def error_any(self, roll, code, in_reply_to):
        """Every code, stop codes and fatal ones included (rarer: most end the session)."""
        if roll == 0:
            self.deliver(Error(code, "refused", in_reply_to), f"Error({code.value}, {in_reply_to!r})")

    @precondition(lambda self: self.session.may_train)
    @rule(dt=st.sampled_from((0.0, 0.25, 0.5)), n=st.integers(1, 8))
    def train(self, dt, n):
        """The driver's loop: inner steps while the session lets it train."""
        for _ in range(n):
            if not self.session.may_train:
                break
            submitted = set(self.session.merge_at)
            self.step_done(dt, 1)
            if set(self.session.merge_at) - submitted:
                break  # overlap: give the Result a chance to come within the window (W16)

    # ------------------------------------------------------------ invariants

    @invariant()
    def state_is_a_session_state(self):
        assert self.session.state in SESSION_STATES

    @invariant()
    def w5_never_train_on_a_stale_base(self):
        s = self.session
        if s.state is WorkerState.TRAINING:
            # W5, W16: with overlap an awaited or held Result is allowed only within its window.
            assert not s.retry_at, f"W5: TRAINING with retry={s.retry_at}"
            for f in list(s.waiting) + list(s.held):
                assert s.merge_at.get(f, -1) > s.sched_step, (
                    f"W5/W16: TRAINING at step {s.sched_step} with fragment {f} outstanding "
                    f"(waiting={s.waiting} held={sorted(s.held)} merge_at={s.merge_at})")
            if not s.overlap_steps:
                assert not s.waiting and not s.held
        assert s.may_train == (s.state is WorkerState.TRAINING)
        if s.state in (WorkerState.WAITING, WorkerState.PAUSED):
            assert not s.may_train

    @invariant()
    def w15_windows_are_at_most_overlap_steps_long(self):
        s = self.session
        assert set(s.held) <= set(s.merge_at) and not (set(s.held) & set(s.waiting))
        for f, at in s.merge_at.items():
            assert at - s.sched_step <= s.overlap_steps, f"W15: merge of {f} at {at}, now step {s.sched_step}"

    @invariant()
    def seconds_paused_never_decreases(self):
        assert self.session.seconds_paused >= self.last_paused
        assert math.isfinite(self.session.seconds_paused)
        self.last_paused = self.session.seconds_paused


TestSession = SessionMachine.TestCase
#: Twice the profile's examples: one example is cheap (~20 ms), and the rarer paths (a pause ended by an
#: error, a resync at exactly 16 intervals) need the breadth. About 15 s under the ci profile on 2 cores.
TestSession.settings = settings(max_examples=2 * settings().max_examples)
