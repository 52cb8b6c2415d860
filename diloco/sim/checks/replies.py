"""What the coordinator sends, judged against what the step did: ``Welcome`` (the rounds,
params and parked contributions of the join; **I6**), ``Result`` (**I11**: it answers an
apply or a stop of this step, with that apply's params), heartbeat replies (**I5** after
a stop, R6 membership, **I6**), ``Error`` (R12, and which ``held_limit`` starts a W8
retry) and admin replies (R8).
"""

from __future__ import annotations

from diloco.sim.checks.model import _Step


class ReplyChecks:
    """A mixin of ``TraceChecker``: each coordinator send of a step."""

    def _send(self, rec: dict, step: _Step) -> None:
        typ = rec["type"]
        m = self.model
        live = self.live
        if typ == "Welcome":
            wid = rec["worker_id"]
            join = step.joins.pop(wid, None)
            if join is None:
                self._violate("R6", f"Welcome to {wid} without a join in the same step")
                return
            if rec["round_ids"] != join["rounds"]:
                self._violate("params", f"Welcome to {wid} names rounds {rec['round_ids']}; they are {join['rounds']}")
            if rec["parked"] != join["parked"]:
                self._violate("P2", f"Welcome to {wid} parks {rec['parked']}; its pending contributions are "
                                    f"{join['parked']}")
            for f, h in enumerate(rec.get("hf", ())):
                want = m.hist[f].get(rec["round_ids"][f])
                if h != want:
                    self._violate("params", f"Welcome to {wid}: fragment {f} params {h} are not the params of "
                                            f"round {rec['round_ids'][f]} ({want}); now {m.fhash(f)}")
            below = len(live) < self.min_workers
            if rec["below_min_workers"] != below or rec["min_workers"] != self.min_workers:
                self._violate("I6", f"Welcome to {wid} says below_min_workers={rec['below_min_workers']} "
                                    f"min_workers={rec['min_workers']}; live members {len(live)}, "
                                    f"min_workers {self.min_workers}")
        elif typ == "Result":
            self.counts["results"] += 1
            wid = self._wid_of(rec["dst"])
            key = (wid, rec["fragment_id"], rec["round_id"])
            expected = step.expect.pop(key, None)
            if expected is None:
                self._violate("I11", f"Result {rec['outcome']} to {wid} for fragment {rec['fragment_id']} round "
                                     f"{rec['round_id']} releases nothing this step applied or stopped")
                return
            outcomes, next_round = expected
            if rec["outcome"] not in outcomes:
                self._violate("I11", f"Result to {wid} for fragment {key[1]} round {key[2]} says {rec['outcome']}; "
                                     f"expected {'/'.join(sorted(outcomes))}")
            if rec["outcome"] != "stop":
                # The params right after the apply that released it, and the round after
                # that apply (async: several held contributions may apply in one step).
                f = rec["fragment_id"]
                if rec["next_round_id"] != next_round:
                    self._violate("params", f"Result to {wid} names next round {rec['next_round_id']}; the apply "
                                            f"that released it opened round {next_round}")
                if self.collective:
                    if (rec["round_id"], rec.get("digest")) != self.last_commit[f]:
                        self._violate("I11", f"Result to {wid}: fragment {f} round {rec['round_id']} digest "
                                             f"{rec.get('digest')} is not the commit {self.last_commit[f]}")
                elif rec["h"] != m.hist[f].get(rec["next_round_id"]):
                    self._violate("params", f"Result to {wid}: fragment {f} params {rec['h']} are not the params of "
                                            f"round {rec['next_round_id']}")
        elif typ == "HeartbeatReply":
            msg = step.msg
            if rec["below_min_workers"] and rec["command"] == "continue" and msg is not None:
                self.below_reply_to[rec["m"]] = msg["m"]
            if self.stopped:
                want = "save_and_stop" if self.stop_kind == "save_and_stop" else "stop"
                if rec["command"] != want:
                    self._violate("I5", f"after a {self.stop_kind} stop a heartbeat reply says {rec['command']}")
                return
            if msg is not None and msg.get("type") == "Join":
                # C6: a reseed tells a member that left (the older state's holders) to join again.
                if rec["command"] != "rejoin" or rec["dst"] in live.values():
                    self._violate("R6", f"a heartbeat reply sent while {msg.get('worker_id')} joins says "
                                        f"{rec['command']} to {rec['dst']}, which "
                                        f"{'is' if rec['dst'] in live.values() else 'is not'} a live member")
                return
            wid = msg["worker_id"] if msg is not None else None
            member = wid is not None and live.get(wid) == step.header.get("src")
            want = "continue" if member else "rejoin"
            if rec["command"] != want:
                self._violate("R6", f"heartbeat reply to {wid} says {rec['command']}; it is "
                                    f"{'a live member' if member else 'not a live member on that connection'}")
            mw = self.min_workers
            if rec["below_min_workers"] != (len(live) < mw) or rec["min_workers"] != mw:
                self._violate("I6", f"heartbeat reply says below_min_workers={rec['below_min_workers']} "
                                    f"min_workers={rec['min_workers']}; live members {len(live)}, min_workers {mw}")
        elif typ == "Error":
            if rec["code"] == "stopped" and not self.stopped:
                self._violate("R12", "an Error says stopped but the run has not stopped")
            msg = step.msg
            if rec["code"] == "held_limit" and msg is not None and msg["type"] == "Submit":
                self.held_errors[rec["m"]] = (rec["dst"], msg["fragment_id"])
        elif typ == "AdminReply":
            header = step.header
            if header.get("command") == "set_min_workers" and rec["ok"]:
                value = header["args"].get("min_workers")
                if value not in step.quorum_min:
                    self._violate("R8", f"min_workers set to {value} without a quorum event announcing it")
