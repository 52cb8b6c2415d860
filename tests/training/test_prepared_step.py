"""An outer step prepared while the loop is idle gives the very bits of one made at once (``Coordinator.tick``).

``tick`` (the runner calls it when its transport had nothing for a tick) prepares one fragment's next
outer step when ``opt.step()`` will make it (a plain Nesterov step with momentum is made into fresh
memory, ``outer.step_in_blocks``, and needs nothing made ahead): the params moved to fresh memory holding the same values (``ParamStore.begin_step``) and
the optimizer's state backed up. ``outer_step`` uses that only while nothing has changed the params
or the optimizer's state since; the params, the optimizer's state, the Results and the undo of a
refused step are bit for bit those of a coordinator that never ticked (as a journal replay does not).
"""

from __future__ import annotations

import pytest
import torch

from diloco.coordinator import OuterConfig
from diloco.core import Mode
from diloco.testing import joined, make_coordinator
from diloco.wire import compression
from diloco.wire.messages import Result, Submit

P0 = {"a": torch.linspace(-1.0, 1.0, 12).reshape(3, 4), "b": torch.tensor([0.5, -0.5]),
      "c": torch.linspace(2.0, 3.0, 30), "d": torch.tensor([1.5])}


def grads(seed: int, names, scale: float = 0.01) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(P0[n].shape, generator=g) * scale for n in names}


def _run(ticking: bool, *, outer: OuterConfig | None = None, wire_dtype: str = "fp32", fragments: int = 1,
         mode: Mode = Mode.SYNC, rounds: int = 5, huge_at: int | None = None):
    c = joined(make_coordinator(min_workers=2, outer=outer, wire_dtype=wire_dtype, num_fragments=fragments,
                                mode=mode, outlier_factor=0.0), P0, "w1", "w2")
    results = []
    now = 0.0
    for r in range(rounds):
        for fid in range(fragments):
            names = c.store.fragments[fid]
            for i, wid in enumerate(("w1", "w2")):
                now += 0.01
                if ticking:
                    c.tick(now)
                g = grads(1000 * r + 10 * fid + i, names)
                if huge_at == r:
                    g = {n: torch.full_like(t, 3e38) for n, t in g.items()}
                base = r if mode is Mode.SYNC else c.fsm.open_round_ids()[fid]
                enc = compression.encode(g, wire_dtype)
                out = c.handle(wid, Submit(wid, fid, base, enc.values, wire_dtype, enc.scales), now)
                results += [(r, fid, m) for _, m in out if isinstance(m, Result)]
            if ticking:
                for _ in range(fragments + 1):
                    now += 0.01
                    c.tick(now)
    return c, results


def _same(x, y) -> None:
    cx, rx = x
    cy, ry = y
    for n in P0:
        assert torch.equal(cx.store.params[n], cy.store.params[n]), n
    for sx, sy in zip(cx.optimizer_states(), cy.optimizer_states()):
        assert sx["state"].keys() == sy["state"].keys()
        for k in sx["state"]:
            for key, v in sx["state"][k].items():
                w = sy["state"][k][key]
                assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w, (k, key)
    assert len(rx) == len(ry) > 0
    for (r1, f1, m1), (r2, f2, m2) in zip(rx, ry):
        assert (r1, f1, m1.outcome, m1.next_round_id, m1.delta) == (r2, f2, m2.outcome, m2.next_round_id, m2.delta)
        for n in m1.params:
            assert torch.equal(m1.params[n], m2.params[n]), (r1, f1, n)


@pytest.mark.parametrize("outer", ["nesterov", "adam", "sgd"])
@pytest.mark.parametrize("fragments", [1, 3])
def test_a_prepared_step_gives_the_bits_of_one_made_at_once(outer, fragments):
    config = OuterConfig(name=outer, lr=0.5 if outer != "adam" else 0.01)
    ticked = _run(True, outer=config, fragments=fragments)
    # The ticks did prepare steps (and the steps used them, below); Nesterov's steps after its first
    # are made into fresh memory, with nothing prepared.
    assert bool(ticked[0].hub._prepared) == (outer != "nesterov")
    _same(ticked, _run(False, outer=config, fragments=fragments))


