"""Bad input, at each of the core's boundaries (SPEC.md sections 2, 3, 7, 10).

* Remote mistakes (a peer's ids, rounds, types; an operator's min_workers):
  exactly one ``Reject`` with the right reason code, and ``snapshot()``
  identical before and after (R2, R3, I10).
* Configuration mistakes: ``ConfigError`` naming the field, the value and the
  allowed range.
* Driver mistakes: the documented ``DriverError`` subclass with a precise
  message, and no state change (R9, R12).
* Corrupt snapshots: ``SnapshotError`` naming the bad field (section 10).
"""

from __future__ import annotations

import copy
import math

import pytest

from diloco.core import (
    ClockWentBackwardsError,
    ConfigError,
    ContributionSubmitted,
    DriverError,
    FSMConfig,
    HeartbeatSeen,
    InvalidEventError,
    LeaveCause,
    MachineStoppedError,
    GraceWindowChanged,
    MinWorkersChanged,
    Mode,
    Phase,
    Reject,
    RejectReason,
    RoundFSM,
    ShutdownKind,
    ShutdownRequested,
    SnapshotError,
    Ticked,
    UnknownEventError,
    WorkerJoined,
    WorkerLeft,
)
from diloco.testing import fsm_after

R = RejectReason
J, S, L = WorkerJoined, ContributionSubmitted, WorkerLeft


def machine(*events, **config) -> RoundFSM:
    config.setdefault("heartbeat_timeout_s", 10.0)
    return fsm_after(*events, **config)


def sync_running_at_round_1() -> RoundFSM:
    """min 2, F=2, A and B live, fragment 0 at round 1, A parked on fragment 0 round 1."""
    return machine(J("A"), J("B"), S("A", 0, 0), S("B", 0, 0), S("A", 0, 1),
                   min_workers=2, num_fragments=2, max_workers=3, max_worker_id_len=8)


def async_running() -> RoundFSM:
    """min 1, async, A and B live, version 4; A's last base is 2, B's is 1; max_staleness 3."""
    fsm = machine(J("A"), J("B"), S("A", 0, 0), S("B", 0, 0), S("B", 0, 1), S("A", 0, 2),
                  min_workers=1, mode=Mode.ASYNC, max_staleness=3, max_workers=3)
    assert fsm.open_round_ids() == (4,)
    return fsm


def async_paused_full() -> RoundFSM:
    """async, below quorum (A and B live, min 3), A holds one contribution, max_held_per_fragment 1."""
    fsm = machine(J("A"), J("B"), S("A", 0, 0), min_workers=3, mode=Mode.ASYNC, max_held_per_fragment=1)
    assert fsm.status().fragments[0].held == ("A",)
    return fsm


