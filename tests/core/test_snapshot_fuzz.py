"""``RoundFSM.restore`` on corrupt input: ``SnapshotError`` naming the field, never anything else.

Two Hypothesis fuzzers: arbitrary msgpack-shaped values, and valid snapshots
(sync and async, with members, contributions and held work) with one node
replaced by an arbitrary value -- including unhashable ones where an id or a
key belongs. A restore that succeeds must give a machine whose own snapshot
restores to the same state (SPEC.md section 10, I9).
"""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diloco.core import (
    ContributionSubmitted,
    FSMConfig,
    LeaveCause,
    Mode,
    RoundFSM,
    SnapshotError,
    Ticked,
    WorkerJoined,
    WorkerLeft,
)

leaves = (st.none() | st.booleans() | st.integers(min_value=-3, max_value=2**40) | st.floats()
          | st.text(max_size=4) | st.binary(max_size=3))
values = st.recursive(leaves, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(max_size=6) | st.integers(-2, 5), inner, max_size=3), max_leaves=8)


def valid_snapshots() -> list[dict]:
    """A few snapshots with something in every field: members, contributions, held work, last bases."""
    out = []
    sync = RoundFSM(FSMConfig(min_workers=2, num_fragments=2))
    for w in "ABC":
        sync.step(WorkerJoined(w))
    sync.step(ContributionSubmitted("A", 0, 0))
    sync.step(ContributionSubmitted("B", 1, 0))
    sync.step(Ticked(1.0))
    out.append(sync.snapshot())
    asyn = RoundFSM(FSMConfig(min_workers=2, mode=Mode.ASYNC, max_staleness=2))
    for w in "AB":
        asyn.step(WorkerJoined(w))
    asyn.step(ContributionSubmitted("A", 0, 0))
    asyn.step(WorkerLeft("B", LeaveCause.CRASHED))
    asyn.step(ContributionSubmitted("A", 0, 1))   # held below quorum
    out.append(asyn.snapshot())
    return out


VALID = valid_snapshots()


def paths(node, prefix=()):
    """Every position in a nested dict/list structure, the root included."""
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from paths(v, prefix + (("key", k),))
            yield prefix + (("rename", k),)
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            yield from paths(v, prefix + (("index", i),))


def replaced(snap: dict, path: tuple, value):
    snap = copy.deepcopy(snap)
    if not path:
        return value
    node = snap
    for kind, k in path[:-1]:
        node = node[k]
    kind, k = path[-1]
    if kind == "rename":  # the key itself becomes the value (maybe unhashable: then a repr'd key)
        item = node.pop(k)
        try:
            node[value] = item
        except TypeError:
            node[repr(value)] = item
    elif isinstance(node, tuple):
        return snap  # tuples do not occur in a snapshot's own structure
    else:
        node[k] = value
    return snap


def check_restore(snap) -> None:
    try:
        fsm = RoundFSM.restore(snap)
    except SnapshotError as exc:
        assert str(exc), "a SnapshotError must say what is wrong"
        return
    # Accepted: then it is a real machine state, and it round-trips.
    again = RoundFSM.restore(fsm.snapshot())
    assert again.snapshot() == fsm.snapshot()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values)
def test_arbitrary_values_are_refused_with_a_snapshot_error(value):
    check_restore(value)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(range(len(VALID))), st.data(), values | st.just(["A"]) | st.just({"x": 1}))
def test_a_valid_snapshot_with_one_node_replaced_restores_or_says_what_is_wrong(which, data, value):
    snap = VALID[which]
    all_paths = list(paths(snap))
    path = data.draw(st.sampled_from(all_paths))
    check_restore(replaced(snap, path, value))


def test_the_fuzzers_start_from_snapshots_that_restore():
    for snap in VALID:
        assert RoundFSM.restore(snap).snapshot() == snap


def test_unhashable_ids_and_mixed_config_keys_are_snapshot_errors():
    """The two TypeErrors an independent checker found, pinned."""
    asyn = VALID[1]
    bad = copy.deepcopy(asyn)
    bad["fragments"][0]["last_base"] = [[["A"], 0]]
    with pytest.raises(SnapshotError, match=r"last_base\[0\]\[0\]"):
        RoundFSM.restore(bad)
    bad = copy.deepcopy(asyn)
    bad["config"][1] = "x"
    bad["config"]["zzz"] = 2
    with pytest.raises(SnapshotError, match=r"snapshot\.config"):
        RoundFSM.restore(bad)
