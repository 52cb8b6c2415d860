"""Data work units (SPEC.md section 12, "Data work units", U1-U5): the ledger and the coordinator.

What this proves:

* ``UnitLedger`` against a reference model (``LedgerMachine``, Hypothesis-driven
  hand-outs, claims, submits right and wrong, applies, failed applies, releases and
  save/restore round trips over four workers and 1..7 units). After every step: no
  unit is held by two workers, nor held and in flight at once (U1); a unit is never
  finished twice in an epoch, and only the units in flight for an applied round's
  contributors finish (U2, U4); every unit handed out is unfinished, and a unit is
  handed out again in its epoch only after it was given back (U1, U3); a worker
  holding a unit gets the same one, a re-joiner's claim of a given-back unit is
  honoured (U5); ``status()`` agrees with the model. At the end, a drain by one
  worker finishes every unit of the oldest open epoch and closes it without
  touching the next epoch: nothing given back is ever lost (U3, U4).
* The ledger's plain properties: the shuffle is a permutation, the same for the same
  (seed, epoch) and across ``to_dict``/``from_dict``; an epoch's tail hands out the
  next epoch's units; ``from_dict`` refuses corrupt data and ``check_units`` nonsense.
* The coordinator (``Coordinator.handle``): Welcomes and Results carry units, applies
  finish them, a wrong unit counts for the round but finishes nothing, a dead or
  leaving worker's unit is handed out again, a checkpoint keeps the ledger and refuses
  a resume with another N, the config refuses units with fragments or the collective
  plane, and a run without units says so on the wire.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from diloco.coordinator import Coordinator, CoordinatorConfig, OuterConfig
from diloco.coordinator.checkpoint import coordinator_state, restore_coordinator
from diloco.coordinator.units import NO_UNIT, UnitLedger, check_units
from diloco.core import ConfigError, FSMConfig
from diloco.ckptio import CheckpointError
from diloco.testing import join_message, only, replies
from diloco.wire.messages import Accepted, AdminRequest, Heartbeat, Leave, Result, Submit, Welcome

WORKERS = ("w0", "w1", "w2", "w3")


# ---------------------------------------------------------------- the ledger against a model


class LedgerMachine(RuleBasedStateMachine):
    """``UnitLedger`` (fragment 0) next to a model of plain sets and dicts."""

    @initialize(units=st.integers(1, 7), seed=st.integers(0, 3))
    def start(self, units: int, seed: int) -> None:
        self.n = units
        self.ledger = UnitLedger(units, seed)
        #: worker -> the unit it holds; worker -> the unit in flight for (fragment 0, worker).
        self.held: dict[str, int] = {}
        self.in_flight: dict[str, int] = {}
        #: epoch -> indices finished in it; epoch -> indices handed out fresh (from its shuffle).
        self.finished: dict[int, set[int]] = {}
        self.fresh: dict[int, set[int]] = {}
        #: Units given back (dead, left, not applied, a restart) and not handed out again yet.
        self.given_back: set[int] = set()

    # -- helpers

    def _epochs_done(self) -> int:
        done = 0
        while len(self.finished.get(done, ())) == self.n:
            done += 1
        return done

    def _is_finished(self, unit: int) -> bool:
        return unit % self.n in self.finished.get(unit // self.n, set())

    def _handed(self, worker: str, unit: int, claim: int = NO_UNIT) -> None:
        """The model's account of ``hand_out(worker, claim) -> unit``."""
        assert unit >= 0, unit
        if worker in self.held:
            assert unit == self.held[worker], "U1: a worker holding a unit is handed that unit again"
            return
        if claim in self.given_back:
            assert unit == claim, f"U5: the claim of given-back unit {claim} was not honoured (got {unit})"
        assert not self._is_finished(unit), f"U4: unit {unit} handed out, but it is finished in its epoch"
        assert unit not in self.held.values(), f"U1: unit {unit} handed out while another worker holds it"
        assert unit not in self.in_flight.values(), f"U1: unit {unit} handed out while it is in flight"
        assert unit // self.n >= self._epochs_done(), f"unit {unit} of a closed epoch handed out"
        if unit in self.given_back:
            self.given_back.discard(unit)
        else:
            epoch, index = divmod(unit, self.n)
            assert index not in self.fresh.setdefault(epoch, set()), \
                f"U3: unit {unit} handed out twice from its epoch's shuffle without being given back"
            self.fresh[epoch].add(index)
        self.held[worker] = unit

    def _finish(self, done: list[int], expected: set[int]) -> None:
        assert sorted(done) == sorted(expected), f"U2: applied finished {done}, in flight were {sorted(expected)}"
        for unit in done:
            epoch, index = divmod(unit, self.n)
            assert index not in self.finished.setdefault(epoch, set()), f"U4: unit {unit} finished twice"
            self.finished[epoch].add(index)

    # -- rules

    @rule(worker=st.sampled_from(WORKERS))
    def hand_out(self, worker: str) -> None:
        self._handed(worker, self.ledger.hand_out(worker))

    @rule(worker=st.sampled_from(WORKERS), data=st.data())
    def hand_out_claimed(self, worker: str, data) -> None:
        choices = st.integers(-1, 3 * self.n)
        if self.given_back:
            choices = st.sampled_from(sorted(self.given_back)) | choices
        claim = data.draw(choices, label="claim")
        self._handed(worker, self.ledger.hand_out(worker, claim), claim)

    @precondition(lambda self: any(w not in self.in_flight for w in self.held))
    @rule(data=st.data())
    def submit_held(self, data) -> None:
        # At most one contribution per (fragment, worker) is accepted at a time (the core refuses
        # a duplicate), so a worker with one in flight does not submit again.
        worker = data.draw(st.sampled_from(sorted(w for w in self.held if w not in self.in_flight)), label="worker")
        assert self.ledger.submitted(worker, 0, self.held[worker]) is None
        self.in_flight[worker] = self.held.pop(worker)

    @rule(worker=st.sampled_from(WORKERS), data=st.data())
    def submit_wrong(self, worker: str, data) -> None:
        unit = data.draw(st.integers(-1, 3 * self.n).filter(lambda u: u != self.held.get(worker)), label="unit")
        before = (self.ledger.to_dict(), dict(self.ledger.held), dict(self.ledger.in_flight))
        why = self.ledger.submitted(worker, 0, unit)
        assert isinstance(why, str) and why, "U2: a Submit naming another unit must say why it finishes none"
        assert (self.ledger.to_dict(), dict(self.ledger.held), dict(self.ledger.in_flight)) == before

    @precondition(lambda self: bool(self.in_flight))
    @rule(data=st.data())
    def applied(self, data) -> None:
        contributors = data.draw(st.lists(st.sampled_from(WORKERS), unique=True), label="contributors")
        expected = {self.in_flight.pop(w) for w in contributors if w in self.in_flight}
        self._finish(self.ledger.applied(0, contributors), expected)

    @rule(worker=st.sampled_from(WORKERS))
    def not_applied(self, worker: str) -> None:
        unit = self.ledger.not_applied(0, worker)
        assert unit == self.in_flight.pop(worker, None)
        if unit is not None:
            self.given_back.add(unit)

    @rule(worker=st.sampled_from(WORKERS))
    def released(self, worker: str) -> None:
        unit = self.ledger.released(worker)
        assert unit == self.held.pop(worker, None)
        if unit is not None:
            self.given_back.add(unit)

    @rule()
    def save_and_restore(self) -> None:
        """A coordinator restart (U5, P4): held and in-flight units come back as given back."""
        saved = self.ledger.to_dict()
        self.ledger = UnitLedger.from_dict(saved)
        assert self.ledger.to_dict() == saved
        self.given_back |= set(self.held.values()) | set(self.in_flight.values())
        self.held.clear()
        self.in_flight.clear()

    # -- invariants

    @invariant()
    def agrees_with_the_model(self) -> None:
        if not hasattr(self, "ledger"):
            return
        assert self.ledger.held == self.held
        assert self.ledger.in_flight == {(0, w): u for w, u in self.in_flight.items()}
        units = list(self.held.values()) + list(self.in_flight.values())
        assert len(units) == len(set(units)), f"U1: a unit in two places at once: {self.held}, {self.in_flight}"
        status = self.ledger.status()
        done = self._epochs_done()
        assert status == {"units": self.n, "epoch": done, "finished": len(self.finished.get(done, ())),
                          "epochs_done": done, "held": len(self.held), "in_flight": len(self.in_flight),
                          "finished_total": sum(len(s) for s in self.finished.values())}

    def teardown(self) -> None:
        """Liveness (U3, U4): whatever happened, one worker drains the oldest open epoch to its close."""
        if not hasattr(self, "ledger"):
            return
        for worker in sorted(self.held):
            self.released(worker)
        if self.in_flight:
            expected = set(self.in_flight.values())
            self._finish(self.ledger.applied(0, sorted(self.in_flight)), expected)
            self.in_flight.clear()
        epoch = self._epochs_done()
        left = self.n - len(self.finished.get(epoch, ()))
        for _ in range(left):
            unit = self.ledger.hand_out("drain")
            self._handed("drain", unit)
            assert unit // self.n == epoch, \
                f"U3: unit {unit} of a later epoch handed out while epoch {epoch} has units left (lost?)"
            assert self.ledger.submitted("drain", 0, unit) is None
            self.in_flight["drain"] = self.held.pop("drain")
            self._finish(self.ledger.applied(0, ["drain"]), {self.in_flight.pop("drain")})
        assert self.finished.get(epoch) == set(range(self.n)), "U4: the epoch did not finish every unit"
        assert self.ledger.epochs_done == self._epochs_done() > epoch, "U4: the finished epoch did not close"


