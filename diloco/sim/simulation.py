"""The simulated world around the real ``Coordinator`` and ``RoundFSM``.

Only the environment is fake: time (a heap of events keyed by ``(time, seq)``,
no sleeps, no clock), the network, the worker processes and the faults. Each
worker process runs the real ``diloco.worker.session.WorkerSession``
(``worker.py``); a supervisor restarts one that exits on a silent coordinator
(from its checkpoint) or on a refused join. The coordinator is
``diloco.coordinator.service.Coordinator``, unchanged, driven exactly as the
real runner drives it (``handle`` per delivered message,
``tick`` when idle, ``peer_lost`` when the transport sees a peer go), and
crashed/restarted with ``coordinator_state``/``restore_coordinator``.

The network follows what ZeroMQ over TCP allows:

* per-connection FIFO: messages between one connection and the coordinator
  arrive in the order they were sent (each direction of each link has a
  "not before" time); different links interleave arbitrarily;
* each worker machine has its own base delay, plus seeded jitter, capped at
  ``MAX_LINK_DELAY_S``;
* loss only where the real thing loses: a message is dropped when its worker
  is partitioned from the coordinator at send or delivery time, when its
  destination process crashed or closed that connection, or when the
  coordinator is down. Messages a crashed process already sent are still
  delivered (they were on the wire);
* a crash or a closed connection is reported to the coordinator as
  ``peer_lost`` only sometimes (``peer_lost_p``), in FIFO order after the
  connection's last message; otherwise only the heartbeat timeout finds it.

A run has two phases, as in TigerBeetle's VOPR: *safety* (faults injected at
a seeded rate until ``rounds`` outer steps applied, or a time cap), then
*liveness*: faults stop, partitions heal, frozen workers thaw, the
coordinator is restarted if down, ``min_workers`` is set back and enough
workers are started; every fragment must then apply another round within
``SimConfig.liveness_bound_s``. Some runs then shut down (drain,
save-and-stop, abort) and every worker must have stopped within the
coordinator's linger.
"""

from __future__ import annotations

import heapq
import random
from math import log as _log
import traceback
from dataclasses import dataclass, field

import torch

from diloco.core import FSMConfig
from diloco.coordinator.checkpoint import coordinator_state, restore_coordinator
from diloco.coordinator.config import CoordinatorConfig
from diloco.coordinator.outer import OuterConfig
from diloco.coordinator.service import Coordinator
from diloco.transport.messages import (
    Accepted,
    AdminReply,
    AdminRequest,
    Error,
    Heartbeat,
    HeartbeatReply,
    Join,
    Leave,
    Result,
    Submit,
    Welcome,
    spec_of,
)
from diloco.sim.config import FAULT_KINDS, MAX_LINK_DELAY_S, SimConfig
from diloco.sim.trace import TRACE_FORMAT, TRACE_VERSION, ConsumerAbort, TraceWriter, hash_values
from diloco.sim.worker import SimWorker

COORDINATOR = "coordinator"
ADMIN = "admin"
_JSON_BOOL = {True: "true", False: "false"}


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


def _tensor_fields_frozen(tensors: dict) -> dict:
    return {n: t.detach().clone() for n, t in tensors.items()}


