"""The collective plane's checks on the coordinator's side (``diloco.coordinator.blame``, SPEC.md
section 7c, "Checks and blame"): a ready's declared norm against the run's bounds, unanimous blame
(nobody can get an honest member evicted), strikes and the ban, fp32's gather, and the bound on
failed attempts in a row -- first on ``ContributionChecks`` alone, then through a real
``Coordinator``."""

from __future__ import annotations

import math
import time

import pytest

from diloco.coordinator.blame import MAX_STRIKES, ContributionChecks
from diloco.coordinator.outliers import MIN_HISTORY, OutlierGuard
from diloco.testing import make_coordinator
from diloco.wire.messages import (
    PROTOCOL_VERSION,
    Error,
    ErrorCode,
    Join,
    ReduceOrder,
    ReduceReport,
    Submit,
    TensorSpec,
)

GROUP = ("w0", "w1", "w2")


def checks(max_update_norm=None, factor=10.0, max_failed=4) -> ContributionChecks:
    return ContributionChecks(OutlierGuard(1, factor), max_update_norm, max_failed)


def report(wid, attempt=0, blame=(), mean_refused=False, rid=0) -> ReduceReport:
    return ReduceReport(wid, 0, rid, attempt, False, "", "checks", tuple(blame), mean_refused)


def test_a_ready_declares_a_finite_norm_within_the_bounds():
    c = checks(max_update_norm=5.0)
    assert c.check_ready(0, None)[0] is ErrorCode.BAD_MESSAGE
    assert c.check_ready(0, "big")[0] is ErrorCode.BAD_MESSAGE
    assert c.check_ready(0, math.nan)[0] is ErrorCode.NON_FINITE
    assert c.check_ready(0, math.inf)[0] is ErrorCode.NON_FINITE
    assert c.check_ready(0, 6.0)[0] is ErrorCode.UPDATE_TOO_LARGE
    assert c.check_ready(0, 4.0) is None


def test_the_outlier_bound_starts_once_enough_norms_are_known():
    c = checks()
    for i, wid in enumerate(("a", "b", "c")[:MIN_HISTORY]):
        assert c.check_ready(0, 1e6) is None  # no params to scale a warm-up bound by: none yet
        c.accepted(0, wid, 1.0 + i)
    code, detail = c.check_ready(0, 1e6)
    assert code is ErrorCode.UPDATE_TOO_LARGE and "far out of line" in detail
    assert c.check_ready(0, 5.0) is None


def test_an_order_carries_the_declared_norms_and_gathers_after_a_refused_mean():
    c = checks()
    for wid, norm in zip(GROUP, (1.0, 2.0, 3.0)):
        c.accepted(0, wid, norm)
    assert c.order_fields(0, 0, 0, GROUP) == ((1.0, 2.0, 3.0), False)
    c.reported(report("w0", mean_refused=True))
    assert c.order_fields(0, 0, 1, GROUP) == ((1.0, 2.0, 3.0), True)
    c.committed(0)
    assert c.order_fields(0, 1, 0, GROUP)[1] is False


def test_only_unanimous_blame_evicts_and_the_blamed_must_agree():
    c = checks()
    c.order_fields(0, 0, 0, GROUP)
    assert c.reported(report("w0", blame=["w2"])) == ()
    assert c.reported(report("w1", blame=["w2"])) == ()
    assert c.reported(report("w2", blame=["w2"])) == ("w2",)
    # A liar blaming an honest member: the honest one's own report does not agree. Nobody goes.
    c.order_fields(0, 0, 1, GROUP)
    c.reported(report("w2", attempt=1, blame=["w0"]))
    c.reported(report("w1", attempt=1))
    assert c.reported(report("w0", attempt=1)) == ()
    assert c.stats["blames_disputed"] == 1
    # Even with every other member lying together, the blamed one's own report must agree.
    c.order_fields(0, 0, 2, GROUP)
    c.reported(report("w1", attempt=2, blame=["w0"]))
    c.reported(report("w2", attempt=2, blame=["w0"]))
    assert c.reported(report("w0", attempt=2)) == ()
    # A report twice, from outside the group, or for an attempt never ordered changes nothing.
    c.order_fields(0, 0, 3, GROUP)
    assert c.reported(report("w0", attempt=3, blame=["w2"])) == ()
    assert c.reported(report("w0", attempt=3, blame=["w2"])) == ()
    assert c.reported(report("x9", attempt=3, blame=["w2"])) == ()
    assert c.reported(report("w0", attempt=7, blame=["w2"])) == ()


def test_strikes_ban_at_the_bound():
    c = checks()
    for i in range(MAX_STRIKES):
        e = c.evicted("w2", 0, i, 0)
        assert e.banned is (i == MAX_STRIKES - 1)
    assert c.strikes["w2"] == MAX_STRIKES and "banned" in e.detail


