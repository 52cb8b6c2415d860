"""M12, the coordinator's side, message by message: a heal whose joiner is gone is withdrawn.

A source serves one heal at a time and is in no reduce meanwhile; a heal to a joiner that left,
died or joined again elsewhere would hold it out of every group until the heal timed out. The
coordinator tells the source (a ``HealOrder`` with no prefix) as soon as it knows. The member's
side is ``tests/property/test_member_rules.py::test_m12_*``; the wait that stops,
``tests/training/test_collective_replica.py::test_m12_*``.
"""

from __future__ import annotations

import dataclasses

import torch

from diloco.testing import join_message, make_coordinator, replies
from diloco.wire.messages import HealOrder, Heartbeat, Leave, ReduceOrder, Submit

PARAMS = {"w": torch.zeros(3)}


def coordinator():
    # Two: w0's ready alone orders no reduce, so w1's ready makes the round's group.
    return make_coordinator(0.0, min_workers=2, data_plane="collective", heartbeat_timeout_s=10.0,
                            reduce_timeout_s=30.0, collective_timeout_s=5.0)


def join(c, wid: str, now: float, held: tuple[int, ...] | None = (0,)):
    msg = join_message(wid, list(join_message(wid, PARAMS).spec))
    if held is not None:
        msg = dataclasses.replace(msg, holds_params=True, held_rounds=held)
    return c.handle(wid, msg, now)


def heal_orders(out) -> list[tuple[str, str, bool]]:
    """(source, joiner, withdrawn?) of every heal order, in the order sent."""
    return [(peer, m.joiner, m.prefix == "") for peer, m in replies(out, HealOrder)]


def started():
    """w0 started the run and is ready (a heal source); w1 was welcomed and heals from it."""
    c = coordinator()
    join(c, "w0", 1.0)
    c.handle("w0", Submit("w0", 0, 0, {}, norm=1.0), 1.5)
    out = join(c, "w1", 2.0)
    assert heal_orders(out) == [("w0", "w1", False)]
    return c


def test_m12_a_joiner_that_leaves_before_it_healed_has_its_heal_withdrawn():
    c = started()
    out = c.handle("w1", Leave("w1"), 3.0)
    assert heal_orders(out) == [("w0", "w1", True)]
    assert c.collective.stats["heals_withdrawn"] == 1


def test_m12_a_joiner_declared_dead_before_it_healed_has_its_heal_withdrawn():
    c = started()
    c.handle("w0", Heartbeat("w0"), 8.0)  # w0 stays alive; w1 goes silent
    out = c.tick(13.0)
    assert heal_orders(out) == [("w0", "w1", True)]
    assert not c.fsm.is_member("w1") and c.fsm.is_member("w0")


def test_m12_no_withdrawal_goes_to_a_source_that_is_gone_too():
    c = started()
    out = c.tick(13.0)  # both silent: w0 is declared dead before (or with) its joiner
    assert heal_orders(out) == [] and not c.fsm.is_member("w0")


def test_m12_a_joiner_that_leaves_and_joins_again_gets_one_withdrawal_then_one_new_order():
    c = started()
    out = c.handle("w1", Leave("w1"), 3.0) + join(c, "w1", 3.5)  # M6: a failed heal re-joins so
    assert heal_orders(out) == [("w0", "w1", True), ("w0", "w1", False)]


def test_m12_a_joiner_that_healed_and_was_ready_is_not_withdrawn_when_it_leaves():
    c = started()
    out = c.handle("w1", Submit("w1", 0, 0, {}, norm=1.0), 3.0)  # ready: it holds the state (C6)
    assert replies(out, ReduceOrder)
    out = c.handle("w1", Leave("w1"), 4.0)
    assert heal_orders(out) == []
    assert c.collective.stats["heals_withdrawn"] == 0
