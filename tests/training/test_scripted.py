"""Scripted, single-threaded scenarios: one real ``DilocoWorker``, a sans-IO ``Coordinator``,
a fake clock, and other workers played by the test.

Whenever the worker waits for a message and none is there, the endpoint runs
the next step of the scenario (a generator). No threads, no real time: the
paths that are hard to hit with real timing (a re-join onto a parked
contribution, a held-limit retry) are exact here.
"""

from __future__ import annotations

import collections

import pytest
import torch

from diloco.core import Mode
from diloco.coordinator import Coordinator
from diloco.testing import join_message, make_coordinator, params_of
from diloco.transport.base import TransportClosed
from diloco.wire.messages import Error, ErrorCode, Heartbeat, Submit, spec_of
from diloco.worker import DilocoWorker
from training_harness import batch_at, linear, mse_loss


class FakeClock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


class Script:
    """Routes messages between one worker endpoint and the coordinator; plays the scenario."""

    def __init__(self, coordinator: Coordinator, clock: FakeClock) -> None:
        self.c = coordinator
        self.clock = clock
        self.inbox: collections.deque = collections.deque()
        #: Everything delivered to the worker, in order.
        self.delivered: list = []
        self.partitioned = False
        self.others: dict[str, list] = collections.defaultdict(list)
        self.scenario = iter(())
        self.idle_turns = 0

    def handle(self, peer: str, message) -> None:
        for to, reply in self.c.handle(peer, message, self.clock()):
            if to == "a":
                if not self.partitioned:
                    self.inbox.append(reply)
                    self.delivered.append(reply)
            else:
                self.others[to].append(reply)

    def idle(self) -> None:
        self.idle_turns += 1
        assert self.idle_turns < 10_000, "the worker is still waiting after the scenario ended"
        try:
            next(self.scenario)
        except StopIteration:
            self.clock.advance(0.01)


class ScriptEndpoint:
    def __init__(self, script: Script) -> None:
        self.script = script
        self.closed = False

    def send(self, message) -> None:
        if self.closed:
            raise TransportClosed("closed")
        if not self.script.partitioned:
            self.script.handle("a", message)

    def recv(self, timeout_s: float):
        if not self.script.inbox:
            self.script.idle()
        return self.script.inbox.popleft() if self.script.inbox else None

    def close(self) -> None:
        self.closed = True


def setup(**fsm):
    clock = FakeClock()
    c = make_coordinator(clock(), **fsm)
    script = Script(c, clock)
    model = linear(0)
    states: list[str] = []
    w = DilocoWorker(model, torch.optim.SGD(model.parameters(), lr=0.05), ScriptEndpoint(script), worker_id="a",
                     sync_every=2, clock=clock, on_state=lambda wid, s, t: states.append(s))
    spec = tuple(spec_of({n: p.detach() for n, p in model.named_parameters()}))
    return clock, c, script, w, states, spec


def train_step(w: DilocoWorker, step: int) -> bool:
    w.inner_optimizer.zero_grad()
    mse_loss(w.model, batch_at(0, step)).backward()
    w.inner_optimizer.step()
    return w.step_done()


def pseudo_gradient(value: float) -> dict[str, torch.Tensor]:
    return {"weight": torch.full((1, 8), value), "bias": torch.full((1,), value)}


def test_rejoin_onto_a_parked_contribution_waits_for_its_result():
    """A submits round 0, is cut off long enough to be declared dead (its contribution stays
    pending, P1), heals, is told to rejoin, and the Welcome parks it on that contribution:
    it must wait for round 0's Result, not train on or resubmit."""
    clock, c, script, w, states, spec = setup(min_workers=2, heartbeat_timeout_s=1.0)
    w.join()
    script.handle("b", join_message("b", spec))

    def scenario():
        assert w.state == "waiting" and c.status()["fragments"][0]["contributed"] == ["a"]
        script.partitioned = True
        while c.fsm.is_member("a"):
            clock.advance(0.2)
            script.handle("b", Heartbeat("b"))
            yield
        script.partitioned = False
        while not c.fsm.is_member("a"):  # A's next heartbeat is answered "rejoin"
            clock.advance(0.1)
            script.handle("b", Heartbeat("b"))
            yield
        (welcome,) = [m for m in script.delivered if type(m).__name__ == "Welcome"][1:]
        assert welcome.parked == ((0, 0),)
        assert w.state == "waiting" and w.session.waiting == {0: 0}, "the re-joined worker must wait on its parked round"
        script.handle("b", Submit("b", 0, 0, pseudo_gradient(0.1)))
        yield

    script.scenario = scenario()
    assert train_step(w, 0) is True
    assert train_step(w, 1) is True          # the sync point: submit, cut off, rejoin, parked, released
    assert w.rounds_synced == 1 and w.round_ids == (1,)
    assert states.count("joining") == 2 and states[-1] == "training"
    assert all(torch.equal(p, c.store.params[n]) for n, p in w.model.named_parameters())
    assert [m.outcome for m in script.others["b"] if type(m).__name__ == "Result"] == ["applied"]


