"""Each coordinator step, and what it does to rounds and membership: **I1** quorum safety,
**I2** no contribution pending or applied twice, **I3** rounds in order, **I4** every
accepted contribution applied with its round (or discarded at a stop, or lost with a
crash), **I6** quorum events, **I12** phase moves; the coordinator's rules R4, R6, R7
and, async, P2/P3 (parked contributions, staleness, arrival order) and P5 (the grace window: a
merged step holds every pending contribution in arrival order, closes only when due -- its
deadline, every live member in it, a departure, a drain -- and no due window stays open while
the quorum holds).
"""

from __future__ import annotations

from diloco.sim.checks.model import ALLOWED_PHASE_MOVES, _Step


class RoundChecks:
    """A mixin of ``TraceChecker``: a coordinator step's observer records and its applies."""

    def _finish_step(self) -> None:
        step, self._step = self._step, None
        self._step_id = None
        header, msg = step.header, step.msg
        recs = step.recs
        if len(recs) == 2 and recs[1]["k"] == "send" and recs[1]["type"] == "HeartbeatReply":
            self._send(recs[1], step)  # the commonest step: a heartbeat and its reply
            if self.collective:
                self._end_of_step_collective(step)
            if self.window_s:
                self._check_windows(step)
            return
        if self.collective and msg is not None and msg["type"] == "ReduceReport":
            self._report_received(step)
        sends = [r for r in step.recs if r["k"] == "send"]
        accepted = [r for r in sends if r["type"] == "Accepted"]
        if accepted:
            a = accepted[0]
            if len(accepted) > 1 or msg is None or msg["type"] != "Submit" or a["dst"] != header["src"] \
                    or (a["fragment_id"], a["round_id"]) != (msg["fragment_id"], msg["round_id"]):
                self._violate("I2", f"Accepted {[(x['fragment_id'], x['round_id']) for x in accepted]} does "
                                    f"not answer the Submit this step handled")
            else:
                step.accept = (msg["worker_id"], msg["fragment_id"], msg["round_id"],
                               self._dense_contribution(msg, msg["fragment_id"]), header["src"])
        for rec in step.recs[1:]:
            k = rec["k"]
            if k == "obs":
                self._obs(rec, step, sends)
            elif k == "fault":
                self._check_state(rec, rec["what"])
        if step.accept is not None:
            self._accept(step)
        for rec in sends:
            self._send(rec, step)
        for (wid, f, r), (outcomes, _next) in step.expect.items():
            self._violate("I11", f"{wid} has a pending contribution to fragment {f} round {r} released by "
                                 f"this step ({'/'.join(sorted(outcomes))}) but got no Result")
        if self.collective:
            self._end_of_step_collective(step)
        if self.window_s:
            self._check_windows(step)

    def _window_changed(self, seconds: float) -> None:
        """``--grace-window auto``: windows opened from now on last ``seconds``, within the ceiling."""
        ceiling = self.cfg.get("grace_window_s", 0.0)
        if not self.cfg.get("grace_auto") or not 0 < seconds <= ceiling:
            self._violate("P5", f"the grace window became {seconds!r} s; "
                                f"{'expected (0, ' + format(ceiling, 'g') + ']' if self.cfg.get('grace_auto') else 'this run sets none'}")
            return
        self.counts["windows_changed"] += 1
        self.window_s = seconds

    def _window_due(self, f: int, t: float) -> bool:
        """P5: fragment ``f``'s open window must close at clock ``t`` (if the quorum allows)."""
        w = self.window.get(f)
        if w is None:
            return False
        return t >= w[0] or w[1] or all(wid in self.pending[f] for wid in self.live)

    def _check_windows(self, step: _Step) -> None:
        """P5 liveness: after a coordinator step (which ticks the machine to its clock first), no
        window that is due stays open while the quorum holds."""
        if self.model is None or self.stopped or self.phase != "running" or len(self.live) < self.min_workers:
            return
        t = step.header["t"]
        for f, pend in enumerate(self.pending):
            if pend and self._window_due(f, t):
                w = self.window[f]
                self._violate("P5", f"async fragment {f} keeps its window open at t={t:.6f} with quorum: deadline "
                                    f"{w[0]:.6f}, released {w[1]}, live {sorted(self.live)}, in it {list(pend)}")
                self.window.pop(f, None)  # once per window

    def _accept(self, step: _Step) -> None:
        wid, f, r, values, peer = step.accept
        step.accept = None
        self.counts["accepted"] += 1
        m = self.model
        if m is None:
            self._violate("I4", f"{wid}'s contribution was accepted before the run had params")
            return
        if self.live.get(wid) != peer:
            self._violate("R4", f"accepted a contribution from {wid} on {peer}, not a live member there")
        pend = self.pending[f]
        if wid in pend:
            self._violate("I2", f"{wid} already has a pending contribution to fragment {f}; another was accepted")
        if self.cfg["mode"] == "sync":
            if r != m.rounds[f]:
                self._violate("R4", f"accepted {wid}'s contribution to fragment {f} round {r}; the open round is "
                                    f"{m.rounds[f]}")
        else:
            v = m.rounds[f]
            if not 0 <= v - r <= self.cfg["max_staleness"]:
                self._violate("P3", f"accepted {wid}'s contribution to fragment {f} from base {r} at version {v}")
            last = self.last_base.get((wid, f), -1)
            if r <= last:
                self._violate("P3", f"accepted {wid}'s contribution to fragment {f} from base {r}, not after its "
                                    f"last base {last}")
            self.last_base[(wid, f)] = r
            if self.window_s and not pend:
                # P5: the first pending contribution opens the window, at the machine's clock then.
                self.window[f] = [step.header["t"] + self.window_s, False]
        pend[wid] = (r, values)
        if self.collective:
            self.holders[wid] = None  # ready for a round: it holds the committed state (C6)
            self.healing.pop(wid, None)

    def _obs(self, rec: dict, step: _Step, sends: list) -> None:
        what = rec["what"]
        live = self.live
        if what == "join":
            wid = rec["worker_id"]
            if wid in live:
                self._violate("R6", f"{wid} joined while already a live member")
            peer = step.header.get("src")
            live[wid] = peer
            self.counts["joins"] += 1
            if self.collective:
                self._joined_collective(rec, step, sends)
            if self.model is None:
                self._install(step, sends, peer)
            m = self.model
            if m is None:
                return
            parked = []
            for f, pend in enumerate(self.pending):
                if wid in pend:
                    parked.append([f, pend[wid][0]])
                    if self.cfg["mode"] == "async":
                        self.last_base[(wid, f)] = pend[wid][0]
            if rec.get("parked", []) != parked:
                self._violate("P2", f"{wid} joined parked on {rec.get('parked')} but its pending contributions "
                                    f"are {parked}")
            step.joins[wid] = dict(rounds=list(m.rounds), parked=parked)
        elif what in ("dead", "left"):
            wid = rec["worker_id"]
            if wid not in live:
                self._violate("R7", f"{wid} {what} but was not a live member")
            live.pop(wid, None)
            if self.collective:
                self._left_collective(wid)
            for key in [k for k in self.last_base if k[0] == wid]:
                del self.last_base[key]
            for f, pend in enumerate(self.pending):
                if pend and f in self.window:
                    self.window[f][1] = True  # P5: a departure inside the window releases it
            self.counts["deaths" if what == "dead" else "leaves"] += 1
        elif what == "grace_window":
            # Before the step's accept: the coordinator ticks (and closes due windows, which sets the
            # next length) before it handles the message, and a Submit closes only its own window.
            self._window_changed(rec["seconds"])
        elif what == "quorum":
            self.min_workers = rec["min_workers"]
            step.quorum_min.append(rec["min_workers"])
            below = len(live) < rec["min_workers"]
            if rec["live_workers"] != len(live) or rec["below_min_workers"] != below:
                self._violate("I6", f"quorum event says live_workers={rec['live_workers']} "
                                    f"below_min_workers={rec['below_min_workers']}; the trace's live members "
                                    f"are {len(live)} with min_workers {rec['min_workers']}")
        elif what == "phase":
            old, new = rec["old"], rec["new"]
            if old != self.phase:
                self._violate("I12", f"phase change from {old} but the run was {self.phase}")
            if (old, new) not in ALLOWED_PHASE_MOVES:
                self._violate("I12", f"phase change {old} -> {new} is not in SPEC.md section 6")
            mw = self.min_workers
            if new in ("running", "draining") and len(live) < mw:
                self._violate("I12", f"phase {new} with {len(live)} live members < min_workers {mw}")
            if new in ("forming", "paused") and len(live) >= mw:
                self._violate("I12", f"phase {new} with {len(live)} live members >= min_workers {mw}")
            self.phase = new
        elif what == "step_refused":
            step.refused.add((rec["fragment_id"], rec["round_id"]))
        elif what == "apply":
            if self.collective:
                self._commit(rec, step)
            else:
                self._apply(rec, step)
        elif what == "reduce":
            self._order(rec, step)
        elif what == "abort":
            self._abort_seen(rec)
        elif what == "stop":
            if step.accept is not None:
                self._accept(step)
            self.stopped = True
            self.stop_kind = rec["kind"]
            for f, pend in enumerate(self.pending):
                for wid, (r, _v) in pend.items():
                    self.counts["discarded_at_stop"] += 1
                    if wid in live:
                        step.expect[(wid, f, r)] = ({"stop"}, None)
                pend.clear()

    def _apply(self, rec: dict, step: _Step) -> None:
        f, r, contributors = rec["fragment_id"], rec["round_id"], rec["contributors"]
        m = self.model
        live = self.live
        cfg = self.cfg
        sync = cfg["mode"] == "sync"
        self.counts["applied_rounds"] += 1
        self.counts["applied_contributions"] += len(contributors)
        acc = step.accept
        if acc is not None and acc[1] == f and (acc[0] in contributors or (sync and acc[2] == r)):
            # The contribution this step accepted precedes an apply of its round (SPEC.md 5.2);
            # an apply that comes first (a tick's death completed the round) is of an older round.
            self._accept(step)
        if m is None:
            self._violate("I4", "a round applied before the run had params")
            return
        if self.stopped:
            self._violate("I5", f"fragment {f} round {r} applied after the stop")
        if r != m.rounds[f]:
            self._violate("I3", f"fragment {f} applied round {r}; the next round in order is {m.rounds[f]}")
        if len(set(contributors)) != len(contributors):
            self._violate("I2", f"fragment {f} round {r} lists a contributor twice: {contributors}")
        mw = self.min_workers
        if len(live) < mw:
            self._violate("I1", f"fragment {f} round {r} applied with {len(live)} live members < min_workers {mw} "
                                f"(contributors {contributors}, live {sorted(live)})")
        if self.phase not in ("running", "draining"):
            self._violate("I1", f"fragment {f} round {r} applied in phase {self.phase}")
        pend = self.pending[f]
        if sync:
            cset = set(contributors)
            missing = [w for w in live if w not in cset]
            if missing:
                self._violate("I1", f"fragment {f} round {r} applied without live members {missing}")
            if len(contributors) < mw:
                self._violate("I1", f"fragment {f} round {r} applied with {len(contributors)} contributors "
                                    f"< min_workers {mw}")
            unaccepted = [w for w in contributors if w not in pend]
            dropped = [w for w in pend if w not in cset]
            if unaccepted:
                self._violate("I4", f"fragment {f} round {r} lists {unaccepted}, whose contributions were never "
                                    f"accepted for it")
            if dropped:
                self._violate("I4", f"fragment {f} round {r} applied without the accepted contributions of "
                                    f"{dropped}: silently dropped")
            keys = [(w, r) for w in contributors if w in pend]
        elif self.window_s:
            # P5: the window closes with everything pending in it, in arrival order, and only when due.
            if list(contributors) != list(pend):
                self._violate("P5", f"async fragment {f} version {r} applied {contributors}; its window holds "
                                    f"{list(pend)} (all of them, in arrival order)")
            if not self._window_due(f, rec["t"]) and self.phase != "draining":
                deadline = self.window.get(f, [None])[0]
                self._violate("P5", f"async fragment {f} version {r} closed its window early at t={rec['t']:.6f} "
                                    f"(deadline {deadline}, no departure, live {sorted(live)} not all in "
                                    f"{list(pend)})")
            self.window.pop(f, None)
            keys = [(w, pend[w][0]) for w in contributors if w in pend]
        else:
            if len(contributors) != 1:
                self._violate("I1", f"async fragment {f} version {r} applied {len(contributors)} contributions")
            head = next(iter(pend), None)
            if not contributors or contributors[0] != head:
                self._violate("I4", f"async fragment {f} version {r} applied {contributors}; the first held "
                                    f"contribution is {head!r} (P3: arrival order)")
            keys = [(w, pend[w][0]) for w in contributors if w in pend]
        for w, base in keys:
            key = (w, f, base)
            if key in self.applied_keys:
                self._violate("I2", f"{w}'s contribution to fragment {f} round {base} applied twice")
            self.applied_keys[key] = r
        grads = [pend.pop(w)[1] for w, _ in keys]
        if (f, r) in step.refused:
            # SPEC.md section 12, "Non-finite steps": params and optimizer state unchanged.
            self.counts["steps_refused"] += 1
            if rec["p"] != m.params[f]:
                self._violate("outer", f"fragment {f} round {r}: the step was refused but the params changed")
        elif grads:
            self._check_outer_step(f, r, grads, rec)
        m.params[f] = {n: list(v) for n, v in rec["p"].items()}
        m.rounds[f] = r + 1
        h = m.fhash(f)
        if h != rec["h"]:
            self._violate("params", f"fragment {f} round {r}: recorded hash {rec['h']} does not match its params")
        m.hist[f][r + 1] = h
        self._made(f, r + 1, h)
        if len(m.hist[f]) > 64:
            del m.hist[f][min(m.hist[f])]
        outcome = {"applied_final"} if self.phase == "draining" else {"applied"}
        for w, base in keys:
            if w in live:
                step.expect[(w, f, base)] = (outcome, r + 1)
        if self.heal_t is not None and f not in self.live_applied:
            self.live_applied[f] = rec["t"]
