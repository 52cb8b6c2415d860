"""The collective plane's replica and its vote, without a group: propose, commit, abort, digest,
the orphaned proposal a coordinator crash leaves, and the heal transfer's wire format."""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch

from diloco.collective.endpoint import CollectiveEndpoint
from diloco.collective.member import HeldState
from diloco.collective.replica import Replica, digest
from diloco.wire.measure import all_finite as finite
from diloco.outer import OuterConfig
from diloco.wire.messages import Welcome

FRAGMENTS = (("a",), ("b",))


def replica(wire_dtype: str = "fp32") -> Replica:
    params = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4)}
    return Replica(params, FRAGMENTS, [0, 0], OuterConfig(), wire_dtype, 2)


def test_a_proposal_changes_nothing_until_committed_and_an_abort_restores_params_and_momentum():
    r = replica()
    before = {n: t.clone() for n, t in r.params.items()}
    vote = r.propose(0, 0, {"a": torch.full((2, 3), 0.5)})
    assert not torch.equal(r.params["a"], before["a"])           # proposed in place ...
    assert r.committed_optimizer_states()[0] == {"state": {}, "param_groups": r.optimizers[0].state_dict()["param_groups"]}
    r.rollback(0)                                                 # ... and rolled back exactly
    assert torch.equal(r.params["a"], before["a"]) and r.optimizers[0].state_dict()["state"] == {}
    again = r.propose(0, 0, {"a": torch.full((2, 3), 0.5)})
    assert again == vote, "the same inputs give the same vote"
    assert not r.commit(0, 0, "another digest") and torch.equal(r.params["a"], before["a"])
    r.propose(0, 0, {"a": torch.full((2, 3), 0.5)})
    assert r.commit(0, 0, vote) and r.round_ids == [1, 0]
    assert digest(r.fragment(0)) == vote and "momentum_buffer" in r.optimizer_states()[0]["state"][0]


def test_the_digest_sees_one_flipped_bit_anywhere_and_a_swapped_name():
    # 140,001 elements: two full blocks of 32,768 words, a tail of words and one odd element.
    params = {"a": torch.randn(140_001), "b": torch.randn(10)}
    base = digest(params)
    assert digest({n: t.clone() for n, t in params.items()}) == base
    for index in (0, 17, 65_535, 65_536, 131_071, 131_072, 140_000):  # blocks, their edges, tail, odd one
        flipped = {n: t.clone() for n, t in params.items()}
        flipped["a"].view(torch.int32)[index] ^= 1 << (index % 31)
        assert digest(flipped) != base, index
    assert digest({"b": params["a"], "a": params["b"]}) != base


def test_finite_sees_a_nan_or_an_infinity_anywhere():
    t = torch.randn(1000)
    assert finite(t) and finite(torch.empty(0))
    for bad in (float("nan"), float("inf"), float("-inf")):
        for index in (0, 500, 999):
            u = t.clone()
            u[index] = bad
            assert not finite(u), (bad, index)


def test_a_rollback_restores_every_optimizers_state_in_place_round_after_round():
    # The backup buffers are reused from round to round and copied back in place: an abort
    # after a commit must restore the committed momentum, not an older one or an alias.
    for name in ("nesterov", "adam", "delayed_nesterov"):
        params = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4)}
        r = Replica(params, FRAGMENTS, [0, 0], OuterConfig(name=name, delay=2), "fp32", 2)
        for rid in range(3):
            vote = r.propose(0, rid, {"a": torch.full((2, 3), 0.5 + rid)})
            assert r.commit(0, rid, vote)
        committed = {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                     for k, v in r.optimizers[0].state_dict()["state"][0].items()}
        committed_params = r.params["a"].clone()
        for attempt in range(2):
            r.propose(0, 3, {"a": torch.full((2, 3), -7.0 - attempt)})
            during = r.committed_optimizer_states()[0]["state"][0]
            assert all(torch.equal(torch.as_tensor(during[k]), torch.as_tensor(v)) for k, v in committed.items()), name
            r.rollback(0)
            state = r.optimizers[0].state_dict()["state"][0]
            assert set(state) == set(committed), name
            assert all(torch.equal(torch.as_tensor(state[k]), torch.as_tensor(v)) for k, v in committed.items()), name
            assert torch.equal(r.params["a"], committed_params), name


