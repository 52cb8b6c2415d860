"""The quorum rule (SPEC.md R5) against a dumb oracle, and the phase table against the hand-drawn graph."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from diloco.core import Phase, quorum_decision
from diloco.core.phases import TRANSITIONS
from model import ALLOWED_PHASE_MOVES


def test_quorum_decision_matches_the_oracle_on_a_grid():
    for live in range(0, 40):
        for min_workers in range(1, 40):
            d = quorum_decision(live, min_workers)
            assert d.below_min_workers is (live < min_workers), (live, min_workers)
            if d.below_min_workers:
                assert d.reason.startswith(f"paused: {live} live worker")
                assert f"< min_workers {min_workers}" in d.reason
                assert f"waiting for {min_workers - live} more" in d.reason
            else:
                assert d.reason.startswith(f"quorum met: {live} live worker")
                assert d.reason.endswith(f">= min_workers {min_workers}")


@given(st.integers(0, 10**6), st.integers(1, 10**6))
def test_quorum_decision_matches_the_oracle(live, min_workers):
    assert quorum_decision(live, min_workers).below_min_workers == (live < min_workers)


def test_singular_and_plural():
    assert quorum_decision(1, 1).reason == "quorum met: 1 live worker >= min_workers 1"
    assert quorum_decision(0, 2).reason.startswith("paused: 0 live workers < min_workers 2")
    assert quorum_decision(1, 3).reason == (
        "paused: 1 live worker < min_workers 3; waiting for 2 more (start a replacement, or lower min_workers)")
    assert quorum_decision(2, 2).reason == "quorum met: 2 live workers >= min_workers 2"


def test_phase_table_is_exactly_the_graph_the_tests_check_against():
    """The transitions table (SPEC.md section 6) and tests/property/model.py agree edge for edge."""
    table = {(src, dst) for _, sources, dst, _, _ in TRANSITIONS for src in sources}
    assert table == set(ALLOWED_PHASE_MOVES)
    assert not any(src is Phase.STOPPED for src, _ in table)
