"""What a worker trains on in a run with data work units (SPEC.md section 12, "Data work units").

* ``run_training``'s batches come from the unit the run hands the worker (``data_unit``), switch when
  the unit changes at a sync point, read a unit again when a round outlasts it, and fall back to the
  setup's own ``batches`` when the run hands out none.
* The built-in entry's unit i of N is the i-th slice of its corpus, the same windows whoever trains it,
  and a unit count the corpus cannot hold is refused with the largest it can.
"""

from __future__ import annotations

import pytest
import torch

from diloco.deploy import default_entry
from diloco.worker.errors import DilocoWorkerError
from diloco.worker.loop import _batches


class FakeWorker:
    """What ``_batches`` reads of a worker: its unit of the moment and the units per epoch."""

    def __init__(self, units_per_epoch: int | None) -> None:
        self.units_per_epoch = units_per_epoch
        self.data_unit: tuple[int, int] | None = None


def unit_data(index: int, units: int):
    return [f"u{index}/{units}-b{j}" for j in range(2)]


def test_batches_follow_the_unit_and_switch_only_when_it_changes():
    worker = FakeWorker(4)
    worker.data_unit = (0, 3)
    stream = _batches(worker, ["own-0", "own-1"], unit_data)
    assert [next(stream) for _ in range(3)] == ["u3/4-b0", "u3/4-b1", "u3/4-b0"]  # the round outlasts the unit
    worker.data_unit = (1, 0)  # the next round's unit (epoch 1)
    assert [next(stream) for _ in range(2)] == ["u0/4-b0", "u0/4-b1"]


def test_without_units_the_setups_own_batches_are_used_and_can_run_out():
    worker = FakeWorker(None)
    assert list(_batches(worker, ["own-0", "own-1"], unit_data)) == ["own-0", "own-1"]
    worker.data_unit = (0, 1)
    assert list(_batches(worker, ["own-0"], None)) == ["own-0"]  # no unit_batches: units are ignored


def test_a_unit_without_batches_is_an_error_naming_it():
    worker = FakeWorker(2)
    worker.data_unit = (0, 1)
    with pytest.raises(DilocoWorkerError, match=r"unit_batches\(1, 2\) gave no batch"):
        next(_batches(worker, [], lambda i, n: []))


def test_the_built_in_entrys_units_are_slices_the_same_for_every_worker():
    a = default_entry.make_setup("w1")
    b = default_entry.make_setup("w2")
    units = 10
    first_a, first_b = next(iter(a.unit_batches(7, units))), next(iter(b.unit_batches(7, units)))
    assert torch.equal(first_a[0], first_b[0])  # the data of a unit does not depend on the worker
    train = a.batches.tokens
    piece = default_entry.unit_slice(train, 7, units)
    share = train.numel() // units
    assert torch.equal(piece, train[7 * share:8 * share])
    windows = first_a[0]
    for row in windows:  # every window of unit 7 lies in its slice
        text = bytes(row.to(torch.uint8).tolist())
        assert text in bytes(piece.tolist())
    assert not torch.equal(next(iter(a.unit_batches(6, units)))[0], first_a[0])


def test_more_units_than_the_corpus_holds_is_refused_with_the_largest_it_can():
    train = torch.zeros(10_000, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"too small for that many units \(at most 153\)"):
        default_entry.unit_slice(train, 0, 5_000)
    worker = FakeWorker(5_000)  # the loop says which unit the setup could not read
    worker.data_unit = (0, 4)
    with pytest.raises(DilocoWorkerError, match=r"data unit 4 of 5000: .*at most 153"):
        next(_batches(worker, [], lambda i, n: default_entry.unit_slice(train, i, n)))