SYNC_CASES = [
    # (event, reason, worker_id in the Reject)
    (J(""), R.INVALID_WORKER_ID, ""),
    (J("W" * 9), R.INVALID_WORKER_ID, "W" * 9),
    (J(7), R.INVALID_WORKER_ID, ""),
    (J(None), R.INVALID_WORKER_ID, ""),
    (J(b"A"), R.INVALID_WORKER_ID, ""),
    (J("A"), R.ALREADY_MEMBER, "A"),
    (HeartbeatSeen("Z"), R.UNKNOWN_WORKER, "Z"),
    (HeartbeatSeen(7), R.UNKNOWN_WORKER, ""),
    (L("Z"), R.UNKNOWN_WORKER, "Z"),
    (L(None, LeaveCause.KICKED), R.UNKNOWN_WORKER, ""),
    (S("Z", 0, 1), R.UNKNOWN_WORKER, "Z"),
    (S("A", 2, 1), R.UNKNOWN_FRAGMENT, "A"),
    (S("A", -1, 1), R.UNKNOWN_FRAGMENT, "A"),
    (S("A", True, 1), R.UNKNOWN_FRAGMENT, "A"),
    (S("A", "0", 1), R.UNKNOWN_FRAGMENT, "A"),
    (S("A", 0.0, 1), R.UNKNOWN_FRAGMENT, "A"),
    (S("A", 0, -1), R.INVALID_ROUND, "A"),
    (S("A", 0, "1"), R.INVALID_ROUND, "A"),
    (S("A", 0, 1.0), R.INVALID_ROUND, "A"),
    (S("A", 0, None), R.INVALID_ROUND, "A"),
    (S("A", 0, False), R.INVALID_ROUND, "A"),
    (S("B", 0, 0), R.STALE_ROUND, "B"),
    (S("B", 0, 2), R.FUTURE_ROUND, "B"),
    (S("B", 1, 1), R.FUTURE_ROUND, "B"),
    (S("A", 0, 1), R.DUPLICATE, "A"),
    (GraceWindowChanged(1.0), R.INVALID_GRACE_WINDOW, ""),  # a sync run has no window
    (MinWorkersChanged(0), R.INVALID_MIN_WORKERS, ""),
    (MinWorkersChanged(4), R.INVALID_MIN_WORKERS, ""),
    (MinWorkersChanged(-1), R.INVALID_MIN_WORKERS, ""),
    (MinWorkersChanged(True), R.INVALID_MIN_WORKERS, ""),
    (MinWorkersChanged("2"), R.INVALID_MIN_WORKERS, ""),
    (MinWorkersChanged(2.0), R.INVALID_MIN_WORKERS, ""),
    (MinWorkersChanged(None), R.INVALID_MIN_WORKERS, ""),
]


def _assert_one_reject(fsm: RoundFSM, event, reason: RejectReason, wid: str) -> Reject:
    before = fsm.snapshot()
    status_before = fsm.status()
    effects = fsm.step(event)
    assert len(effects) == 1 and isinstance(effects[0], Reject), effects
    rej = effects[0]
    assert rej.reason is reason, f"{event!r}: {rej.reason} != {reason}"
    assert rej.worker_id == wid
    assert isinstance(rej.detail, str) and len(rej.detail) > 10
    # I10 / R2: nothing changed, not even last-seen times.
    assert fsm.snapshot() == before
    assert fsm.status() == status_before
    return rej


@pytest.mark.parametrize("event, reason, wid", SYNC_CASES, ids=lambda v: repr(v)[:40])
def test_sync_invalid_event_is_one_reject_and_changes_nothing(event, reason, wid):
    _assert_one_reject(sync_running_at_round_1(), event, reason, wid)


ASYNC_CASES = [
    (S("A", 0, 5), R.FUTURE_ROUND, "A"),     # base > version 4
    (S("B", 0, 0), R.STALE_ROUND, "B"),      # 4 - 0 > max_staleness 3
    (S("A", 0, 2), R.DUPLICATE, "A"),        # base == last accepted base
    (S("A", 0, 1), R.DUPLICATE, "A"),        # base < last accepted base
    (S("B", 0, 1), R.DUPLICATE, "B"),
    (S("A", 1, 4), R.UNKNOWN_FRAGMENT, "A"),
    (S("A", 0, -3), R.INVALID_ROUND, "A"),
    (S("Q", 0, 4), R.UNKNOWN_WORKER, "Q"),
]


@pytest.mark.parametrize("event, reason, wid", ASYNC_CASES, ids=lambda v: repr(v)[:40])
def test_async_invalid_event_is_one_reject_and_changes_nothing(event, reason, wid):
    _assert_one_reject(async_running(), event, reason, wid)


def test_async_duplicate_while_held_and_held_limit():
    fsm = async_paused_full()  # A's contribution is held below quorum; limit 1
    rej = _assert_one_reject(fsm, S("B", 0, 0), R.HELD_LIMIT, "B")
    assert "max_held_per_fragment=1" in rej.detail
    # A worker with a contribution held may not send another, whatever the base (P3).
    _assert_one_reject(fsm, S("A", 0, 0), R.DUPLICATE, "A")
    # A departed holder's contribution still counts against the limit (P1).
    fsm.step(L("A"))
    _assert_one_reject(fsm, S("B", 0, 0), R.HELD_LIMIT, "B")