TestLedgerAgainstModel = LedgerMachine.TestCase


# ---------------------------------------------------------------- the ledger's plain properties


def drain_order(ledger: UnitLedger, count: int) -> list[int]:
    """``count`` units handed out to one worker, each finished before the next."""
    order = []
    for _ in range(count):
        unit = ledger.hand_out("w")
        assert ledger.submitted("w", 0, unit) is None
        assert ledger.applied(0, ["w"]) == [unit]
        order.append(unit)
    return order


@pytest.mark.parametrize("units", [1, 2, 7, 20])
def test_the_shuffle_is_a_permutation_the_same_for_the_same_seed_and_epoch_and_across_a_save(units):
    first = drain_order(UnitLedger(units, seed=5), 2 * units)
    assert sorted(first[:units]) == list(range(units))
    assert sorted(first[units:]) == list(range(units, 2 * units))
    assert first == drain_order(UnitLedger(units, seed=5), 2 * units)
    # A save half-way through the first epoch resumes the same shuffle.
    half = UnitLedger(units, seed=5)
    done = drain_order(half, units // 2)
    resumed = UnitLedger.from_dict(half.to_dict())
    assert done + drain_order(resumed, 2 * units - units // 2) == first
    assert resumed.epochs_done == 2 and resumed.finished_total == 2 * units
    if units == 20:
        assert first[:units] != list(range(units)), "20 units in order: no shuffle"
        assert first[:units] != drain_order(UnitLedger(units, seed=6), units), "the seed changes nothing"
        assert [u - units for u in first[units:]] != first[:units], "every epoch shuffles the same"


def test_a_worker_at_an_epochs_tail_gets_a_unit_of_the_next_epoch():
    ledger = UnitLedger(3, seed=1)
    units = [ledger.hand_out(w) for w in WORKERS]
    assert sorted(u for u in units[:3]) == [0, 1, 2] and units[3] // 3 == 1
    assert ledger.status()["epoch"] == 0 and ledger.status()["held"] == 4
    # A unit of epoch 0 given back goes out before any more of epoch 1.
    ledger.released("w1")
    assert ledger.hand_out("w9") == units[1]
    # Epoch 1 finishing first does not close anything; epoch 0 finishing closes both in order.
    for w, u in zip(WORKERS, units):
        if w != "w1":
            assert ledger.submitted(w, 0, u) is None
    ledger.submitted("w9", 0, units[1])
    assert sorted(ledger.applied(0, ["w3"])) == [units[3]] and ledger.epochs_done == 0
    assert sorted(ledger.applied(0, ["w0", "w2", "w9"])) == sorted(units[:3]) and ledger.epochs_done == 1
    assert ledger.status()["epoch"] == 1 and ledger.status()["finished"] == 1


def test_from_dict_refuses_corrupt_data():
    ledger = UnitLedger(10, seed=2)
    for w in ("a", "b", "c"):
        ledger.hand_out(w)
    ledger.submitted("a", 0, ledger.held["a"])
    ledger.applied(0, ["a"])
    ledger.released("b")
    good = ledger.to_dict()
    assert UnitLedger.from_dict(good).to_dict() == good
    assert not UnitLedger.from_dict(None).enabled and UnitLedger.from_dict({}, units=4).units == 4
    finished_index = next(i for i in range(10) if bytes.fromhex(good["epochs"][0]["finished"])[i >> 3] & 1 << (i & 7))

    def with_epoch(**changes) -> dict:
        return {**good, "epochs": [{**good["epochs"][0], **changes}]}

    corrupt = {
        "bad hex": with_epoch(finished="zz01"),
        "a bitmap of the wrong length": with_epoch(finished="000000"),
        "a pool index out of range": with_epoch(pool=[10]),
        "a negative pool index": with_epoch(pool=[-1]),
        "a finished unit in the pool": with_epoch(pool=[finished_index]),
        "handed beyond the units": with_epoch(handed=11),
        "negative units": {**good, "units": -1},
        "units that do not match the bitmap": {**good, "units": 30},
        "units not a number": {**good, "units": "many"},
        "a missing key": {k: v for k, v in good.items() if k != "epochs"},
        "epochs not a list of epochs": {**good, "epochs": [3]},
    }
    for what, data in corrupt.items():
        with pytest.raises(ValueError, match="data units: the saved ledger is invalid"):
            UnitLedger.from_dict(data)
            pytest.fail(f"from_dict accepted {what}")


@pytest.mark.parametrize("bad", [-1, True, 2.5, "3", None])
def test_check_units_refuses_what_is_not_a_count(bad):
    with pytest.raises(ValueError):
        check_units(bad)


def test_check_units_takes_counts_and_an_off_ledger_hands_out_nothing():
    assert check_units(0) == 0 and check_units(7) == 7
    off = UnitLedger(0)
    assert not off.enabled and off.hand_out("a") == NO_UNIT and off.submitted("a", 0, 3) is None
    assert off.held == {} and off.applied(0, ["a"]) == []


# ---------------------------------------------------------------- the coordinator


P0 = {"w": torch.tensor([1.0, 2.0])}
TIMEOUT_S = 10.0


def make(data_units: int, min_workers: int = 2, now_s: float = 0.0, **fsm) -> Coordinator:
    config = CoordinatorConfig(FSMConfig(min_workers=min_workers, heartbeat_timeout_s=TIMEOUT_S, **fsm),
                               outer=OuterConfig("sgd", 1.0, 0.0), data_units=data_units)
    return Coordinator(config, now_s)


def join(c: Coordinator, wid: str, now_s: float = 0.0, unit: int | None = None) -> Welcome:
    return only(c.handle(wid, dataclasses.replace(join_message(wid, P0), unit=unit), now_s), Welcome)


def submit(c: Coordinator, wid: str, unit: int | None, now_s: float = 1.0) -> list:
    rid = c.fsm.open_round_ids()[0]
    out = c.handle(wid, Submit(wid, 0, rid, {"w": torch.full((2,), 0.1)}, unit=unit), now_s)
    assert replies(out, Accepted), out
    return out


def test_welcomes_and_results_carry_distinct_units_and_an_applied_round_finishes_them():
    c = make(4)
    wa, wb = join(c, "a"), join(c, "b")
    assert wa.data_units == wb.data_units == 4
    assert wa.unit is not None and wb.unit is not None and wa.unit != wb.unit
    assert not replies(submit(c, "a", wa.unit), Result)
    results = dict(replies(submit(c, "b", wb.unit), Result))
    assert {r.outcome for r in results.values()} == {"applied"}
    next_units = {results["a"].unit, results["b"].unit}
    assert None not in next_units and len(next_units) == 2 and not next_units & {wa.unit, wb.unit}
    units = c.status()["units"]
    assert (units["finished"], units["finished_total"], units["held"], units["in_flight"]) == (2, 2, 2, 0)


def test_a_submit_naming_a_wrong_unit_counts_for_the_round_but_finishes_no_unit():
    c = make(4)
    wa, wb = join(c, "a"), join(c, "b")
    submit(c, "a", wa.unit)
    results = dict(replies(submit(c, "b", wa.unit), Result))  # b names a's unit, not its own
    assert set(results) == {"a", "b"} and {r.outcome for r in results.values()} == {"applied"}
    assert c.fsm.rounds_applied == 1
    assert c.status()["units"]["finished"] == 1
    # b still holds its unit: it is handed the same one until it submits it (U1).
    assert results["b"].unit == wb.unit and results["a"].unit not in (wa.unit, wb.unit)
    # A Submit naming no unit: the same.
    submit(c, "a", results["a"].unit, 2.0)
    results = dict(replies(submit(c, "b", None, 2.0), Result))
    assert set(results) == {"a", "b"} and c.status()["units"]["finished"] == 2


def test_a_dead_workers_unit_is_handed_out_again():
    c = make(2, min_workers=1)
    wa, wb = join(c, "a"), join(c, "b")
    assert {wa.unit, wb.unit} == {0, 1}
    c.handle("a", Heartbeat("a"), TIMEOUT_S - 1)
    c.tick(TIMEOUT_S + 1)  # b is silent past the timeout: dead, its unit goes back
    assert c.status()["units"]["held"] == 1 and not c.fsm.is_member("b")
    # The shuffle is used up: a's next unit, after its round applies, is b's.
    result = only(submit(c, "a", wa.unit, TIMEOUT_S + 2), Result)
    assert result.outcome == "applied" and result.unit == wb.unit
    units = c.status()["units"]
    assert (units["finished"], units["held"]) == (1, 1)


def test_a_leaving_workers_unit_goes_to_the_next_joiner():
    c = make(2, min_workers=1)
    wa, wb = join(c, "a"), join(c, "b")
    c.handle("b", Leave("b"), 1.0)
    assert not c.fsm.is_member("b") and c.status()["units"]["held"] == 1
    assert join(c, "c", 2.0).unit == wb.unit
    # Epoch 0 is all handed out and nothing came back: the next joiner trains on epoch 1.
    assert join(c, "d", 2.0).unit // 2 == 1


def test_a_kicked_workers_unit_goes_back_and_a_dead_workers_contribution_keeps_its_unit():
    c = make(2, min_workers=1)
    wa, wb = join(c, "a"), join(c, "b")
    assert c.handle("ops", AdminRequest("kick", {"worker_id": "b"}), 1.0)[-1][1].ok
    assert c.status()["units"]["held"] == 1 and join(c, "c", 2.0).unit == wb.unit
    # U3: a contribution in flight whose worker dies keeps its unit, and the round applies it.
    c = make(4, min_workers=1)
    wa, wb = join(c, "a"), join(c, "b")
    submit(c, "b", wb.unit, 1.0)
    c.handle("a", Heartbeat("a"), TIMEOUT_S - 1)
    c.tick(TIMEOUT_S + 2)
    assert not c.fsm.is_member("b") and c.status()["units"]["in_flight"] == 1
    result = only(submit(c, "a", wa.unit, TIMEOUT_S + 3), Result)
    assert result.outcome == "applied" and result.unit not in (wa.unit, wb.unit)
    units = c.status()["units"]
    assert (units["finished"], units["held"], units["in_flight"]) == (2, 1, 0)


def test_a_checkpoint_keeps_the_ledger_and_a_rejoiner_gets_its_unit_back():
    c = make(4)
    wa, wb = join(c, "a"), join(c, "b")
    submit(c, "a", wa.unit)
    results = dict(replies(submit(c, "b", wb.unit), Result))
    meta, tensors = coordinator_state(c)
    back = restore_coordinator(meta, tensors, 5.0)
    units = back.status()["units"]
    assert (units["epoch"], units["finished"], units["finished_total"], units["held"], units["in_flight"]) \
        == (0, 2, 2, 0, 0)
    # U5: a re-joiner naming the unit it held takes it back; the other gets the one left.
    assert join(back, "b", 6.0, unit=results["b"].unit).unit == results["b"].unit
    assert join(back, "a", 6.0, unit=None).unit == results["a"].unit
    # The finished units are never handed out again in this epoch.
    assert {results["a"].unit, results["b"].unit}.isdisjoint({wa.unit, wb.unit})
    for other in (5, 0):
        with pytest.raises(CheckpointError, match="data units"):
            restore_coordinator(meta, tensors, 5.0, config=CoordinatorConfig(FSMConfig(min_workers=2),
                                                                             data_units=other))


def test_the_config_refuses_units_with_several_fragments_or_the_collective_plane_or_a_bad_count():
    with pytest.raises(ConfigError):
        CoordinatorConfig(FSMConfig(num_fragments=2), data_units=4)
    with pytest.raises(ConfigError):
        CoordinatorConfig(FSMConfig(data_plane="collective"), data_units=4)
    for bad in (-1, True, 2.5):
        with pytest.raises(ConfigError):
            CoordinatorConfig(FSMConfig(), data_units=bad)
    assert CoordinatorConfig(FSMConfig(num_fragments=2)).data_units == 0
    assert CoordinatorConfig.from_dict(CoordinatorConfig(FSMConfig(), data_units=3).to_dict()).data_units == 3


def test_a_run_without_units_says_so_on_the_wire():
    c = make(0)
    wa, wb = join(c, "a"), join(c, "b")
    assert (wa.data_units, wa.unit, wb.data_units, wb.unit) == (None, None, None, None)
    submit(c, "a", None)
    results = dict(replies(submit(c, "b", 7), Result))  # a unit named in a run without units: ignored
    assert set(results) == {"a", "b"} and all(r.unit is None for r in results.values())
    assert c.status()["units"] is None
    meta, _ = coordinator_state(c)
    assert meta["units"] is None
