"""Data work units (``diloco server --data-units N``, SPEC.md section 12, "Data work units").

The dataset is cut into N units; an epoch hands every unit out once, in a
fleet-wide shuffle of the epoch. A worker holds one unit at a time: the
Welcome hands it its first, each Result of an applied round its next, and its
Submit names the unit the pseudo-gradient trained on. A unit is *finished*
when a round applies with that contribution, and only then; a worker that dies
or leaves before its Submit gives its unit back, and a contribution that never
applies (discarded, or its outer step refused) gives back the unit it trained
on. Given-back units are handed out again once the epoch's shuffle is used up,
so a unit is trained to completion exactly once per epoch however the workers
come and go. When a worker has no unit of the current epoch left to take, it
gets one of the next epoch: no worker idles at an epoch's tail.

Unit ids on the wire are ``epoch * N + index``: ``index`` (0..N-1) names the
data, ``epoch`` the pass. What is durable is what a restart needs: per open
epoch, the finished bitmap and how far the shuffle has been handed out. Units
that were held or in flight go back to the pool at a restart (the in-flight
contributions are discarded, P4), and a re-joining worker that names its unit
in its Join takes it back if nobody else holds it.

Plain Python, no torch: the shuffle is ``random.Random`` seeded by (seed, epoch),
the same on every incarnation.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

#: Nothing to hand out / nothing named (the wire's "no unit").
NO_UNIT = -1


def check_units(units: int) -> int:
    if isinstance(units, bool) or not isinstance(units, int) or units < 0:
        raise ValueError(f"data units: {units!r} is not a number of units >= 0 (0: off)")
    return units


@dataclass
class _Epoch:
    """One pass over the data: its shuffle, how much of it was handed out, what finished, what came back."""

    number: int
    order: list[int]
    handed: int = 0
    finished: bytearray = field(default_factory=bytearray)
    #: Units given back (a death, a leave, a contribution that did not apply): handed out again after the shuffle.
    pool: list[int] = field(default_factory=list)

    #: Units finished so far: kept with ``finish`` so an apply need not count the bitmap (O(N)).
    finished_count: int = 0

    def is_finished(self, index: int) -> bool:
        return bool(self.finished[index >> 3] & (1 << (index & 7)))

    def finish(self, index: int) -> None:
        self.finished[index >> 3] |= 1 << (index & 7)
        self.finished_count += 1


class UnitLedger:
    """Which worker holds which unit, what is in flight, what finished: the coordinator's data bookkeeping."""

    def __init__(self, units: int, seed: int = 0) -> None:
        self.units = check_units(units)
        self.seed = seed
        #: Open epochs by number: the current one, and the next once its units are being handed out.
        self._epochs: dict[int, _Epoch] = {}
        #: Epochs whose every unit finished.
        self.epochs_done = 0
        #: worker -> the unit it holds (handed out, not yet submitted).
        self.held: dict[str, int] = {}
        #: (fragment, worker) -> the unit its accepted, not yet applied contribution trained on.
        self.in_flight: dict[tuple[int, str], int] = {}
        #: Units finished so far, over all epochs (the audit log names each one).
        self.finished_total = 0

    @property
    def enabled(self) -> bool:
        return self.units > 0

    # ------------------------------------------------------------------ the round's events

    def hand_out(self, worker_id: str, claim: int = NO_UNIT) -> int:
        """The unit ``worker_id`` trains on next: the one it holds, else ``claim`` (a re-joiner's own,
        if still free), else the next of the oldest open epoch's shuffle, then its given-back units,
        then the next epoch's. NO_UNIT when the ledger is off."""
        if not self.enabled:
            return NO_UNIT
        if worker_id in self.held:
            return self.held[worker_id]
        unit = self._take_claimed(claim) if claim != NO_UNIT else None
        if unit is None:
            unit = self._take_next()
        self.held[worker_id] = unit
        return unit

    def submitted(self, worker_id: str, fragment_id: int, unit: int) -> str | None:
        """An accepted contribution says it trained on ``unit``. Returns None when that is the unit the
        worker holds; otherwise why it is not counted (the contribution still counts for the round)."""
        if not self.enabled or unit == NO_UNIT:
            return None if not self.enabled else "the Submit names no unit"
        held = self.held.get(worker_id)
        if held == unit:
            del self.held[worker_id]
            self.in_flight[(fragment_id, worker_id)] = unit
            return None
        return (f"the Submit names unit {unit}, but the worker holds "
                + (f"unit {held}" if held is not None else "none"))

    def applied(self, fragment_id: int, contributors: tuple[str, ...] | list[str]) -> list[int]:
        """A round applied with these contributions: their units are finished. Returns those units."""
        done = []
        for wid in contributors:
            unit = self.in_flight.pop((fragment_id, wid), None)
            if unit is None:
                continue
            epoch = self._epochs.get(unit // self.units)
            index = unit % self.units
            if epoch is None or epoch.is_finished(index):
                continue  # cannot happen while units are handed out once (kept safe for restored state)
            epoch.finish(index)
            self.finished_total += 1
            done.append(unit)
        self._close_finished_epochs()
        return done

    def not_applied(self, fragment_id: int, worker_id: str) -> int | None:
        """The contribution will not apply (discarded, or its outer step refused): its unit goes back."""
        unit = self.in_flight.pop((fragment_id, worker_id), None)
        if unit is not None:
            self._give_back(unit)
        return unit

    def released(self, worker_id: str) -> int | None:
        """The worker is gone (dead, left, kicked): the unit it held goes back. What it submitted stays
        in flight (its contribution may still apply)."""
        unit = self.held.pop(worker_id, None)
        if unit is not None:
            self._give_back(unit)
        return unit

    # ------------------------------------------------------------------ views and durability

    def status(self) -> dict:
        current = self._current()
        return {"units": self.units, "epoch": current.number if current else self.epochs_done,
                "finished": current.finished_count if current else 0,
                "epochs_done": self.epochs_done, "held": len(self.held), "in_flight": len(self.in_flight),
                "finished_total": self.finished_total}

    def to_dict(self) -> dict:
        """What a checkpoint keeps. Held and in-flight units are saved as given back: a restart discards
        what was in flight (P4) and the workers re-join."""
        epochs = []
        for number in sorted(self._epochs):
            e = self._epochs[number]
            back = list(e.pool) + [u % self.units for u in (*self.held.values(), *self.in_flight.values())
                                   if u // self.units == number]
            epochs.append({"epoch": number, "handed": e.handed, "finished": e.finished.hex(), "pool": back})
        return {"units": self.units, "seed": self.seed, "epochs_done": self.epochs_done,
                "finished_total": self.finished_total, "epochs": epochs}

    @classmethod
    def from_dict(cls, d: dict | None, units: int = 0, seed: int = 0) -> "UnitLedger":
        """A ledger from ``to_dict`` (None or {}: a fresh one of ``units``). Raises ValueError on bad data."""
        if not d:
            return cls(units, seed)
        try:
            ledger = cls(check_units(int(d["units"])), int(d["seed"]))
            ledger.epochs_done = int(d["epochs_done"])
            ledger.finished_total = int(d["finished_total"])
            for e in d["epochs"]:
                epoch = ledger._open(int(e["epoch"]))
                epoch.handed = int(e["handed"])
                epoch.finished = bytearray.fromhex(e["finished"])
                epoch.finished_count = sum(bin(b).count("1") for b in epoch.finished)  # once, at a restore
                epoch.pool = [int(i) for i in e["pool"]]
                if (len(epoch.finished) != len(epoch.order) + 7 >> 3 or not 0 <= epoch.handed <= ledger.units
                        or any(not 0 <= i < ledger.units or epoch.is_finished(i) for i in epoch.pool)):
                    raise ValueError(f"epoch {epoch.number} is inconsistent")
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"data units: the saved ledger is invalid ({exc})") from None
        return ledger

    # ------------------------------------------------------------------ inside

    def _open(self, number: int) -> _Epoch:
        epoch = self._epochs.get(number)
        if epoch is None:
            order = list(range(self.units))
            random.Random(f"diloco-units:{self.seed}:{number}").shuffle(order)
            epoch = _Epoch(number, order, finished=bytearray(self.units + 7 >> 3))
            self._epochs[number] = epoch
        return epoch

    def _current(self) -> _Epoch | None:
        return self._epochs[min(self._epochs)] if self._epochs else None

    def _take_next(self) -> int:
        number = min(self._epochs) if self._epochs else self.epochs_done
        while True:
            epoch = self._open(number)
            if epoch.handed < self.units:
                epoch.handed += 1
                return number * self.units + epoch.order[epoch.handed - 1]
            if epoch.pool:
                return number * self.units + epoch.pool.pop(0)
            number += 1

    def _take_claimed(self, unit: int) -> int | None:
        """``unit`` if it is in its epoch's pool (given back, nobody holds it): a re-joiner keeps its data."""
        if type(unit) is not int or unit < 0:
            return None
        epoch = self._epochs.get(unit // self.units)
        index = unit % self.units
        if epoch is None or index not in epoch.pool:
            return None
        epoch.pool.remove(index)
        return unit

    def _give_back(self, unit: int) -> None:
        epoch = self._epochs.get(unit // self.units)
        if epoch is not None and not epoch.is_finished(unit % self.units):
            epoch.pool.append(unit % self.units)

    def _close_finished_epochs(self) -> None:
        while self._epochs:
            current = self._current()
            assert current is not None
            if current.finished_count < self.units:
                return
            del self._epochs[current.number]
            self.epochs_done += 1