def windowed() -> RoundFSM:
    """async, min 2, a 4 s grace window; A and B live."""
    return machine(J("A"), J("B"), min_workers=2, mode=Mode.ASYNC, grace_window_s=4.0)


@pytest.mark.parametrize("seconds", [0, -1.0, 4.5, float("nan"), float("inf"), True, "1", None])
def test_a_grace_window_change_outside_its_ceiling_is_one_reject_and_changes_nothing(seconds):
    rej = _assert_one_reject(windowed(), GraceWindowChanged(seconds), R.INVALID_GRACE_WINDOW, "")
    assert "(0, 4]" in rej.detail


def test_a_grace_window_change_sets_the_next_windows_and_survives_a_snapshot():
    fsm = windowed()
    assert fsm.step(GraceWindowChanged(1.5)) == [] and fsm.grace_window_s == 1.5
    fsm.step(S("A", 0, 0))  # opens a window of 1.5 s, not 4
    assert fsm.step(Ticked(1.4)) == []
    assert any(type(e).__name__ == "ApplyRound" for e in fsm.step(Ticked(1.6)))
    again = RoundFSM.restore(fsm.snapshot())
    assert again.grace_window_s == 1.5 and again.snapshot() == fsm.snapshot()
    assert "window_s" not in windowed().snapshot(), "an unchanged window leaves the snapshot as it was"
    # A new incarnation of the run (a coordinator restart, ``--resume``) starts at that length too.
    resumed = RoundFSM.resume(fsm.snapshot(), now_s=10.0)
    assert resumed.grace_window_s == 1.5 and resumed.snapshot()["window_s"] == 1.5


def test_join_while_draining_and_repeat_drain_are_shutting_down():
    fsm = machine(J("A"), J("B"), S("A", 0, 0), ShutdownRequested(ShutdownKind.DRAIN), min_workers=2)
    assert fsm.phase is Phase.DRAINING
    _assert_one_reject(fsm, J("C"), R.SHUTTING_DOWN, "C")
    _assert_one_reject(fsm, ShutdownRequested(ShutdownKind.DRAIN), R.SHUTTING_DOWN, "")


def test_too_many_workers():
    fsm = machine(J("A"), J("B"), max_workers=2)
    rej = _assert_one_reject(fsm, J("C"), R.TOO_MANY_WORKERS, "C")
    assert "max_workers=2" in rej.detail


def test_reject_details_name_the_field_and_value():
    fsm = sync_running_at_round_1()
    assert "fragment_id=2" in fsm.step(S("A", 2, 1))[0].detail
    assert "0..1" in fsm.step(S("A", 2, 1))[0].detail
    assert "round_id=-1" in fsm.step(S("A", 0, -1))[0].detail
    assert "min_workers=0" in fsm.step(MinWorkersChanged(0))[0].detail
    assert "1..3" in fsm.step(MinWorkersChanged(0))[0].detail
    assert "open round is 1" in fsm.step(S("B", 0, 0))[0].detail
    assert "'W" in fsm.step(J("W" * 9))[0].detail and "8 characters" in fsm.step(J("W" * 9))[0].detail


def test_every_reject_reason_is_exercised_here():
    """Each RejectReason of SPEC.md section 4 has a case in this file (a new code needs a test)."""
    from tests.core.test_collective import COLLECTIVE_CASES

    covered = {r for _, r, _ in SYNC_CASES + ASYNC_CASES + COLLECTIVE_CASES} | {
        R.HELD_LIMIT, R.SHUTTING_DOWN, R.TOO_MANY_WORKERS, R.DUPLICATE,
        R.REDUCING}  # REDUCING: tests/core/test_collective.py, the joiner during a reduce
    assert covered == set(RejectReason)


# ------------------------------------------------------------------ config