class Simulation:
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
        self.now = 0.0
        self._heap: list = []
        self._seq = 0
        self._mid = 0
        self._step = 0
        self._obs_buf: list[dict] | None = None
        # network
        self._up_last: dict[str, float] = {}
        self._down_last: dict[str, float] = {}
        self._partitioned: dict[str, int] = {}
        self.peers: dict[str, SimWorker] = {}
        self._peer_wid: dict[str, str] = {}
        self._peer_delay: dict[str, float] = {}
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
        self.coord_config = CoordinatorConfig(
            fsm=FSMConfig(min_workers=cfg.min_workers, mode=cfg.mode, num_fragments=cfg.num_fragments,
                          heartbeat_timeout_s=cfg.heartbeat_timeout_s, max_staleness=cfg.max_staleness,
                          max_held_per_fragment=cfg.max_held_per_fragment, max_workers=cfg.max_workers),
            outer=OuterConfig("nesterov" if self.sync else "delayed_nesterov", cfg.outer_lr,
                              cfg.outer_momentum, cfg.outer_delay),
            heartbeat_interval_s=cfg.heartbeat_interval_s,
        )
        self.coord: Coordinator | None = Coordinator(self.coord_config, 0.0, observer=self._observe)
        self._coord_exited = False
        self._snapshot: tuple[dict, dict] | None = None
        # phases
        self.phase = "safety"
        self._done = False
        self._heal_started = False
        self._live_progress: set[int] = set()
        self._stopped = False
        self._checkpoint_due = False

    # ------------------------------------------------------------------ queue

    def schedule(self, t: float, fn, arg=None) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fn, arg))

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
        heap = self._heap
        pop = heapq.heappop
        stats = self.stats
        try:
            while heap and not self._done:
                t, _seq, fn, arg = pop(heap)
                self.now = t
                stats.events += 1
                fn(arg)
                if stats.events >= self.max_events:
                    self._end("event cap")
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

    # ---------------------------------------------------------------- network

    def open_connection(self, w: SimWorker) -> None:
        """A worker process connects (once: every incarnation keeps its connection for life)."""
        w.peer = f"{w.wid}/{w.inc}"
        self.peers[w.peer] = w
        self._peer_wid[w.peer] = w.wid
        self._peer_delay[w.peer] = w.link_delay_s

    def close_connection(self, w: SimWorker, *, notice: bool) -> None:
        peer = w.peer
        if self.peers.get(peer) is w:
            del self.peers[peer]
            if notice and self.rng.random() < self.cfg.peer_lost_p:
                t = max(self.now + w.link_delay_s, self._up_last.get(peer, 0.0))
                self._up_last[peer] = t
                self.schedule(t, self._peer_lost, peer)

    def _delay(self, base: float) -> float:
        # base + exponential jitter with mean cfg.jitter * base (random.expovariate, inlined), capped.
        d = base - _log(1.0 - self._random()) * self._jitter * base
        return d if d < MAX_LINK_DELAY_S else MAX_LINK_DELAY_S

    def send_from_worker(self, w: SimWorker, msg) -> None:
        """Hand a worker's message to the network. It is traced when delivered (``recv``, with
        its fields and ``ts``, the send time) or lost (``drop``, the same fields)."""
        self._mid += 1
        mid = self._mid
        peer = w.peer
        self.stats.messages_sent += 1
        if self._partitioned and self._partitioned.get(w.wid):
            self._drop_from_worker(mid, peer, msg, self.now, "partition")
            return
        t = self.now + self._delay(w.link_delay_s)
        last = self._up_last.get(peer, 0.0)
        if t < last:
            t = last
        self._up_last[peer] = t
        self.schedule(t, self._deliver_to_coord, (mid, peer, msg, self.now))

    def _drop_from_worker(self, mid: int, peer: str, msg, sent_s: float, why: str) -> None:
        self.stats.messages_dropped += 1
        rec = {"k": "drop", "t": self.now, "m": mid, "src": peer, "dst": COORDINATOR, "ts": sent_s, "why": why}
        rec.update(_encode(msg))
        self.emit(rec)

    def _send_to_worker(self, peer: str, msg, fields: dict | None) -> None:
        self._mid += 1
        mid = self._mid
        now = self.now
        step = self._step
        typ = type(msg)
        head = f'{{"k":"send","t":{now!r},"s":{step},"m":{mid},"src":"coordinator","dst":"{peer}",'
        if typ is HeartbeatReply:
            # The commonest coordinator message: record and line built directly.
            below, command = msg.below_min_workers, msg.command.value
            self.emit({"k": "send", "t": now, "s": step, "m": mid, "src": COORDINATOR, "dst": peer,
                       "type": "HeartbeatReply", "below_min_workers": below, "min_workers": msg.min_workers,
                       "phase": msg.phase, "command": command},
                      f'{head}"type":"HeartbeatReply","below_min_workers":{_JSON_BOOL[below]},'
                      f'"min_workers":{msg.min_workers},"phase":"{msg.phase}","command":"{command}"}}')
            self._transmit(peer, mid, msg)
            return
        rec = {"k": "send", "t": now, "s": step, "m": mid, "src": COORDINATOR, "dst": peer}
        rec.update(fields)
        if typ is Accepted:
            self.emit(rec, f'{head}"type":"Accepted","fragment_id":{msg.fragment_id},"round_id":{msg.round_id}}}')
        elif typ is Result:
            self.emit(rec, f'{head}"type":"Result","fragment_id":{msg.fragment_id},"round_id":{msg.round_id},'
                           f'"outcome":"{msg.outcome}","next_round_id":{msg.next_round_id},"h":"{fields["h"]}"}}')
        else:
            self.emit(rec)
        self._transmit(peer, mid, msg)

    def _transmit(self, peer: str, mid: int, msg) -> None:
        self.stats.messages_sent += 1
        wid = self._peer_wid.get(peer)
        if wid is None or (self._partitioned and self._partitioned.get(wid)):
            self.record_drop(mid, COORDINATOR, peer, msg, "partition" if wid else "unknown peer")
            return
        t = self.now + self._delay(self._peer_delay[peer])
        last = self._down_last.get(peer, 0.0)
        if t < last:
            t = last
        self._down_last[peer] = t
        self.schedule(t, self._deliver_to_worker, (mid, peer, wid, msg))

    def record_drop(self, mid: int, src: str, dst: str, msg, why: str) -> None:
        self.stats.messages_dropped += 1
        self.emit({"k": "drop", "t": self.now, "m": mid, "src": src, "dst": dst, "type": type(msg).__name__,
                   "why": why})

    def record_recv(self, mid: int, src: str, dst: str, msg) -> None:
        self.stats.messages_delivered += 1
        now = self.now
        typ = type(msg).__name__
        self.emit({"k": "recv", "t": now, "m": mid, "src": src, "dst": dst, "type": typ},
                  f'{{"k":"recv","t":{now!r},"m":{mid},"src":"{src}","dst":"{dst}","type":"{typ}"}}')

    def _deliver_to_worker(self, arg) -> None:
        mid, peer, wid, msg = arg
        if self._partitioned and self._partitioned.get(wid):
            self.record_drop(mid, COORDINATOR, peer, msg, "partition")
            return
        w = self.peers.get(peer)
        if w is None:
            self.record_drop(mid, COORDINATOR, peer, msg, "closed")
            return
        if w.frozen:
            w.buffer(mid, peer, COORDINATOR, msg)
            return
        self.record_recv(mid, COORDINATOR, peer, msg)
        w.on_message(mid, msg)

    # ------------------------------------------------------------ coordinator

    def _observe(self, what: str, now: float, info: dict) -> None:
        rec = {"k": "obs", "t": now, "s": self._step, "what": what}
        rec.update(info)
        if what == "apply":
            fid = info["fragment_id"]
            params = {n: t.tolist() for n, t in self.coord.store.fragment_params(fid).items()}
            rec["p"] = params
            rec["h"] = hash_values(params.items())
            rec["contributors"] = list(info["contributors"])
            self._on_applied(fid, len(info["contributors"]))
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

    def _freeze(self, msg, cache: dict):
        """Copy the tensors a message carries, as the wire would (the coordinator's are live)."""
        typ = type(msg)
        if typ is Result:
            params = msg.params
            if not params:
                return msg, _encode(msg)
            key = tuple(id(t) for t in params.values())
            hit = cache.get(key)
            if hit is None:
                frozen = _tensor_fields_frozen(params)
                hit = (frozen, hash_values((n, t.tolist()) for n, t in frozen.items()))
                cache[key] = hit
            frozen, h = hit
            msg = Result(msg.fragment_id, msg.round_id, msg.outcome, msg.next_round_id, frozen)
            return msg, {"type": "Result", "fragment_id": msg.fragment_id, "round_id": msg.round_id,
                         "outcome": msg.outcome, "next_round_id": msg.next_round_id, "h": h}
        if typ is Welcome:
            frozen = _tensor_fields_frozen(msg.params)
            values = {n: t.tolist() for n, t in frozen.items()}
            hf = [hash_values((n, values[n]) for n in names) for names in msg.fragments]
            msg = Welcome(msg.worker_id, msg.round_ids, msg.parked, msg.mode, msg.fragments, msg.min_workers,
                          msg.below_min_workers, msg.heartbeat_interval_s, frozen)
            rec = _encode(msg)
            rec["hf"] = hf
            return msg, rec
        return msg, _encode(msg)

    def _deliver_to_coord(self, arg) -> None:
        mid, peer, msg, sent_s = arg
        if self._partitioned and self._partitioned.get(self._peer_wid[peer]):
            self._drop_from_worker(mid, peer, msg, sent_s, "partition")
            return
        if self.coord is None:
            self._drop_from_worker(mid, peer, msg, sent_s, "coordinator down")
            return
        self.stats.messages_delivered += 1
        now = self.now
        header = {"k": "recv", "t": now, "m": mid, "src": peer, "dst": COORDINATOR, "ts": sent_s}
        if type(msg) is Heartbeat:
            # The commonest record: formatted by hand (ids and peer names never need escaping).
            header["type"] = "Heartbeat"
            header["worker_id"] = msg.worker_id
            line = (f'{{"k":"recv","t":{now!r},"m":{mid},"src":"{peer}","dst":"coordinator","ts":{sent_s!r},'
                    f'"type":"Heartbeat","worker_id":"{msg.worker_id}","s":')
        else:
            header.update(_encode(msg))
            line = None
        self._coord_call(header, self.coord.handle, peer, msg, now, line=line)

    def _peer_lost(self, peer: str) -> None:
        if self.coord is None or self._partitioned.get(self._peer_wid[peer]):
            return
        self._coord_call({"k": "lost", "t": self.now, "peer": peer}, self.coord.peer_lost, peer, self.now)

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
        hf = [hash_values((n, store.params[n].tolist()) for n in names) for names in store.fragments]
        rec = {"k": "fault", "t": self.now, "what": what, "rounds": list(coord.fsm.open_round_ids()),
               "min_workers": coord.fsm.min_workers, "hf": hf}
        if step is not None:
            rec["s"] = step
        self.emit(rec)

    def _take_snapshot(self, _arg=None) -> None:
        coord = self.coord
        if coord is not None and coord.store is not None and not coord.stopped and self.phase != "shutdown":
            self._snapshot = coordinator_state(coord)
            self._record_state("snapshot")
        if not self._done:
            self.schedule(self.now + self.cfg.snapshot_interval_s, self._take_snapshot)

    def _coord_crash(self) -> None:
        self.emit({"k": "fault", "t": self.now, "what": "coord_crash"})
        self.coord = None

    def _coord_restart(self, _arg=None) -> None:
        if self.coord is not None or self._snapshot is None:
            return
        meta, tensors = self._snapshot
        self.coord = restore_coordinator(meta, tensors, self.now, observer=self._observe)
        self._record_state("coord_restart")

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

    def _on_stopped(self, kind: str) -> None:
        self._stopped = True
        self._checkpoint_due = kind == "save_and_stop"
        self.stats.stop_at_s = self.now
        self.schedule(self.now + self.cfg.linger_s, self._coordinator_exits)

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
        self._end("stopped")

    # ------------------------------------------------------------------ faults

    def _count(self, kind: str) -> None:
        self.stats.faults[kind] = self.stats.faults.get(kind, 0) + 1

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


