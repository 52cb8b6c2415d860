"""The simulated world around the real ``Coordinator`` and ``RoundFSM``: one seeded run.

Only the environment is fake. ``Simulation`` builds the pieces and wires them, each
getting in its constructor only what it uses:

* the clock: ``scheduler.EventQueue`` (time, the event heap, the run loop);
* the network: ``network.Network`` (links, FIFO delays, partitions, drops, the
  ``send``/``recv``/``drop`` records);
* the coordinator's process: ``coord_process.CoordinatorProcess`` (the real
  ``Coordinator``, driven as the runner drives it; snapshots, crash, restart);
* the fault injector: ``faults.FaultInjector``;
* on a collective run, the gloo network and rendezvous store: ``collective.SimGloo``;
* the worker processes: ``worker.SimWorker``, each running the real
  ``diloco.worker.session.WorkerSession``.

The pieces talk through ``world.py``'s Protocols: ``Simulation`` is the
``WorkerWorld`` and ``PlaneWorld`` of the workers and their collective planes, and the
``FaultHost`` of the injector; the coordinator's process is the network's
``CoordinatorPort``. Most members are bound methods of the pieces, stored once, so a
worker's call reaches the network directly.

What ``Simulation`` itself keeps: the run loop, the worker processes and their
supervisor (a worker that exits on a silent coordinator or a refused join is started
again, from its checkpoint), and the run's phases: *safety* under faults, then
*liveness* (faults stop, partitions heal, frozen workers thaw, the coordinator is
restarted if down, ``min_workers`` is set back and enough workers are started; every
fragment must then apply another round within ``SimConfig.liveness_bound_s``), then
for some runs a shutdown (drain, save-and-stop, abort: every worker must have stopped
within the coordinator's linger).
"""

from __future__ import annotations

import random
import traceback

import torch

from diloco.sim.collective import SimEndpoint, SimGloo
from diloco.sim.config import SimConfig
from diloco.sim.coord_process import CoordinatorProcess
from diloco.sim.faults import FaultInjector
from diloco.sim.network import Network
from diloco.sim.scheduler import EventQueue
from diloco.sim.stats import SimStats
from diloco.sim.trace import TRACE_FORMAT, TRACE_VERSION, ConsumerAbort, TraceWriter
from diloco.sim.worker import SimWorker
from diloco.sim.world import SimModel
from diloco.wire.messages import spec_of


def initial_model(cfg: SimConfig) -> SimModel:
    """The run's model: tensors named p0, p1, ... of a few float32 elements each, seeded."""
    init_rng = random.Random(f"{cfg.seed}/params")
    params = {
        f"p{i}": torch.tensor([round(init_rng.uniform(-1, 1), 6) for _ in range(n)], dtype=torch.float32)
        for i, n in enumerate(cfg.param_sizes)
    }
    return SimModel(params, spec_of(params), {f"p{i}": n for i, n in enumerate(cfg.param_sizes)})


