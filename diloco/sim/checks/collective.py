"""The collective data plane (SPEC.md C1-C7): **I13** every commit commits the open attempt of
its fragment -- its contributors are exactly that attempt's group, all live, at least the
``min_workers`` in force, and every one reported ok with the committed digest; **I14** every
order names every live member (all ready), at least ``min_workers``, while no other attempt
of the fragment is open, and every abort ends the open attempt; **C5** an attempt that can
no longer commit (a member gone, a failed or mismatching report, the quorum raised above its
group, its deadline passed) is not left open past the step that broke it; **C4**, the
worker's side: no worker adopts an outer step the machine did not commit -- every ``adopt``
of a commit names a (fragment, round, digest) the coordinator committed, that the worker
reported ok itself and got a ``Result`` for, and every replica that adopted one commit holds
the same params; **C6** a joiner starts the run from its own params only if it offered to
(``holds_params``) and no live member holds the state (then the members still healing are gone
by the end of that step) -- or, before the first commit since the (re)start, it replaces the
start's state: its ``held_rounds``/``held_digests`` are those the last commits made and the
start's were not, or, not welcomed by this coordinator before, its rounds are newer; then every
other holder and healer is gone by the end of that step (reseeded) -- otherwise it heals from a
live holder, and a healed replica holds what its source held at those rounds. Rounds commit in order
without skips or repeats (I3, in ``rounds``); a coordinator restart rolls them back to its
snapshot, as on the hub.

The worker's records are ``adopt`` records with ``src`` (``commit``, ``heal``, ``start``),
``r`` (the round the replica's fragment is at after it), ``h`` (its params' hash) and, for a
commit, ``d`` (the digest).
"""

from __future__ import annotations

from diloco.sim.checks.model import _Model, _Step

#: Rounds of each replica's params history the heal check keeps per fragment.
_HISTORY = 64


