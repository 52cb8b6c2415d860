"""A worker's error-feedback residuals and the rules that keep their mass exact (SPEC.md section 11,
"The accumulator"; section 14, "Error feedback").

Per param the residual the wire left out (the sparse wire's accumulator), per fragment the round it
is for (the round after the Submit that made it) and, on the sparse wire, the last payload sent, to
send again unchanged if that round is submitted again. ``ReplicaKeeper`` keeps one for the real
worker; the simulator's worker (``diloco.sim.accumulator``) keeps one too, so the trace checker
judges these very rules. No torch operations here: only which residual may travel, and when.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping


class Residuals:
    """The residuals, their rounds and the last payloads; see the module."""

    def __init__(self) -> None:
        self.residual: dict[str, Any] = {}
        #: fragment -> the round its residual's next Submit is for.
        self.round: dict[int, int] = {}
        #: fragment -> (round, ...what was sent) of its last sparse Submit.
        self.last_payload: dict[int, tuple] = {}

    def restore(self, residual: Mapping[str, Any], rounds: Mapping[int, int]) -> None:
        """From a checkpoint: the residuals with their rounds (no payload is kept there)."""
        self.residual = dict(residual)
        self.round = dict(rounds) if self.residual else {}
        self.last_payload = {}

    def _drop(self, fid: int, names: Iterable[str]) -> list[str]:
        dropped = [n for n in names if self.residual.pop(n, None) is not None]
        self.round.pop(fid, None)
        self.last_payload.pop(fid, None)
        return dropped

    def stale_at(self, round_ids, fragments: int, parked=()) -> list[int]:
        """The fragments whose residual a Welcome (its ``round_ids`` and ``parked``) leaves stale: the
        round it opens for the fragment is neither the one the residual was made for (with no Submit
        of it held already: that one is a dead process's, taken from this very residual restored from
        its checkpoint, and carries its mass) nor the one of the Submit that made it, with that Submit
        parked (its Result still to come) or its payload kept to send again (it was lost)."""
        held = {(int(f), int(r)) for f, r in parked}
        stale = []
        for fid, want in sorted(self.round.items()):
            if fid >= min(fragments, len(round_ids)):
                continue
            if round_ids[fid] == want:
                if (fid, want) in held:
                    stale.append(fid)
                continue
            made_by = want - 1
            if round_ids[fid] == made_by and ((fid, made_by) in held
                                              or self.last_payload.get(fid, (None,))[0] == made_by):
                continue
            stale.append(fid)
        return stale

    def settle(self, round_ids, fragments, parked=()) -> list[str]:
        """A Welcome: the residuals it leaves stale dropped (``stale_at``); the names dropped."""
        dropped: list[str] = []
        for fid in self.stale_at(round_ids, len(fragments), parked):
            dropped += self._drop(fid, fragments[fid])
        return dropped

    def resend(self, fid: int, round_id: int) -> tuple | None:
        """A Submit of a round sent already (a held_limit retry, a Submit lost before a re-join): what
        was sent then (``(round, ...)``), or None. Sending it again, not a new payload, keeps the mass
        exact: the first payload's entries left the accumulator already, and the round's delta is in it."""
        kept = self.last_payload.get(fid)
        if kept is not None and kept[0] == round_id and self.round.get(fid) == round_id + 1:
            return kept
        return None

    def drop_stale(self, fid: int, names: Iterable[str], round_id: int) -> bool:
        """Before a Submit of ``round_id``: a residual made for another round is dropped, whatever led
        here (``settle`` leaves none; this holds without it). True if one was."""
        want = self.round.get(fid)
        if want is None or want == round_id:
            return False
        self._drop(fid, names)
        return True

    def sent(self, fid: int, round_id: int, residual: Mapping[str, Any], payload: tuple | None = None) -> None:
        """A Submit of ``round_id`` left ``residual``; ``payload`` (``(round_id, ...)``) to send again."""
        self.residual.update(residual)
        self.round[fid] = round_id + 1
        if payload is not None:
            self.last_payload[fid] = payload
