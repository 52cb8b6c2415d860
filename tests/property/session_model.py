"""A reference model of the worker session: SPEC.md section 14 (rules W1-W18), executed literally.

``SessionModel`` is written from the rules, not from ``diloco/worker/session.py``:
it keeps the state a reader of section 14 would write down (where the worker is,
what it waits for, what it retries, its rounds and schedule, how long the
coordinator has been silent) and answers each event with the *protocol* actions
the rules call for, as plain tuples (``observe`` turns a session's actions into
the same tuples; log ``Note`` lines are not part of the protocol and are dropped).
``test_session_stateful.py`` feeds the session and this model the same events and
compares, after every event, the tuples and the observables ``observables()``.

The schedule arithmetic is restated here from section 14 ("Schedule") rather than
imported from ``diloco.worker.schedule``, so a bug there is caught too.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Iterable

from diloco.wire.messages import (
    Accepted,
    Command,
    Error,
    HeartbeatReply,
    Result,
    Welcome,
)
from diloco.worker.actions import (
    Fail,
    InstallParams,
    MergeParams,
    Note,
    OutageReport,
    Send,
    SendJoinWithParams,
    StateChanged,
    Stop,
    SubmitFragment,
)

# The numbers of section 14, written out (not imported from the session).
RESYNC_INTERVALS = 16
RESYNC_MAX_INTERVALS = 256
ALREADY_MEMBER_RETRIES = 3
OUTAGE_NOTICE_S = 5.0
OUTAGE_EVERY_S = 10.0
JOIN_RESEND_FIRST_S = 2.5
JOIN_RESEND_MAX_S = 30.0
ASK_MAX_S = 1.0
ASK_MAX_INTERVALS = 4
DEFAULT_HEARTBEAT_S = 1.0

JOINING, TRAINING, WAITING, PAUSED, STOPPING, STOPPED = (
    "joining", "training", "waiting", "paused", "stopping", "stopped")

REJOIN_CODES = {"stale_round", "future_round", "unknown_worker", "evicted"}
STOP_CODES = {"stopped", "shutting_down"}


def observe(actions: Iterable[Any]) -> list[tuple]:
    """A session's actions as the model's tuples (``Note`` dropped)."""
    out: list[tuple] = []
    for a in actions:
        if isinstance(a, Note):
            continue
        if isinstance(a, Send):
            out.append(("send", type(a.message).__name__))
        elif isinstance(a, SendJoinWithParams):
            out.append(("join_with_params",))
        elif isinstance(a, SubmitFragment):
            out.append(("submit", a.fragment_id, a.round_id))
        elif isinstance(a, InstallParams):
            out.append(("install", a.fragment_id, tuple(a.names), a.keep_if_same, a.source))
        elif isinstance(a, MergeParams):
            out.append(("merge", a.fragment_id, tuple(a.names), a.alpha))
        elif isinstance(a, StateChanged):
            out.append(("state", a.state.value, None if a.previous is None else a.previous.value))
        elif isinstance(a, OutageReport):
            out.append(("outage", a.kind, a.waited_s))
        elif isinstance(a, Stop):
            out.append(("stop", a.reason, a.save))
        elif isinstance(a, Fail):
            out.append(("fail", a.code))
        else:
            raise AssertionError(f"an action that is not in the vocabulary: {a!r}")
    return out


def _value(x: Any) -> str:
    return x.value if hasattr(x, "value") else str(x)


class SessionModel:
    """One worker, per section 14. Every method returns the list of action tuples."""

    def __init__(self, sync_every: int, names: Iterable[str], coordinator_timeout_s: float, overlap_steps: int = 0,
                 alpha: float = 0.5) -> None:
        self.H = sync_every
        self.T = overlap_steps                       # W15: 0 is no overlap
        self.alpha = alpha
        self.names = frozenset(names)
        self.limit_s = coordinator_timeout_s
        self.state: str | None = None
        self.stopping_from: str | None = None
        self.stop_reason: str | None = None
        # the run as the worker knows it
        self.welcomed = False
        self.restored = False
        self.fragments: tuple[tuple[str, ...], ...] = ()
        self.mode: str | None = None
        self.below = False
        self.hb_s = DEFAULT_HEARTBEAT_S
        # rounds and schedule (W2, W4, W7)
        self.round_ids: list[int] = []
        self.next_close: list[int] = []
        self.sched_step = 0
        self.inner_step = 0
        self.rounds_synced = 0
        # contributions (W4, W7, W8)
        self.waiting: dict[int, int] = {}
        self.retry: dict[int, float] = {}
        # overlap (W15-W18): when each submitted fragment is merged; the applied Results not merged yet
        self.merge_at: dict[int, int] = {}
        self.held: set[int] = set()
        self.unanswered_submits: deque[int] = deque()   # Errors name no fragment: replies come in order
        self.last_submit: tuple[int, int] | None = None
        # heartbeats and the quorum (W3, W6)
        self.last_heartbeat = float("-inf")
        self.heartbeats_unanswered = 0
        self.replies_from_before_wait = 0
        self.quorum_news_fresh = False
        # silence and outages (W11)
        self.silent_since: float | None = None
        self.reports = 0
        # joining (W1)
        self.last_join = float("-inf")
        self.join_every = JOIN_RESEND_FIRST_S
        self.already_member_left = ALREADY_MEMBER_RETRIES
        self.must_rejoin = False
        # resync (W9)
        self.wait_began: float | None = None
        self.resync_after = float("inf")
        # stopping (W12, W13)
        self.stop_order: tuple[str, bool | None] | None = None   # (reason, save); save None: ask
        self.ask_until: float | None = None
        self.left = False
        # pauses
        self.paused_at: float | None = None
        self.seconds_paused = 0.0
        self.out: list[tuple] = []

    # ------------------------------------------------------------ helpers

    def offsets(self) -> list[int]:
        F = len(self.fragments)
        return [max(1, (f + 1) * self.H // F) for f in range(F)]

    def due(self, now: float) -> list[int]:
        return [f for f in range(len(self.next_close))
                if f not in self.waiting and f not in self.merge_at and self.sched_step >= self.next_close[f]
                and not (f in self.retry and now < self.retry[f])]

    def goto(self, state: str) -> None:
        if state != self.state:
            self.out.append(("state", state, self.state))
            if self.state == WAITING:
                self.wait_began = None                    # W9: leaving WAITING ends the wait
            if state == STOPPING:
                self.stopping_from = self.state
            self.state = state

    def sent(self, what: str, now: float) -> None:
        self.out.append(("send", what))
        if self.silent_since is None:
            self.silent_since = now

    def heartbeat(self, now: float) -> None:
        self.sent("Heartbeat", now)
        self.heartbeats_unanswered += 1
        self.last_heartbeat = now

    def end_pause(self, now: float) -> None:
        if self.paused_at is not None:
            self.seconds_paused += max(0.0, now - self.paused_at)
            self.paused_at = None

    def join(self, now: float) -> None:
        self.sent("Join", now)
        self.last_join = now
        self.join_every = JOIN_RESEND_FIRST_S
        self.already_member_left = ALREADY_MEMBER_RETRIES

    def merge(self, f: int) -> None:
        self.held.discard(f)
        del self.merge_at[f]
        self.out.append(("merge", f, self.fragments[f], self.alpha))

    def merge_everything(self) -> None:                   # W17
        for f in sorted(self.held):
            self.merge(f)

    def rejoin(self, now: float) -> None:
        self.merge_everything()                           # W17
        self.end_pause(now)
        self.goto(JOINING)
        self.join(now)

    def stop(self, reason: str, save: bool, now: float) -> None:
        self.end_pause(now)
        self.ask_until = None
        if self.stop_reason is None:
            self.stop_reason = reason
        self.goto(STOPPING)
        self.merge_everything()                           # W17: before the checkpoint
        self.out.append(("stop", self.stop_reason, save))

    def failed(self, code: str, now: float) -> None:
        self.end_pause(now)
        self.out.append(("fail", code))
        if self.stop_reason is None:
            self.stop_reason = f"error: {code}"
        self.ask_until = None
        self.held.clear()                                  # W17: a failed worker merges nothing
        self.merge_at.clear()
        self.goto(STOPPED)

    def take(self) -> list[tuple]:
        out, self.out = self.out, []
        return out

    def silence(self, now: float, transport_silence_s: float | None) -> float:
        if self.silent_since is None:
            return 0.0
        s = max(0.0, now - self.silent_since)
        if transport_silence_s is not None:
            s = min(s, max(0.0, transport_silence_s))
        return s

    # ------------------------------------------------------------ events

    def restore(self, fragments, round_ids, next_close, sched_step, inner_step, rounds_synced, mode) -> None:
        self.fragments = tuple(tuple(f) for f in fragments)
        self.round_ids = list(round_ids)
        self.next_close = list(next_close)
        self.sched_step, self.inner_step, self.rounds_synced = sched_step, inner_step, rounds_synced
        self.mode = mode
        self.restored = True

    def start(self, now: float) -> list[tuple]:
        self.goto(JOINING)                                   # W1
        self.join(now)
        return self.take()

    def step_done(self, now: float) -> list[tuple]:
        if self.state == STOPPED:
            return []
        self.inner_step += 1                                 # W4: counted in every state but STOPPED ...
        if self.state == TRAINING or (self.state == STOPPING and self.stopping_from == TRAINING):
            self.sched_step += 1                             # ... the schedule moves only for a trained step
        self.settle(now)
        return self.take()

    def request_stop(self, now: float, save: bool) -> list[tuple]:
        if self.state is None:
            self.goto(STOPPING)
            self.stop("stop_requested", save, now)
        elif self.state not in (STOPPING, STOPPED) or (self.state == STOPPING and self.ask_until is not None):
            self.stop("stop_requested", save, now)           # W12: at once, from any state
        return self.take()

    def leave(self, now: float) -> list[tuple]:
        if self.left:
            return []
        self.left = True
        if self.state != STOPPED:
            self.merge_everything()                        # W17
        if self.welcomed and self.stop_order is None:       # W13
            self.out.append(("send", "Leave"))
        self.end_pause(now)
        if self.stop_reason is None:
            self.stop_reason = "left"
        self.ask_until = None
        self.goto(STOPPED)
        return self.take()

    def stopped_done(self, now: float) -> list[tuple]:
        if self.state == STOPPING and self.ask_until is None:
            self.goto(STOPPED)
        return self.take()

    def driver_fail(self, code: str, now: float) -> list[tuple]:
        if self.state != STOPPED:
            self.end_pause(now)
            if self.stop_reason is None:
                self.stop_reason = f"error: {code}"
            self.held.clear()
            self.merge_at.clear()
            self.goto(STOPPED)
        return self.take()

    def tick(self, now: float, transport_silence_s: float | None = None) -> list[tuple]:
        if self.state in (None, STOPPED):
            return []
        if self.state == STOPPING:
            if self.ask_until is not None and now >= self.ask_until:   # W12: no answer in time
                self.stop(self.stop_order[0], False, now)
            return self.take()
        silence = self.silence(now, transport_silence_s)
        if self.state == JOINING:
            if not self.outage(now, silence) and self.silent_since is not None \
                    and now - max(self.last_join, self.silent_since) >= self.join_every:
                self.sent("Join", now)                                # W1: resend, doubling, at most 30 s
                self.last_join = now
                self.join_every = min(2 * self.join_every, JOIN_RESEND_MAX_S)
            return self.take()
        if now - self.last_heartbeat >= self.hb_s:                    # W3
            self.heartbeat(now)
        if self.outage(now, silence):
            return self.take()
        if self.state in (WAITING, PAUSED):
            self.resync(now, silence)
        self.settle(now)
        return self.take()

    def message(self, msg: Any, now: float) -> list[tuple]:
        if self.state in (None, STOPPED):
            return []
        if self.reports:                                              # W11: "back"
            self.out.append(("outage", "back", now - self.silent_since))
        self.silent_since = None
        self.reports = 0
        if self.state == JOINING:
            self.joining_message(msg, now)
        elif isinstance(msg, HeartbeatReply):
            self.heartbeat_reply(msg, now)
        elif isinstance(msg, Result):
            self.result(msg, now)
        elif isinstance(msg, Accepted):
            if msg.fragment_id in self.unanswered_submits:
                self.unanswered_submits.remove(msg.fragment_id)
            if (msg.fragment_id, msg.round_id) == self.last_submit:
                # W6: replies come in order, so every heartbeat sent before the latest Submit
                # has been answered or lost by now: none of its replies is still to come.
                self.heartbeats_unanswered -= self.replies_from_before_wait
                self.replies_from_before_wait = 0
                self.unanswered_submits.clear()
        elif isinstance(msg, Error):
            self.error(msg, now)
        self.settle(now)
        return self.take()

    # ------------------------------------------------------------ messages

    def joining_message(self, msg: Any, now: float) -> None:
        if isinstance(msg, Welcome):
            self.welcome(msg, now)
        elif isinstance(msg, Error) and msg.in_reply_to in ("Join", ""):
            code = _value(msg.code)
            if code in STOP_CODES:                                    # W1
                self.stop_order = (code, False)
                self.stop(f"run {code} before join: {msg.detail}", False, now)
            elif code in ("params_required", "start_params_required"):
                self.out.append(("join_with_params",))
                self.silent_since = now
            elif code == "already_member" and self.already_member_left > 0:
                self.already_member_left -= 1
                self.sent("Leave", now)
                self.sent("Join", now)
            else:
                self.failed(code, now)
        elif self.silent_since is None:
            self.silent_since = now        # an answer to something older: the Join is still unanswered

    def welcome(self, msg: Welcome, now: float) -> None:
        fragments = tuple(tuple(f) for f in msg.fragments)
        names = [n for f in fragments for n in f]
        if sorted(names) != sorted(self.names) or len(msg.round_ids) != len(fragments):
            self.failed("bad_welcome", now)
            return
        same_layout = (self.welcomed or self.restored) and fragments == self.fragments
        same_rounds = same_layout and list(msg.round_ids) == self.round_ids
        for f, frag in enumerate(fragments):                          # W2
            self.out.append(("install", f, frag, same_layout, "Welcome"))
        self.fragments = fragments
        self.round_ids = list(msg.round_ids)
        self.mode = _value(msg.mode)
        self.below = msg.below_min_workers
        self.hb_s = float(msg.heartbeat_interval_s)
        F = len(fragments)
        if self.mode == "sync":
            if not (same_rounds and len(self.next_close) == F):
                self.next_close = [r * self.H + off for r, off in zip(self.round_ids, self.offsets())]
                self.sched_step = max(0, max(c - self.H for c in self.next_close))
        elif not (same_layout and len(self.next_close) == F):
            self.next_close = [self.sched_step + off for off in self.offsets()]
        self.waiting = {f: r for f, r in msg.parked}
        self.merge_at.clear()                                         # W18: parked: no window
        self.unanswered_submits.clear()
        self.retry.clear()
        self.must_rejoin = False
        self.last_heartbeat = now
        self.heartbeats_unanswered = 0
        self.replies_from_before_wait = 0
        self.quorum_news_fresh = True      # the Welcome's own below_min_workers is news of now
        self.wait_began = None
        if not self.welcomed:
            self.resync_after = RESYNC_INTERVALS * self.hb_s
        self.welcomed = True
        self.goto(WAITING if self.waiting or (self.due(now) and not self.T) else TRAINING)

    def heartbeat_reply(self, msg: HeartbeatReply, now: float) -> None:
        self.heartbeats_unanswered = max(0, self.heartbeats_unanswered - 1)
        if self.replies_from_before_wait:
            self.replies_from_before_wait -= 1
        else:
            self.quorum_news_fresh = True
        self.below = msg.below_min_workers
        command = _value(msg.command)
        if self.state == STOPPING:
            if self.ask_until is not None:                            # W12: the answer to the ask
                if command == Command.SAVE_AND_STOP.value:
                    self.stop("save_and_stop", True, now)
                else:
                    self.stop(self.stop_order[0], False, now)
            return
        if command == Command.REJOIN.value:                           # W10
            self.must_rejoin = True
        elif command == Command.STOP.value:                           # W12
            self.stop_order = ("stop", False)
        elif command == Command.SAVE_AND_STOP.value:
            self.stop_order = ("save_and_stop", True)

    def result(self, msg: Result, now: float) -> None:
        f = msg.fragment_id
        if f not in self.waiting or self.waiting[f] != msg.round_id:
            return                                                    # W7: not what we wait for
        outcome = _value(msg.outcome)
        if outcome in ("applied", "applied_final", "stop") and f in self.unanswered_submits:
            self.unanswered_submits.remove(f)      # its Result answers the Submit (an Accepted was lost)
        if outcome in ("applied", "applied_final"):                  # W7
            del self.waiting[f]
            if f in self.merge_at:                                    # W16: held until its window ends
                self.held.add(f)
                if self.state == STOPPING:
                    self.merge(f)
            else:
                self.out.append(("install", f, self.fragments[f], False, "Result"))
            self.round_ids[f] = msg.next_round_id
            if self.mode == "sync":
                self.next_close[f] = msg.next_round_id * self.H + self.offsets()[f]
            else:
                self.next_close[f] += self.H
            self.rounds_synced += 1
            self.wait_began = None
            self.resync_after = RESYNC_INTERVALS * self.hb_s
            if outcome == "applied_final":
                self.stop_order = ("drain", False)
        elif outcome == "stop":                                       # W12: ask
            del self.waiting[f]
            self.merge_at.pop(f, None)
            if self.stop_order is None:
                self.stop_order = ("stop", None)
        else:
            self.failed("bad_message", now)                           # W14

    def error(self, msg: Error, now: float) -> None:
        code = _value(msg.code)
        if msg.in_reply_to == "Submit":
            f = self.unanswered_submits.popleft() if self.unanswered_submits else None
            if code in REJOIN_CODES:                                  # W10
                self.must_rejoin = True
            elif code == "duplicate":
                pass
            elif code in ("held_limit", "reducing") and f is not None:  # W8
                self.waiting.pop(f, None)
                self.merge_at.pop(f, None)
                self.retry[f] = now + self.hb_s
            elif code in STOP_CODES:                                  # W12: ask
                if self.stop_order is None:
                    self.stop_order = (code, None)
            else:
                self.failed(code, now)                                # W14
        elif msg.in_reply_to == "Heartbeat" and code in STOP_CODES:
            if self.stop_order is None:
                self.stop_order = (code, None)

    # ------------------------------------------------------------ after every event

    def settle(self, now: float) -> None:
        if self.state in (None, STOPPING, STOPPED):
            return
        if self.stop_order is not None:
            reason, save = self.stop_order
            if save is None:                                          # W12: ask with one heartbeat
                self.end_pause(now)
                self.goto(STOPPING)
                self.heartbeat(now)
                self.ask_until = now + min(ASK_MAX_S, ASK_MAX_INTERVALS * self.hb_s)
            else:
                self.stop(reason, save, now)
            return
        if self.must_rejoin:
            self.must_rejoin = False
            self.rejoin(now)
            return
        if self.state == JOINING:
            return
        for f in sorted(self.held):                                   # W16: windows that ended
            if self.merge_at[f] <= self.sched_step:
                self.merge(f)
        for f in self.due(now):                                       # W4, W8
            self.retry.pop(f, None)
            if self.T:
                self.merge_at[f] = self.sched_step + self.T           # W15: train on
            elif self.state == TRAINING:
                self.goto(WAITING)                                    # (from PAUSED: decided below)
            self.out.append(("submit", f, self.round_ids[f]))
            self.waiting[f] = self.round_ids[f]
            self.unanswered_submits.append(f)
            self.last_submit = (f, self.round_ids[f])
            self.replies_from_before_wait = self.heartbeats_unanswered   # W6
            self.quorum_news_fresh = False
            self.heartbeat(now)                                           # W3
        overdue = [f for f in self.waiting if f not in self.merge_at or self.merge_at[f] <= self.sched_step]
        stuck = bool(overdue) or bool(self.retry)                     # W5, W16
        if self.state == TRAINING:
            if not stuck:
                return
            self.goto(WAITING)                                        # W16: the window ended first
        if not stuck:                                                 # W7
            self.end_pause(now)
            self.goto(TRAINING)
            return
        pause = self.below and self.quorum_news_fresh                 # W6
        if pause and self.state == WAITING:
            self.paused_at = now
            self.wait_began = None
            self.goto(PAUSED)
        elif not pause and self.state == PAUSED:
            self.end_pause(now)
            self.goto(WAITING)

    def resync(self, now: float, silence: float) -> None:
        """W9: a long unpaused wait, with the coordinator answering, means a lost Result."""
        if self.state != WAITING or not self.waiting or silence > 2 * self.hb_s:
            self.wait_began = None
            return
        if self.wait_began is None:
            self.wait_began = now
            return
        if now - self.wait_began >= self.resync_after:
            self.resync_after = min(2 * self.resync_after, RESYNC_MAX_INTERVALS * self.hb_s)
            self.wait_began = None
            self.sent("Leave", now)
            self.rejoin(now)

    def outage(self, now: float, silence: float) -> bool:
        """W11. True when the worker gave up."""
        if silence >= self.limit_s:
            self.out.append(("outage", "gave_up", silence))
            save = self.welcomed or self.restored
            self.stop_order = ("coordinator_unreachable", save)
            self.stop("coordinator_unreachable", save, now)
            return True
        if silence >= OUTAGE_NOTICE_S + self.reports * OUTAGE_EVERY_S:
            self.reports = int((silence - OUTAGE_NOTICE_S) // OUTAGE_EVERY_S) + 1
            self.out.append(("outage", "waiting", silence))
        return False

    # ------------------------------------------------------------ comparison

    def observables(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "waiting": dict(self.waiting),
            "retry": dict(self.retry),
            "merge_at": dict(self.merge_at),
            "held": sorted(self.held),
            "round_ids": list(self.round_ids),
            "next_close": list(self.next_close),
            "sched_step": self.sched_step,
            "inner_step": self.inner_step,
            "rounds_synced": self.rounds_synced,
            "stop_reason": self.stop_reason,
            "welcomed": self.welcomed,
            "seconds_paused": self.seconds_paused,
        }


def session_observables(s: Any) -> dict[str, Any]:
    """The same observables, read from a ``WorkerSession``."""
    return {
        "state": None if s.state is None else s.state.value,
        "waiting": dict(s.waiting),
        "retry": dict(s.retry_at),
        "merge_at": dict(s.merge_at),
        "held": sorted(s.held),
        "round_ids": list(s.round_ids),
        "next_close": list(s.next_close),
        "sched_step": s.sched_step,
        "inner_step": s.inner_step,
        "rounds_synced": s.rounds_synced,
        "stop_reason": s.stop_reason,
        "welcomed": s.welcomed,
        "seconds_paused": s.seconds_paused,
    }
