"""The collective data plane end to end, in one process: real gloo groups among worker threads.

A real coordinator loop (``Run``), real ``DilocoWorker``s, a real store. What is
checked is the plane's promise (SPEC.md C4): no worker adopts a round the
machine did not commit, every commit has at least ``min_workers`` confirming
contributors, members hold bit-identical params, round ids never skip or
repeat -- also when a member dies at each point of a round.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from diloco.collective.groups import CollectiveError
from diloco.collective.store import StoreHost
from diloco.testing import make_coordinator
from diloco.wire.messages import AdminRequest, ReduceReport, Submit

from training_harness import Run, batches, mlp, wait_for

HB_TIMEOUT_S = 3.0
COLLECTIVE_TIMEOUT_S = 1.0


@pytest.fixture
def store():
    return StoreHost()


def collective_run(store: StoreHost, *, min_workers: int = 2, wire_dtype: str = "fp32", fragments: int = 1,
                   heartbeat_timeout_s: float = HB_TIMEOUT_S) -> Run:
    coord = make_coordinator(time.monotonic(), min_workers=min_workers, heartbeat_timeout_s=heartbeat_timeout_s,
                             data_plane="collective", reduce_timeout_s=4 * COLLECTIVE_TIMEOUT_S,
                             collective_timeout_s=COLLECTIVE_TIMEOUT_S, wire_dtype=wire_dtype,
                             num_fragments=fragments)
    coord.collective.store_port = store.port
    return Run(coordinator=coord, linger_s=2.0)


def commits(run: Run) -> list[tuple[int, int, str, int]]:
    return [(e["fragment_id"], e["round_id"], e["digest"], len(e["contributors"]))
            for kind, e in list(run.events) if kind == "apply"]


def assert_plane_promise(run: Run, workers, min_workers: int) -> None:
    done = commits(run)
    committed = {(f, r): d for f, r, d, _ in done}
    assert all(n >= min_workers for *_, n in done), f"a commit below min_workers {min_workers}: {done}"
    for fid in {f for f, *_ in done}:
        rounds = [r for f, r, *_ in done if f == fid]
        assert rounds == list(range(len(rounds))), f"fragment {fid}: rounds skipped or repeated: {rounds}"
    for w in workers:
        for fid, rid, digest in w.data_plane.adopted:
            assert committed.get((fid, rid)) == digest, f"{w.worker_id} adopted uncommitted {fid}/{rid}/{digest}"


def assert_same_params(run: Run, workers) -> None:
    """Every member holds, per fragment, exactly the state a commit of the run voted for, and
    members that hold the same round hold bit-identical params.

    Read as committed (``Replica.committed_state``): a member stopped with a proposal open holds
    the proposal's backup as its state, and whether the others had committed that proposal or
    aborted it when the stop came is a race the check must not depend on."""
    committed = {(f, r): d for f, r, d, _ in commits(run)}
    states = [(w.worker_id, *w.data_plane.replica.committed_state()[:2], w.data_plane.replica.committed_digests())
              for w in workers]
    for fid, names in enumerate(workers[0].data_plane.replica.fragments):
        for worker_id, rounds, _, digests in states:
            assert rounds[fid] > 0, f"{worker_id}: fragment {fid} never committed"
            assert committed.get((fid, rounds[fid] - 1)) == digests[fid], \
                f"{worker_id}: fragment {fid} at round {rounds[fid]} holds a state no commit voted for"
        by_round: dict[int, list] = {}
        for worker_id, rounds, params, _ in states:
            by_round.setdefault(rounds[fid], []).append((worker_id, params))
        for rid, held in by_round.items():
            (first, mine), *others = held
            for other, theirs in others:
                assert all(torch.equal(mine[n], theirs[n]) for n in names), \
                    f"fragment {fid} round {rid}: {first} and {other} hold different params"


@pytest.mark.parametrize("wire_dtype, fragments", [("fp32", 1), ("int8", 2), ("bf16", 1)])
def test_members_heal_reduce_and_commit_to_bit_identical_params(store, wire_dtype, fragments):
    with collective_run(store, wire_dtype=wire_dtype, fragments=fragments) as run:
        workers = [run.worker(f"w{i}", mlp(i), sync_every=4) for i in range(3)]
        for i, w in enumerate(workers):
            run.start(w, batches(i), max_steps=24)
        reports = run.join_workers(60)
        assert all(r.rounds_synced >= 4 for r in reports.values()), reports
        assert_same_params(run, workers)
        assert_plane_promise(run, workers, 2)
        # Two joiners healed from a member; the coordinator never held a parameter.
        assert sum(w.data_plane.stats["healed"] for w in workers) == 2
        assert run.coordinator.store is None
        assert run.coordinator.status()["data_plane"] == "collective"


class Death:
    """Kills one in-process worker at a chosen point of a round: cut off from the coordinator
    (partitioned) and from its group (its collectives never run), as a killed process is."""

    def __init__(self, run: Run, worker, phase: str) -> None:
        self.run, self.worker, self.phase = run, worker, phase
        self.dead = threading.Event()
        self.release = threading.Event()  # ends the blocked data thread at teardown
        ep = worker.data_plane
        if phase == "before_ready":
            real_send = ep.send

            def send(message):
                if isinstance(message, Submit) and message.round_id >= 1:
                    self.die()
                real_send(message)
            ep.send = send
        elif phase in ("group_forms", "in_reduce"):
            real_cache = ep._group_cache

            def group_cache():
                cache = real_cache()
                if ep.replica is not None and ep.replica.round_ids[0] >= 1 and not self.dead.is_set():
                    return _DyingCache(cache, self, during_collective=phase == "in_reduce")
                return cache
            ep._group_cache = group_cache
        elif phase == "after_report":
            inner = ep.inner
            real = inner.send

            def inner_send(message):
                real(message)
                if isinstance(message, ReduceReport) and message.round_id >= 1:
                    self.die()
            inner.send = inner_send
        elif phase == "after_commit":
            real_commit = None

            def watch():
                nonlocal real_commit
                wait_for(lambda: ep.replica is not None, 30, "the victim's replica")
                real_commit = ep.replica.commit

                def commit(fid, rid, digest):
                    ok = real_commit(fid, rid, digest)
                    if rid >= 1:
                        self.die()
                    return ok
                ep.replica.commit = commit
            threading.Thread(target=watch, daemon=True).start()

    def die(self) -> None:
        if not self.dead.is_set():
            self.run.net.partition(self.worker.worker_id)
            self.dead.set()


class _DyingCache:
    """A group cache whose member dies while the group forms or inside the collective."""

    def __init__(self, cache, death: Death, during_collective: bool) -> None:
        self._cache, self._death, self._during = cache, death, during_collective
        self.store, self.interface, self.timeout_s = cache.store, cache.interface, cache.timeout_s
        self.device = cache.device

    def get(self, prefix, rank, size, stop=None):
        if not self._during:
            self._death.die()
            self._death.release.wait(30)
            raise CollectiveError("dead")
        group = self._cache.get(prefix, rank, size, stop)
        death = self._death

        class _Group:
            def size(self):
                return group.size()

            def allreduce(self, tensors):
                death.die()
                death.release.wait(30)
                raise CollectiveError("dead inside the all-reduce")
            allgather = allreduce
        return _Group()

    def drop(self):
        self._cache.drop()


@pytest.mark.parametrize("phase", ["before_ready", "group_forms", "in_reduce", "after_report", "after_commit"])
def test_a_death_at_any_point_of_a_round_never_commits_without_the_quorum_and_the_run_goes_on(store, phase):
    """Three members, quorum 2: one dies at ``phase`` of round 1; the survivors go on, identical."""
    with collective_run(store, min_workers=2) as run:
        workers = [run.worker(f"w{i}", mlp(i), sync_every=3, coordinator_timeout_s=5.0) for i in range(3)]
        victim = workers[2]
        death = Death(run, victim, phase)
        handles = [run.start(w, batches(i), max_steps=30) for i, w in enumerate(workers)]
        try:
            wait_for(death.dead.is_set, 60, f"the victim to die ({phase})")
            before = run.coordinator.fsm.rounds_applied
            wait_for(lambda: run.coordinator.fsm.rounds_applied >= before + 2, 60, "two rounds after the death")
            for h in handles[:2]:
                h.join(60)
        finally:
            death.release.set()
            victim.request_stop()
            handles[2].join(30, expect_error=True)
        survivors = workers[:2]
        assert_same_params(run, survivors)
        assert_plane_promise(run, workers, 2)
        assert not run.coordinator.fsm.is_member("w2")
        aborts = [e["reason"] for k, e in run.events if k == "abort"]
        if phase in ("group_forms", "in_reduce"):  # after its report, the commit may include it: legal
            assert aborts, f"{phase}: the attempt the victim was in must abort"


def test_below_quorum_the_collective_run_pauses_and_a_replacement_resumes_it(store):
    with collective_run(store, min_workers=2) as run:
        a, b = run.worker("a", mlp(0), sync_every=3), run.worker("b", mlp(1), sync_every=3)
        ha = run.start(a, batches(0), max_steps=60)
        hb = run.start(b, batches(1), max_steps=60)
        wait_for(lambda: run.coordinator.fsm.rounds_applied >= 2, 60, "two rounds")
        death = Death(run, b, "before_ready")
        death.die()
        wait_for(lambda: run.coordinator.fsm.phase.value == "paused", 30, "the run to pause")
        frozen = run.coordinator.fsm.rounds_applied
        time.sleep(1.0)
        assert run.coordinator.fsm.rounds_applied == frozen
        c = run.worker("c", mlp(2), sync_every=3)
        hc = run.start(c, batches(2), max_steps=30)
        wait_for(lambda: run.coordinator.fsm.rounds_applied >= frozen + 2, 60, "the replacement resumes the run")
        b.request_stop()
        hb.join(30, expect_error=True)
        a.request_stop(), c.request_stop()
        ha.join(30), hc.join(30)
        assert c.data_plane.stats["healed"] == 1
        assert_same_params(run, [a, c])
        assert_plane_promise(run, [a, c], 2)


def test_a_coordinator_crash_costs_at_most_the_open_round_and_the_members_carry_on(store, tmp_path):
    """The coordinator dies (no goodbye); a new one resumes from its checkpoint, which holds no
    params (kilobytes). The members re-join: the first starts the run again from the committed
    state it holds, the other heals from it; round ids continue where the durable ones stopped."""
    from diloco.coordinator.checkpoint import list_checkpoints, load_coordinator
    from diloco.coordinator.runner import CoordinatorThread

    ckpt = tmp_path / "coordinator"
    coord = make_coordinator(time.monotonic(), min_workers=2, heartbeat_timeout_s=HB_TIMEOUT_S,
                             data_plane="collective", reduce_timeout_s=4 * COLLECTIVE_TIMEOUT_S,
                             collective_timeout_s=COLLECTIVE_TIMEOUT_S)
    coord.collective.store_port = store.port
    run = Run(coordinator=coord, linger_s=2.0, checkpoint_dir=ckpt)
    try:
        workers = [run.worker(f"w{i}", mlp(i), sync_every=3, coordinator_timeout_s=60.0) for i in range(2)]
        handles = [run.start(w, batches(i), max_steps=60) for i, w in enumerate(workers)]
        wait_for(lambda: coord.fsm.rounds_applied >= 3, 60, "three commits")
        run.thread.stop(10.0)  # the crash: nothing more is sent
        newest = list_checkpoints(ckpt)[0]
        assert newest.stat().st_size < 64 * 1024, "a collective coordinator's checkpoint holds no params"
        durable = int(newest.name.split("-")[1].split(".")[0])
        restored = load_coordinator(ckpt, time.monotonic(), observer=run._observe)
        assert restored.store is None and restored.fsm.open_round_ids() == (durable,)
        restored.collective.store_port = store.port
        run.coordinator = restored
        run.thread = CoordinatorThread(run.net.coordinator(), restored, checkpoint_dir=ckpt, linger_s=2.0)
        run.thread.start()
        wait_for(lambda: restored.fsm.rounds_applied >= durable + 2, 60, "two commits after the restart")
        for w in workers:
            w.request_stop()
        for h in handles:
            h.join(30)
    finally:
        run.close()
    assert_same_params(run, workers)
    # Every commit of either incarnation is in order (the observer heard both), none repeated.
    rounds = [e["round_id"] for k, e in run.events if k == "apply"]
    assert rounds == list(range(len(rounds))), rounds
    assert_plane_promise(run, workers, 2)
    assert sum(w.data_plane.stats["healed"] for w in workers) >= 2  # one at the start, one after the restart


def test_a_whole_run_resumes_from_the_newest_worker_checkpoint_and_an_older_one_heals_from_it(store, tmp_path):
    """C6, restarts: everything stops; the coordinator resumes its record, the workers their
    checkpoints -- w0's older than w1's. w0 joins first and starts the run from its state; w1
    offers a newer one before any commit, so the run starts again from w1's and w0 (reseeded)
    heals from it. min_workers 3 holds every commit back while that is checked, then 2 lets
    the run go on, in order and bit-identical."""
    import shutil

    from diloco.coordinator.checkpoint import load_coordinator
    from diloco.coordinator.runner import CoordinatorThread
    from diloco.worker.checkpoint import checkpoint_path, load_worker_checkpoint

    ckpt, wdir = tmp_path / "coordinator", tmp_path / "workers"
    coord = make_coordinator(time.monotonic(), min_workers=2, heartbeat_timeout_s=HB_TIMEOUT_S,
                             data_plane="collective", reduce_timeout_s=4 * COLLECTIVE_TIMEOUT_S,
                             collective_timeout_s=COLLECTIVE_TIMEOUT_S)
    coord.collective.store_port = store.port
    run = Run(coordinator=coord, linger_s=2.0, checkpoint_dir=ckpt)
    w0_path, w1_path = checkpoint_path(wdir, "w0"), checkpoint_path(wdir, "w1")
    old_copy = tmp_path / "w0-old.ckpt"

    def start_worker(i: int):
        w = run.worker(f"w{i}", mlp(i), sync_every=3, coordinator_timeout_s=60.0, checkpoint_dir=wdir,
                       checkpoint_every=1)
        return w, run.start(w, batches(i), max_steps=400)

    try:
        (a, ha), (b, hb) = start_worker(0), start_worker(1)
        wait_for(lambda: coord.fsm.rounds_applied >= 2 and w0_path.exists(), 60, "two commits")
        shutil.copy(w0_path, old_copy)  # w0's checkpoint of an early round
        old_rounds = load_worker_checkpoint(old_copy).round_ids
        wait_for(lambda: coord.fsm.rounds_applied >= sum(old_rounds) + 3, 60, "three more commits")
        for w in (a, b):
            w.request_stop()
        for h in (ha, hb):
            h.join(30)
        run.thread.stop(10.0)  # the whole run is down
        shutil.copy(old_copy, w0_path)
        newest = load_worker_checkpoint(w1_path)
        assert sum(newest.round_ids) > sum(old_rounds), (newest.round_ids, old_rounds)

        restored = load_coordinator(ckpt, time.monotonic(), observer=run._observe)
        restored.collective.store_port = store.port
        restored.handle("admin", AdminRequest("set_min_workers", {"min_workers": 3}), time.monotonic())
        run.coordinator = restored
        run.thread = CoordinatorThread(run.net.coordinator(), restored, checkpoint_dir=ckpt, linger_s=2.0)
        run.thread.start()
        before = len(run.events)
        (a, ha) = start_worker(0)
        wait_for(lambda: a.data_plane.replica is not None, 30, "w0 starts the run from its old checkpoint")
        assert a.data_plane.stats["healed"] == 0
        (b, hb) = start_worker(1)
        wait_for(lambda: a.data_plane.stats["healed"] >= 1, 30, "w0 reseeded: it heals from w1's newer state")
        reseeds = [e for k, e in run.events[before:] if k == "reseed"]
        assert [(e["worker_id"], e["starter"]) for e in reseeds] == [("w0", "w1")], reseeds
        assert b.data_plane.stats["healed"] == 0, "w1 started the run again from its own checkpoint"
        for w in (a, b):
            assert all(torch.equal(w.data_plane.replica.params[n], newest.global_params[n])
                       for n in newest.global_params), f"{w.worker_id} does not hold w1's checkpointed state"
        assert restored.fsm.rounds_applied == coord.fsm.rounds_applied, "nothing committed below min_workers 3"

        resumed_at = restored.fsm.rounds_applied
        assert run.admin("set_min_workers", min_workers=2).ok
        wait_for(lambda: restored.fsm.rounds_applied >= resumed_at + 2, 60, "two commits after the resume")
        for w in (a, b):
            w.request_stop()
        for h in (ha, hb):
            h.join(30)
    finally:
        run.close()
    assert_same_params(run, [a, b])
    rounds = [e["round_id"] for k, e in run.events if k == "apply"]
    assert rounds == list(range(len(rounds))), rounds
    assert_plane_promise(run, [a, b], 2)


def _liar(worker, after_round: int, factor: float = 1e6) -> None:
    """From ``after_round`` on, ``worker`` sends its pseudo-gradient times ``factor`` while it declares
    the honest one's norm: a lie (or a fault between the measure and the wire) only the group sees."""
    import dataclasses

    ep = worker.data_plane
    send = ep.send

    def lying_send(message):
        if isinstance(message, Submit) and ep.collective and message.round_id >= after_round:
            norm = ep._declared_norm(message)
            if message.scales:
                message = dataclasses.replace(message, scales={n: s * factor for n, s in message.scales.items()})
            else:
                message = dataclasses.replace(message, tensors={n: t * factor for n, t in message.tensors.items()})
            message = dataclasses.replace(message, norm=norm)
        send(message)

    ep.send = lying_send


