"""The params the trace implies: the first ``Join`` installs the model, every apply's new
params must equal an independent recomputation of the outer step (**outer**: Nesterov,
sync, or Delayed Nesterov, async, on the mean of exactly its contributors'
pseudo-gradients; a refused step changes nothing), workers install exactly what they
were sent (**params**), and snapshots, coordinator restarts and the save-and-stop
checkpoint carry exactly that model (**snapshot**).
"""

from __future__ import annotations

import copy

from diloco.sim.checks.model import ATOL, RTOL, _Model, _Step


class ParamsChecks:
    """A mixin of ``TraceChecker``: the model, the outer step, adopts, snapshots and restarts."""

    def _install(self, step: _Step, sends: list, peer: str) -> None:
        if self.collective:
            self._install_collective(step, sends, peer)
            return
        msg = step.msg
        welcome = next((s for s in sends if s["type"] == "Welcome" and s["dst"] == peer), None)
        if msg is None or msg["type"] != "Join" or welcome is None:
            self._violate("params", "the first join has no Join with params or no Welcome")
            return
        fragments = welcome["fragments"]
        values = msg["v"]
        cfg = self.cfg
        nf = len(fragments)
        # The coordinator builds its optimizers when the first worker is welcomed; Delayed
        # Nesterov's default delay is the min_workers of that moment (diloco/outer.py).
        delay = cfg["outer_delay"] or max(1, self.min_workers)
        opt = [{"buf": None} if cfg["mode"] == "sync" else {"m": None, "d": None, "step": 0} for _ in range(nf)]
        self.model = _Model(fragments=fragments, rounds=[0] * nf,
                            params=[{n: list(values[n]) for n in names} for names in fragments],
                            hist=[{} for _ in range(nf)], opt=opt, delay=delay)
        for f in range(nf):
            self.model.hist[f][0] = self.model.fhash(f)
            self._made(f, 0, self.model.hist[f][0])

    def _check_outer_step(self, f: int, r: int, grads: list[dict], rec: dict) -> None:
        m = self.model
        cfg = self.cfg
        lr, mu = cfg["outer_lr"], cfg["outer_momentum"]
        names = m.fragments[f]
        n = len(grads)
        mean = {name: [sum(g[name][i] for g in grads) / n for i in range(len(grads[0][name]))] for name in names}
        before = m.params[f]
        opt = m.opt[f]
        expected: dict[str, list[float]] = {}
        if cfg["mode"] == "sync":
            # torch.optim.SGD(lr, momentum=mu, nesterov=mu > 0), dampening 0, no weight decay.
            if mu > 0:
                if opt["buf"] is None:
                    opt["buf"] = {k: list(v) for k, v in mean.items()}
                else:
                    opt["buf"] = {k: [mu * b + g for b, g in zip(opt["buf"][k], mean[k])] for k in names}
                for k in names:
                    d = [g + mu * b for g, b in zip(mean[k], opt["buf"][k])]
                    expected[k] = [p - lr * x for p, x in zip(before[k], d)]
            else:
                for k in names:
                    expected[k] = [p - lr * g for p, g in zip(before[k], mean[k])]
        else:
            # Delayed Nesterov (Liu et al. 2024): the gradient term at once, momentum every `delay` steps.
            delay = m.delay
            if opt["m"] is None:
                opt["m"] = {k: [0.0] * len(before[k]) for k in names}
                opt["d"] = {k: [0.0] * len(before[k]) for k in names}
            opt["step"] += 1
            for k in names:
                p = [x - lr * g / delay for x, g in zip(before[k], mean[k])]
                opt["d"][k] = [d + g for d, g in zip(opt["d"][k], mean[k])]
                if opt["step"] % delay == 0:
                    opt["m"][k] = [mu * mm + d / delay for mm, d in zip(opt["m"][k], opt["d"][k])]
                    p = [x - lr * mu * mm for x, mm in zip(p, opt["m"][k])]
                    opt["d"][k] = [0.0] * len(before[k])
                expected[k] = p
        self.counts["outer_steps_checked"] += 1
        got = rec["p"]
        for k in names:
            for i, (e, g) in enumerate(zip(expected[k], got[k])):
                if abs(e - g) > ATOL + RTOL * abs(e):
                    self._violate("outer", f"fragment {f} round {r}: {k}[{i}] is {g!r}; the outer step on the mean "
                                           f"of its {n} contributions gives {e!r}")
                    return

    def _on_adopt(self, rec: dict) -> None:
        if "src" in rec:
            self._on_adopt_collective(rec)
            return
        sent = self._last_recv
        if sent is None or sent["m"] != rec["m"]:
            self._violate("params", f"{rec['w']} installed params from message {rec['m']}, which it did not just receive")
            return
        if self.sparse and sent["type"] == "Welcome":
            self._welcome_taken(sent)
        want = sent["hf"][rec["f"]] if sent["type"] == "Welcome" else sent.get("h")
        if want != rec["h"]:
            self._violate("params", f"{rec['w']} installed fragment {rec['f']} params {rec['h']} but the "
                                    f"{sent['type']} carried {want}")

    def _on_fault(self, rec: dict) -> None:
        what = rec["what"]
        if self.collective:
            self._collective_fault(rec)
        if what == "snapshot":
            self.counts["snapshots"] += 1
            self._check_state(rec, "snapshot")
            self.snap = (copy.deepcopy(self.model), self.min_workers)
            self.snap_window_s = self.window_s  # the core's window length is in its snapshot (P5)
            self.snap_commits = list(self.last_commit)
        elif what == "coord_crash":
            self.counts["coordinator_crashes"] += 1
            self.counts["lost_with_crash"] += sum(len(p) for p in self.pending)
            self.pending = [{} for _ in self.pending]
            self.window.clear()
            self.last_base.clear()
            self.live.clear()
            self.up = False
            self.phase = "down"
            self._coord_gone_collective()
        elif what == "coord_restart":
            if self.snap is None:
                self._violate("snapshot", "the coordinator restarted but the trace shows no snapshot")
                return
            snap, snap_min_workers = self.snap
            rolled = sum(a - b for a, b in zip(self.model.rounds, snap.rounds))
            self.counts["rolled_back_rounds"] += rolled
            for key, f_round in list(self.applied_keys.items()):
                if f_round >= snap.rounds[key[1]]:
                    del self.applied_keys[key]
            self.model = copy.deepcopy(snap)
            self.min_workers = snap_min_workers
            self.window_s = self.snap_window_s
            if self.collective:
                self.last_commit = list(self.snap_commits)
                self._coord_gone_collective()
            self.up = True
            self.phase = "forming"
            self.live.clear()
            self._check_state(rec, "restart")

    def _check_state(self, rec: dict, what: str) -> None:
        m = self.model
        if m is None:
            self._violate("snapshot", f"a {what} before the run had params")
            return
        if rec["rounds"] != m.rounds:
            self._violate("snapshot", f"{what}: rounds {rec['rounds']} but the trace implies {m.rounds}")
        if "commits" in rec:
            self._check_commits(rec, what)
        hf = [m.fhash(f) for f in range(len(m.rounds))] if "hf" in rec else None
        if hf is not None and rec["hf"] != hf:
            self._violate("snapshot", f"{what}: params {rec['hf']} but the trace implies {hf}")
        if rec["min_workers"] != self.min_workers:
            self._violate("snapshot", f"{what}: min_workers {rec['min_workers']} but the trace implies "
                                      f"{self.min_workers}")
