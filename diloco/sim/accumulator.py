"""A simulated worker's sparse wire (SPEC.md section 11): the settings its Welcome told it and
its error-feedback accumulator, kept by the real worker's rules (``diloco.worker.keeper``:
``stale_residuals``, ``resend_of``, ``drop_stale``) on its seeded pseudo-gradients.

One per worker process (``sim.worker.SimWorker``); a restart from a checkpoint starts from what
``saved`` put in it. The trace checker rebuilds the same accumulator from the trace alone
(``sim.checks.accumulators``), so this is the side under test.
"""

from __future__ import annotations

import torch

from diloco.wire import sparse
from diloco.wire.messages import Submit, Welcome
from diloco.worker.keeper import drop_stale, resend_of, sparse_wire_of, stale_residuals


class SimAccumulator:
    """The sparse wire's settings and a worker's residuals (``ReplicaKeeper``'s, without a model)."""

    def __init__(self, saved: dict | None = None) -> None:
        #: None until a Welcome names the sparse wire.
        self.wire: sparse.SparseWire | None = None
        self.residual: dict[str, torch.Tensor] = {}
        #: fragment -> the round its residual is for; fragment -> (round, entries, scales) of its last payload.
        self.residual_round: dict[int, int] = {}
        self.last_payload: dict[int, tuple] = {}
        if saved:  # as ReplicaKeeper.restore: the residuals with the rounds they are for, no payload
            self.residual = {n: t.clone() for n, t in saved["residual"].items()}
            self.residual_round = dict(saved["residual_rounds"]) if self.residual else {}

    def saved(self) -> dict:
        """What a checkpoint holds of it."""
        return {"residual": {n: t.clone() for n, t in self.residual.items()},
                "residual_rounds": dict(self.residual_round)}

    def adopt(self, welcome: Welcome) -> None:
        """As ``DilocoWorker._adopt_wire``: the Welcome's settings; the residuals it leaves stale dropped."""
        self.wire = sparse_wire_of(welcome, False)
        for fid in stale_residuals(self.residual_round, welcome.round_ids, len(welcome.fragments),
                                   self.last_payload, welcome.parked):
            for n in welcome.fragments[fid]:
                self.residual.pop(n, None)
            del self.residual_round[fid]
            self.last_payload.pop(fid, None)

    def submit(self, worker_id: str, fid: int, rid: int, delta: dict[str, torch.Tensor], tokens: int) -> Submit:
        """As ``ReplicaKeeper.pseudo_gradient`` on the sparse wire: a round sent again re-sends its
        payload; else ``beta * e + delta``, its payload, and what that carries taken out of it."""
        again = resend_of(self.last_payload, self.residual_round, fid, rid)
        if again is not None:
            _, values, scales = again
        else:
            drop_stale(self.residual, self.residual_round, self.last_payload, fid, list(delta), rid)
            sparse.accumulate(delta, self.residual, self.wire.beta)
            values, scales, _ = sparse.send_from(delta, self.wire.fmt, f"{worker_id}'s own payload")
            self.residual.update(delta)
            self.residual_round[fid] = rid + 1
            self.last_payload[fid] = (rid, values, scales)
        return Submit(worker_id, fid, rid, values, "sparse", scales, tokens=tokens)
