"""A read-only view of the machine for status pages (``diloco status``) and logs."""

from __future__ import annotations

from dataclasses import dataclass

from diloco.core.config import Mode
from diloco.core.phases import Phase


@dataclass(frozen=True, slots=True)
class MemberStatus:
    worker_id: str
    last_seen_s: float
    #: Seconds since the member was last heard from, by the machine's clock.
    age_s: float


@dataclass(frozen=True, slots=True)
class FragmentStatus:
    fragment_id: int
    #: Sync: the open round. Async: the current version.
    round_id: int
    #: Sync: members that contributed to the open round (parked at the barrier).
    contributed: tuple[str, ...]
    #: Sync: members the open round still waits for.
    awaited: tuple[str, ...]
    #: Async: contributions held below quorum, in the order they will apply.
    held: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class StatusView:
    phase: Phase
    mode: Mode
    min_workers: int
    below_min_workers: bool
    quorum_reason: str
    now_s: float
    members: tuple[MemberStatus, ...]
    fragments: tuple[FragmentStatus, ...]
    rounds_applied: int

    @property
    def parked_workers(self) -> tuple[str, ...]:
        """Members waiting on an accepted contribution, over all fragments, without repeats.

        Parked means a live member at the barrier (SPEC.md section 4): a contributor that
        has left is still listed in ``contributed`` / ``held`` (its work stays, P1) but
        nobody waits on it, so it is not parked.
        """
        live = {m.worker_id for m in self.members}
        seen: dict[str, None] = {}
        for f in self.fragments:
            for wid in f.contributed + f.held:
                if wid in live:
                    seen[wid] = None
        return tuple(seen)

    def to_dict(self) -> dict:
        """JSON-ready form; the keys are part of ``diloco status --json`` (SPEC.md section 11)."""
        return {
            "phase": self.phase.value,
            "mode": self.mode.value,
            "min_workers": self.min_workers,
            "below_min_workers": self.below_min_workers,
            "quorum_reason": self.quorum_reason,
            "now_s": self.now_s,
            "members": [
                {"worker_id": m.worker_id, "last_seen_s": m.last_seen_s, "age_s": m.age_s}
                for m in self.members
            ],
            "fragments": [
                {"fragment_id": f.fragment_id, "round_id": f.round_id, "contributed": list(f.contributed),
                 "awaited": list(f.awaited), "held": list(f.held)}
                for f in self.fragments
            ],
            "parked_workers": list(self.parked_workers),
            "rounds_applied": self.rounds_applied,
        }