@pytest.mark.parametrize("kwargs, field, allowed", [
    ({"min_workers": 0}, "min_workers", "an integer in 1..10000"),
    ({"min_workers": -1}, "min_workers", "an integer in 1..10000"),
    ({"min_workers": 5, "max_workers": 4}, "min_workers", "an integer in 1..4"),
    ({"min_workers": True}, "min_workers", "an integer in 1..10000"),
    ({"min_workers": 2.0}, "min_workers", "an integer in 1..10000"),
    ({"min_workers": "2"}, "min_workers", "an integer in 1..10000"),
    ({"mode": "bogus"}, "mode", "'sync' or 'async'"),
    ({"num_fragments": 0}, "num_fragments", "an integer in 1..1024"),
    ({"num_fragments": 1025}, "num_fragments", "an integer in 1..1024"),
    ({"heartbeat_timeout_s": 0}, "heartbeat_timeout_s", "a finite number of seconds > 0"),
    ({"heartbeat_timeout_s": -1.0}, "heartbeat_timeout_s", "a finite number of seconds > 0"),
    ({"heartbeat_timeout_s": math.inf}, "heartbeat_timeout_s", "a finite number of seconds > 0"),
    ({"heartbeat_timeout_s": math.nan}, "heartbeat_timeout_s", "a finite number of seconds > 0"),
    ({"heartbeat_timeout_s": "30"}, "heartbeat_timeout_s", "a finite number of seconds > 0"),
    ({"heartbeat_timeout_s": True}, "heartbeat_timeout_s", "a finite number of seconds > 0"),
    ({"max_workers": 0}, "max_workers", "an integer in 1..1000000"),
    ({"max_workers": 1_000_001}, "max_workers", "an integer in 1..1000000"),
    ({"max_staleness": -1}, "max_staleness", "an integer in 0..1000000"),
    ({"max_held_per_fragment": 0}, "max_held_per_fragment", "an integer in 1..1000000"),
    ({"max_worker_id_len": 0}, "max_worker_id_len", "an integer in 1..4096"),
    ({"max_worker_id_len": 4097}, "max_worker_id_len", "an integer in 1..4096"),
])
def test_config_errors_name_field_value_and_range(kwargs, field, allowed):
    with pytest.raises(ConfigError) as info:
        FSMConfig(**kwargs)
    exc = info.value
    value = kwargs[field]
    assert exc.field == field
    assert exc.allowed == allowed
    assert exc.value is value or exc.value == value or (value != value and exc.value != exc.value)
    assert str(exc) == f"{field}={value!r} is invalid: expected {allowed}"
    assert isinstance(exc, ValueError)


def test_config_from_dict_refuses_unknown_and_non_dicts():
    with pytest.raises(ConfigError, match=r"^min_worker=2 is invalid: expected one of the fields"):
        FSMConfig.from_dict({"min_worker": 2})
    with pytest.raises(ConfigError, match=r"^config=\[\] is invalid"):
        FSMConfig.from_dict([])
    assert FSMConfig.from_dict(FSMConfig(min_workers=3, mode="async").to_dict()) == FSMConfig(
        min_workers=3, mode=Mode.ASYNC)


def test_config_from_dict_says_what_is_allowed_and_names_a_non_string_key_by_its_repr():
    """Section 2: a bad value raises ConfigError naming the field, the value and what is allowed."""
    with pytest.raises(ConfigError) as info:
        FSMConfig.from_dict(["min_workers", 2])
    assert (info.value.field, info.value.value, info.value.allowed) == (
        "config", ["min_workers", 2], "a dict of FSMConfig fields")
    for key, name in ((7, "7"), (b"x", "b'x'"), (None, "None")):
        with pytest.raises(ConfigError) as info:
            FSMConfig.from_dict({"min_workers": 1, key: 3})
        assert info.value.field == name and info.value.value == 3
        assert str(info.value).startswith(f"{name}=3 is invalid: expected one of the fields [")