def test_held_limit_is_retried_after_an_interval():
    """Async, below quorum, the fragment's hold is full: A's submission is refused with
    held_limit; A stays at its sync point and submits again once quorum returns."""
    clock, c, script, w, states, spec = setup(min_workers=3, mode=Mode.ASYNC, max_held_per_fragment=1,
                                              heartbeat_timeout_s=10.0)
    w.join()
    script.handle("b", join_message("b", spec))
    script.handle("b", Submit("b", 0, 0, pseudo_gradient(0.1)))  # held: 2 < 3 live

    def scenario():
        while not any(isinstance(m, Error) and m.code is ErrorCode.HELD_LIMIT
                      for m in script.delivered) or w.state != "paused":
            yield
        script.handle("c", join_message("c", spec))  # quorum: B's contribution applies
        assert c.fsm.open_round_ids() == (1,)
        while True:
            clock.advance(0.5)
            yield

    script.scenario = scenario()
    assert train_step(w, 0) is True
    assert train_step(w, 1) is True
    assert c.fsm.open_round_ids() == (2,) and w.round_ids == (2,) and w.rounds_synced == 1
    assert "paused" in states and states[-1] == "training"


def test_coordinator_silence_stops_the_worker_with_its_checkpoint(tmp_path):
    clock, c, script, w, states, spec = setup(min_workers=2, heartbeat_timeout_s=1.0)
    w.session.coordinator_timeout_s = 5.0
    from diloco.worker.checkpoint import checkpoint_path
    w.checkpoint_path = checkpoint_path(tmp_path, "a")
    w.join()

    def scenario():
        script.partitioned = True  # the coordinator is gone: nothing answers
        while True:
            clock.advance(0.1)
            yield

    script.scenario = scenario()
    assert train_step(w, 0) is True
    assert train_step(w, 1) is False
    assert w.stop_reason == "coordinator_unreachable" and w.state == "stopped"
    assert w.checkpoint_path.exists()
    assert 5.0 < clock.t - 100.0 < 7.0


@pytest.mark.parametrize("code", ["future_round", "unknown_worker"])
def test_refused_submission_rejoins_and_takes_the_welcome(code):
    """Kicked between rounds (unknown_worker: round 0 then applies with B alone), or off by
    some rounds (future_round): either way the worker joins again and goes on from the
    Welcome -- its params if the global params moved, its own progress if they did not."""
    clock, c, script, w, states, spec = setup(min_workers=1, heartbeat_timeout_s=10.0)
    w.join()
    script.handle("b", join_message("b", spec))
    if code == "unknown_worker":
        from diloco.wire.messages import AdminRequest
        script.handle("admin", AdminRequest("kick", {"worker_id": "a"}))
        script.handle("b", Submit("b", 0, 0, pseudo_gradient(0.1)))   # round 0 applies with B alone
    else:
        w.session.round_ids[0] = 5  # a worker that believes round 5 is open
    assert train_step(w, 0) is True
    w.inner_optimizer.zero_grad()
    mse_loss(w.model, batch_at(0, 1)).backward()
    w.inner_optimizer.step()
    local = params_of(w.model)
    assert w.step_done() is True  # the sync point: refused, re-joined, back to training
    assert states.count("joining") == 2 and states[-1] == "training"
    assert c.fsm.is_member("a")
    if code == "unknown_worker":
        # Round 0 applied without A: A takes the new global params, and round 1 is open.
        assert w.round_ids == (1,) and w.rounds_synced == 0
        assert all(torch.equal(p, c.store.params[n]) for n, p in w.model.named_parameters())
    else:
        # Nothing applied: round 0 is still open and A's local progress is still valid from
        # its base, so A keeps it, and is placed back on the run's schedule (round 0 closes
        # at schedule step 2, counted from the Welcome): two more steps, then it submits.
        assert w.round_ids == (0,) and w.session.waiting == {}
        assert all(torch.equal(p, local[n]) for n, p in w.model.named_parameters())

        def b_contributes():
            while w.session.waiting != {0: 0}:
                yield
            assert w.inner_step == 4 and c.status()["fragments"][0]["contributed"] == ["a"]
            script.handle("b", Submit("b", 0, 0, pseudo_gradient(0.1)))
            yield

        script.scenario = b_contributes()
        assert train_step(w, 2) and train_step(w, 3)
        assert w.rounds_synced == 1 and w.round_ids == (1,) and w.state == "training"


def test_a_lost_result_is_recovered_by_leaving_and_joining_again():
    """The Result of round 0 is lost on the way (a short partition, too short to be declared
    dead); A waits unpaused, then leaves and joins again, and the Welcome brings round 1."""
    clock, c, script, w, states, spec = setup(min_workers=2, heartbeat_timeout_s=1.0)
    w.join()
    script.handle("b", join_message("b", spec))

    def scenario():
        script.partitioned = True
        script.handle("b", Submit("b", 0, 0, pseudo_gradient(0.1)))  # applies; A's Result is lost
        assert c.fsm.open_round_ids() == (1,)
        clock.advance(0.3)
        script.partitioned = False
        while w.state != "joining" and not states.count("joining") == 2:
            clock.advance(0.05)
            script.handle("b", Heartbeat("b"))
            yield

    script.scenario = scenario()
    assert train_step(w, 0) is True
    assert train_step(w, 1) is True
    assert states.count("joining") == 2 and states[-1] == "training"
    assert w.round_ids == (1,)
    assert all(torch.equal(p, c.store.params[n]) for n, p in w.model.named_parameters())
    # 16 heartbeat intervals of 0.25 s: it waited about 4 s of (fake) time first.
    assert 4.0 <= clock.t - 100.0 < 5.0
