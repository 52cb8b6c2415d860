"""The worker side of the trace: messages sent, delivered and dropped, per-connection FIFO
(**net**), the states ``worker`` records name, and the workers' rules **W5** (no training
while a contribution is pending), **W6** (a waiting worker pauses on a below-quorum reply
it knows is fresh) and **W8** (a ``held_limit`` retry waits one heartbeat interval, not
much more).
"""

from __future__ import annotations

from diloco.sim.checks.model import _LEFT_THE_WAIT, _LINK_S, _RETRY_SLACK_S, WORKER_STATES


class WorkerChecks:
    """A mixin of ``TraceChecker``: the records outside coordinator steps, and W5, W6, W8."""

    def _on_send(self, rec: dict) -> None:  # a worker's send (a coordinator's carries "s")
        self.counts["messages"] += 1
        self.msgs[rec["m"]] = rec
        wid = rec.get("worker_id")
        if wid is not None:
            self.peer_wid[rec["src"]] = wid

    def _fifo(self, rec: dict) -> None:
        link = (rec["src"], rec["dst"])
        m = rec["m"]
        last = self.link_last.get(link, 0)
        if m < last:
            self._violate("net", f"message {m} on {link[0]} -> {link[1]} delivered after message {last}, "
                                 f"which was sent later: per-connection FIFO broken")
        self.link_last[link] = m

    def _on_recv(self, rec: dict) -> None:  # delivered to a worker
        self._fifo(rec)
        m = rec["m"]
        self._last_recv = self.msgs.pop(m, None)
        if self._last_recv is None:
            self._violate("trace", f"message {m} delivered but never sent")
        peer = rec["dst"]
        if self.below_reply_to:
            hb = self.below_reply_to.pop(m, None)
            if hb is not None and peer in self.fenced and hb > self.last_submit_m.get(peer, 0):
                wid = self.peer_wid.get(peer)
                if wid is not None and self.wstate.get(wid) == "waiting":
                    self._expect_pause = (wid, peer, hb, rec["t"])
        sent = self._last_recv
        if sent is not None:
            typ = sent["type"]
            if self.collective and typ in ("Result", "Welcome"):
                self._result_delivered(sent, peer)
            if typ == "Welcome" or (typ == "Accepted" and self.last_submit.get(peer)
                                    == (sent["fragment_id"], sent["round_id"])):
                self.fenced.add(peer)
        if self.held_errors:
            held = self.held_errors.pop(m, None)
            if held is not None:
                self.retry_due[peer] = (held[1], rec["t"], self.peer_wid.get(peer, "?"))

    def _on_drop(self, rec: dict) -> None:
        self.counts["drops"] += 1
        m = rec["m"]
        self.msgs.pop(m, None)
        self.below_reply_to.pop(m, None)
        self.held_errors.pop(m, None)
        if rec.get("type") == "Submit" and "worker_id" in rec:
            self._worker_submitted(rec)
        elif rec.get("type") == "ReduceReport" and "worker_id" in rec:
            self._report_dropped(rec)

    def _on_worker(self, rec: dict) -> None:
        wid, state = rec["w"], rec["state"]
        if state not in WORKER_STATES:
            self._violate("trace", f"{wid} is in state {state!r}, which is not a worker state {WORKER_STATES}")
        self.wstate[wid] = state
        if state == "training":
            pending = [f for f, pend in enumerate(self.pending) if wid in pend]
            if pending:
                self._violate("W5", f"{wid} trains while its contribution to fragment(s) {pending} is "
                                    f"pending (round {self.pending[pending[0]][wid][0]})")
        elif state in _LEFT_THE_WAIT:
            self.retry_due.pop(rec["p"], None)

    # ------------------------------------------------------------ the workers' rules

    def _worker_submitted(self, rec: dict) -> None:
        """A worker's Submit, seen delivered or dropped (``ts``: when the worker sent it)."""
        peer, f = rec["src"], rec["fragment_id"]
        if self.sparse:
            self._payload_sent(rec)
        if rec["m"] > self.last_submit_m.get(peer, 0):
            self.last_submit_m[peer] = rec["m"]
            self.last_submit[peer] = (f, rec["round_id"])
            self.fenced.discard(peer)
        if self._pause_suspects:
            # Sent after the heartbeat and before the reply arrived: the reply was stale to it.
            m, ts = rec["m"], rec["ts"]
            self._pause_suspects = [x for x in self._pause_suspects
                                    if not (x[1] == peer and x[2] < m and ts <= x[3])]
        due = self.retry_due.get(peer)
        if due is not None and due[0] == f:
            del self.retry_due[peer]
            waited = rec["ts"] - due[1]
            if waited < self.hb_interval_s - 1e-6:
                self._violate("W8", f"{due[2]} sent fragment {f} again {waited:.3f}s after its held_limit; "
                                    f"a retry waits one heartbeat interval ({self.hb_interval_s:.3f}s)")

    def _check_retries(self) -> None:
        late = 2 * self.hb_interval_s + _RETRY_SLACK_S
        for peer, (f, t, wid) in list(self.retry_due.items()):
            if self.t > t + late:
                del self.retry_due[peer]
                self._violate("W8", f"{wid} got held_limit for fragment {f} at t={t:.3f}s and has not sent "
                                    f"it again {late:.3f}s later (still {self.wstate.get(wid)})")

    def _check_pause(self, rec: dict | None) -> None:
        """The record after a below-quorum heartbeat reply reached a waiting worker."""
        expect, self._expect_pause = self._expect_pause, None
        if rec is not None and rec["k"] == "worker" and rec["w"] == expect[0]:
            return  # it changed state: paused (or joined again, or stopped)
        if self.wstate.get(expect[0]) == "waiting":
            self._pause_suspects.append(expect)

    def _judge_pauses(self) -> None:
        """Suspects whose worker sent no Submit between the heartbeat and the reply: it had to pause."""
        keep = []
        for x in self._pause_suspects:
            if self.t <= x[3] + _LINK_S:
                keep.append(x)
                continue
            self._violate("W6", f"{x[0]} still waits after a heartbeat reply said below_min_workers at "
                                f"t={x[3]:.3f}s (the reply to a heartbeat sent after its last Submit): it "
                                f"must pause")
        self._pause_suspects = keep