def test_machine_constructor_checks_its_arguments():
    with pytest.raises(ConfigError, match=r"^config=\{'min_workers': 2\} is invalid: expected an FSMConfig"):
        RoundFSM({"min_workers": 2})
    for bad in ("0", None, math.nan, True):
        with pytest.raises(ConfigError, match=r"^now_s=") as info:
            RoundFSM(FSMConfig(), now_s=bad)
        assert info.value.field == "now_s" and info.value.allowed == "a number of seconds"
        assert info.value.value is bad


# ------------------------------------------------------------ driver misuse


def _assert_raises_unchanged(fsm: RoundFSM, event, error: type, pattern: str) -> None:
    before = fsm.snapshot()
    with pytest.raises(error, match=pattern) as info:
        fsm.step(event)
    assert isinstance(info.value, DriverError)
    assert fsm.snapshot() == before


def test_clock_going_backwards_raises_with_both_times():
    fsm = machine(J("A"), Ticked(5.0))
    _assert_raises_unchanged(fsm, Ticked(4.5), ClockWentBackwardsError,
                             r"^Ticked\(now_s=4\.5\) is earlier than the machine's clock 5\.0 \(SPEC\.md R9\)$")
    assert fsm.step(Ticked(5.0)) == []  # the same time is not backwards


def test_a_tick_that_is_no_clock_reading_is_an_invalid_event_not_a_clock_going_back():
    """NaN, a string, None, a bool: not time at all. Infinity: after it no deadline could
    ever pass again (nobody could expire). All raise InvalidEventError, the state unchanged."""
    fsm = machine(J("A"), Ticked(5.0))
    for bad in (math.nan, math.inf, -math.inf, "6", None, True):
        _assert_raises_unchanged(fsm, Ticked(bad), InvalidEventError,
                                 r"^Ticked\.now_s must be a finite number of seconds, got ")
    fsm.step(Ticked(1e12))  # a finite time, however large, is a clock reading: A expires
    assert fsm.live_workers == 0


def test_a_leave_with_a_cause_that_is_no_leave_cause_is_an_invalid_event():
    fsm = machine(J("A"))
    _assert_raises_unchanged(fsm, WorkerLeft("A", "evaporated"), InvalidEventError,
                             r"^WorkerLeft\.cause='evaporated' is not a LeaveCause$")
    assert fsm.is_member("A")


def test_a_subclassed_event_is_that_event():
    class MyJoin(WorkerJoined):
        __slots__ = ()

    fsm = machine()
    effects = fsm.step(MyJoin("A"))
    assert fsm.is_member("A") and any(type(e).__name__ == "AcceptJoin" for e in effects)


def test_unknown_events_raise_naming_the_type():
    fsm = machine(J("A"))
    _assert_raises_unchanged(fsm, object(), UnknownEventError,
                             r"^step\(\) takes one of the events in diloco\.core\.events, got object$")
    _assert_raises_unchanged(fsm, ("WorkerJoined", "B"), UnknownEventError, r"got tuple$")
    _assert_raises_unchanged(fsm, None, UnknownEventError, r"got NoneType$")
    _assert_raises_unchanged(fsm, ShutdownRequested("nope"), UnknownEventError,
                             r"^ShutdownRequested\.kind='nope' is not a ShutdownKind$")
    assert fsm.phase is Phase.RUNNING


@pytest.mark.parametrize("event", [J("B"), HeartbeatSeen("A"), S("A", 0, 0), L("A"), Ticked(99.0),
                                   MinWorkersChanged(1), ShutdownRequested(ShutdownKind.ABORT),
                                   ShutdownRequested("nope")])
def test_stepping_a_stopped_machine_raises(event):
    fsm = machine(J("A"), ShutdownRequested(ShutdownKind.SAVE_AND_STOP))
    assert fsm.phase is Phase.STOPPED
    _assert_raises_unchanged(fsm, event, MachineStoppedError,
                             rf"^the run is STOPPED; {type(event).__name__} cannot be stepped \(SPEC\.md R12\)$")


