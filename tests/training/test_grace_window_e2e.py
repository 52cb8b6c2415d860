"""End to end with a grace window (SPEC.md P5): a real coordinator loop and DilocoWorkers in threads
over the inproc network; merged Results are taken like any other, and every worker ends on the
coordinator's params."""

from __future__ import annotations

import time

import torch

from diloco.coordinator import OuterConfig
from diloco.core import Mode
from diloco.testing import make_coordinator
from training_harness import Run, batches, linear


def test_async_workers_with_a_grace_window_merge_and_end_on_the_coordinators_params():
    H, steps, k = 5, 25, 3
    coordinator = make_coordinator(time.monotonic(), outer=OuterConfig("delayed_nesterov", 0.7, 0.9, delay=1),
                                   min_workers=1, mode=Mode.ASYNC, heartbeat_timeout_s=10.0, grace_window_s=5.0)
    with Run(coordinator=coordinator) as run:
        ws = [run.worker(f"w{i}", linear(seed=40 + i), sync_every=H) for i in range(k)]
        for i, w in enumerate(ws):
            run.start(w, batches(seed=i), max_steps=steps)
        reports = run.join_workers()
    applies = [info["contributors"] for kind, info in run.events if kind == "apply"]
    # Every contribution applied once (k workers x 5 syncs), in fewer outer steps: windows merged.
    assert sum(len(c) for c in applies) == k * steps // H
    assert len(applies) < k * steps // H and max(len(c) for c in applies) > 1
    assert [rid for _, rid, _ in run.applied] == list(range(len(applies)))
    for r in reports.values():
        assert r.rounds_synced == steps // H and r.inner_steps == steps
    final = run.coordinator.store.params
    for w in ws:
        versions = [rid for _, _, rid, outcome in w.sync_history if outcome == "applied"]
        assert versions == sorted(versions) and len(versions) == steps // H
    # The contributors of the last merged step took its Result: they hold the final params.
    by_id = {w.worker_id: w for w in ws}
    for wid in applies[-1]:
        assert all(torch.equal(by_id[wid].global_params[n], final[n]) for n in final), wid
