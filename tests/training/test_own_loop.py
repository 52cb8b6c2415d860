"""The worker's communication thread and the ``diloco.Worker`` context manager.

* A worker whose inner step takes three times the coordinator's heartbeat
  timeout stays a member and its rounds apply: the communication thread
  heartbeats while the step runs. The same worker without the thread is
  declared dead (the control that shows the test can fail).
* ``diloco.Worker``: joins on entry, counts steps, leaves on exit and on an
  exception (the exception propagates), and counts steps from an optimizer
  hook with ``hook=True``.
"""

from __future__ import annotations

import time

import pytest
import torch

import diloco
from training_harness import Run, batch_at, linear, mse_loss

HEARTBEAT_TIMEOUT_S = 0.5
SLOW_STEP_S = 3 * HEARTBEAT_TIMEOUT_S


def slow_batches(seed: int, slow_steps: set[int], sleep_s: float):
    step = 0
    while True:
        if step in slow_steps:
            time.sleep(sleep_s)  # an inner step (or an evaluation) far longer than the heartbeat timeout
        yield batch_at(seed, step)
        step += 1


@pytest.mark.parametrize("comm_thread", [True, False], ids=["comm_thread", "no_thread_control"])
def test_an_inner_step_three_heartbeat_timeouts_long_keeps_the_worker_a_member(comm_thread):
    H, steps = 4, 12
    with Run(min_workers=2, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S) as run:
        slow = run.worker("slow", linear(1), sync_every=H, comm_thread=comm_thread)
        fast = run.worker("fast", linear(2), sync_every=H)
        run.start(slow, slow_batches(1, {1, 6, 9}, SLOW_STEP_S), max_steps=steps)
        run.start(fast, slow_batches(2, set(), 0.0), max_steps=steps)
        if comm_thread:
            reports = run.join_workers(60.0)
        else:
            deadline = time.monotonic() + 60.0
            while not any(k == "dead" for k, _ in run.events) and time.monotonic() < deadline:
                time.sleep(0.05)
            for h in run.handles.values():
                h.worker.request_stop()
                h.join(60.0, expect_error=True)
    dead = [info["worker_id"] for k, info in run.events if k == "dead"]
    if not comm_thread:
        assert dead == ["slow"], "control: without the thread a 1.5 s step must get the worker declared dead"
        return
    assert dead == [], f"declared dead while a long step ran: {dead}"
    applied = [info for k, info in run.events if k == "apply"]
    assert [a["round_id"] for a in applied] == [0, 1, 2]
    assert all(sorted(a["contributors"]) == ["fast", "slow"] for a in applied), applied
    assert reports["slow"].rounds_synced == 3 and reports["slow"].inner_steps == steps


def own_loop(run: Run, worker_id: str, steps: int, *, fail_at: int | None = None, hook: bool = False):
    """The README's loop, over the in-process network."""
    torch.manual_seed(0)
    model = linear(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    with diloco.Worker(model, optimizer, connect=run.net.connect(worker_id), worker_id=worker_id,
                       sync_every=5, hook=hook) as w:
        for step in range(steps):
            if step == fail_at:
                raise RuntimeError("the user's loop failed")
            loss = mse_loss(model, batch_at(0, step))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if hook:
                if w.stopped:
                    break
            elif not w.step():
                break
    return w


def wait_left(run: Run, worker_id: str) -> None:
    """The coordinator hears the Leave at once (well before the 10 s heartbeat timeout)."""
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        left = [info for k, info in list(run.events) if k == "left" and info["worker_id"] == worker_id]
        if left:
            assert left[0]["cause"] == "left", left
            return
        time.sleep(0.01)
    raise AssertionError(f"the coordinator never heard {worker_id} leave: {run.events}")


def test_the_context_manager_joins_syncs_and_leaves():
    with Run(min_workers=1) as run:
        w = own_loop(run, "mine", 20)
        assert w.inner_step == 20 and w.rounds_synced == 4 and w.state == "stopped" and w.stop_reason == "left"
        assert [info["round_id"] for k, info in run.events if k == "apply"] == [0, 1, 2, 3]
        wait_left(run, "mine")


def test_an_exception_in_the_loop_leaves_cleanly_and_propagates():
    with Run(min_workers=1) as run:
        with pytest.raises(RuntimeError, match="the user's loop failed"):
            own_loop(run, "mine", 20, fail_at=7)
        wait_left(run, "mine")
        assert [info["round_id"] for k, info in run.events if k == "apply"] == [0]


def test_hook_mode_counts_steps_from_the_optimizer():
    with Run(min_workers=1) as run:
        w = own_loop(run, "hooked", 15, hook=True)
        assert w.inner_step == 15 and w.rounds_synced == 3


def test_bad_connect_values_are_refused_precisely():
    model = linear(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="expected tcp://HOST:PORT"):
        diloco.Worker(model, opt, connect="http://127.0.0.1:5555", sync_every=5)
    with pytest.raises(TypeError, match="endpoint with send/recv/close"):
        diloco.Worker(model, opt, connect=5555, sync_every=5)
    with pytest.raises(ValueError, match="sync_every"):
        diloco.Worker(model, opt, connect=_NullEndpoint(), sync_every=0)


class _NullEndpoint:
    def send(self, message) -> None: ...
    def recv(self, timeout_s): return None
    def close(self) -> None: ...