@pytest.mark.parametrize("outer", ["nesterov", "adam"])
@pytest.mark.parametrize("wire_dtype", ["bf16", "int8"])
def test_a_prepared_step_gives_the_same_bits_with_a_wire_dtype(wire_dtype, outer):
    config = OuterConfig(name=outer, lr=0.5 if outer != "adam" else 0.01)
    ticked = _run(True, wire_dtype=wire_dtype, outer=config)
    # A bf16/int8 run's step needs the params' old values (its delta): prepared for Nesterov too, and
    # then made in place on the prepared copy (``step_in_blocks(undo_kept=True)``).
    assert ticked[0].hub._prepared
    _same(ticked, _run(False, wire_dtype=wire_dtype, outer=config))  # asserts every param, state and Result equal


def test_a_prepared_step_gives_the_same_bits_in_async_mode():
    outer = OuterConfig(name="delayed_nesterov", lr=0.5)
    ticked = _run(True, outer=outer, mode=Mode.ASYNC)
    assert ticked[0].hub._prepared  # the ticks did prepare steps
    _same(ticked, _run(False, outer=outer, mode=Mode.ASYNC))  # asserts every param, state and Result equal


@pytest.mark.parametrize("outer", ["nesterov", "sgd"])
def test_a_refused_step_puts_back_the_same_values(outer):
    config = OuterConfig(name=outer, lr=1.5)  # lr x 3e38 overflows
    ticked, plain = _run(True, huge_at=2, outer=config), _run(False, huge_at=2, outer=config)
    assert ticked[0].stats.steps_refused == plain[0].stats.steps_refused == 1
    _same(ticked, plain)
    # And the same as a run whose step never happened: the refused round left no trace.
    skipped = _run(False, rounds=2, outer=config)
    refused, _ = _run(False, rounds=3, huge_at=2, outer=config)
    assert refused.stats.steps_refused == 1 and refused.stats.rounds_applied == 3
    for n in P0:
        assert torch.equal(refused.store.params[n], skipped[0].store.params[n]), n
    for sx, sy in zip(refused.optimizer_states(), skipped[0].optimizer_states()):
        for k in sx["state"]:
            for key, v in sx["state"][k].items():
                w = sy["state"][k][key]
                assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w, (k, key)


def test_the_blocked_step_keeps_what_was_released():
    """A plain Nesterov step writes fresh memory: the Results of the round before keep their values."""
    c, results = _run(False, rounds=2)
    released = results[-1][2].params
    kept = {n: t.clone() for n, t in released.items()}
    c.handle("w1", Submit("w1", 0, 2, grads(7, list(P0))), 10.0)
    out = c.handle("w2", Submit("w2", 0, 2, grads(8, list(P0))), 10.0)
    assert any(isinstance(m, Result) for _, m in out) and c.stats.rounds_applied == 3
    assert not c.hub._prepared
    for n, t in released.items():
        assert torch.equal(t, kept[n])  # the Results of the round before kept their values
        assert not torch.equal(c.store.params[n], kept[n])


def test_the_preparation_keeps_the_values_and_what_was_released():
    c, results = _run(True, rounds=2, outer=OuterConfig(name="sgd", lr=0.5))
    released = results[-1][2].params
    kept = {n: t.clone() for n, t in released.items()}
    values = {n: p.clone() for n, p in c.store.params.items()}
    c.tick(10.0)
    assert 0 in c.hub._prepared
    for n, p in c.store.params.items():
        assert torch.equal(p, values[n])  # same values, on fresh memory
        assert p.data_ptr() != released[n].data_ptr()
    c.handle("w1", Submit("w1", 0, 2, grads(7, list(P0))), 10.0)
    c.handle("w2", Submit("w2", 0, 2, grads(8, list(P0))), 10.0)
    for n, t in released.items():
        assert torch.equal(t, kept[n])  # the Results of the round before kept their values


def test_a_preparation_that_is_no_longer_current_is_not_used():
    config = OuterConfig(name="sgd", lr=0.5)
    c, _ = _run(True, rounds=2, outer=config)
    plain, _ = _run(False, rounds=2, outer=config)
    c.tick(10.0)
    assert 0 in c.hub._prepared
    for coordinator in (c, plain):  # something changes the params after the preparation
        with torch.no_grad():
            coordinator.store.params["a"].add_(1.0)
    for coordinator in (c, plain):
        coordinator.handle("w1", Submit("w1", 0, 2, grads(7, list(P0))), 10.0)
        coordinator.handle("w2", Submit("w2", 0, 2, grads(8, list(P0))), 10.0)
    assert 0 not in c.hub._prepared
    for n in P0:
        assert torch.equal(c.store.params[n], plain.store.params[n]), n