class CollectiveChecks:
    """A mixin of ``TraceChecker``: orders, reports, aborts, commits and adoptions of the collective plane."""

    def _init_collective(self) -> None:
        self.collective = False
        #: fragment -> the open attempt: dict(r, attempt, group, reports {wid: (ok, digest)}, t), or None.
        self.attempts: list[dict | None] = []
        #: (fragment, round) -> digests committed for it (by any coordinator incarnation).
        self.commits: dict[tuple[int, int], set] = {}
        #: fragment -> (round, digest) of its last commit in the current incarnation ((-1, "") before any).
        self.last_commit: list[tuple[int, str]] = []
        self.snap_commits: list[tuple[int, str]] | None = None
        #: (fragment, round, digest) -> params hash of the first replica that adopted that commit.
        self.commit_h: dict[tuple[int, int, str], str] = {}
        #: peer -> {(fragment, round): (attempt, ok, digest)}: the worker's latest report of each round.
        self.reports_sent: dict[str, dict] = {}
        #: (peer, fragment, round) -> digest of the commit Result delivered to that worker.
        self.results_got: dict[tuple[str, int, int], str] = {}
        #: peer -> the last commits ([round, digest] per fragment) its last delivered Welcome named.
        self.welcome_committed: dict[str, list] = {}
        #: Members that hold the committed state, as the coordinator must see it (ready once, or started).
        self.holders: dict[str, None] = {}
        #: Members told to heal and not yet ready: a reseed removes them too.
        self.healing: dict[str, None] = {}
        #: C6 restarts: the held rounds the run (re)started from, whether a round committed since,
        #: the workers this coordinator welcomed, and the members a reseed must have removed.
        self.start_rounds: tuple[int, ...] | None = None
        self.start_current = False
        self.committed_since_start = False
        self.welcomed_here: set[str] = set()
        self.reseed_due: set[str] = set()
        #: Welcome message id -> the peer of the heal source it names ("": start the run).
        self.heal_from: dict[int, str | None] = {}
        #: peer -> fragment -> {round: params hash} of the replica's committed state.
        self.replica_h: dict[str, list[dict]] = {}
        #: (fragment, round, attempt) of attempts a member was made to propose from another mean.
        self.injected_mismatch: set[tuple[int, int, int]] = set()

    def _collective_config(self, rec: dict) -> None:
        self.collective = rec.get("data_plane", "hub") == "collective"
        nf = rec["num_fragments"]
        self.attempts = [None] * nf
        self.last_commit = [(-1, "")] * nf
        for key in ("reduce_orders", "reduce_aborts", "commits", "reports", "adopt_commit", "adopt_heal",
                    "adopt_start"):
            self.counts[key] = 0
        self.counts["abort_reasons"] = {}

    # ------------------------------------------------------------ the coordinator's side

    def _install_collective(self, step: _Step, sends: list, peer: str) -> None:
        welcome = next((s for s in sends if s["type"] == "Welcome" and s["dst"] == peer), None)
        if welcome is None:
            self._violate("C6", "the first join has no Welcome")
            return
        fragments = welcome["fragments"]
        nf = len(fragments)
        self.model = _Model(fragments=fragments, rounds=[0] * nf, params=[{} for _ in range(nf)],
                            hist=[{} for _ in range(nf)], opt=[{} for _ in range(nf)], delay=1)

    def _report_received(self, step: _Step) -> None:
        """A ``ReduceReport`` this step handled: it counts in the open attempt if C4 says it does."""
        msg = step.msg
        self.counts["reports"] += 1
        wid, f, r, a = msg["worker_id"], msg["fragment_id"], msg["round_id"], msg["attempt"]
        src = step.header["src"]
        self.reports_sent.setdefault(src, {})[(f, r)] = (a, msg["ok"], msg["digest"])
        att = self.attempts[f] if isinstance(f, int) and 0 <= f < len(self.attempts) else None
        if (att is None or self.live.get(wid) != src or (att["r"], att["attempt"]) != (r, a)
                or wid not in att["group"] or wid in att["reports"]):
            return  # stale, duplicate or from a non-member: refused (C4)
        att["reports"][wid] = (msg["ok"], msg["digest"])

    def _order(self, rec: dict, step: _Step) -> None:
        f, r, a, group = rec["fragment_id"], rec["round_id"], rec["attempt"], rec["group"]
        self.counts["reduce_orders"] += 1
        acc = step.accept
        if acc is not None and acc[1] == f:
            self._accept(step)  # the ready that completed the set precedes its order
        m = self.model
        if self.attempts[f] is not None:
            old = self.attempts[f]
            self._violate("I14", f"fragment {f}: attempt {a} ordered while attempt {old['attempt']} of round "
                                 f"{old['r']} is open")
        if m is not None and r != m.rounds[f]:
            self._violate("I14", f"fragment {f}: order for round {r}; the open round is {m.rounds[f]}")
        if group != sorted(set(group)):
            self._violate("I14", f"fragment {f} round {r}: the group {group} is not in rank (sorted) order")
        live = set(self.live)
        ready = set(self.pending[f])
        if set(group) != live or not live <= ready:
            self._violate("I14", f"fragment {f} round {r} attempt {a}: group {group}, but the live members are "
                                 f"{sorted(live)} and the ready ones {sorted(ready)}")
        if len(group) < self.min_workers or len(self.live) < self.min_workers:
            self._violate("I14", f"fragment {f} round {r} attempt {a}: ordered with a group of {len(group)} and "
                                 f"{len(self.live)} live members; min_workers is {self.min_workers}")
        if self.phase not in ("running", "draining"):
            self._violate("I14", f"fragment {f} round {r} attempt {a}: ordered in phase {self.phase}")
        self.attempts[f] = dict(r=r, attempt=a, group=list(group), reports={}, t=rec["t"])

    def _abort_seen(self, rec: dict) -> None:
        f, r, a, reason = rec["fragment_id"], rec["round_id"], rec["attempt"], rec["reason"]
        self.counts["reduce_aborts"] += 1
        reasons = self.counts["abort_reasons"]
        reasons[reason] = reasons.get(reason, 0) + 1
        att = self.attempts[f]
        if att is None or (att["r"], att["attempt"]) != (r, a):
            self._violate("I14", f"fragment {f}: abort of round {r} attempt {a} ({reason}), which is not the open "
                                 f"attempt ({None if att is None else (att['r'], att['attempt'])})")
        elif reason == "digest_mismatch" and (f, r, a) not in self.injected_mismatch:
            # Honest members combine the same pseudo-gradients into the same mean and step the same
            # committed state: different digests mean their replicas (params or optimizer state) forked.
            digests = {w: d[:16] for w, (ok, d) in att["reports"].items() if ok}
            self._violate("fork", f"fragment {f} round {r} attempt {a}: honest members proposed different digests "
                                  f"{digests}: their replicas of the committed state differ")
        self.attempts[f] = None

    def _commit(self, rec: dict, step: _Step) -> None:
        f, r, contributors, digest = rec["fragment_id"], rec["round_id"], rec["contributors"], rec.get("digest", "")
        m = self.model
        live = self.live
        self.counts["applied_rounds"] += 1
        self.counts["applied_contributions"] += len(contributors)
        self.counts["commits"] += 1
        if m is None:
            self._violate("I13", "a commit before the run had a layout")
            return
        if self.stopped:
            self._violate("I5", f"fragment {f} round {r} committed after the stop")
        if r != m.rounds[f]:
            self._violate("I3", f"fragment {f} committed round {r}; the next round in order is {m.rounds[f]}")
        mw = self.min_workers
        if len(live) < mw:
            self._violate("I1", f"fragment {f} round {r} committed with {len(live)} live members < min_workers {mw}")
        if self.phase not in ("running", "draining"):
            self._violate("I1", f"fragment {f} round {r} committed in phase {self.phase}")
        att = self.attempts[f]
        if not digest:
            self._violate("I13", f"fragment {f} round {r}: a commit without a digest")
        if att is None or att["r"] != r:
            self._violate("I13", f"fragment {f} round {r} committed without an open attempt of that round")
        else:
            if contributors != att["group"]:
                self._violate("I13", f"fragment {f} round {r}: contributors {contributors} are not attempt "
                                     f"{att['attempt']}'s group {att['group']}")
            unconfirmed = [w for w in att["group"] if att["reports"].get(w) != (True, digest)]
            if unconfirmed:
                got = {w: att["reports"].get(w) for w in unconfirmed}
                self._violate("I13", f"fragment {f} round {r} committed digest {digest[:16]} without every group "
                                     f"member confirming it: {got} (None: no report)")
        if len(contributors) < mw:
            self._violate("I13", f"fragment {f} round {r} committed with {len(contributors)} confirming contributors "
                                 f"< min_workers {mw}")
        gone = [w for w in contributors if w not in live]
        if gone:
            self._violate("I13", f"fragment {f} round {r} committed with contributors {gone} no longer live")
        self.attempts[f] = None
        pend = self.pending[f]
        cset = set(contributors)
        for w in contributors:
            pend.pop(w, None)
        stray = [w for w in pend if w not in cset]
        if stray:
            self._violate("I4", f"fragment {f} round {r} committed while {stray} were ready for it outside the group")
            for w in stray:
                pend.pop(w)
        self.commits.setdefault((f, r), set()).add(digest)
        self.last_commit[f] = (r, digest)
        self.committed_since_start = True
        m.rounds[f] = r + 1
        outcome = {"applied_final"} if self.phase == "draining" else {"applied"}
        for w in contributors:
            if w in live:
                step.expect[(w, f, r)] = (outcome, r + 1)
        if self.heal_t is not None and f not in self.live_applied:
            self.live_applied[f] = rec["t"]

    def _joined_collective(self, rec: dict, step: _Step, sends: list) -> None:
        """C6: who a joiner heals from (``obs`` join carries the Welcome's ``heal_source``)."""
        wid = rec["worker_id"]
        source = rec.get("heal_source", "")
        peer = step.header.get("src")
        welcome = next((s["m"] for s in sends if s["type"] == "Welcome" and s["dst"] == peer), None)
        msg = step.msg
        offered = msg is not None and msg.get("type") == "Join" and bool(msg.get("holds_params"))
        held = tuple(msg.get("held_rounds") or ()) if offered else ()
        digests = tuple(msg.get("held_digests") or ()) if offered else ()
        current = self._is_current(held, digests)
        newer = (wid not in self.welcomed_here and self.start_rounds is not None
                 and bool(held) and (not self.start_rounds or (len(held) == len(self.start_rounds)
                                                                and sum(held) > sum(self.start_rounds))))
        replaces = not self.committed_since_start and self.start_rounds is not None and (
            (current and not self.start_current) or newer)
        self.welcomed_here.add(wid)
        if source:
            if source == wid or source not in self.holders or source not in self.live:
                self._violate("C6", f"{wid} is told to heal from {source!r}, which is not a live member holding "
                                    f"the state (holders {sorted(self.holders)})")
            self.heal_from[welcome] = self.live.get(source)
            self.healing[wid] = None
        else:
            holding = [w for w in self.holders if w != wid and w in self.live]
            if holding and not replaces:
                self._violate("C6", f"{wid} starts the run from its own params while {holding} hold its state")
            # Gone by the end of the step: a reseed's older holders and healers; on a plain start
            # the members healing from a source that is gone (they join again).
            others = [w for w in (*self.holders, *self.healing) if w != wid and w in self.live]
            if not offered:
                self._violate("C6", f"{wid} is told to start the run from its own params, but its Join did not "
                                    f"offer them (holds_params)")
            self.reseed_due.update(others)
            self.heal_from[welcome] = ""
            self.holders = {wid: None}
            self.start_rounds = held
            self.start_current = current
            self.committed_since_start = False

    def _is_current(self, held: tuple, digests: tuple) -> bool:
        """The state the last commits made: every fragment with a commit at the round after it, its digest."""
        n = len(self.last_commit)
        if len(held) != n or len(digests) != n:
            return False
        committed = [(f, r, d) for f, (r, d) in enumerate(self.last_commit) if r >= 0]
        return bool(committed) and all(held[f] == r + 1 and digests[f] == d for f, r, d in committed)

    def _left_collective(self, wid: str) -> None:
        """C2: a departed member's readiness is withdrawn, and it no longer holds the state."""
        for pend in self.pending:
            pend.pop(wid, None)
        self.holders.pop(wid, None)
        self.healing.pop(wid, None)

    def _end_of_step_collective(self, step: _Step) -> None:
        """C5: what the step left open must still be able to commit; C6: a reseed removed the old holders."""
        stayed = sorted(w for w in self.reseed_due if w in self.live)
        if stayed:
            self._violate("C6", f"the run started again from a newer state, but {stayed} still hold the older one")
        self.reseed_due.clear()
        t = step.header["t"]
        for f, att in enumerate(self.attempts):
            if att is None:
                continue
            bad = ""
            gone = [w for w in att["group"] if w not in self.live]
            failed = [w for w, (ok, _d) in att["reports"].items() if not ok]
            digests = {d for ok, d in att["reports"].values() if ok}
            if gone:
                bad = f"members {gone} are gone"
            elif failed:
                bad = f"members {failed} reported failure"
            elif len(digests) > 1:
                bad = f"the reports disagree ({sorted(d[:16] for d in digests)})"
            elif len(att["group"]) < self.min_workers:
                bad = f"its group of {len(att['group'])} is below min_workers {self.min_workers}"
            elif t > att["t"] + self.cfg["reduce_timeout_s"]:
                bad = f"its deadline {att['t'] + self.cfg['reduce_timeout_s']:.3f}s passed"
            elif self.stopped:
                bad = "the run stopped"
            if bad:
                self._violate("C5", f"fragment {f} round {att['r']} attempt {att['attempt']} is still open after "
                                    f"this step, but {bad}")
                self.attempts[f] = None

    # ------------------------------------------------------------ the workers' side

    def _collective_fault(self, rec: dict) -> None:
        if rec["what"] == "digest_mismatch":
            self.injected_mismatch.add((rec["f"], rec["r"], rec["a"]))

    def _report_dropped(self, rec: dict) -> None:
        self.reports_sent.setdefault(rec["src"], {})[(rec["fragment_id"], rec["round_id"])] = (
            rec["attempt"], rec["ok"], rec["digest"])

    def _result_delivered(self, sent: dict, peer: str) -> None:
        if sent["type"] == "Welcome":
            self.welcome_committed[peer] = sent.get("committed", [])
        elif sent.get("digest"):
            self.results_got[(peer, sent["fragment_id"], sent["round_id"])] = sent["digest"]

    def _on_adopt_collective(self, rec: dict) -> None:
        src, peer, wid, f, r, h = rec["src"], rec["p"], rec["w"], rec["f"], rec["r"], rec["h"]
        self.counts["adopt_" + src] = self.counts.get("adopt_" + src, 0) + 1
        if src == "commit":
            rid, d = r - 1, rec.get("d", "")
            if d not in self.commits.get((f, rid), ()):
                self._violate("C4", f"{wid} adopted fragment {f} round {rid} with digest {d[:16]}, which the "
                                    f"coordinator never committed (commits: "
                                    f"{sorted(x[:16] for x in self.commits.get((f, rid), ()))})")
            if rec.get("via") == "welcome":
                # An orphan proposal (its verdict lost with the connection), adopted because the
                # Welcome of its re-join names it as the fragment's last commit.
                named = self.welcome_committed.get(peer, [])
                if f >= len(named) or list(named[f]) != [rid, d]:
                    self._violate("C4", f"{wid} adopted its orphan proposal for fragment {f} round {rid} digest "
                                        f"{d[:16]}; its last Welcome named {named[f] if f < len(named) else None}")
            elif self.results_got.get((peer, f, rid)) != d:
                self._violate("C4", f"{wid} adopted fragment {f} round {rid} digest {d[:16]} without a commit Result "
                                    f"for it (got {self.results_got.get((peer, f, rid))})")
            sent = self.reports_sent.get(peer, {}).get((f, rid))
            if sent is None or not sent[1] or sent[2] != d:
                self._violate("C4", f"{wid} adopted fragment {f} round {rid} digest {d[:16]}, but its own report for "
                                    f"that round was {sent} (it adopts only what it proposed)")
            self._made(f, rid + 1, h)
            first = self.commit_h.setdefault((f, rid, d), h)
            if first != h:
                self._violate("C4", f"{wid} adopted fragment {f} round {rid} digest {d[:16]} with params {h}; another "
                                    f"replica adopted that commit with params {first}")
        elif src == "heal":
            source = self.heal_from.get(rec["m"])
            had = self.replica_h.get(source, [])
            want = had[f].get(r) if f < len(had) else None
            if want is not None and want != h:
                self._violate("C6", f"{wid} healed fragment {f} at round {r} with params {h}; its source "
                                    f"{rec.get('from')} held {want} at that round")
        elif src == "start":
            if self.heal_from.get(rec["m"]) != "":
                self._violate("C6", f"{wid} started fragment {f} from its own params without a Welcome telling it to")
        else:
            self._violate("trace", f"adopt record with unknown src {src!r}")
        hist = self.replica_h.setdefault(peer, [{} for _ in range(len(self.attempts))])
        hist[f][r] = h
        if len(hist[f]) > _HISTORY:
            del hist[f][min(hist[f])]

    # ------------------------------------------------------------ crashes and restarts

    def _coord_gone_collective(self) -> None:
        self.attempts = [None] * len(self.attempts)
        self.holders.clear()
        self.healing.clear()
        self.start_rounds, self.start_current, self.committed_since_start = None, False, False
        self.welcomed_here.clear()

    def _check_commits(self, rec: dict, what: str) -> None:
        got = [tuple(c) for c in rec.get("commits", [])]
        if got != self.last_commit:
            self._violate("snapshot", f"{what}: last commits {got} but the trace implies {self.last_commit}")
