"""The coordinator's process in the simulator: the real ``Coordinator``, driven as the runner drives it.

``CoordinatorProcess`` holds ``diloco.coordinator.service.Coordinator``, unchanged, and
drives it exactly as the real runner does: ``handle`` per delivered message (the
network calls ``step``, ``world.CoordinatorPort``), ``tick`` on a timer, ``peer_lost``
when the transport sees a peer go, and admin commands. Each of these is one
coordinator *step*: its trace header, the observer's records, the checkpoint the runner
writes before it sends (a save-and-stop), then its sends, in that order.

It also owns the process's life: periodic snapshots (``coordinator_state``), a crash
(the rendezvous store of the collective plane dies with it, ``SimGloo.store_lost``), a
restart from the last snapshot (``restore_coordinator``) and the exit after a
shutdown's linger. It tells the simulation two things the observer reports:
an outer step applied (``on_applied``) and the run stopped (``on_stopped``).
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any, Callable

from diloco.core import FSMConfig
from diloco.coordinator.checkpoint import coordinator_state, restore_coordinator
from diloco.coordinator.config import CoordinatorConfig
from diloco.outer import OuterConfig
from diloco.coordinator.service import Coordinator
from diloco.sim.network import ADMIN, freeze
from diloco.sim.trace import hash_values
from diloco.wire.messages import AdminReply, AdminRequest, HeartbeatReply, Result

if TYPE_CHECKING:  # pragma: no cover
    from diloco.sim.collective import SimGloo
    from diloco.sim.config import SimConfig
    from diloco.sim.network import Network
    from diloco.sim.world import Clock


def coordinator_config(cfg: SimConfig) -> CoordinatorConfig:
    """The coordinator's configuration for a run of ``cfg``."""
    plane: dict = {}
    if cfg.collective:
        plane = dict(data_plane="collective", reduce_timeout_s=cfg.reduce_timeout_s)
    outer = "nesterov" if cfg.mode == "sync" else "delayed_nesterov"
    wire: dict = {}
    if cfg.sparse:
        # The method's own step (SPEC.md section 11): plain SGD, no momentum (the config's is 0).
        outer = "sgd"
        wire = dict(wire_dtype="sparse", sparsity=cfg.sparse_k / cfg.sparse_chunk, sparse_chunk=cfg.sparse_chunk,
                    sparse_beta=cfg.sparse_beta)
    return CoordinatorConfig(
        fsm=FSMConfig(min_workers=cfg.min_workers, mode=cfg.mode, num_fragments=cfg.num_fragments,
                      heartbeat_timeout_s=cfg.heartbeat_timeout_s, max_staleness=cfg.max_staleness,
                      max_held_per_fragment=cfg.max_held_per_fragment, max_workers=cfg.max_workers,
                      grace_window_s=cfg.grace_window_s, **plane),
        outer=OuterConfig(outer, cfg.outer_lr, cfg.outer_momentum, cfg.outer_delay),
        **wire,
        heartbeat_interval_s=cfg.heartbeat_interval_s,
        # The checker models every accepted contribution's outer step; the simulated pseudo-gradients
        # are seeded noise, and the outlier bound's refusals are tested on the coordinator itself.
        outlier_factor=0.0,
        collective_timeout_s=cfg.collective_timeout_s if cfg.collective else 0.0,
        grace_auto=cfg.grace_auto,
    )


