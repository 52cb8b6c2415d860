"""h2-style: every phase x every event type (with representative payloads).

Each phase is reached by a known event prefix (some with contributions parked
or held, so the step has something to settle or discard). From there, every
payload of every event type either

* raises exactly the documented ``DriverError`` subclass -- ``UnknownEventError``
  for something that is not an event, ``InvalidEventError`` for an event whose
  driver-built field is impossible (an unknown shutdown kind or leave cause, a
  tick that is not a finite number), ``MachineStoppedError`` for any event into
  STOPPED (R12), ``ClockWentBackwardsError`` for a tick earlier than the clock
  (R9) -- and leaves the snapshot unchanged; or
* returns effects that the tracking model accepts, lands in a phase of the
  graph with the invariants intact (I1-I7, I11, I12), and if it is a
  ``Reject``, leaves the snapshot unchanged (I10).

A Hypothesis test then walks short random sequences of the same payloads from
each phase, so pairs and triples of events are covered too.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco.core import (
    ClockWentBackwardsError,
    InvalidEventError,
    ContributionSubmitted,
    DriverError,
    FSMConfig,
    HeartbeatSeen,
    LeaveCause,
    MachineStoppedError,
    MinWorkersChanged,
    Mode,
    Phase,
    Reject,
    RoundFSM,
    ShutdownKind,
    ShutdownRequested,
    Ticked,
    UnknownEventError,
    WorkerJoined,
    WorkerLeft,
)
from model import Tracker

J, S, L = WorkerJoined, ContributionSubmitted, WorkerLeft
CRASH = LeaveCause.CRASHED

SYNC = FSMConfig(min_workers=2, heartbeat_timeout_s=10.0)
SYNC_F2 = FSMConfig(min_workers=2, num_fragments=2, heartbeat_timeout_s=10.0)
ASYNC = FSMConfig(min_workers=2, mode=Mode.ASYNC, heartbeat_timeout_s=10.0, max_held_per_fragment=2)

#: name -> (config, prefix, the phase the prefix must reach)
PREFIXES: dict[str, tuple[FSMConfig, list, Phase]] = {
    "sync-forming": (SYNC, [], Phase.FORMING),
    "sync-forming-parked": (SYNC, [J("A"), S("A", 0, 0)], Phase.FORMING),
    "sync-running": (SYNC, [J("A"), J("B")], Phase.RUNNING),
    "sync-running-parked": (SYNC, [J("A"), J("B"), S("A", 0, 0)], Phase.RUNNING),
    "sync-running-departed": (SYNC, [J("A"), J("B"), J("C"), S("A", 0, 0), L("A", CRASH)], Phase.RUNNING),
    "sync-paused-parked": (SYNC, [J("A"), J("B"), S("A", 0, 0), L("B", CRASH)], Phase.PAUSED),
    "sync-draining": (SYNC, [J("A"), J("B"), S("A", 0, 0), ShutdownRequested(ShutdownKind.DRAIN)], Phase.DRAINING),
    "sync-stopped": (SYNC, [J("A"), ShutdownRequested(ShutdownKind.ABORT)], Phase.STOPPED),
    "frag-draining": (SYNC_F2, [J("A"), J("B"), S("A", 0, 0), S("B", 1, 0),
                                ShutdownRequested(ShutdownKind.DRAIN)], Phase.DRAINING),
    "frag-paused": (SYNC_F2, [J("A"), J("B"), S("A", 1, 0), S("B", 0, 0), L("B", CRASH)], Phase.PAUSED),
    "async-forming-held": (ASYNC, [J("A"), S("A", 0, 0)], Phase.FORMING),
    "async-running": (ASYNC, [J("A"), J("B"), S("A", 0, 0)], Phase.RUNNING),
    "async-paused-held": (ASYNC, [J("A"), J("B"), S("A", 0, 0), L("B", CRASH), S("A", 0, 1)], Phase.PAUSED),
    "async-stopped": (ASYNC, [J("A"), J("B"), ShutdownRequested(ShutdownKind.SAVE_AND_STOP)], Phase.STOPPED),
}


class NotAnEvent:
    """Something a buggy driver might pass to ``step``."""


def payloads(fsm: RoundFSM) -> dict[str, list]:
    """Representative payloads of each event type, relative to the machine's state."""
    open_id = fsm.open_round_ids()[0]
    now = fsm.now_s
    return {
        "WorkerJoined": [J("A"), J("C"), J(""), J(5), J("x" * 200), J(None)],
        "HeartbeatSeen": [HeartbeatSeen("A"), HeartbeatSeen("Z"), HeartbeatSeen(None), HeartbeatSeen(["A"])],
        "ContributionSubmitted": [
            S("A", 0, open_id), S("B", 0, open_id), S("C", 0, open_id), S("A", 0, open_id + 1),
            S("A", 0, open_id - 1), S("Z", 0, 0), S("A", 9, open_id), S("A", -1, open_id),
            S("A", True, open_id), S("A", 0, "1"), S("A", 0, 1.0), S("A", 0, None), S(("A",), 0, 0),
        ],
        "WorkerLeft": [L("A"), L("B", LeaveCause.KICKED), L("C", CRASH), L("Z"), L(3), L("A", "evaporated")],
        "Ticked": [Ticked(now), Ticked(now + 1.0), Ticked(now + 100.0), Ticked(now - 1.0),
                   Ticked(math.nan), Ticked(math.inf), Ticked("1"), Ticked(True)],
        "MinWorkersChanged": [MinWorkersChanged(n) for n in (1, 2, 3, 0, -1, 10**9, "1", True, 1.5)],
        "ShutdownRequested": [ShutdownRequested(k) for k in ShutdownKind] + [ShutdownRequested("bogus")],
        "not-an-event": [NotAnEvent(), None, ("WorkerJoined", "A"), "heartbeat"],
    }