def test_a_rollback_of_the_first_proposal_leaves_no_optimizer_state():
    r = replica()
    r.propose(0, 0, {"a": torch.full((2, 3), 0.5)})
    assert r.optimizers[0].state_dict()["state"]  # the step made momentum ...
    r.rollback(0)
    assert r.optimizers[0].state_dict()["state"] == {}  # ... which the rollback removes


def test_int8_and_bf16_round_the_step_like_the_hub_and_stay_finite():
    for dtype in ("bf16", "int8"):
        r = replica(dtype)
        vote = r.propose(1, 0, {"b": torch.full((4,), 1e-3)})
        assert len(vote) == 64 and bool(torch.isfinite(r.params["b"]).all())


def test_an_orphaned_proposal_is_adopted_only_if_the_restarted_coordinator_committed_it():
    """M4 through the real driver: a Welcome that starts the run from this member settles the
    proposal a lost connection orphaned, on the data-plane thread."""
    for committed, adopted in (((0, "VOTE"), True), ((-1, ""), False)):
        ep = CollectiveEndpoint(_NullEndpoint(), "w1")
        ep.replica = replica()
        ep.machine.held = HeldState(FRAGMENTS, (0, 0), tuple(ep.replica.committed_digests()))
        vote = ep.replica.propose(0, 0, {"a": torch.full((2, 3), 0.5)})
        ep.machine.proposals[0] = (0, vote)
        proposed = ep.replica.params["a"].clone()
        record = (0, vote) if committed[1] == "VOTE" else committed
        welcome = Welcome("w1", (1, 0) if adopted else (0, 0), (), "sync", FRAGMENTS, 2, False, 1.0, {},
                          data_plane="collective", committed=(record, (-1, "")))
        ep._carry_out(ep.machine.received(welcome))
        deadline = time.monotonic() + 30.0
        try:
            handed = None
            while handed is None and time.monotonic() < deadline:
                handed = ep.recv(0.05)  # the null endpoint does not block: poll for the completion
                time.sleep(0.01)
        finally:
            ep.close()
        assert isinstance(handed, Welcome) and handed.params, handed
        assert ep.replica.proposal(0) is None
        assert torch.equal(ep.replica.params["a"], proposed) is adopted
        assert (list(ep.adopted) == [(0, 0, vote)]) is adopted
        assert ep.replica.round_ids[0] == (1 if adopted else 0)
        assert ep.machine.held.round_ids == tuple(handed.round_ids)


class _NullEndpoint:
    def send(self, message) -> None: ...
    def recv(self, timeout_s):
        return None
    def wake(self) -> None: ...
    def close(self) -> None: ...


def test_the_heal_transfer_carries_params_momentum_and_round_ids():
    from diloco.collective import heal
    from diloco.collective.store import StoreHost
    from diloco.collective.groups import connect_store

    host = StoreHost()
    source = replica()
    vote = source.propose(0, 0, {"a": torch.full((2, 3), 0.5)})
    assert source.commit(0, 0, vote)
    got = {}

    def joiner():
        got["state"] = heal.recv_state(connect_store("127.0.0.1", host.port, 10), "run/heal1", "127.0.0.1", 10)

    t = threading.Thread(target=joiner)
    t.start()
    heal.send_state(connect_store("127.0.0.1", host.port, 10), "run/heal1", "127.0.0.1", 10, source.round_ids,
                    source.params, source.optimizer_states())
    t.join(20)
    round_ids, params, states = got["state"]
    assert round_ids == [1, 0]
    assert all(torch.equal(params[n], source.params[n]) for n in source.params)
    healed = Replica(params, FRAGMENTS, round_ids, OuterConfig(), "fp32", 2, states)
    assert digest(healed.params) == digest(source.params)
    assert torch.equal(healed.optimizer_states()[0]["state"][0]["momentum_buffer"],
                       source.optimizer_states()[0]["state"][0]["momentum_buffer"])
    # gloo's two address keys and the heal's two presence keys (``heal.meet``)
    assert host.forget("run/heal1", 2) == 4 and host.num_keys() == 0, "a retired prefix leaves no key behind"


