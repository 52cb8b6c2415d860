"""C6, restarts, message by message: the newest committed state a joiner offers starts the run.

Until the first commit after a (re)start, a joiner whose ``held_rounds`` are newer than the
state the run started from starts it again; the members holding (or healing to) the older
state leave (``reseeded``), are told to join again, and then heal from the newer one. After a
commit, every joiner heals. The whole loop with real workers and checkpoints is
``test_collective_run.py::test_a_whole_run_resumes_from_the_newest_worker_checkpoint...``.
"""

from __future__ import annotations

import dataclasses

import torch

from diloco.testing import join_message, make_coordinator, replies
from diloco.wire.messages import (
    Command,
    HealOrder,
    HeartbeatReply,
    Leave,
    ReduceOrder,
    ReduceReport,
    Result,
    Submit,
    Welcome,
)

PARAMS = {"w": torch.zeros(3)}


def coordinator(min_workers: int = 2):
    events: list[tuple[str, dict]] = []
    c = make_coordinator(0.0, min_workers=min_workers, data_plane="collective", heartbeat_timeout_s=60.0,
                         reduce_timeout_s=30.0, collective_timeout_s=5.0,
                         observer=lambda kind, now, info: events.append((kind, info)))
    return c, events


def join(c, wid: str, held: tuple[int, ...] | None, now: float = 1.0):
    msg = join_message(wid, list(join_message(wid, PARAMS).spec))
    if held is not None:
        msg = dataclasses.replace(msg, holds_params=True, held_rounds=held)
    return c.handle(wid, msg, now)


def welcome_of(out, wid: str) -> Welcome:
    found = [m for peer, m in replies(out, Welcome) if peer == wid]
    assert len(found) == 1, out
    return found[0]


def test_a_newer_state_offered_before_the_first_commit_starts_the_run_again_and_the_older_heals_from_it():
    c, events = coordinator()
    w0 = welcome_of(join(c, "w0", (2,)), "w0")
    assert w0.heal_source == "" and c.fsm.is_member("w0")  # nobody holds a state: w0's starts the run
    out = join(c, "w1", (5,))
    assert welcome_of(out, "w1").heal_source == ""  # newer: w1's state starts the run again
    told = [(peer, m.command) for peer, m in replies(out, HeartbeatReply)]
    assert told == [("w0", Command.REJOIN)] and not c.fsm.is_member("w0")
    assert [(e["worker_id"], e["starter"], e["held_rounds"]) for k, e in events if k == "reseed"] == [("w0", "w1", [5])]
    assert ("left", {"worker_id": "w0", "cause": "reseeded"}) in [(k, {x: e[x] for x in ("worker_id", "cause")})
                                                                  for k, e in events if k == "left"]
    # w0 joins again, offering its replica (relabelled to the run's rounds): it was welcomed by
    # this coordinator, so its state came from this incarnation or is older -- it heals.
    out = join(c, "w0", (7,), now=2.0)
    assert welcome_of(out, "w0").heal_source == "w1"
    assert [peer for peer, _ in replies(out, HealOrder)] == ["w1"]
    assert not replies(out, HeartbeatReply) and c.fsm.is_member("w1")


def test_an_equal_or_older_state_heals_and_a_joiner_healing_from_the_old_start_is_reseeded_too():
    c, events = coordinator(min_workers=3)
    join(c, "w0", (4,))
    assert welcome_of(join(c, "w1", (4,)), "w1").heal_source == "w0"   # as new: heals
    assert welcome_of(join(c, "w2", (3,)), "w2").heal_source == "w0"   # older: heals
    out = join(c, "w3", (6,))
    assert welcome_of(out, "w3").heal_source == ""
    assert sorted(peer for peer, m in replies(out, HeartbeatReply) if m.command is Command.REJOIN) == ["w0", "w1", "w2"]
    assert [w for w in ("w0", "w1", "w2", "w3") if c.fsm.is_member(w)] == ["w3"]


def test_initial_params_give_way_to_any_committed_state_but_after_a_commit_every_joiner_heals():
    c, _ = coordinator()
    join(c, "w0", ())            # initial params (answering start_params_required)
    out = join(c, "w1", (0,))    # a checkpointed state, even of round 0, is a committed one
    assert welcome_of(out, "w1").heal_source == "" and not c.fsm.is_member("w0")
    assert welcome_of(join(c, "w0", None, now=2.0), "w0").heal_source == "w1"
    # One round, committed by both: ready (a tensorless Submit), the order, two matching reports.
    orders = []
    for wid in ("w0", "w1"):
        orders += replies(c.handle(wid, Submit(wid, 0, 0, {}, norm=1.0), 3.0), ReduceOrder)
    order = orders[-1][1]
    out = []
    for wid in order.group:
        out += c.handle(wid, ReduceReport(wid, 0, 0, order.attempt, True, "d" * 64, ""), 3.5)
    assert {m.digest for _, m in replies(out, Result)} == {"d" * 64} and c.fsm.rounds_applied == 1
    out = join(c, "w2", (40,), now=4.0)
    assert welcome_of(out, "w2").heal_source in ("w0", "w1")  # after a commit a newer offer heals too
    assert not replies(out, HeartbeatReply)


def join_with(c, wid: str, held: tuple[int, ...], digests: tuple[str, ...], now: float = 1.0):
    msg = dataclasses.replace(join_message(wid, list(join_message(wid, PARAMS).spec)), holds_params=True,
                              held_rounds=held, held_digests=digests)
    return c.handle(wid, msg, now)


def test_the_state_the_last_commits_made_replaces_a_start_from_any_other_even_from_a_welcomed_worker():
    c, events = coordinator(min_workers=3)
    c.collective.last_commit = [(3, "d" * 64)]  # as restored from the checkpoint: round 3 committed with d
    assert welcome_of(join_with(c, "w0", (2,), ("old",)), "w0").heal_source == ""        # an older checkpoint
    assert welcome_of(join(c, "w1", None), "w1").heal_source == "w0"                     # fresh: heals
    c.handle("w1", Leave("w1"), 2.0)
    # w1 was welcomed here, but what it offers now is round 4 with the digest of commit 3: the
    # state the run's last commit made, which the start's was not. It wins.
    out = join_with(c, "w1", (4,), ("d" * 64,), now=3.0)
    assert welcome_of(out, "w1").heal_source == ""
    assert [peer for peer, m in replies(out, HeartbeatReply) if m.command is Command.REJOIN] == ["w0"]
    # A third offer of the same current state does not reseed the current start again: it heals.
    out = join_with(c, "w2", (4,), ("d" * 64,), now=4.0)
    assert welcome_of(out, "w2").heal_source == "w1" and not replies(out, HeartbeatReply)
    # Nor does a wrong digest at the right round: it is not the state the commit made.
    assert not c.collective.is_current((4,), ("e" * 64,)) and c.collective.is_current((4,), ("d" * 64,))


def test_a_plain_start_sends_the_members_healing_from_a_source_that_is_gone_to_join_again():
    c, events = coordinator(min_workers=3)
    join(c, "w0", ())
    assert welcome_of(join(c, "w1", None), "w1").heal_source == "w0"
    c.handle("w0", Leave("w0"), 2.0)  # the source is gone while w1 heals (or has healed, not yet ready)
    out = join(c, "w2", (), now=3.0)
    assert welcome_of(out, "w2").heal_source == ""  # nobody holds the state: w2 starts the run
    assert [peer for peer, m in replies(out, HeartbeatReply) if m.command is Command.REJOIN] == ["w1"]
    assert not c.fsm.is_member("w1")  # it joins again: to heal from w2, or to offer what it healed