class CoordinatorProcess:
    """The coordinator's process: its steps, snapshots, crash, restart and exit (``world.CoordinatorPort``)."""

    def __init__(self, cfg: SimConfig, clock: Clock, emit: Callable[..., None], gloo: SimGloo | None, *,
                 on_applied: Callable[[int, int], None], on_stopped: Callable[[str], None]) -> None:
        self.cfg = cfg
        self._clock = clock
        self.emit = emit
        self._gloo = gloo
        self._on_applied = on_applied
        self._on_stopped = on_stopped
        self._network: Network | None = None
        #: Coordinator steps so far (every trace record of a step carries its number).
        self._step = 0
        self._obs_buf: list[dict] | None = None
        #: The last snapshot (what a restart restores), and whether a checkpoint is due before the next sends.
        self._snapshot: tuple[dict, dict] | None = None
        self._checkpoint_due = False
        self._processes = 0
        self.coord: Coordinator | None = Coordinator(coordinator_config(cfg), 0.0, observer=self._observe)
        if cfg.collective:
            # The run's secret and each coordinator process's incarnation name store prefixes;
            # random in a real run, seeded here (determinism).
            self.coord.collective.secret = random.Random(f"{cfg.seed}/secret").getrandbits(64).to_bytes(8, "big").hex()
            self._seed_incarnation()

    def connect(self, network: Network) -> None:
        """The network the coordinator's sends go out on (it delivers to ``step`` in turn)."""
        self._network = network

    # ------------------------------------------------------------------ steps

    def step(self, header: dict | None, call: Callable[..., list], *args: Any, line: str | None = None) -> None:
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
            self.emit({"k": "tick", "t": self._clock.now, "s": self._step})
        for rec in obs:
            self.emit(rec)
        if self._checkpoint_due:
            # Persist before you send (SPEC.md section 5): the runner writes its checkpoint here.
            self._checkpoint_due = False
            self._record_state("checkpoint", step=self._step)
        network = self._network
        step = self._step
        cache: dict = {}
        for peer, msg in out:
            if peer == ADMIN:
                network.send_admin_reply(step, msg)
                continue
            if type(msg) is HeartbeatReply:
                network.send_to_worker(peer, msg, None, step)
            else:
                msg, rec = freeze(msg, cache)
                if type(msg) is Result and msg.delta:
                    # A sparse Result carries the round's payloads: its trace names the params they
                    # resolve to, the coordinator's (every worker must install exactly these).
                    rec["h"] = self._fragment_hash(msg.fragment_id, cache)
                network.send_to_worker(peer, msg, rec, step)

    def _fragment_hash(self, fid: int, cache: dict) -> str:
        key = ("fragment", fid)
        if key not in cache:
            cache[key] = hash_values((n, t.tolist()) for n, t in self.coord.store.fragment_params(fid).items())
        return cache[key]

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
            self._checkpoint_due = info["kind"] == "save_and_stop"
            self._on_stopped(info["kind"])
        self._obs_buf.append(rec)

    def tick(self, _arg=None) -> None:
        """The runner's idle tick, every ``tick_interval_s`` (while down: nothing, and again later)."""
        if self.coord is not None:
            self.step(None, self.coord.tick, self._clock.now)
        self._clock.schedule(self._clock.now + self.cfg.tick_interval_s, self.tick)

    def admin(self, command: str, **args) -> AdminReply | None:
        """An admin command (``diloco admin``): one step; its reply, or None if the coordinator is down."""
        now = self._clock.now
        if self.coord is None:
            self.emit({"k": "fault", "t": now, "what": "admin_failed", "command": command,
                       "args": args, "why": "coordinator down"})
            return None
        out_reply: list = []

        def call():
            out = self.coord.handle(ADMIN, AdminRequest(command, dict(args)), now)
            out_reply.extend(m for p, m in out if p == ADMIN)
            return out

        self.step({"k": "admin", "t": now, "command": command, "args": args}, call)
        return out_reply[0] if out_reply else None

    @property
    def min_workers(self) -> int:
        return self.coord.fsm.min_workers

    # ------------------------------------------------------------------ the process's life

    def _record_state(self, what: str, step: int | None = None) -> None:
        coord = self.coord
        store = coord.store
        rec = {"k": "fault", "t": self._clock.now, "what": what, "rounds": list(coord.fsm.open_round_ids()),
               "min_workers": coord.fsm.min_workers}
        if coord.collective is not None:
            # No params on this plane (SPEC.md C6): the durable record is each fragment's last commit.
            rec["commits"] = [list(c) for c in coord.collective.last_commit]
        else:
            rec["hf"] = [hash_values((n, store.params[n].tolist()) for n in names) for names in store.fragments]
        if step is not None:
            rec["s"] = step
        self.emit(rec)

    def snapshot(self) -> None:
        """Take a snapshot (what a restart restores), if there is a running coordinator with state."""
        coord = self.coord
        if coord is not None and coord.has_state and not coord.stopped:
            self._snapshot = coordinator_state(coord)
            self._record_state("snapshot")

    def crashable(self) -> bool:
        return self.coord is not None and self._snapshot is not None

    def crash(self) -> None:
        self.emit({"k": "fault", "t": self._clock.now, "what": "coord_crash"})
        self.coord = None
        if self._gloo is not None:
            self._gloo.store_lost()  # the rendezvous store lives in the coordinator's process

    def restart(self, _arg=None) -> None:
        if self.coord is not None or self._snapshot is None:
            return
        meta, tensors = self._snapshot
        self.coord = restore_coordinator(meta, tensors, self._clock.now, observer=self._observe)
        if self._gloo is not None:
            self._gloo.store_restarted()
        if self.coord.collective is not None:
            self._seed_incarnation()
        self._record_state("coord_restart")

    def exit(self) -> None:
        """The process exits after a shutdown's linger."""
        self.emit({"k": "phase", "t": self._clock.now, "what": "coordinator_exit"})
        self.coord = None
        if self._gloo is not None:
            self._gloo.store_lost()

    def _seed_incarnation(self) -> None:
        self._processes += 1
        rng = random.Random(f"{self.cfg.seed}/incarnation/{self._processes}")
        self.coord.collective.incarnation = rng.getrandbits(32).to_bytes(4, "big").hex()