class Simulation:
    """One seeded run. ``run()`` returns the stats; the trace goes to ``trace``."""

    def __init__(self, cfg: SimConfig, trace: TraceWriter, *, max_events: int = 50_000_000) -> None:
        self.cfg = cfg
        self.trace = trace
        self.emit = trace.emit
        #: The run's one random stream: every piece draws from it, in event order (determinism).
        self.rng = random.Random(f"{cfg.seed}/run")
        self.max_events = max_events
        self.stats = SimStats()
        self.clock = EventQueue()
        self.model = initial_model(cfg)
        # phases
        self.phase = "safety"
        self._heal_started = False
        self._live_progress: set[int] = set()
        self._stopped = False
        # workers
        self.workers: dict[str, SimWorker] = {}
        self._incarnations: dict[str, int] = {}
        self._next_index = 0
        # the pieces
        #: Collective plane: the workers' data network (gloo groups on the coordinator's store).
        self.gloo: SimGloo | None = SimGloo(self.clock, cfg.group_build_s) if cfg.collective else None
        self.coordinator = CoordinatorProcess(cfg, self.clock, self.emit, self.gloo,
                                              on_applied=self._on_applied, on_stopped=self._on_stopped)
        self.network = Network(self.clock, self.rng, jitter=cfg.jitter, peer_lost_p=cfg.peer_lost_p,
                               stats=self.stats, emit=self.emit, port=self.coordinator)
        self.coordinator.connect(self.network)
        self.faults = FaultInjector(cfg, self.clock, self.rng, self.stats, self.emit, self.network, self)
        # WorkerWorld and PlaneWorld (world.py): the pieces' methods themselves, no forwarding call.
        self.send = self.network.send_from_worker
        self.open_connection = self.network.open_connection
        self.close_connection = self.network.close_connection
        self.record_recv = self.network.record_recv
        self.record_drop = self.network.record_drop
        self.reduce_fault = self.faults.reduce_fault
        self.crash_before_collective = self.faults.crash_before_collective
        self.crash_in_reduce = self.faults.crash_in_reduce
        # FaultHost (world.py)
        self.admin = self.coordinator.admin
        self.coordinator_crashable = self.coordinator.crashable
        self.crash_coordinator = self.coordinator.crash
        self.restart_coordinator = self.coordinator.restart

    # ------------------------------------------------------------------ run

    def run(self) -> SimStats:
        cfg = self.cfg
        clock = self.clock
        self.emit({"k": "config", "t": 0.0, "format": TRACE_FORMAT, "version": TRACE_VERSION,
                   **cfg.to_dict(), "liveness_bound_s": cfg.liveness_bound_s,
                   "coordinator_timeout_s": cfg.coordinator_timeout_s,
                   "params": {n: t.tolist() for n, t in self.model.params.items()}})
        self._start_initial_workers()
        clock.schedule(cfg.tick_interval_s, self.coordinator.tick)
        self.faults.start()
        clock.schedule(cfg.snapshot_interval_s, self._take_snapshot)
        clock.schedule(cfg.safety_cap_s, self._heal, "time cap")
        stats = self.stats
        try:
            clock.run(self.max_events, self._end)
        except ConsumerAbort:
            raise
        except Exception as exc:  # a crash of the coordinator, the core or the sim is a failure
            stats.error = "".join(traceback.format_exception(exc))
            self.emit({"k": "phase", "t": clock.now, "what": "crash", "error": f"{type(exc).__name__}: {exc}"})
            self._end("crash")
        finally:
            stats.events = clock.events
        stats.sim_time_s = clock.now
        return stats

    def _end(self, why: str) -> None:
        if self.clock.stopped:
            return
        self.clock.stop()
        self.stats.end_reason = why
        self.emit({"k": "phase", "t": self.clock.now, "what": "end", "why": why, "events": self.clock.events})

    # ---------------------------------------------------------------- workers

    def _start_initial_workers(self) -> None:
        cfg = self.cfg
        for _ in range(cfg.workers):
            late = self.rng.random() < cfg.late_fraction
            start = self.rng.uniform(0, 3 * cfg.train_s) if late else self.rng.uniform(0, 0.5)
            self.clock.schedule(start, self.start_worker, self.new_worker_id())

    def new_worker_id(self) -> str:
        wid = f"worker-{self._next_index}"
        self._next_index += 1
        return wid

    def start_worker(self, wid: str, checkpoint: dict | None = None) -> None:
        if self.clock.stopped:
            return
        cfg = self.cfg
        if checkpoint is None and cfg.worker_checkpoints and wid in self.workers:
            checkpoint = self.workers[wid].checkpoint  # a crashed worker resumes from its last checkpoint
        inc = self._incarnations.get(wid, 0) + 1
        self._incarnations[wid] = inc
        delay = self.rng.uniform(cfg.link_delay_min_s, cfg.link_delay_max_s)
        speed = self.rng.uniform(1.0, cfg.speed_spread)
        if self.rng.random() < cfg.straggler_fraction:
            speed *= cfg.straggler_factor
        w = SimWorker(self, wid, inc, delay, speed, checkpoint)
        self.workers[wid] = w
        w.start()

    def endpoint(self, w: SimWorker) -> SimEndpoint | None:
        return SimEndpoint(w, self, self.gloo) if self.gloo is not None else None

    def exited(self, w: SimWorker, why: str) -> None:
        """A worker process exited with a status its supervisor restarts it on.

        ``coordinator_unreachable`` (``diloco worker`` exits 3: it gave up on a silent
        coordinator, checkpoint written) or a refused join (the run is full). The
        supervisor starts it again, with the same id, from its checkpoint if it wrote one.
        """
        if self.phase == "shutdown" or self.clock.stopped:
            return
        delay = self.rng.uniform(0.2, 2.0) * self.cfg.heartbeat_timeout_s
        self.clock.schedule(self.clock.now + delay, self._supervisor_restart, (w.wid, why, w.checkpoint))

    def _supervisor_restart(self, arg: tuple[str, str, dict | None]) -> None:
        wid, why, checkpoint = arg
        if self.phase == "shutdown" or self.workers[wid].alive:
            return
        self.faults.count("supervisor_restart")
        self.emit({"k": "fault", "t": self.clock.now, "what": "restart", "w": wid, "why": why,
                   "resume": checkpoint is not None})
        self.start_worker(wid, checkpoint)

    def segment_time(self, w: SimWorker) -> float:
        return self.cfg.train_s * w.speed * w.straggle * self.rng.uniform(0.9, 1.1)

    def alive_workers(self) -> list[SimWorker]:
        return [w for w in self.workers.values() if w.alive]

    def is_alive(self, wid: str) -> bool:
        return self.workers[wid].alive

    # ------------------------------------------------------------------ phases

    def _take_snapshot(self, _arg=None) -> None:
        if self.phase != "shutdown":
            self.coordinator.snapshot()
        if not self.clock.stopped:
            self.clock.schedule(self.clock.now + self.cfg.snapshot_interval_s, self._take_snapshot)

    def _on_applied(self, fid: int, contributors: int) -> None:
        self.stats.applied += 1
        self.stats.worker_rounds += contributors
        if self.phase == "safety":
            if self.stats.applied >= self.cfg.rounds and not self._heal_started:
                self._heal_started = True
                self.clock.schedule(self.clock.now, self._heal, "rounds reached")
        elif self.phase == "liveness":
            self._live_progress.add(fid)
            if len(self._live_progress) == self.cfg.num_fragments:
                self.phase = "liveness_ok"
                self.clock.schedule(self.clock.now, self._liveness_ok)

    def _heal(self, why: str) -> None:
        """The safety phase ends: faults stop and everything heals; the liveness bound starts."""
        if self.phase != "safety":
            return
        self._heal_started = True
        self.phase = "liveness"
        cfg = self.cfg
        now = self.clock.now
        self.stats.heal_at_s = now
        self.emit({"k": "phase", "t": now, "what": "heal", "why": why, "bound_s": cfg.liveness_bound_s})
        if self.coordinator.coord is None:
            self.coordinator.restart()
        for wid in self.network.heal_all_partitions():
            self.emit({"k": "fault", "t": now, "what": "heal_partition", "w": wid})
        for w in self.alive_workers():
            w.straggle = 1.0
            if w.frozen:
                self.emit({"k": "fault", "t": now, "what": "thaw", "w": w.wid})
                w.thaw()
        if self.coordinator.min_workers != cfg.min_workers:
            self.admin("set_min_workers", min_workers=cfg.min_workers)
        missing = cfg.min_workers - len(self.alive_workers())
        for _ in range(max(0, missing)):
            wid = self.new_worker_id()
            self.emit({"k": "fault", "t": now, "what": "replace", "w": wid, "why": "heal"})
            self.start_worker(wid)
        self.clock.schedule(now + cfg.liveness_bound_s, self._liveness_deadline)

    def _liveness_deadline(self, _arg=None) -> None:
        if self.phase == "liveness":
            self.emit({"k": "phase", "t": self.clock.now, "what": "liveness_timeout",
                       "fragments_applied": sorted(self._live_progress)})
            self._end("liveness timeout")

    def _liveness_ok(self, _arg=None) -> None:
        now = self.clock.now
        self.stats.liveness_s = now - self.stats.heal_at_s
        self.emit({"k": "phase", "t": now, "what": "liveness_ok", "after_s": self.stats.liveness_s})
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
        self.clock.schedule(now + delay, self._shutdown)

    # ------------------------------------------------------------------ shutdown

    def _on_stopped(self, kind: str) -> None:
        self._stopped = True
        self.stats.stop_at_s = self.clock.now
        self.clock.schedule(self.clock.now + self.cfg.linger_s, self._coordinator_exits)

    def _shutdown(self, _arg=None) -> None:
        self.emit({"k": "phase", "t": self.clock.now, "what": "shutdown", "kind": self.cfg.shutdown})
        self.admin("shutdown", kind=self.cfg.shutdown)
        self.clock.schedule(self.clock.now + self.cfg.liveness_bound_s, self._stop_deadline)

    def _stop_deadline(self, _arg=None) -> None:
        if not self._stopped:
            self.emit({"k": "phase", "t": self.clock.now, "what": "stop_timeout"})
            self._end("stop timeout")

    def _coordinator_exits(self, _arg=None) -> None:
        self.coordinator.exit()
        self._end("stopped")
