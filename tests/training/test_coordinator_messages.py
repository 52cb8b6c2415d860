"""Regression: the messages ``Coordinator.handle`` returns are values, not views.

The coordinator is sans-IO: whoever drives it may hold the returned messages
for a while before sending them (the simulator delays delivery). Welcome and
Result params used to be the store's live tensors, which every later outer
step changes in place, so a delayed message carried params it was never sent
with; and in async mode a step that applies several held contributions gave
each released worker the params after *all* of them, paired with a
``next_round_id`` that did not match its own apply.
"""

from __future__ import annotations

import torch

from diloco.core import Mode
from diloco.coordinator import Coordinator, OuterConfig
from diloco.testing import join_message, joined, make_coordinator, only, replies
from diloco.wire.messages import AdminRequest, Result, Submit, Welcome

P0 = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.5])}


def grad(v: float) -> dict[str, torch.Tensor]:
    return {n: torch.full_like(t, v) for n, t in P0.items()}


def make(mode: Mode, min_workers: int) -> Coordinator:
    return make_coordinator(min_workers=min_workers, mode=mode, outer=OuterConfig("sgd", 1.0, 0.0))


def test_sync_result_keeps_its_values_after_later_rounds():
    c = joined(make(Mode.SYNC, 1), P0, "a")
    first = only(c.handle("a", Submit("a", 0, 0, grad(0.5)), 0.0), Result)
    kept = {n: t.clone() for n, t in first.params.items()}
    c.handle("a", Submit("a", 0, 1, grad(0.25)), 0.0)   # the driver has not sent `first` yet
    for n in P0:
        assert torch.equal(first.params[n], kept[n]), "a held Result changed under the driver"
    assert torch.equal(kept["w"], torch.tensor([0.5, 1.5]))


def test_welcome_keeps_its_values_after_later_rounds():
    c = make(Mode.SYNC, 1)
    welcome = only(c.handle("a", join_message("a", P0), 0.0), Welcome)
    c.handle("a", Submit("a", 0, 0, grad(0.5)), 0.0)
    assert torch.equal(welcome.params["w"], P0["w"])


def test_async_held_contributions_release_each_worker_at_its_own_version():
    c = joined(make(Mode.ASYNC, 2), P0, "a", "b")
    # Below quorum: both contributions are held (SPEC.md P3) ...
    c.handle("admin", AdminRequest("set_min_workers", {"min_workers": 3}), 0.0)
    assert not replies(c.handle("a", Submit("a", 0, 0, grad(0.5)), 0.0), Result)
    assert not replies(c.handle("b", Submit("b", 0, 0, grad(0.25)), 0.0), Result)
    # ... and apply one by one, in arrival order, when the quorum returns.
    out = c.handle("admin", AdminRequest("set_min_workers", {"min_workers": 2}), 0.0)
    res = dict(replies(out, Result))
    assert (res["a"].next_round_id, res["b"].next_round_id) == (1, 2)
    # Outer SGD lr 1: version 1 = P0 - 0.5, version 2 = P0 - 0.75.
    assert torch.equal(res["a"].params["w"], P0["w"] - 0.5)
    assert torch.equal(res["b"].params["w"], P0["w"] - 0.75)
    assert torch.equal(c.store.params["w"], P0["w"] - 0.75)


def test_key_bindings_of_departed_ids_are_bounded_oldest_first(monkeypatch):
    """SPEC.md section 11, A3: at most MAX_BOUND_IDS bindings of ids that are no longer members."""
    from types import SimpleNamespace

    import diloco.coordinator.access as access
    from diloco.wire.messages import Leave

    monkeypatch.setattr(access, "MAX_BOUND_IDS", 3)
    c = make_coordinator(min_workers=1)
    key = SimpleNamespace(public_key="K" * 40, name="k")
    for i in range(6):
        c.handle(f"p{i}", join_message(f"w{i}", P0), float(i), identity=key)
        assert c.fsm.is_member(f"w{i}")
        c.handle(f"p{i}", Leave(f"w{i}"), float(i) + 0.5, identity=key)
    assert list(c.access.keys) == ["w3", "w4", "w5"]