@pytest.mark.parametrize("wire_dtype", ["fp32", "int8"])
def test_a_member_whose_contribution_is_not_what_it_declares_is_blamed_evicted_and_banned(store, wire_dtype):
    """SPEC.md section 7c: the group sees the lie (int8: in the all-gather; fp32: the mean fails its
    check and the round's next attempt gathers), blames the liar unanimously -- its own machine
    included -- and the coordinator evicts it; after three evictions it is banned. Nothing it sent
    after it turned bad is in a commit, and the honest members' params stay bounded."""
    with collective_run(store, min_workers=2, wire_dtype=wire_dtype) as run:
        workers = [run.worker(f"w{i}", mlp(i), sync_every=3, coordinator_timeout_s=20.0) for i in range(3)]
        liar = workers[2]
        _liar(liar, after_round=3)
        handles = [run.start(w, batches(i), max_steps=120) for i, w in enumerate(workers)]
        wait_for(lambda: any(k == "evicted" and e["banned"] for k, e in run.events), 90, "the liar banned")
        banned_at = run.coordinator.fsm.rounds_applied
        wait_for(lambda: run.coordinator.fsm.rounds_applied >= banned_at + 3, 60, "three commits after the ban")
        handles[2].join(30, expect_error=True)
        for w in workers[:2]:
            w.request_stop()
        for h in handles[:2]:
            h.join(60)
        evictions = [e for k, e in run.events if k == "evicted"]
        assert [e["worker_id"] for e in evictions] == ["w2"] * 3, evictions
        assert [e["banned"] for e in evictions] == [False, False, True]
        # Whoever was in the group blamed w2: the liar's own machine too (it measured the same bytes).
        blamers = {e["worker_id"] for k, e in run.events if k == "reduce_failed" and e.get("blame") == ["w2"]}
        assert "w2" in blamers and blamers & {"w0", "w1"}, blamers
        if wire_dtype == "fp32":
            assert any(k == "reduce_failed" and "mean" in e["detail"] for k, e in run.events)
        for fid, rid, _digest, _n in commits(run):
            assert rid < 3 or "w2" not in next(e["contributors"] for k, e in run.events
                                               if k == "apply" and e["round_id"] == rid and e["fragment_id"] == fid)
        assert "w2" in run.coordinator.access.banned_ids
        assert_plane_promise(run, workers[:2], 2)
        assert_same_params(run, workers[:2])
        for w in workers[:2]:
            assert all(bool(t.abs().max() < 100) for t in w.data_plane.replica.params.values())