# --------------------------------------------------------------------------- encoding


def _values(tensors: dict) -> dict:
    return {n: t.reshape(-1).tolist() for n, t in tensors.items()}


def _encode(msg) -> dict:
    """A message's non-tensor fields, plus ``h``/``v`` for tensors (see trace.py)."""
    typ = type(msg)
    if typ is Heartbeat:
        return {"type": "Heartbeat", "worker_id": msg.worker_id}
    if typ is HeartbeatReply:
        return {"type": "HeartbeatReply", "below_min_workers": msg.below_min_workers,
                "min_workers": msg.min_workers, "phase": msg.phase, "command": msg.command.value}
    if typ is Submit:
        v = _values(msg.tensors)
        return {"type": "Submit", "worker_id": msg.worker_id, "fragment_id": msg.fragment_id,
                "round_id": msg.round_id, "h": hash_values(v.items()), "v": v}
    if typ is Accepted:
        return {"type": "Accepted", "fragment_id": msg.fragment_id, "round_id": msg.round_id}
    if typ is Result:
        h = hash_values((n, t.tolist()) for n, t in msg.params.items()) if msg.params else ""
        return {"type": "Result", "fragment_id": msg.fragment_id, "round_id": msg.round_id,
                "outcome": msg.outcome, "next_round_id": msg.next_round_id, "h": h}
    if typ is Error:
        code = msg.code.value if hasattr(msg.code, "value") else str(msg.code)
        return {"type": "Error", "code": code, "detail": msg.detail, "in_reply_to": msg.in_reply_to}
    if typ is Join:
        v = _values(msg.params)
        return {"type": "Join", "worker_id": msg.worker_id, "protocol_version": msg.protocol_version,
                "spec": [[s.name, list(s.shape), s.dtype] for s in msg.spec], "h": hash_values(v.items()), "v": v}
    if typ is Welcome:
        return {"type": "Welcome", "worker_id": msg.worker_id, "round_ids": list(msg.round_ids),
                "parked": [list(p) for p in msg.parked], "mode": msg.mode,
                "fragments": [list(f) for f in msg.fragments], "min_workers": msg.min_workers,
                "below_min_workers": msg.below_min_workers, "heartbeat_interval_s": msg.heartbeat_interval_s}
    if typ is Leave:
        return {"type": "Leave", "worker_id": msg.worker_id}
    if typ is AdminReply:
        return {"type": "AdminReply", "ok": msg.ok, "error": msg.error}
    if typ is AdminRequest:
        return {"type": "AdminRequest", "command": msg.command, "args": dict(msg.args)}
    raise TypeError(f"cannot encode {typ.__name__}")