def test_failed_attempts_in_a_row_of_one_group_stop_the_run():
    c = checks(max_failed=4)
    for reason in ("timeout", "digest_mismatch", "reduce_failed"):
        assert c.aborted(0, 5, GROUP, reason) is None
    assert c.aborted(0, 5, GROUP, "member_lost") is None  # the group changes: not counted
    why = c.aborted(0, 5, GROUP, "timeout")
    assert why is not None and "4 attempts in a row" in why and "timeout x2" in why
    # Another group, or a commit, starts the count again.
    c2 = checks(max_failed=2)
    assert c2.aborted(0, 5, GROUP, "timeout") is None
    assert c2.aborted(0, 5, GROUP[:2], "timeout") is None
    c2.committed(0)
    assert c2.aborted(0, 6, GROUP[:2], "timeout") is None


# ---------------------------------------------------------------- through a real Coordinator


SPEC = (TensorSpec("w", (4,), "float32"),)


def coordinator(**kw):
    c = make_coordinator(time.monotonic(), min_workers=2, data_plane="collective", **kw)
    for wid in ("w0", "w1", "w2"):
        c.handle(wid, Join(wid, PROTOCOL_VERSION, SPEC, holds_params=True, held_rounds=(0,), held_digests=("D",)),
                 1.0)
    return c


def replies(out, kind):
    return [(peer, m) for peer, m in out if isinstance(m, kind)]


def test_the_coordinator_refuses_a_bad_ready_and_orders_with_the_declared_norms():
    c = coordinator(max_update_norm=10.0)
    (_, err), = replies(c.handle("w0", Submit("w0", 0, 0, {}, norm=math.nan), 2.0), Error)
    assert err.code is ErrorCode.NON_FINITE
    (_, err), = replies(c.handle("w0", Submit("w0", 0, 0, {}, norm=11.0), 2.0), Error)
    assert err.code is ErrorCode.UPDATE_TOO_LARGE
    out = []
    for wid, norm in (("w0", 1.0), ("w1", 2.0), ("w2", 3.0)):
        out += c.handle(wid, Submit(wid, 0, 0, {}, norm=norm), 3.0)
    orders = [m for _, m in replies(out, ReduceOrder)]
    assert orders and all(o.norms == (1.0, 2.0, 3.0) and not o.gather for o in orders)


def test_the_coordinator_evicts_on_unanimous_blame_and_tells_the_member():
    c = coordinator()
    out = []
    for wid in GROUP:
        out += c.handle(wid, Submit(wid, 0, 0, {}, norm=1.0), 2.0)
    order = replies(out, ReduceOrder)[0][1]
    out = []
    for wid in GROUP:
        out += c.handle(wid, ReduceReport(wid, 0, 0, order.attempt, False, "", "checks", ("w2",)), 3.0)
    assert not c.fsm.is_member("w2") and c.fsm.is_member("w0") and c.fsm.is_member("w1")
    told = [m for peer, m in replies(out, Error) if peer == "w2" and m.code is ErrorCode.EVICTED]
    assert told and told[0].in_reply_to == "Submit"
    assert c.status()["collective"]["checks"]["strikes"] == {"w2": 1}
    # The survivors stay ready: the next attempt is ordered without w2 at once.
    assert any(m.group == ("w0", "w1") for _, m in replies(out, ReduceOrder))


def test_the_coordinator_stops_a_round_that_keeps_failing_with_the_reason():
    c = coordinator(max_failed_attempts=3)
    out = []
    for wid in ("w0", "w1", "w2"):
        out += c.handle(wid, Submit(wid, 0, 0, {}, norm=1.0), 2.0)
    for attempt in range(3):
        out = c.handle("w0", ReduceReport("w0", 0, 0, attempt, False, "", "gloo timed out"), 3.0 + attempt)
    assert c.stopped and "3 attempts in a row" in c.status()["stop_reason"]
    assert c.fsm.rounds_applied == 0


def test_diloco_status_names_the_evictions_and_why_the_run_stopped():
    from diloco.deploy.admin import render_status

    c = coordinator(max_failed_attempts=3)
    out = []
    for wid in GROUP:
        out += c.handle(wid, Submit(wid, 0, 0, {}, norm=1.0), 2.0)
    order = replies(out, ReduceOrder)[0][1]
    for wid in GROUP:
        out = c.handle(wid, ReduceReport(wid, 0, 0, order.attempt, False, "", "checks", ("w2",)), 3.0)
    page = render_status(c.status(), width=400)
    assert "checks: 1 evictions (strikes: w2 1), 0 disputed blames" in page
    # The eviction ended attempt 1 (member lost); the group w0, w1 fails attempts 2, 3 and 4.
    for attempt in range(2, 5):
        c.handle("w0", ReduceReport("w0", 0, 0, attempt, False, "", "gloo timed out"), 4.0 + attempt)
    page = render_status(c.status(), width=400)
    assert "stopped because: fragment 0 round 0: 3 attempts in a row" in page
