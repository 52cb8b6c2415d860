"""The fault injector: what goes wrong during a run's safety phase.

A run has two phases, as in TigerBeetle's VOPR: *safety* (faults injected at a
seeded rate until ``rounds`` outer steps applied, or a time cap), then *liveness*
(faults stop, everything heals; ``simulation.py`` runs that phase and judges it).

``FaultInjector`` chooses a fault kind (``FAULT_KINDS``, weighted by
``SimConfig.fault_weights``) at a seeded rate while the phase is *safety* and applies
it (``_fault_<kind>``): a worker crashes, leaves, is kicked, freezes, straggles, is
partitioned off; the coordinator crashes (and restarts from its snapshot); workers
join; ``min_workers`` changes. After a crash or a leave a process may be restarted or
replaced. On the collective plane it also draws, per reduce, the faults of that plane
(``reduce_fault``, ``REDUCE_FAULT_KINDS``) and kills a member inside its reduce.

It acts on the workers themselves (``SimWorker.crash``, ``freeze``, ...), on the
network's partitions, and on the rest of the run only through ``world.FaultHost``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from diloco.sim.config import FAULT_KINDS, REDUCE_FAULT_KINDS

if TYPE_CHECKING:  # pragma: no cover
    import random

    from diloco.sim.config import SimConfig
    from diloco.sim.network import Network
    from diloco.sim.stats import SimStats
    from diloco.sim.worker import SimWorker
    from diloco.sim.world import Clock, FaultHost
    from diloco.wire.messages import ReduceOrder


class FaultInjector:
    """Faults during the safety phase: on workers, links, the coordinator and collective reduces."""

    def __init__(self, cfg: SimConfig, clock: Clock, rng: random.Random, stats: SimStats,
                 emit: Callable[..., None], network: Network, host: FaultHost) -> None:
        self.cfg = cfg
        self.clock = clock
        self.rng = rng
        self.stats = stats
        self.emit = emit
        self.network = network
        self.host = host

    def start(self) -> None:
        """Schedule the first fault (none if the run's rate is 0)."""
        if self.cfg.fault_rate_per_s > 0:
            self.clock.schedule(self.rng.expovariate(self.cfg.fault_rate_per_s), self._fault)

    def count(self, kind: str) -> None:
        """Count a fault (or a supervisor's restart) in the run's stats."""
        self.stats.faults[kind] = self.stats.faults.get(kind, 0) + 1

    # ------------------------------------------------------------------ the collective plane's

    def reduce_fault(self, w: SimWorker, order: ReduceOrder) -> str | None:
        """The fault, if any, that hits ``w``'s reduce job for ``order`` (safety phase only)."""
        cfg, rng = self.cfg, self.rng
        # ``reduce_fault_p`` is per attempt: each of its k members draws with p / k.
        if cfg.reduce_fault_p <= 0 or self.host.phase != "safety" or \
                rng.random() >= cfg.reduce_fault_p / max(1, len(order.group)):
            return None
        kind = rng.choices(REDUCE_FAULT_KINDS, weights=cfg.reduce_fault_weights)[0]
        self.count(kind)
        self.emit({"k": "fault", "t": self.clock.now, "what": kind, "w": w.wid, "f": order.fragment_id,
                   "r": order.round_id, "a": order.attempt})
        return kind

    def crash_before_collective(self) -> bool:
        """A ``reduce_crash`` of a member holding its pseudo-gradient: before the collective (else after)."""
        return self.rng.random() < 0.5

    def crash_in_reduce(self, w: SimWorker, where: str) -> None:
        """Collective plane: ``w`` dies inside a reduce (its fault was drawn and counted already)."""
        self.emit({"k": "fault", "t": self.clock.now, "what": "crash", "w": w.wid,
                   "why": f"inside the reduce, {where}"})
        w.crash()
        self._after_exit(w, crashed=True)

    # ------------------------------------------------------------------ the injector

    def _fault(self, _arg=None) -> None:
        if self.host.phase != "safety":
            return
        cfg = self.cfg
        rng = self.rng
        kind = rng.choices(FAULT_KINDS, weights=cfg.fault_weights)[0]
        getattr(self, "_fault_" + kind)()
        self.clock.schedule(self.clock.now + rng.expovariate(cfg.fault_rate_per_s), self._fault)

    def _pick_alive(self) -> SimWorker | None:
        alive = self.host.alive_workers()
        return self.rng.choice(alive) if alive else None

    def _after_exit(self, w: SimWorker, crashed: bool) -> None:
        cfg = self.cfg
        rng = self.rng
        now = self.clock.now
        if crashed and rng.random() < cfg.restart_p:
            self.clock.schedule(now + rng.uniform(0.2, 2.0) * cfg.heartbeat_timeout_s, self._restart, w.wid)
        elif rng.random() < cfg.replace_p:
            wid = self.host.new_worker_id()
            self.clock.schedule(now + rng.uniform(0.2, 2.0) * cfg.heartbeat_timeout_s, self._replace, wid)

    def _restart(self, wid: str) -> None:
        if self.host.phase == "shutdown" or self.host.is_alive(wid):
            return
        self.count("restart")
        self.emit({"k": "fault", "t": self.clock.now, "what": "restart", "w": wid})
        self.host.start_worker(wid)

    def _replace(self, wid: str) -> None:
        if self.host.phase == "shutdown":
            return
        self.count("replace")
        self.emit({"k": "fault", "t": self.clock.now, "what": "replace", "w": wid})
        self.host.start_worker(wid)

    def _fault_crash(self) -> None:
        w = self._pick_alive()
        if w is None:
            return
        self.count("crash")
        self.emit({"k": "fault", "t": self.clock.now, "what": "crash", "w": w.wid})
        w.crash()
        self._after_exit(w, crashed=True)

    def _fault_leave(self) -> None:
        w = self._pick_alive()
        if w is None or w.frozen:
            return
        self.count("leave")
        self.emit({"k": "fault", "t": self.clock.now, "what": "leave", "w": w.wid})
        w.leave()
        self._after_exit(w, crashed=False)

    def _fault_kick(self) -> None:
        w = self._pick_alive()
        if w is None:
            return
        self.count("kick")
        self.host.admin("kick", worker_id=w.wid)

    def _fault_freeze(self) -> None:
        w = self._pick_alive()
        if w is None or w.frozen:
            return
        self.count("freeze")
        self.emit({"k": "fault", "t": self.clock.now, "what": "freeze", "w": w.wid})
        w.freeze()
        self.clock.schedule(self.clock.now + self.rng.expovariate(1.0 / self.cfg.freeze_mean_s), self._thaw, w)

    def _thaw(self, w: SimWorker) -> None:
        if w.alive and w.frozen:
            self.emit({"k": "fault", "t": self.clock.now, "what": "thaw", "w": w.wid})
            w.thaw()

    def _fault_partition(self) -> None:
        alive = self.host.alive_workers()
        if not alive:
            return
        n = 1 + int(self.rng.random() * len(alive)) if self.rng.random() < 0.3 else 1
        group = self.rng.sample(alive, min(n, len(alive)))
        duration = min(self.rng.expovariate(1.0 / self.cfg.partition_mean_s), 6 * self.cfg.partition_mean_s)
        self.count("partition")
        wids = sorted(w.wid for w in group)
        self.emit({"k": "fault", "t": self.clock.now, "what": "partition", "w": wids, "duration_s": duration})
        self.network.partition(wids)
        self.clock.schedule(self.clock.now + duration, self._heal_partition, wids)

    def _heal_partition(self, wids: list[str]) -> None:
        healed = self.network.heal_partition(wids)
        if healed:
            self.emit({"k": "fault", "t": self.clock.now, "what": "heal_partition", "w": healed})

    def _fault_coord_crash(self) -> None:
        if not self.host.coordinator_crashable():
            return
        self.count("coord_crash")
        self.host.crash_coordinator()
        down = min(max(1.0, self.rng.expovariate(1.0 / self.cfg.coord_down_mean_s)),
                   4 * self.cfg.coord_down_mean_s + 1.0)
        self.clock.schedule(self.clock.now + down, self.host.restart_coordinator)

    def _fault_straggle(self) -> None:
        w = self._pick_alive()
        if w is None:
            return
        factor = self.rng.uniform(2.0, self.cfg.straggle_max_factor)
        self.count("straggle")
        self.emit({"k": "fault", "t": self.clock.now, "what": "straggle", "w": w.wid, "factor": factor})
        w.straggle = factor
        self.clock.schedule(self.clock.now + self.rng.expovariate(1.0 / self.cfg.straggle_mean_s),
                            self._unstraggle, w)

    def _unstraggle(self, w: SimWorker) -> None:
        w.straggle = 1.0

    def _fault_min_workers(self) -> None:
        alive = len(self.host.alive_workers())
        r = self.rng.random()
        if r < 0.1:
            value = 0  # invalid on purpose: R8 says rejected, nothing changes
        else:
            value = 1 + int(self.rng.random() * (alive + 1))
        self.count("min_workers")
        self.host.admin("set_min_workers", min_workers=value)

    def _fault_join(self) -> None:
        if len(self.host.alive_workers()) >= 2 * self.cfg.workers + 2:
            return
        wid = self.host.new_worker_id()
        self.count("join")
        self.emit({"k": "fault", "t": self.clock.now, "what": "join", "w": wid})
        self.host.start_worker(wid)
