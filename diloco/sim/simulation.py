"""The simulated world around the real ``Coordinator`` and ``RoundFSM``.

Only the environment is fake: time (``scheduler.py``), the network
(``network.py``), the worker processes and the faults (``faults.py``). Each
worker process runs the real ``diloco.worker.session.WorkerSession``
(``worker.py``); a supervisor restarts one that exits on a silent coordinator
(from its checkpoint) or on a refused join. The coordinator is
``diloco.coordinator.service.Coordinator``, unchanged, driven exactly as the
real runner drives it (``handle`` per delivered message,
``tick`` when idle, ``peer_lost`` when the transport sees a peer go), and
crashed/restarted with ``coordinator_state``/``restore_coordinator``.

This module keeps ``Simulation``: the run loop, the worker processes and their
supervisor, the coordinator's driving (each step's records, then its sends),
snapshots, and the shutdown that ends some runs (drain, save-and-stop, abort:
every worker must have stopped within the coordinator's linger).

``diloco sim --data-plane collective`` runs the coordinator on the collective plane; the
workers' data plane (gloo groups on the coordinator's store, heals, the replicas) is
``diloco.sim.collective``.
"""

from __future__ import annotations

import random
import traceback
from dataclasses import dataclass, field

import torch

from diloco.core import FSMConfig
from diloco.coordinator.checkpoint import coordinator_state, restore_coordinator
from diloco.coordinator.config import CoordinatorConfig
from diloco.coordinator.outer import OuterConfig
from diloco.coordinator.service import Coordinator
from diloco.wire.messages import AdminReply, AdminRequest, HeartbeatReply, spec_of
from diloco.sim.config import SimConfig
from diloco.sim.faults import FaultInjector
from diloco.sim.network import ADMIN, COORDINATOR, Network, _encode
from diloco.sim.scheduler import EventQueue
from diloco.sim.trace import TRACE_FORMAT, TRACE_VERSION, ConsumerAbort, TraceWriter, hash_values
from diloco.sim.collective import SimGloo
from diloco.sim.worker import SimWorker


@dataclass
class SimStats:
    events: int = 0
    messages_sent: int = 0
    messages_delivered: int = 0
    messages_dropped: int = 0
    applied: int = 0
    worker_rounds: int = 0
    faults: dict = field(default_factory=dict)
    end_reason: str = ""
    sim_time_s: float = 0.0
    heal_at_s: float | None = None
    liveness_s: float | None = None
    stop_at_s: float | None = None
    error: str = ""