# ------------------------------------------------------------ snapshots


def _sync_snap() -> dict:
    # A and B live (B seen last), A parked on round 1, fragment 1 at round 0; min 2.
    return sync_running_at_round_1().snapshot()


def _async_snap() -> dict:
    # min 3, A and B live, A holding base 0 (below quorum), version 0, max_held 1.
    return async_paused_full().snapshot()


def _with(snap: dict, path: tuple, value) -> dict:
    snap = copy.deepcopy(snap)
    target = snap
    for key in path[:-1]:
        target = target[key]
    if value is _DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return snap


_DELETE = object()

SNAPSHOT_CASES = [
    # (name, base, path, value, message regex)
    ("not a dict", None, None, None, r"^snapshot must be a dict, got list$"),
    ("wrong format", _sync_snap, ("format",), "other", r"^snapshot\.format='other': expected 'diloco\.round_fsm'$"),
    ("version 999", _sync_snap, ("version",), 999, r"^snapshot\.version=999 is not supported: this diloco reads version 1$"),
    ("no version", _sync_snap, ("version",), _DELETE, r"^snapshot\.version=None is not supported"),
    ("no config", _sync_snap, ("config",), _DELETE, r"^snapshot\.config must be a dict, got NoneType$"),
    ("config unknown key", _sync_snap, ("config", "extra"), 1, r"^snapshot\.config: extra=1 is invalid"),
    ("config bad value", _sync_snap, ("config", "num_fragments"), 0, r"^snapshot\.config: num_fragments=0 is invalid"),
    ("bad phase", _sync_snap, ("phase",), "dancing", r"^snapshot\.phase='dancing': expected one of"),
    ("min_workers 0", _sync_snap, ("min_workers",), 0, r"^snapshot\.min_workers=0: expected an integer 1\.\.3$"),
    ("min_workers > max", _sync_snap, ("min_workers",), 4, r"^snapshot\.min_workers=4: expected an integer 1\.\.3$"),
    ("now_s a string", _sync_snap, ("now_s",), "0", r"^snapshot\.now_s='0': expected a number$"),
    ("members missing", _sync_snap, ("members",), _DELETE, r"^snapshot\.members must be a list, got NoneType$"),
    ("member truncated", _sync_snap, ("members", 0), ["A"], r"^snapshot\.members\[0\] must be a pair, got 1 items$"),
    ("member id not str", _sync_snap, ("members", 0), [7, 0.0], r"^snapshot\.members\[0\]\[0\]=7: expected a worker id string$"),
    ("member twice", _sync_snap, ("members",), [["A", 0.0], ["A", 0.0]],
     r"^snapshot\.members\[1\]: worker 'A' listed twice$"),
    ("members out of order", _sync_snap, ("members",), [["A", 0.0], ["B", -0.5]],
     r"^snapshot\.members\[1\]: last seen -0\.5 out of order \(must be non-decreasing and <= now_s=0\.0\)$"),
    ("member seen in the future", _sync_snap, ("members",), [["A", 0.0], ["B", 99.0]],
     r"^snapshot\.members\[1\]: last seen 99\.0 out of order"),
    ("fragments missing one", _sync_snap, ("fragments",), [{"round_id": 1, "contributed": []}],
     r"^snapshot\.fragments has 1 entries; config says num_fragments=2$"),
    ("round_id negative", _sync_snap, ("fragments", 0, "round_id"), -1,
     r"^snapshot\.fragments\[0\]\.round_id=-1: expected an integer >= 0$"),
    ("round_id missing", _sync_snap, ("fragments", 0, "round_id"), _DELETE,
     r"^snapshot\.fragments\[0\]\.round_id=None: expected an integer >= 0$"),
    ("contributed twice", _sync_snap, ("fragments", 0, "contributed"), ["A", "A"],
     r"^snapshot\.fragments\[0\]\.contributed\[1\]='A': listed twice$"),
    ("contributed bad id", _sync_snap, ("fragments", 0, "contributed"), [""],
     r"^snapshot\.fragments\[0\]\.contributed\[0\]='': expected a worker id string$"),
    ("running below quorum", _sync_snap, ("min_workers",), 3,
     r"^snapshot\.phase='running' contradicts 2 members and min_workers=3$"),
    ("paused with quorum", _sync_snap, ("phase",), "paused",
     r"^snapshot\.phase='paused' contradicts 2 members and min_workers=2$"),
    ("forming with quorum", _sync_snap, ("phase",), "forming",
     r"^snapshot\.phase='forming' contradicts 2 members and min_workers=2$"),
    # Self-contradicting states a real machine never reaches (section 10; found missing by this file).
    ("draining below quorum", lambda: machine(J("A"), J("B"), S("A", 0, 0), ShutdownRequested(ShutdownKind.DRAIN),
                                               min_workers=2).snapshot(), ("min_workers",), 3,
     r"^snapshot\.phase='draining' contradicts 2 members and min_workers=3$"),
    ("async held with quorum", lambda: _with(_async_snap(), ("min_workers",), 2), ("phase",), "running",
     r"^snapshot\.fragments\[0\]: contributions held in a stopped run or although quorum holds \(I5, I7\)$"),
    ("async draining phase", lambda: machine(J("A"), mode=Mode.ASYNC).snapshot(), ("phase",), "draining",
     r"^snapshot\.phase='draining' contradicts mode='async'"),
    ("stopped with a parked contribution", _sync_snap, ("phase",), "stopped",
     r"^snapshot\.fragments\[0\]: contributions pending in a stopped run \(I5\)$"),
    ("stopped with a held contribution", _async_snap, ("phase",), "stopped",
     r"^snapshot\.fragments\[0\]: contributions held in a stopped run"),
    ("complete round with quorum not applied", _sync_snap, ("fragments", 0, "contributed"), ["A", "B"],
     r"^snapshot\.fragments\[0\]: round 1 is complete with quorum but did not apply \(I7\)$"),
    ("async held base > version", _async_snap, ("fragments", 0, "held"), [["A", 5]],
     r"^snapshot\.fragments\[0\]\.held\[0\]\[1\]=5: expected an integer 0\.\.0$"),
    ("async held twice", _async_snap, ("fragments", 0, "held"), [["A", 0], ["A", 0]],
     r"^snapshot\.fragments\[0\]\.held\[1\]='A': listed twice$"),
    ("async held over limit", _async_snap, ("fragments", 0, "held"), [["A", 0], ["C", 0]],
     r"^snapshot\.fragments\[0\]\.held: more than max_held_per_fragment entries$"),
    ("async last_base non-member", _async_snap, ("fragments", 0, "last_base"), [["Z", 0]],
     r"^snapshot\.fragments\[0\]\.last_base\[0\]='Z': not a member$"),
    ("async held disagrees with last_base", _async_snap, ("fragments", 0, "held"), [["B", 0]],
     r"^snapshot\.fragments\[0\]: held contribution of 'B' disagrees with last_base$"),
    ("async fragment lacks version", _async_snap, ("fragments", 0, "version"), _DELETE,
     r"^snapshot\.fragments\[0\]\.version=None: expected an integer >= 0$"),
]


@pytest.mark.parametrize("name, base, path, value, pattern", SNAPSHOT_CASES, ids=[c[0] for c in SNAPSHOT_CASES])
def test_corrupt_snapshot_raises_snapshot_error(name, base, path, value, pattern):
    snap = [] if base is None else _with(base(), path, value)
    with pytest.raises(SnapshotError, match=pattern):
        RoundFSM.restore(snap)
    with pytest.raises(SnapshotError, match=pattern):
        RoundFSM.resume(snap)


def test_the_corruption_cases_start_from_valid_snapshots():
    """So each case fails for the one field it breaks."""
    for base in (_sync_snap, _async_snap):
        assert RoundFSM.restore(base()).snapshot() == base()