def expected_error(fsm: RoundFSM, event: object) -> type | None:
    """The documented DriverError for ``event`` in this state, or None if it must not raise."""
    if type(event) not in (J, HeartbeatSeen, S, L, Ticked, MinWorkersChanged, ShutdownRequested):
        return UnknownEventError
    if fsm.phase is Phase.STOPPED:
        return MachineStoppedError
    if isinstance(event, Ticked):
        t = event.now_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not -math.inf < t < math.inf:
            return InvalidEventError
        if t < fsm.now_s:
            return ClockWentBackwardsError
    if isinstance(event, ShutdownRequested) and event.kind not in {k.value for k in ShutdownKind}:
        return InvalidEventError
    if isinstance(event, L) and event.cause not in {c.value for c in LeaveCause}:
        return InvalidEventError
    return None


def reach(name: str) -> tuple[RoundFSM, Tracker]:
    config, prefix, phase = PREFIXES[name]
    fsm, tracker = RoundFSM(config), Tracker.fresh(config)
    for event in prefix:
        tracker.observe(event, fsm.step(event))
    assert fsm.phase is phase, f"prefix {name} reached {fsm.phase}, not {phase}"
    tracker.check_state(fsm)
    return fsm, tracker


def check_step(fsm: RoundFSM, tracker: Tracker, event: object) -> None:
    """One cell of the product: the documented error, or effects with every invariant intact."""
    before = fsm.snapshot()
    want_error = expected_error(fsm, event)
    try:
        effects = fsm.step(event)
    except DriverError as exc:
        assert type(exc) is want_error, f"{event!r} in {fsm.phase}: raised {type(exc).__name__}, expected {want_error}"
        assert str(exc), "a DriverError explains itself"
        assert fsm.snapshot() == before, f"{type(exc).__name__} for {event!r} changed the state"
        return
    assert want_error is None, f"{event!r} in {Phase(before['phase'])}: expected {want_error.__name__}, got {effects!r}"
    if any(isinstance(e, Reject) for e in effects):
        assert fsm.snapshot() == before, f"I10: {event!r} was rejected but the snapshot changed"
    tracker.observe(event, effects)
    tracker.check_state(fsm)
    assert fsm.phase in Phase


@pytest.mark.parametrize("event_type", list(payloads(RoundFSM(SYNC))))
@pytest.mark.parametrize("prefix", list(PREFIXES))
def test_every_phase_times_every_event(prefix, event_type):
    probe, _ = reach(prefix)
    for i in range(len(payloads(probe)[event_type])):
        fsm, tracker = reach(prefix)  # a fresh copy for every payload
        event = payloads(fsm)[event_type][i]
        check_step(fsm, tracker, event)


def test_product_reaches_every_phase():
    """The prefixes above cover the whole phase graph, so the product is really phases x events."""
    assert {phase for _, _, phase in PREFIXES.values()} == set(Phase)


EVENT_TYPES = list(payloads(RoundFSM(SYNC)))


@settings(max_examples=max(settings().max_examples * 3, 100))
@given(
    prefix=st.sampled_from(list(PREFIXES)),
    picks=st.lists(st.tuples(st.sampled_from(EVENT_TYPES), st.integers(0, 12)), min_size=1, max_size=4),
)
def test_short_sequences_from_every_phase(prefix, picks):
    """Pairs, triples and quadruples of the same payloads, from every phase."""
    fsm, tracker = reach(prefix)
    for event_type, i in picks:
        options = payloads(fsm)[event_type]
        check_step(fsm, tracker, options[i % len(options)])