class Simulation(EventQueue, Network, FaultInjector):
    """One seeded run. ``run()`` returns the stats; the trace goes to ``trace``."""

    def __init__(self, cfg: SimConfig, trace: TraceWriter, *, max_events: int = 50_000_000) -> None:
        self.cfg = cfg
        self.trace = trace
        self.emit = trace.emit
        self.rng = random.Random(f"{cfg.seed}/run")
        self._random = self.rng.random
        self._jitter = cfg.jitter
        self.sync = cfg.mode == "sync"
        self.max_events = max_events
        self.stats = SimStats()
        self._init_queue()
        self._init_network()
        self._step = 0
        self._obs_buf: list[dict] | None = None
        # workers
        self.workers: dict[str, SimWorker] = {}
        self._incarnations: dict[str, int] = {}
        self._next_index = 0
        # the model: tensors named p0, p1, ... of a few float32 elements each
        init_rng = random.Random(f"{cfg.seed}/params")
        self.initial_params = {
            f"p{i}": torch.tensor([round(init_rng.uniform(-1, 1), 6) for _ in range(n)], dtype=torch.float32)
            for i, n in enumerate(cfg.param_sizes)
        }
        self.param_spec = spec_of(self.initial_params)
        self.param_sizes = {f"p{i}": n for i, n in enumerate(cfg.param_sizes)}
        # the coordinator
        plane = {}
        if cfg.collective:
            plane = dict(data_plane="collective", reduce_timeout_s=cfg.reduce_timeout_s)
        self.coord_config = CoordinatorConfig(
            fsm=FSMConfig(min_workers=cfg.min_workers, mode=cfg.mode, num_fragments=cfg.num_fragments,
                          heartbeat_timeout_s=cfg.heartbeat_timeout_s, max_staleness=cfg.max_staleness,
                          max_held_per_fragment=cfg.max_held_per_fragment, max_workers=cfg.max_workers,
                          grace_window_s=cfg.grace_window_s, **plane),
            outer=OuterConfig("nesterov" if self.sync else "delayed_nesterov", cfg.outer_lr,
                              cfg.outer_momentum, cfg.outer_delay),
            heartbeat_interval_s=cfg.heartbeat_interval_s,
            # The checker models every accepted contribution's outer step; the simulated pseudo-gradients
            # are seeded noise, and the outlier bound's refusals are tested on the coordinator itself.
            outlier_factor=0.0,
            collective_timeout_s=cfg.collective_timeout_s if cfg.collective else 0.0,
        )
        self.coord: Coordinator | None = Coordinator(self.coord_config, 0.0, observer=self._observe)
        #: Collective plane: the workers' data plane (gloo groups on the coordinator's store).
        self.gloo: SimGloo | None = None
        if cfg.collective:
            # The run's secret and each coordinator process's incarnation name store prefixes;
            # random in a real run, seeded here (determinism).
            self.coord.collective.secret = random.Random(f"{cfg.seed}/secret").getrandbits(64).to_bytes(8, "big").hex()
            self._seed_incarnation()
            self.gloo = SimGloo(self)
        self._coord_exited = False
        self._snapshot: tuple[dict, dict] | None = None
        # phases
        self.phase = "safety"
        self._done = False
        self._heal_started = False
        self._live_progress: set[int] = set()
        self._stopped = False
        self._checkpoint_due = False

    # ------------------------------------------------------------------ run

    def run(self) -> SimStats:
        cfg = self.cfg
        self.emit({"k": "config", "t": 0.0, "format": TRACE_FORMAT, "version": TRACE_VERSION,
                   **cfg.to_dict(), "liveness_bound_s": cfg.liveness_bound_s,
                   "coordinator_timeout_s": cfg.coordinator_timeout_s,
                   "params": {n: t.tolist() for n, t in self.initial_params.items()}})
        self._start_initial_workers()
        self.schedule(cfg.tick_interval_s, self._coord_tick)
        if cfg.fault_rate_per_s > 0:
            self.schedule(self.rng.expovariate(cfg.fault_rate_per_s), self._fault)
        self.schedule(cfg.snapshot_interval_s, self._take_snapshot)
        self.schedule(cfg.safety_cap_s, self._heal, "time cap")
        stats = self.stats
        try:
            self._run_events()
        except ConsumerAbort:
            raise
        except Exception as exc:  # a crash of the coordinator, the core or the sim is a failure
            stats.error = "".join(traceback.format_exception(exc))
            self.emit({"k": "phase", "t": self.now, "what": "crash", "error": f"{type(exc).__name__}: {exc}"})
            self._end("crash")
        stats.sim_time_s = self.now
        return stats

    def _end(self, why: str) -> None:
        if self._done:
            return
        self._done = True
        self.stats.end_reason = why
        self.emit({"k": "phase", "t": self.now, "what": "end", "why": why, "events": self.stats.events})

    # ---------------------------------------------------------------- workers

    def _start_initial_workers(self) -> None:
        cfg = self.cfg
        for _ in range(cfg.workers):
            late = self.rng.random() < cfg.late_fraction
            start = self.rng.uniform(0, 3 * cfg.train_s) if late else self.rng.uniform(0, 0.5)
            self.schedule(start, self._start_worker, self._new_worker_id())

    def _new_worker_id(self) -> str:
        wid = f"worker-{self._next_index}"
        self._next_index += 1
        return wid

    def _start_worker(self, wid: str, checkpoint: dict | None = None) -> None:
        if self._done:
            return
        cfg = self.cfg
        inc = self._incarnations.get(wid, 0) + 1
        self._incarnations[wid] = inc
        delay = self.rng.uniform(cfg.link_delay_min_s, cfg.link_delay_max_s)
        speed = self.rng.uniform(1.0, cfg.speed_spread)
        if self.rng.random() < cfg.straggler_fraction:
            speed *= cfg.straggler_factor
        w = SimWorker(self, wid, inc, delay, speed, checkpoint)
        self.workers[wid] = w
        w.start()

    def worker_exited(self, w: SimWorker, why: str) -> None:
        """A worker process exited with a status its supervisor restarts it on.

        ``coordinator_unreachable`` (``diloco worker`` exits 3: it gave up on a silent
        coordinator, checkpoint written) or a refused join (the run is full). The
        supervisor starts it again, with the same id, from its checkpoint if it wrote one.
        """
        if self.phase == "shutdown" or self._done:
            return
        delay = self.rng.uniform(0.2, 2.0) * self.cfg.heartbeat_timeout_s
        self.schedule(self.now + delay, self._supervisor_restart, (w.wid, why, w.checkpoint))

    def _supervisor_restart(self, arg: tuple[str, str, dict | None]) -> None:
        wid, why, checkpoint = arg
        if self.phase == "shutdown" or self.workers[wid].alive:
            return
        self._count("supervisor_restart")
        self.emit({"k": "fault", "t": self.now, "what": "restart", "w": wid, "why": why,
                   "resume": checkpoint is not None})
        self._start_worker(wid, checkpoint)

    def segment_time(self, w: SimWorker) -> float:
        return self.cfg.train_s * w.speed * w.straggle * self.rng.uniform(0.9, 1.1)

    def alive_workers(self) -> list[SimWorker]:
        return [w for w in self.workers.values() if w.alive]

    # ------------------------------------------------------------ coordinator

    def _observe(self, what: str, now: float, info: dict) -> None:
        rec = {"k": "obs", "t": now, "s": self._step, "what": what}
        rec.update(info)
        if what == "apply":
            fid = info["fragment_id"]
            if self.coord.store is not None:
                params = {n: t.tolist() for n, t in self.coord.store.fragment_params(fid).items()}
                rec["p"] = params
                rec["h"] = hash_values(params.items())
            rec["contributors"] = list(info["contributors"])
            self._on_applied(fid, len(info["contributors"]))
        elif what == "reduce":
            rec["group"] = list(info["group"])
        elif what == "join":
            rec["parked"] = [list(p) for p in info.get("parked", ())]
        elif what == "stop":
            self._on_stopped(info["kind"])
        self._obs_buf.append(rec)

    def _coord_call(self, header: dict | None, call, *args, line: str | None = None) -> None:
        """One coordinator step: header record, the observer's records, then the sends."""
        self._step += 1
        self._obs_buf = []
        if header is not None:
            header["s"] = self._step
            self.emit(header, None if line is None else f"{line}{self._step}}}")
        out = call(*args)
        obs, self._obs_buf = self._obs_buf, None
        if header is None and not obs and not out:
            return
        if header is None:
            self.emit({"k": "tick", "t": self.now, "s": self._step})
        for rec in obs:
            self.emit(rec)
        if self._checkpoint_due:
            # Persist before you send (SPEC.md section 5): the runner writes its checkpoint here.
            self._checkpoint_due = False
            self._record_state("checkpoint", step=self._step)
        cache: dict = {}
        for peer, msg in out:
            if peer == ADMIN:
                self._mid += 1
                rec = {"k": "send", "t": self.now, "s": self._step, "m": self._mid, "src": COORDINATOR,
                       "dst": ADMIN}
                rec.update(_encode(msg))
                self.emit(rec)
                continue
            if type(msg) is HeartbeatReply:
                self._send_to_worker(peer, msg, None)
            else:
                msg, rec = self._freeze(msg, cache)
                self._send_to_worker(peer, msg, rec)

    def _coord_tick(self, _arg=None) -> None:
        if self.coord is not None:
            self._coord_call(None, self.coord.tick, self.now)
        self.schedule(self.now + self.cfg.tick_interval_s, self._coord_tick)

    def admin(self, command: str, **args) -> AdminReply | None:
        if self.coord is None:
            self.emit({"k": "fault", "t": self.now, "what": "admin_failed", "command": command,
                       "args": args, "why": "coordinator down"})
            return None
        out_reply: list = []

        def call():
            out = self.coord.handle(ADMIN, AdminRequest(command, dict(args)), self.now)
            out_reply.extend(m for p, m in out if p == ADMIN)
            return out

        self._coord_call({"k": "admin", "t": self.now, "command": command, "args": args}, call)
        return out_reply[0] if out_reply else None

    def _record_state(self, what: str, step: int | None = None) -> None:
        coord = self.coord
        store = coord.store
        rec = {"k": "fault", "t": self.now, "what": what, "rounds": list(coord.fsm.open_round_ids()),
               "min_workers": coord.fsm.min_workers}
        if coord.collective is not None:
            # No params on this plane (SPEC.md C6): the durable record is each fragment's last commit.
            rec["commits"] = [list(c) for c in coord.collective.last_commit]
        else:
            rec["hf"] = [hash_values((n, store.params[n].tolist()) for n in names) for names in store.fragments]
        if step is not None:
            rec["s"] = step
        self.emit(rec)

    def _take_snapshot(self, _arg=None) -> None:
        coord = self.coord
        if coord is not None and coord.has_state and not coord.stopped and self.phase != "shutdown":
            self._snapshot = coordinator_state(coord)
            self._record_state("snapshot")
        if not self._done:
            self.schedule(self.now + self.cfg.snapshot_interval_s, self._take_snapshot)

    def _coord_crash(self) -> None:
        self.emit({"k": "fault", "t": self.now, "what": "coord_crash"})
        self.coord = None
        if self.gloo is not None:
            self.gloo.store_lost()  # the rendezvous store lives in the coordinator's process

    def _coord_restart(self, _arg=None) -> None:
        if self.coord is not None or self._snapshot is None:
            return
        meta, tensors = self._snapshot
        self.coord = restore_coordinator(meta, tensors, self.now, observer=self._observe)
        if self.coord.collective is not None:
            self._seed_incarnation()
        self._record_state("coord_restart")

    def _seed_incarnation(self) -> None:
        self._coord_processes = getattr(self, "_coord_processes", 0) + 1
        rng = random.Random(f"{self.cfg.seed}/incarnation/{self._coord_processes}")
        self.coord.collective.incarnation = rng.getrandbits(32).to_bytes(4, "big").hex()

    # ------------------------------------------------------------------ shutdown

    def _on_stopped(self, kind: str) -> None:
        self._stopped = True
        self._checkpoint_due = kind == "save_and_stop"
        self.stats.stop_at_s = self.now
        self.schedule(self.now + self.cfg.linger_s, self._coordinator_exits)

    def _shutdown(self, _arg=None) -> None:
        self.emit({"k": "phase", "t": self.now, "what": "shutdown", "kind": self.cfg.shutdown})
        self.admin("shutdown", kind=self.cfg.shutdown)
        self.schedule(self.now + self.cfg.liveness_bound_s, self._stop_deadline)

    def _stop_deadline(self, _arg=None) -> None:
        if not self._stopped:
            self.emit({"k": "phase", "t": self.now, "what": "stop_timeout"})
            self._end("stop timeout")

    def _coordinator_exits(self, _arg=None) -> None:
        self.emit({"k": "phase", "t": self.now, "what": "coordinator_exit"})
        self.coord = None
        if self.gloo is not None:
            self.gloo.store_lost()
        self._end("stopped")
