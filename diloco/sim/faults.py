"""The fault injector, and the heal that ends it: the safety and liveness phases.

A run has two phases, as in TigerBeetle's VOPR: *safety* (faults injected at
a seeded rate until ``rounds`` outer steps applied, or a time cap), then
*liveness*: faults stop, partitions heal, frozen workers thaw, the
coordinator is restarted if down, ``min_workers`` is set back and enough
workers are started; every fragment must then apply another round within
``SimConfig.liveness_bound_s``. Some runs then shut down (``simulation.py``).

``FaultInjector`` is a mixin of ``Simulation``: ``_fault`` chooses a fault kind
(``FAULT_KINDS``, weighted by ``SimConfig.fault_weights``) at a seeded rate and
applies it (``_fault_<kind>``); ``_heal`` stops the faults and starts the liveness
phase, which ``_on_applied`` and the deadline judge. It uses the host's ``now``,
``rng``, ``cfg``, ``stats``, ``emit``, ``schedule``, ``admin``, the workers and the
coordinator.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from diloco.sim.config import FAULT_KINDS

if TYPE_CHECKING:  # pragma: no cover
    from diloco.sim.worker import SimWorker


class FaultInjector:
    """Faults during the safety phase, then the heal and the liveness check (a mixin of ``Simulation``)."""

    # ------------------------------------------------------------------ phases

    def _on_applied(self, fid: int, contributors: int) -> None:
        self.stats.applied += 1
        self.stats.worker_rounds += contributors
        if self.phase == "safety":
            if self.stats.applied >= self.cfg.rounds and not self._heal_started:
                self._heal_started = True
                self.schedule(self.now, self._heal, "rounds reached")
        elif self.phase == "liveness":
            self._live_progress.add(fid)
            if len(self._live_progress) == self.cfg.num_fragments:
                self.phase = "liveness_ok"
                self.schedule(self.now, self._liveness_ok)

    def _heal(self, why: str) -> None:
        if self.phase != "safety":
            return
        self._heal_started = True
        self.phase = "liveness"
        cfg = self.cfg
        self.stats.heal_at_s = self.now
        self.emit({"k": "phase", "t": self.now, "what": "heal", "why": why, "bound_s": cfg.liveness_bound_s})
        if self.coord is None:
            self._coord_restart()
        for wid in list(self._partitioned):
            if self._partitioned[wid]:
                self.emit({"k": "fault", "t": self.now, "what": "heal_partition", "w": wid})
            del self._partitioned[wid]
        for w in self.alive_workers():
            w.straggle = 1.0
            if w.frozen:
                self.emit({"k": "fault", "t": self.now, "what": "thaw", "w": w.wid})
                w.thaw()
        if self.coord.fsm.min_workers != cfg.min_workers:
            self.admin("set_min_workers", min_workers=cfg.min_workers)
        missing = cfg.min_workers - len(self.alive_workers())
        for _ in range(max(0, missing)):
            wid = self._new_worker_id()
            self.emit({"k": "fault", "t": self.now, "what": "replace", "w": wid, "why": "heal"})
            self._start_worker(wid)
        self.schedule(self.now + cfg.liveness_bound_s, self._liveness_deadline)

    def _liveness_deadline(self, _arg=None) -> None:
        if self.phase == "liveness":
            self.emit({"k": "phase", "t": self.now, "what": "liveness_timeout",
                       "fragments_applied": sorted(self._live_progress)})
            self._end("liveness timeout")

    def _liveness_ok(self, _arg=None) -> None:
        self.stats.liveness_s = self.now - self.stats.heal_at_s
        self.emit({"k": "phase", "t": self.now, "what": "liveness_ok", "after_s": self.stats.liveness_s})
        cfg = self.cfg
        if cfg.shutdown == "none":
            self._end("liveness ok")
            return
        self.phase = "shutdown"
        delay = cfg.shutdown_delay_segments * cfg.train_s
        if cfg.shutdown_paused:
            # Pause the run (quorum out of reach), let workers park, then stop it.
            self.admin("set_min_workers", min_workers=len(self.alive_workers()) + 1)
            delay += cfg.heartbeat_timeout_s
        self.schedule(self.now + delay, self._shutdown)

    # ------------------------------------------------------------------ faults

    def _count(self, kind: str) -> None:
        self.stats.faults[kind] = self.stats.faults.get(kind, 0) + 1

    count_fault = _count

    def crash_in_reduce(self, w: SimWorker, where: str) -> None:
        """Collective plane: ``w`` dies inside a reduce (its fault was drawn and counted already)."""
        self.emit({"k": "fault", "t": self.now, "what": "crash", "w": w.wid, "why": f"inside the reduce, {where}"})
        w.crash()
        self._after_exit(w, crashed=True)

    def _fault(self, _arg=None) -> None:
        if self.phase != "safety":
            return
        cfg = self.cfg
        rng = self.rng
        kind = rng.choices(FAULT_KINDS, weights=cfg.fault_weights)[0]
        getattr(self, "_fault_" + kind)()
        self.schedule(self.now + rng.expovariate(cfg.fault_rate_per_s), self._fault)

    def _pick_alive(self) -> SimWorker | None:
        alive = self.alive_workers()
        return self.rng.choice(alive) if alive else None

    def _after_exit(self, w: SimWorker, crashed: bool) -> None:
        cfg = self.cfg
        rng = self.rng
        if crashed and rng.random() < cfg.restart_p:
            self.schedule(self.now + rng.uniform(0.2, 2.0) * cfg.heartbeat_timeout_s, self._restart, w.wid)
        elif rng.random() < cfg.replace_p:
            wid = self._new_worker_id()
            self.schedule(self.now + rng.uniform(0.2, 2.0) * cfg.heartbeat_timeout_s, self._replace, wid)

    def _restart(self, wid: str) -> None:
        if self.phase in ("shutdown",) or self.workers[wid].alive:
            return
        self._count("restart")
        self.emit({"k": "fault", "t": self.now, "what": "restart", "w": wid})
        self._start_worker(wid)

    def _replace(self, wid: str) -> None:
        if self.phase in ("shutdown",):
            return
        self._count("replace")
        self.emit({"k": "fault", "t": self.now, "what": "replace", "w": wid})
        self._start_worker(wid)

    def _fault_crash(self) -> None:
        w = self._pick_alive()
        if w is None:
            return
        self._count("crash")
        self.emit({"k": "fault", "t": self.now, "what": "crash", "w": w.wid})
        w.crash()
        self._after_exit(w, crashed=True)

    def _fault_leave(self) -> None:
        w = self._pick_alive()
        if w is None or w.frozen:
            return
        self._count("leave")
        self.emit({"k": "fault", "t": self.now, "what": "leave", "w": w.wid})
        w.leave()
        self._after_exit(w, crashed=False)

    def _fault_kick(self) -> None:
        w = self._pick_alive()
        if w is None:
            return
        self._count("kick")
        self.admin("kick", worker_id=w.wid)

    def _fault_freeze(self) -> None:
        w = self._pick_alive()
        if w is None or w.frozen:
            return
        self._count("freeze")
        self.emit({"k": "fault", "t": self.now, "what": "freeze", "w": w.wid})
        w.freeze()
        self.schedule(self.now + self.rng.expovariate(1.0 / self.cfg.freeze_mean_s), self._thaw, w)

    def _thaw(self, w: SimWorker) -> None:
        if w.alive and w.frozen:
            self.emit({"k": "fault", "t": self.now, "what": "thaw", "w": w.wid})
            w.thaw()

    def _fault_partition(self) -> None:
        alive = self.alive_workers()
        if not alive:
            return
        n = 1 + int(self.rng.random() * len(alive)) if self.rng.random() < 0.3 else 1
        group = self.rng.sample(alive, min(n, len(alive)))
        duration = min(self.rng.expovariate(1.0 / self.cfg.partition_mean_s), 6 * self.cfg.partition_mean_s)
        self._count("partition")
        wids = sorted(w.wid for w in group)
        self.emit({"k": "fault", "t": self.now, "what": "partition", "w": wids, "duration_s": duration})
        for wid in wids:
            self._partitioned[wid] = self._partitioned.get(wid, 0) + 1
        self.schedule(self.now + duration, self._heal_partition, wids)

    def _heal_partition(self, wids: list[str]) -> None:
        healed = []
        for wid in wids:
            n = self._partitioned.get(wid, 0)
            if n > 1:
                self._partitioned[wid] = n - 1
            elif n == 1:
                del self._partitioned[wid]
                healed.append(wid)
        if healed:
            self.emit({"k": "fault", "t": self.now, "what": "heal_partition", "w": healed})

    def _fault_coord_crash(self) -> None:
        if self.coord is None or self._snapshot is None:
            return
        self._count("coord_crash")
        self._coord_crash()
        down = min(max(1.0, self.rng.expovariate(1.0 / self.cfg.coord_down_mean_s)),
                   4 * self.cfg.coord_down_mean_s + 1.0)
        self.schedule(self.now + down, self._coord_restart)

    def _fault_straggle(self) -> None:
        w = self._pick_alive()
        if w is None:
            return
        factor = self.rng.uniform(2.0, self.cfg.straggle_max_factor)
        self._count("straggle")
        self.emit({"k": "fault", "t": self.now, "what": "straggle", "w": w.wid, "factor": factor})
        w.straggle = factor
        self.schedule(self.now + self.rng.expovariate(1.0 / self.cfg.straggle_mean_s), self._unstraggle, w)

    def _unstraggle(self, w: SimWorker) -> None:
        w.straggle = 1.0

    def _fault_min_workers(self) -> None:
        alive = len(self.alive_workers())
        r = self.rng.random()
        if r < 0.1:
            value = 0  # invalid on purpose: R8 says rejected, nothing changes
        else:
            value = 1 + int(self.rng.random() * (alive + 1))
        self._count("min_workers")
        self.admin("set_min_workers", min_workers=value)

    def _fault_join(self) -> None:
        if len(self.alive_workers()) >= 2 * self.cfg.workers + 2:
            return
        wid = self._new_worker_id()
        self._count("join")
        self.emit({"k": "fault", "t": self.now, "what": "join", "w": wid})
        self._start_worker(wid)
