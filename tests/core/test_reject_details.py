"""A ``Reject``'s detail names the field, the value and what was expected (SPEC.md section 4,
``Reject``: tell the sender; section 11, ``Error.detail``): the worker's log is all an
operator has to see why a submission was refused.
"""

from __future__ import annotations

import re

from diloco.core import (
    ContributionSubmitted,
    Mode,
    Reject,
    RejectReason,
    RoundFSM,
    WorkerJoined,
    WorkerLeft,
)
from diloco.testing import fsm_after

J, S, L = WorkerJoined, ContributionSubmitted, WorkerLeft
R = RejectReason


machine = fsm_after


def detail(fsm: RoundFSM, event, reason: RejectReason) -> str:
    (rej,) = fsm.step(event)
    assert isinstance(rej, Reject) and rej.reason is reason, rej
    return rej.detail


def assert_says(text: str, *phrases: str) -> None:
    for phrase in phrases:
        assert re.search(rf"(?<![\w]){re.escape(phrase)}(?![\w])", text), f"{phrase!r} not in {text!r}"


def test_sync_stale_and_future_rounds_name_the_fragment_the_round_and_the_open_round():
    fsm = machine(J("A"), J("B"), S("A", 1, 0), S("B", 1, 0), S("A", 1, 1), min_workers=2, num_fragments=2)
    assert_says(detail(fsm, S("B", 1, 0), R.STALE_ROUND), "fragment 1", "round 0 already applied", "open round is 1")
    assert_says(detail(fsm, S("B", 1, 4), R.FUTURE_ROUND), "fragment 1", "round 4 has not opened", "open round is 1")
    assert_says(detail(fsm, S("B", 0, 2), R.FUTURE_ROUND), "fragment 0", "round 2 has not opened", "open round is 0")


def test_async_future_base_names_the_fragment_the_base_and_the_current_version():
    fsm = machine(J("A"), S("A", 1, 0), S("A", 1, 1), mode=Mode.ASYNC, num_fragments=2)
    assert_says(detail(fsm, S("A", 1, 5), R.FUTURE_ROUND), "fragment 1", "version 5 has not opened",
         "open version is 2")


def test_async_stale_base_says_how_many_versions_old_it_is_and_the_limit():
    fsm = machine(J("A"), J("B"), *[S("A", 1, v) for v in range(5)], mode=Mode.ASYNC, num_fragments=2,
                  max_staleness=3)
    assert_says(detail(fsm, S("B", 1, 1), R.STALE_ROUND), "fragment 1", "base version 1", "4 versions old",
         "max_staleness=3")


def test_async_duplicate_names_the_workers_last_base():
    fsm = machine(J("A"), J("B"), S("A", 0, 0), S("B", 0, 1), S("A", 0, 2), mode=Mode.ASYNC, max_staleness=5)
    assert_says(detail(fsm, S("A", 0, 1), R.DUPLICATE), "'A'", "fragment 0", "base version 2")
    fsm.step(L("B"))
    fsm.step(J("B"))                                  # joined at version 3: its last base is 2
    assert_says(detail(fsm, S("B", 0, 2), R.DUPLICATE), "'B'", "base version 2")