def test_m12_a_serve_whose_joiner_never_comes_stops_when_withdrawn_not_at_its_timeout():
    from diloco.collective import heal
    from diloco.collective.groups import CollectiveError, connect_store
    from diloco.collective.store import StoreHost

    host = StoreHost()
    source = replica()
    withdrawn_at = time.monotonic() + 0.3
    stop = lambda: "withdrawn" if time.monotonic() >= withdrawn_at else ""  # noqa: E731
    started = time.monotonic()
    with pytest.raises(CollectiveError, match="stopped before its peer came: withdrawn"):
        heal.send_state(connect_store("127.0.0.1", host.port, 10), "run/heal2", "127.0.0.1", 30, source.round_ids,
                        source.params, source.optimizer_states(), stop)
    assert time.monotonic() - started < 5, "it waited for its 30 s timeout"
    # A joiner that never comes within the timeout: the same wait ends, with the reason.
    with pytest.raises(CollectiveError, match="did not come within 1 s"):
        heal.recv_state(connect_store("127.0.0.1", host.port, 10), "run/heal3", "127.0.0.1", 1)
    # Each rank that gave up took its presence key back: a peer coming later does not take it for
    # one that is there (and wait in gloo's rendezvous for it until its own timeout).
    assert host.num_keys() == 0
    late = connect_store("127.0.0.1", host.port, 10)
    with pytest.raises(CollectiveError, match="did not come within 1 s"):
        heal.recv_state(late, "run/heal2", "127.0.0.1", 1)


def test_a_heal_whose_peer_met_it_and_then_vanished_fails_within_the_rendezvous_bound_not_the_heals():
    """A rank frozen between the meeting and gloo's rendezvous thaws to a peer that gave up: it
    learns so within one collective timeout, not the heal's six (which bound the transfer)."""
    from diloco.collective import heal
    from diloco.collective.groups import CollectiveError, connect_store
    from diloco.collective.store import StoreHost

    host = StoreHost()
    store = connect_store("127.0.0.1", host.port, 10)
    store.set("run/heal4/here/0", b"1")  # the source was here, then stopped before the group formed
    started = time.monotonic()
    with pytest.raises(CollectiveError, match="did not form"):
        heal.recv_state(store, "run/heal4", "127.0.0.1", 30, rendezvous_s=1)
    assert time.monotonic() - started < 10, "the rendezvous waited for the heal's 30 s bound"


def test_the_heal_transfer_gets_the_heals_bound_not_the_rendezvous_one():
    from diloco.collective import heal
    from diloco.collective.groups import build_group, connect_store
    from diloco.collective.store import StoreHost

    host = StoreHost()
    got = {}

    def joiner():
        group = build_group(connect_store("127.0.0.1", host.port, 10), "run/heal5", 1, 2, "127.0.0.1", 1)
        got["t"] = torch.zeros(3)
        heal._broadcast(group, got["t"], 10)

    t = threading.Thread(target=joiner)
    t.start()
    group = build_group(connect_store("127.0.0.1", host.port, 10), "run/heal5", 0, 2, "127.0.0.1", 1)
    time.sleep(2.0)  # a transfer that takes longer than the group's 1 s rendezvous bound
    heal._broadcast(group, torch.ones(3), 10)
    t.join(20)
    assert got["t"].tolist() == [1.0, 1.0, 1.0]


