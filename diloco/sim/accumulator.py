"""A simulated worker's sparse wire (SPEC.md section 11): the settings its Welcome told it and
its error-feedback accumulator, kept by the real worker's rules (``diloco.worker.residuals``) on
its seeded pseudo-gradients.

One per worker process (``sim.worker.SimWorker``); a restart from a checkpoint starts from what
``saved`` put in it. The trace checker rebuilds the same accumulator from the trace alone
(``sim.checks.accumulators``), so this is the side under test.
"""

from __future__ import annotations

import torch

from diloco.wire import sparse
from diloco.wire.messages import Submit, Welcome
from diloco.worker.keeper import sparse_wire_of
from diloco.worker.residuals import Residuals


class SimAccumulator:
    """The sparse wire's settings and a worker's residuals (``ReplicaKeeper``'s, without a model)."""

    def __init__(self, saved: dict | None = None) -> None:
        #: None until a Welcome names the sparse wire.
        self.wire: sparse.SparseWire | None = None
        self.residuals = Residuals()
        if saved:  # as ReplicaKeeper.restore: the residuals with the rounds they are for, no payload
            self.residuals.restore({n: t.clone() for n, t in saved["residual"].items()}, saved["residual_rounds"])

    def saved(self) -> dict:
        """What a checkpoint holds of it."""
        r = self.residuals
        return {"residual": {n: t.clone() for n, t in r.residual.items()}, "residual_rounds": dict(r.round)}

    def adopt(self, welcome: Welcome) -> None:
        """As ``DilocoWorker._adopt_wire``: the Welcome's settings; the residuals it leaves stale dropped."""
        self.wire = sparse_wire_of(welcome, False)
        self.residuals.settle(welcome.round_ids, welcome.fragments, welcome.parked)

    def submit(self, worker_id: str, fid: int, rid: int, delta: dict[str, torch.Tensor], tokens: int) -> Submit:
        """As ``ReplicaKeeper.pseudo_gradient`` on the sparse wire: a round sent again re-sends its
        payload; else ``beta * e + delta``, its payload, and what that carries taken out of it."""
        r = self.residuals
        again = r.resend(fid, rid)
        if again is not None:
            _, values, scales = again
        else:
            r.drop_stale(fid, list(delta), rid)
            sparse.accumulate(delta, r.residual, self.wire.beta)
            values, scales, _ = sparse.send_from(delta, self.wire.fmt, f"{worker_id}'s own payload")
            r.sent(fid, rid, delta, (rid, values, scales))
        return Submit(worker_id, fid, rid, values, "sparse", scales, tokens=tokens)
