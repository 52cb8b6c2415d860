"""Worker checkpoints (SPEC.md M10, W18): every ``ckpt`` record a worker writes holds, for each
fragment, a state some commit made for the round label it carries -- the params the coordinator
applied for that label on the hub, the params the replicas adopted from that label's commit on
the collective plane. A label names a state by the commit that made it, whatever the coordinator
incarnation (a restart from an older snapshot may make a label's state again, differently; both
are states commits made). A collective state no commit made is a run's start, accepted only under
label 0 (a sim's coordinator starts every fragment there): a start state relabelled to the run's
later rounds (C6) must not be written until a commit confirms it.

A ``ckpt`` record: ``w`` (the worker), ``r`` (its round ids, one per fragment) and ``h`` (each
fragment's params hash, as an ``adopt`` record's).
"""

from __future__ import annotations


class CheckpointChecks:
    """A mixin of ``TraceChecker``: the states each round label was given, and the checkpoints."""

    def _init_checkpoints(self) -> None:
        #: (fragment, round label) -> every params hash a commit gave that label (hub: the applied
        #: params of the round before it, or the first Join's; collective: what replicas adopted).
        self.states_at: dict[tuple[int, int], set[str]] = {}

    def _made(self, f: int, label: int, h: str) -> None:
        self.states_at.setdefault((f, label), set()).add(h)

    def _on_ckpt(self, rec: dict) -> None:
        self.counts["checkpoints_checked"] += 1
        self._accumulator_saved(rec)
        for f, (label, h) in enumerate(zip(rec["r"], rec["h"])):
            made = self.states_at.get((f, label))
            if made is not None and h in made:
                continue
            if made is None and self.collective and label == 0:
                continue  # a run's start state, before any commit of the fragment
            self._violate("M10", f"{rec['w']} wrote a checkpoint of fragment {f} labelled round {label} with params "
                                 f"{h}, a state no commit made for that label ({sorted(made or ())})")