def test_m12_the_driver_stops_the_job_the_machine_withdrew_and_every_heal_when_it_closes():
    from diloco.collective.member import CancelJob, HealJob, ServeHealJob
    from diloco.wire.messages import HealOrder

    class Inner:
        address = "tcp://127.0.0.1:5555"

        def close(self) -> None:
            pass

    ep = CollectiveEndpoint(Inner(), "w1")
    serve, other = ServeHealJob(HealOrder("w3", "h1")), ServeHealJob(HealOrder("w4", "h2"))
    heal_job = HealJob(None)
    assert ep._stop_for(serve)() == "" and ep._stop_for(heal_job)() == ""
    ep._carry_out([CancelJob(serve)])
    assert "withdrew" in ep._stop_for(serve)() and ep._stop_for(other)() == ""
    ep.close()
    assert "stopping" in ep._stop_for(heal_job)() and "stopping" in ep._stop_for(other)()


def test_a_failed_serve_and_a_slow_job_are_in_the_workers_log(caplog):
    from diloco.collective.member import Committed, CommitJob, HealServed, ServeHealJob
    from diloco.wire.messages import HealOrder

    class Inner:
        address = "tcp://127.0.0.1:5555"

    ep = CollectiveEndpoint(Inner(), "w1")
    with caplog.at_level("WARNING", logger="diloco.collective"):
        ep._say_if_slow_or_failed(ServeHealJob(HealOrder("w3", "h1")), HealServed(False, "peer gone"), 0.2)
        ep._say_if_slow_or_failed(CommitJob(0, 0, "d"), Committed({}), 0.2)  # quick and fine: nothing
        ep._say_if_slow_or_failed(CommitJob(0, 0, "d"), Committed({}), ep._timeout_s + 1)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "worker w1: ServeHealJob to w3 failed after 0.2 s: peer gone"
    assert len(lines) == 2 and lines[1].startswith("worker w1: CommitJob ended after 31.0 s")


def test_a_withheld_welcome_is_no_silence_to_the_session():
    """M5: while a start or heal carries the coordinator's Welcome, the session's outage clock (W11)
    hears no silence, however quiet the socket; a heal longer than --coordinator-timeout once made
    the worker give up on a coordinator that had answered. And the Welcome counts as arriving, so
    the session heartbeats: a heal delayed past the heartbeat timeout (its source busy serving a
    joiner that had gone) once got the joiner declared dead and re-joining in a loop."""

    class Quiet(_NullEndpoint):
        def silence_s(self) -> float:
            return 25.0

        def receiving(self) -> bool:
            return False

    ep = CollectiveEndpoint(Quiet(), "w1")
    assert ep.silence_s() == 25.0 and not ep.receiving()
    ep.machine.welcome_withheld = True
    assert ep.silence_s() == 0.0 and ep.receiving()


def _big_replica() -> tuple[Replica, dict]:
    """A one-fragment replica over several step blocks (65,536 elements each), an odd-sized tensor, a
    tail shorter than a digest block and an empty one; and the same state under torch's own optimizer."""
    torch.manual_seed(3)
    params = {"w": torch.randn(3 * 65_536 + 7), "v": torch.randn(100_001), "e": torch.randn(0)}
    r = Replica(params, (tuple(params),), [0], OuterConfig(), "fp32", 2)
    ref = {n: t.clone() for n, t in params.items()}
    return r, ref


