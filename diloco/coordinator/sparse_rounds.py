"""A sparse run's rounds on the hub (``--wire-dtype sparse``; SPEC.md section 11, "The sparse wire").

Each Submit's payload is checked and decoded to entries (``sparse.decode``), never to a dense
tensor; the entries are added into the round's running sum in place as the contribution is
accepted, and the payloads are kept as they came, in that order. The outer step is the method's
(``sparse.step``: theta - lr * sum / n) and the Results carry the round's payloads: every worker
adds them into zeros in the same order and steps with the same expression, so all hold the same
bits as the coordinator. ``HubRounds`` owns the checks that every submission gets and the Results.
"""

from __future__ import annotations

import math

import torch

from diloco.coordinator.params import all_finite
from diloco.wire import compression, sparse
from diloco.wire.messages import Submit, Tensors


class SparseRounds:
    def __init__(self, wire: sparse.SparseWire) -> None:
        self.wire = wire
        #: fragment -> the round's running sum (dense fp32, entries added in place).
        self._sums: dict[int, Tensors] = {}
        #: fragment -> the round's payloads as they came (values, scales), in the order summed.
        self._sent: dict[int, list[tuple[Tensors, Tensors]]] = {}

    def decode(self, msg: Submit, spec, what: str) -> dict[str, sparse.Payload]:
        """The Submit's payloads, checked (``compression.EncodingError`` and its kinds if not)."""
        return sparse.decode(msg.tensors, msg.scales, spec, self.wire.fmt, what)

    @staticmethod
    def norm(payloads: dict[str, sparse.Payload]) -> float:
        """The L2 norm of the contribution the payloads stand for (what the bounds hold it to)."""
        return math.sqrt(sum(p.norm() ** 2 for p in payloads.values()))

    def add(self, fid: int, params: Tensors, payloads: dict[str, sparse.Payload], msg: Submit) -> None:
        sums = self._sums.get(fid)
        if sums is None:
            sums = self._sums[fid] = {n: torch.zeros(p.shape) for n, p in params.items()}
        for n, payload in payloads.items():
            sparse.add_into(sums[n], payload)
        self._sent.setdefault(fid, []).append((msg.tensors, msg.scales))

    def step(self, fid: int, params: Tensors, count: int) -> tuple[str | None, compression.Encoded]:
        """The outer step on fragment ``fid``'s ``params`` (into fresh memory, then copied in), and what
        its Results carry: each tensor's payloads one after another. A step to a non-finite value
        changes nothing and its Results carry no payload (SPEC.md section 12, "Non-finite steps")."""
        sums = self._sums.pop(fid, None)
        sent = self._sent.pop(fid, [])
        new = {n: sparse.step(p, sums[n], count, self.wire.lr) for n, p in params.items()} if sums else {}
        bad = next((n for n, t in new.items() if not all_finite(t)), None)
        if bad is not None or not new:
            return bad, compression.Encoded({n: torch.empty(0, dtype=torch.int16) for n in params},
                                            {n: torch.empty(0) for n in params})
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(new[n])
        return None, compression.Encoded({n: torch.cat([v[n] for v, _ in sent]) for n in params},
                                         {n: torch.cat([s[n] for _, s in sent]) for n in params})

    def discard(self, fid: int) -> None:
        self._sums.pop(fid, None)
        self._sent.pop(fid, None)

    def summing(self) -> bool:
        """Whether any round's sum holds a contribution."""
        return bool(self._sums)
