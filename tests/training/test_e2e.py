"""End to end: a real coordinator loop and DilocoWorkers in threads over the inproc network."""

from __future__ import annotations

import threading

import torch

from diloco.core import Mode
from diloco.coordinator import OuterConfig
from diloco.testing import params_of
from training_harness import Run, batches, linear, mlp


def test_after_every_sync_round_all_workers_hold_the_coordinators_params_bit_for_bit():
    k, H, steps = 3, 5, 30
    snapshots: dict[str, dict[int, dict[str, torch.Tensor]]] = {f"w{i}": {} for i in range(k)}
    workers = {}
    lock = threading.Lock()

    def on_state(wid: str, state: str, t: float) -> None:
        # Entering TRAINING right after a Welcome or a Result: the model holds the global params.
        if state == "training":
            w = workers[wid]
            with lock:
                snapshots[wid][w.round_ids[0]] = params_of(w.model)

    with Run(min_workers=k) as run:
        for i in range(k):
            w = run.worker(f"w{i}", linear(seed=100 + i), sync_every=H, on_state=on_state)
            workers[w.worker_id] = w
        for i, w in enumerate(workers.values()):
            run.start(w, batches(seed=i), max_steps=steps)
        reports = run.join_workers()
    rounds = steps // H
    assert [r for _, r, _ in run.applied] == list(range(rounds))
    for wid, report in reports.items():
        assert report.inner_steps == steps and report.rounds_synced == rounds
        assert report.stop_reason == "max_steps"
    for _fid, rid, coordinator_params in run.applied:
        for wid in workers:
            held = snapshots[wid][rid + 1]
            for name, t in coordinator_params.items():
                assert torch.equal(held[name], t), f"{wid} after round {rid}: {name} differs"
    # The Welcome's params (round 0's base) are the first joiner's, identical everywhere too.
    bases = [snapshots[wid][0] for wid in workers]
    for b in bases[1:]:
        assert all(torch.equal(b[n], bases[0][n]) for n in b)
    # And the workers' own global copies equal the final global params.
    final = run.coordinator.store.params
    for w in workers.values():
        assert all(torch.equal(w.global_params[n], final[n]) for n in final)
        assert all(torch.equal(p, final[n]) for n, p in w.model.named_parameters())


def test_fragments_sync_staggered_end_to_end():
    H, F, steps = 6, 2, 24
    with Run(min_workers=2, num_fragments=F) as run:
        ws = [run.worker(f"w{i}", mlp(seed=10 + i), sync_every=H) for i in range(2)]
        for i, w in enumerate(ws):
            run.start(w, batches(seed=i), max_steps=steps)
        reports = run.join_workers()
    frag0, frag1 = ws[0].fragments
    assert frag0 and frag1
    # Fragment f's round r closes at inner step r*H + (f+1)*H//F: 3, 9, 15, 21 and 6, 12, 18, 24.
    for w in ws:
        synced = [(step, fid, rid) for step, fid, rid, outcome in w.sync_history if outcome == "applied"]
        assert synced == sorted(
            [(r * H + 3, 0, r) for r in range(4)] + [(r * H + 6, 1, r) for r in range(4)]), synced
        assert w.round_ids == (4, 4)
    assert all(r.rounds_synced == 8 for r in reports.values())
    assert run.coordinator.fsm.open_round_ids() == (4, 4)
    by_fragment = {0: set(frag0), 1: set(frag1)}
    for fid, _rid, params in run.applied:
        assert set(params) == by_fragment[fid]
    # The workers' global copies equal the coordinator's; their models equal it on fragment 1,
    # which synced at the last step (fragment 0 trained 3 more local steps since step 21).
    final = run.coordinator.store.params
    for w in ws:
        assert all(torch.equal(w.global_params[n], final[n]) for n in final)
        model = dict(w.model.named_parameters())
        assert all(torch.equal(model[n], final[n]) for n in frag1)
        assert not any(torch.equal(model[n], final[n]) for n in frag0)


def test_async_two_workers_end_to_end():
    H, steps = 5, 25
    # min_workers=1: with 2, whichever worker finishes first leaves the other's last
    # contribution held below quorum (correct, SPEC.md P3; a run ends with a drain).
    outer = OuterConfig("delayed_nesterov", 0.7, 0.9, delay=2)
    with Run(min_workers=1, mode=Mode.ASYNC, outer=outer) as run:
        ws = [run.worker(f"w{i}", linear(seed=20 + i), sync_every=H) for i in range(2)]
        initial_loss = _eval_loss(ws[0].model)
        for i, w in enumerate(ws):
            run.start(w, batches(seed=i), max_steps=steps)
        reports = run.join_workers()
    assert run.coordinator.config.outer.name == "delayed_nesterov"
    # Every contribution applied on its own: 2 workers x 5 syncs = 10 versions.
    assert run.coordinator.fsm.open_round_ids() == (10,)
    assert [rid for _, rid, _ in run.applied] == list(range(10))
    for r in reports.values():
        assert r.rounds_synced == 5 and r.inner_steps == steps
    for w in ws:
        # Each worker's base version moved on with every Result it took.
        versions = [rid for _, _, rid, outcome in w.sync_history if outcome == "applied"]
        assert versions == sorted(versions) and len(versions) == 5
    final = run.coordinator.store.params
    model = linear(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(final[n])
    assert _eval_loss(model) < 0.5 * initial_loss


def _eval_loss(model: torch.nn.Module) -> float:
    from training_harness import batch_at, mse_loss
    with torch.no_grad():
        return sum(float(mse_loss(model, batch_at(999, s, batch_size=256))) for s in range(4)) / 4
