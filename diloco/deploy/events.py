"""The server's event lines: one readable line per coordinator event worth a line (``EventPrinter``)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from diloco.coordinator import Coordinator


class EventPrinter:
    """The coordinator's observer: one readable line per event worth a line."""

    def __init__(self, out: TextIO = sys.stdout) -> None:
        self.out = out
        self.coordinator: Coordinator | None = None
        #: (fragment, round) of the last refused step: its "apply" event needs no second line.
        self._refused: tuple[int, int] | None = None

    def _live(self) -> str:
        c = self.coordinator
        if c is None:
            return ""
        return f"{c.fsm.live_workers} live, min {c.fsm.min_workers}"

    def __call__(self, kind: str, now_s: float, info: dict) -> None:
        if kind in ("input", "unit", "units_finished"):
            return  # the machine's inputs and each unit handed out or finished are for the audit log

        if kind == "join":
            parked = f", parked on {info['parked']}" if info.get("parked") else ""
            heal = f", heals from {info['heal_source']}" if info.get("heal_source") else ""
            line = f"join     {info['worker_id']} ({self._live()}){parked}{heal}"
        elif kind == "reduce":
            line = (f"reduce   fragment {info['fragment_id']} round {info['round_id']} attempt {info['attempt']} "
                    f"by [{', '.join(info['group'])}]")
        elif kind == "abort":
            line = (f"ABORTED  fragment {info['fragment_id']} round {info['round_id']} attempt {info['attempt']} "
                    f"({info['reason']}); the survivors stay ready")
        elif kind == "reduce_failed":
            blame = f" (blames {', '.join(info['blame'])})" if info.get("blame") else ""
            line = (f"failed   {info['worker_id']}: fragment {info['fragment_id']} round {info['round_id']} "
                    f"attempt {info['attempt']}: {info['detail']}{blame}")
        elif kind == "step_refused":
            self._refused = (info["fragment_id"], info["round_id"])
            who = ", ".join(info["contributors"])
            line = (f"REFUSED  fragment {info['fragment_id']} round {info['round_id']}: the outer step made "
                    f"{info['tensor']!r} non-finite; params unchanged, contributions of [{who}] discarded")
        elif kind == "apply":
            if self._refused == (info["fragment_id"], info["round_id"]):
                self._refused = None
                return  # the REFUSED line said it all
            who = ", ".join(info["contributors"])
            digest = f", digest {info['digest'][:12]}" if info.get("digest") else ""
            line = (f"applied  fragment {info['fragment_id']} round {info['round_id']} "
                    f"from {len(info['contributors'])} contributors [{who}]{digest}")
        elif kind == "quorum":
            state = "BELOW" if info["below_min_workers"] else "ok"
            line = f"quorum   {state}: {info['live_workers']} live, min {info['min_workers']} ({info['reason']})"
        elif kind == "dead":
            line = f"dead     {info['worker_id']} (silent for {now_s - info['last_seen_s']:.1f} s) ({self._live()})"
        elif kind == "left":
            line = f"left     {info['worker_id']} ({info['cause']}) ({self._live()})"
        elif kind == "phase":
            line = f"phase    {info['old']} -> {info['new']}"
        elif kind == "discard":
            line = (f"discard  fragment {info['fragment_id']} round {info['round_id']} of {info['worker_id']} "
                    f"({info['reason']})")
        elif kind == "outlier":
            line = f"REFUSED  {info['worker_id']}'s fragment {info['fragment_id']} submission: {info['detail']}"
        elif kind == "evicted":
            line = f"EVICTED  {info['worker_id']} from fragment {info['fragment_id']} round {info['round_id']}: {info['detail']}"
        elif kind == "stuck":
            line = f"STUCK    {info['detail']}"
        elif kind == "reconciled":
            line = (f"RECONCILED {info['worker_id']} submitted fragment {info['fragment_id']} round "
                    f"{info['round_id']}, ahead of this coordinator's durable round {info['open_round']}: "
                    f"the durable state wins, the worker re-joins and takes its params")
        elif kind == "reseed":
            rounds = info["held_rounds"]
            line = (f"reseed   {info['worker_id']}: the run starts from {info['starter']}'s state"
                    f"{f' (rounds {rounds})' if rounds else ''}; it joins again (and heals, or offers its own)")
        elif kind == "budget":
            line = (f"budget   reached: {info['trained']:,} tokens trained of {info['budget']:,} "
                    f"(--token-budget): stopping as shutdown --save does")
        elif kind == "stop":
            line = f"stopped  {info['kind']}"
        elif kind == "grace_window":
            line = f"window   the next grace windows last {info['seconds']:.2f} s (--grace-window auto)"
        elif kind == "unit_back":
            line = f"unit     {info['unit']} back from {info['worker_id']}: handed out again"
        elif kind == "unit_mismatch":
            line = (f"unit     {info['worker_id']}'s fragment {info['fragment_id']} round {info['round_id']}: "
                    f"{info['detail']} (counted for the round; its unit not marked trained)")
        else:
            line = f"{kind:8} {info}"
        print(f"{time.strftime('%H:%M:%S')} {line}", file=self.out, flush=True)