def test_the_step_backed_up_measured_and_digested_block_by_block_is_torchs_step_and_its_digest():
    """The fp32 Nesterov proposal (the blocked step with ``_StepWatch``): the very params torch's own
    step gives, a vote that is their digest, and an exact backup (an abort restores every bit)."""
    from diloco.outer import build_outer_optimizer

    r, ref = _big_replica()
    ref_opt = build_outer_optimizer(list(ref.values()), OuterConfig(), 2)
    for round_id in range(4):  # the first step makes the momentum (torch's path), the rest are blocked
        mean = {n: torch.randn(t.shape) * 0.01 for n, t in ref.items()}
        before = {n: t.clone() for n, t in r.params.items()}
        momentum = [s["momentum_buffer"].clone() for s in r.optimizer_states()[0]["state"].values()]
        vote = r.propose(0, round_id, mean, mean_bound=1e9)
        for n, p in ref.items():
            p.grad = mean[n].clone()
        ref_opt.step()
        assert all(torch.equal(r.params[n], ref[n]) for n in ref), round_id
        assert vote == digest(ref), round_id
        if round_id == 2:  # an abort puts back the params and the momentum, bit for bit
            r.rollback(0)
            assert all(torch.equal(r.params[n], before[n]) for n in before)
            assert all(torch.equal(m, s["momentum_buffer"])
                       for m, s in zip(momentum, r.optimizer_states()[0]["state"].values()))
            assert r.propose(0, round_id, mean, mean_bound=1e9) == vote, "the same step again"
        assert r.commit(0, round_id, vote)


def test_the_step_measured_block_by_block_is_the_step_measured_whole():
    from diloco.blocked_step import step_in_blocks
    from diloco.collective import digest as digest_mod

    r, _ = _big_replica()
    r.commit(0, 0, r.propose(0, 0, {n: torch.ones(t.shape) for n, t in r.params.items()}, mean_bound=1e9))
    opt, params = r.optimizers[0], r.fragment(0)
    old = {n: t.clone() for n, t in params.items()}
    backup = {n: torch.full_like(t, math.nan) for n, t in params.items()}
    watch = digest_mod.StepWatch(params, backup, torch.empty(1 << 18))
    mean = {n: torch.randn(t.shape) for n, t in params.items()}
    assert step_in_blocks(opt, params, mean, undo_kept=True, watch=watch) is not None
    assert all(torch.equal(backup[n], old[n]) for n in old), "every block backed up before its step"
    vote, norm = watch.result()
    whole_vote, whole_norm = digest_mod.digest_and_step_norm(params, old, torch.empty(1 << 18))
    assert vote == whole_vote == digest(params)
    expected = float(torch.cat([(params[n].double() - old[n].double()).reshape(-1) for n in old]).norm())
    assert norm == pytest.approx(expected, rel=1e-6) and whole_norm == pytest.approx(expected, rel=1e-6)
    with pytest.raises(ValueError, match="needs undo_kept"):
        step_in_blocks(opt, params, mean, watch=watch)


def test_a_step_that_fails_part_way_leaves_the_replica_as_it_was(monkeypatch):
    from diloco.collective import digest as digest_mod

    r, _ = _big_replica()
    r.commit(0, 0, r.propose(0, 0, {n: torch.ones(t.shape) for n, t in r.params.items()}, mean_bound=1e9))
    params = {n: t.clone() for n, t in r.params.items()}
    momentum = [s["momentum_buffer"].clone() for s in r.optimizer_states()[0]["state"].values()]
    real_after = digest_mod.StepWatch.after
    seen = []

    def failing_after(self, name, start, end):
        real_after(self, name, start, end)
        seen.append(name)
        if len(seen) == 3:  # the third block: two stepped and measured, the rest untouched
            raise MemoryError("the machine ran out part way")

    monkeypatch.setattr(digest_mod.StepWatch, "after", failing_after)
    with pytest.raises(MemoryError):
        r.propose(0, 1, {n: torch.full(t.shape, 0.5) for n, t in r.params.items()}, mean_bound=1e9)
    assert all(torch.equal(r.params[n], params[n]) for n in params)
    assert all(torch.equal(m, s["momentum_buffer"])
               for m, s in zip(momentum, r.optimizer_states()[0]["state"].values()))
    assert not r.has_proposal(0) and r.round_ids == [1]
