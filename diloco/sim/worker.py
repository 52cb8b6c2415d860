"""A light worker: the real ``WorkerSession`` in a simulated process.

Each incarnation of a worker process owns a ``diloco.worker.session.WorkerSession``,
the same pure machine ``DilocoWorker`` drives, and does no protocol logic of its
own: this class is only the environment around it. It turns simulated time into
the session's events and carries out the actions the session returns, in order.
Everything it uses of the rest of the simulation is its ``world.WorkerWorld``
(the clock, the trace, its link, its supervisor, the model):

* the "model" is a handful of small float32 tensors and never trains: an inner
  step is a timer of ``WorkerWorld.segment_time``. The session runs with
  ``sync_every`` = the number of fragments, so each inner step closes the next
  fragment in turn (schedule offsets 1..F). ``step_done`` after each step; the
  next one starts while ``session.may_train``;
* ``tick`` on a timer: at each heartbeat's due time while a member (heartbeats
  go out on time), every ``TICK_S`` while joining or stopping (join resends,
  the stop's save question);
* ``Send`` goes on the simulated network; ``SendJoinWithParams`` sends a Join
  carrying the model's initial params (``WorkerWorld.model``); ``SubmitFragment`` sends
  ``seeded_update``, a seeded function of (seed, worker id, fragment, round), so
  a run's numbers depend on the seed alone (on the sparse wire, through its
  accumulator: ``accumulator.py``); ``InstallParams`` copies the params
  in (the sim worker never trains, so its params *are* its global copy and
  ``keep_if_same`` changes nothing; a sparse Result's payloads are added to
  them first) and traces an ``adopt``; ``StateChanged``
  traces the state (``diloco.worker.states``);
* ``Stop`` ends the process: ``stopped_done``, then ``leave`` as
  ``run_training`` does on its way out. A worker that gave up on a silent
  coordinator (``coordinator_unreachable``: ``diloco worker`` exits 3) is
  restarted by its supervisor from the checkpoint it wrote;
* ``Fail`` ends it too. A refused join (``RESTARTABLE_FAILS``: the run is
  full, or the join kept being answered ``already_member``) is an ordinary
  exit its supervisor retries; any other means a worker got something it
  could not use, and the run fails (``SimWorkerFailure``).

On a collective run (``SimConfig.data_plane``) ``plane`` (``diloco.sim.collective.SimEndpoint``,
from ``WorkerWorld.endpoint``) stands where ``CollectiveEndpoint`` stands in the real
worker: every message of the session goes out through it, every coordinator message comes
in through it, and what it hands the session later (a healed Welcome, a commit's Result)
arrives through ``deliver_local``.

A process keeps one connection for its life, as the real worker keeps one
ZeroMQ DEALER socket with a fixed routing id: re-joins, resyncs and a
restarted coordinator all use it. Only a new incarnation (a restart) connects
anew. Frozen workers (a SIGSTOP'd process) neither send nor handle anything;
what arrives meanwhile, and the timers that fired, are handled in order when
they thaw.
"""

from __future__ import annotations

import hashlib
import struct
from typing import TYPE_CHECKING

import torch

from diloco.collective.member import PlaneEventKind
from diloco.sim.trace import hash_values
from diloco.sim.accumulator import SimAccumulator
from diloco.wire import compression
from diloco.wire.messages import PROTOCOL_VERSION, Heartbeat, Join, Submit, Welcome
from diloco.worker.actions import (
    Fail,
    InstallParams,
    Send,
    SendJoinWithParams,
    StateChanged,
    Stop,
    SubmitFragment,
)
from diloco.worker.session import WorkerSession
from diloco.worker.states import WorkerState

if TYPE_CHECKING:  # pragma: no cover
    from diloco.sim.world import MemberPlane, WorkerWorld

# Timer kinds (indexes into SimWorker.tokens).
TICK, TRAIN = 0, 1
#: Tick period while joining or stopping (join resends come after 2.5 s or more; the
#: save question of a stop waits at most 1 s).
TICK_S = 0.5
#: A heartbeat tick comes this much after the due time, so ``now - last >= interval`` holds
#: despite rounding.
_HB_SLACK_S = 1e-6
#: Fail codes of a refused join a real worker exits on and its supervisor retries.
RESTARTABLE_FAILS = frozenset({"too_many_workers", "already_member"})
#: The fail code of a collective joiner that could not copy the run's state (``PlaneEventKind``).
_HEAL_FAILED = PlaneEventKind.HEAL_FAILED.value

_MEMBER = (WorkerState.TRAINING, WorkerState.WAITING, WorkerState.PAUSED)


class SimWorkerFailure(RuntimeError):
    """The session failed on something it got (a ``Fail`` a healthy run never causes)."""


def seeded_update(seed: int, worker_id: str, fragment_id: int, round_id: int,
                  names: tuple[str, ...], sizes: dict[str, int]) -> dict[str, torch.Tensor]:
    """The pseudo-gradient a light worker submits: seeded, in [-0.1, 0.1), float32."""
    total = sum(sizes[n] for n in names)
    digest = hashlib.blake2b(f"{seed}:{worker_id}:{fragment_id}:{round_id}".encode(),
                             digest_size=max(4 * total, 4)).digest()
    words = struct.unpack(f"<{total}I", digest[:4 * total])
    out: dict[str, torch.Tensor] = {}
    i = 0
    for n in names:
        k = sizes[n]
        out[n] = torch.tensor([(w / 4294967296.0 - 0.5) * 0.2 for w in words[i:i + k]], dtype=torch.float32)
        i += k
    return out


class SimWorker:
    """One incarnation of a worker process (a restart is a new incarnation with the same id)."""

    def __init__(self, world: WorkerWorld, worker_id: str, incarnation: int, link_delay_s: float,
                 speed: float, checkpoint: dict | None = None) -> None:
        self.world = world
        # The world's clock and its calls of every event, kept as attributes (the hot path).
        self.clock = world.clock
        self._schedule = world.clock.schedule
        self._emit = world.emit
        self._send = world.send
        self.wid = worker_id
        self.inc = incarnation
        self.link_delay_s = link_delay_s
        self.speed = speed
        self.straggle = 1.0
        self.peer = ""
        self.alive = True
        self.frozen = False
        #: The state last traced (the session's, or "frozen" / "dead").
        self.state = ""
        self._buffer: list = []
        self._deferred: list = []
        self.tokens = [0, 0]
        self.session = WorkerSession(worker_id, world.cfg.num_fragments, world.model.spec,
                                     coordinator_timeout_s=world.cfg.coordinator_timeout_s)
        self.params: dict[str, torch.Tensor] = {}
        #: The sparse wire (``--wire-dtype sparse``): its settings and the accumulator.
        self.acc = SimAccumulator(None if checkpoint is None else checkpoint.get("accumulator"))
        #: The checkpoint it last wrote (at a save stop, or at a sync point with ``worker_checkpoints``):
        #: a supervisor's restart resumes from it.
        self.checkpoint: dict | None = None
        self._stepping = False
        self._hb_due = 0.0
        self._mid = 0          # the message being handled: adopt records name it
        self._stop: Stop | None = None
        self._fail: Fail | None = None
        #: Collective plane: what ``CollectiveEndpoint`` does around the session (``collective.py``).
        self.plane: MemberPlane | None = world.endpoint(self)
        if checkpoint is not None and world.cfg.worker_checkpoints:
            self.checkpoint = checkpoint  # the file stays until this incarnation writes its own
        self._resumed = checkpoint is not None
        if checkpoint is not None:
            self.session.restore(**checkpoint["session"])
            self.params = dict(checkpoint["params"])
            if self.plane is not None:  # as DilocoWorker: the committed state is offered in the Join (C6)
                s = self.session
                self.plane.restore(self.params, list(s.round_ids), s.fragments)

    # ------------------------------------------------------------ plumbing

    def set_state(self, state: str) -> None:
        if state != self.state:
            self.state = state
            now = self.clock.now
            self._emit({"k": "worker", "t": now, "w": self.wid, "p": self.peer, "state": state},
                          f'{{"k":"worker","t":{now!r},"w":"{self.wid}","p":"{self.peer}","state":"{state}"}}')

    def arm(self, kind: int, delay_s: float) -> None:
        self.tokens[kind] += 1
        self._schedule(self.clock.now + delay_s, self._timer, (kind, self.tokens[kind]))

    def _arm_tick(self) -> None:
        s = self.session
        now = self.clock.now
        if s.state in _MEMBER:
            due = self._hb_due
            if due <= now:  # (a heartbeat the session did not send when due: ask again an interval on)
                due = now + s.heartbeat_interval_s + _HB_SLACK_S
        else:
            due = now + TICK_S
        self.arm(TICK, due - now)

    def later(self, delay_s: float, fn, arg) -> None:
        """Run ``fn(arg)`` in this process ``delay_s`` from now (not if it died; after a freeze ends)."""
        self._schedule(self.clock.now + delay_s, self._call, (fn, arg))

    def _call(self, item) -> None:
        if not self.alive:
            return
        if self.frozen:
            self._deferred.append(item)
            return
        fn, arg = item
        fn(arg)

    def _timer(self, arg: tuple[int, int]) -> None:
        if not self.alive:
            return
        if self.frozen:
            self._deferred.append(arg)
            return
        kind, token = arg
        if token != self.tokens[kind]:
            return
        now = self.clock.now
        if kind == TICK:
            # As CollectiveEndpoint.silence_s and .receiving: a withheld Welcome is the coordinator's
            # answer, on its way (M5).
            withheld = self.plane is not None and self.plane.machine.welcome_withheld
            self._run(self.session.tick(now, 0.0 if withheld else None, receiving=withheld))
            if self.alive:
                self._arm_tick()
        else:
            self._stepping = False
            self._run(self.session.step_done(now))

    # ------------------------------------------------------------ the session's actions

    def _run(self, actions: list) -> None:
        world = self.world
        for a in actions:
            typ = type(a)
            if typ is Send:
                msg = a.message
                if type(msg) is Heartbeat:
                    self._hb_due = self.clock.now + self.session.heartbeat_interval_s + _HB_SLACK_S
                if self.plane is not None:
                    self.plane.send(msg)
                else:
                    self._send(self, msg)
            elif typ is StateChanged:
                self.set_state(a.state.value)
                if a.state not in _MEMBER:
                    if self.alive:
                        self._arm_tick()  # joining or stopping: tick at the finer period now
                elif a.previous is WorkerState.JOINING:
                    # A Welcome restarts the heartbeat clock (W3).
                    self._hb_due = self.clock.now + self.session.heartbeat_interval_s + _HB_SLACK_S
                    self._arm_tick()
            elif typ is SubmitFragment:
                if world.cfg.worker_checkpoints:
                    self._write_checkpoint()  # at the sync point, as ``--checkpoint-every 1``
                fid, rid = a.fragment_id, a.round_id
                tensors = seeded_update(world.cfg.seed, self.wid, fid, rid, self.session.fragments[fid],
                                        world.model.sizes)
                # Tokens: the inner steps of its round (H_w under DyLU), for a token-weighted merge.
                if self.acc.wire is not None:
                    submit = self.acc.submit(self.wid, fid, rid, tensors, self.session.sync_every)
                else:
                    submit = Submit(self.wid, fid, rid, tensors, tokens=self.session.sync_every)
                if self.plane is not None:
                    self.plane.send(submit)
                else:
                    self._send(self, submit)
            elif typ is InstallParams:
                self._install(a)
            elif typ is SendJoinWithParams:
                model = world.model
                if self.plane is not None:
                    # As DilocoWorker: the model's params (here, what it last installed, if all of it).
                    params = self.params if set(self.params) == set(model.params) else model.params
                    self.plane.send(Join(self.wid, PROTOCOL_VERSION, model.spec, dict(params)))
                else:
                    self._send(self, Join(self.wid, PROTOCOL_VERSION, model.spec, model.params))
            elif typ is Stop:
                self._stop = a
            elif typ is Fail:
                self._fail = a
            # OutageReport and Note: log lines; nothing to do.
        if self._stop is not None:
            self._stopped()
        elif self._fail is not None:
            self._failed()
        elif self.alive and not self._stepping and self.session.may_train:
            self._stepping = True
            self.arm(TRAIN, world.segment_time(self))

    def _install(self, a: InstallParams) -> None:
        params = a.params
        names = a.names
        if isinstance(params, compression.DeltaParams):  # a sparse Result: its payloads on this copy
            params = params.resolve(self.params, names, f"{self.wid}: the Result for fragment {a.fragment_id}")
        for n in names:
            self.params[n] = params[n]
        if self.plane is not None:
            return  # collective: the replica's changes are traced (collective.py), not their copies
        h = hash_values((n, params[n].tolist()) for n in names)
        now, mid, fid = self.clock.now, self._mid, a.fragment_id
        self._emit({"k": "adopt", "t": now, "w": self.wid, "m": mid, "f": fid, "h": h},
                      f'{{"k":"adopt","t":{now!r},"w":"{self.wid}","m":{mid},"f":{fid},"h":"{h}"}}')

    def _stopped(self) -> None:
        stop, self._stop = self._stop, None
        s = self.session
        now = self.clock.now
        if stop.save:
            self._write_checkpoint()
        self._run(s.stopped_done(now))
        self._run(s.leave(now))  # as run_training does on its way out: Leave, unless the run ended it
        self._exit(notice=False)
        if stop.reason == "coordinator_unreachable":
            self.world.exited(self, "coordinator_unreachable")

    def _write_checkpoint(self) -> None:
        """``DilocoWorker.save_checkpoint``: nothing while the round labels do not name the global copy
        (a Result held for its overlap window; a collective start state no commit confirmed: W18,
        M10), else the labels and the params together, traced as a ``ckpt`` record."""
        s = self.session
        model = self.world.model
        if s.held or (self.plane is not None and not self.plane.state_confirmed):
            return
        if not s.fragments or set(self.params) != set(model.params):
            return  # nothing installed yet: no state to write
        self.checkpoint = {
            "session": dict(fragments=s.fragments, round_ids=list(s.round_ids), next_close=list(s.next_close),
                            sched_step=s.sched_step, inner_step=s.inner_step, rounds_synced=s.rounds_synced,
                            mode=s.mode),
            "params": dict(self.params),
            "accumulator": self.acc.saved(),
        }
        rec = {"k": "ckpt", "t": self.clock.now, "w": self.wid, "r": list(s.round_ids),
               "h": [hash_values((n, self.params[n].tolist()) for n in names) for names in s.fragments]}
        if self.world.cfg.sparse:
            rec["p"] = self.peer  # whose accumulator it holds
        self._emit(rec)

    def _failed(self) -> None:
        fail, self._fail = self._fail, None
        self._exit(notice=False)
        if fail.code not in RESTARTABLE_FAILS and not (self.plane is not None and fail.code == _HEAL_FAILED):
            raise SimWorkerFailure(f"{self.wid} failed ({fail.code}): {fail.detail}")
        # A join refused for a reason that passes (the run is full), or a joiner that could not
        # heal after COLLECTIVE_HEAL_ATTEMPTS tries: the process exits with an error, and its
        # supervisor starts it again.
        self.world.exited(self, fail.code)

    def _exit(self, *, notice: bool) -> None:
        self.tokens[TICK] += 1
        self.tokens[TRAIN] += 1
        self.alive = False
        self.frozen = False
        self._buffer = []
        self._deferred = []
        if self.plane is not None:
            self.plane.close()
        self.world.close_connection(self, notice=notice)

    # ------------------------------------------------------------ lifecycle (the simulation's calls)

    def start(self) -> None:
        self.world.open_connection(self)
        if self.world.cfg.sparse:
            # The checker follows each incarnation's accumulator: restored from its checkpoint, or empty.
            self._emit({"k": "acc", "t": self.clock.now, "w": self.wid, "p": self.peer, "resume": self._resumed})
        self._run(self.session.start(self.clock.now))
        if self.alive:
            self._arm_tick()

    def crash(self) -> None:
        self.set_state(WorkerState.DEAD.value)
        self._exit(notice=True)

    def leave(self) -> None:
        """The process is asked to stop (SIGTERM): the session stops, and leaves on the way out."""
        self._run(self.session.request_stop(self.clock.now))

    def freeze(self) -> None:
        self.frozen = True
        self.set_state(WorkerState.FROZEN.value)

    def thaw(self) -> None:
        if not self.frozen:
            return
        self.frozen = False
        self.set_state(self.session.state.value)
        buffered, self._buffer = self._buffer, []
        deferred, self._deferred = self._deferred, []
        for mid, peer, src, message in buffered:
            if not self.alive or peer != self.peer:
                self.world.record_drop(mid, src, peer, message, "closed")
                continue
            self.world.record_recv(mid, src, peer, message)
            self.on_message(mid, message)
        for arg in deferred:
            if len(arg) == 2 and callable(arg[0]):
                self._call(arg)
            else:
                self._timer(arg)

    def buffer(self, mid: int, peer: str, src: str, message) -> None:
        self._buffer.append((mid, peer, src, message))

    def on_message(self, mid: int, msg) -> None:
        self._mid = mid
        if self.plane is None:
            msg = compression.mark_delta(msg, self.acc.wire)  # a delta Result is decoded at install
            actions = self.session.on_message(msg, self.clock.now)
            if type(msg) is Welcome and any(type(a) is InstallParams for a in actions):
                self.acc.adopt(msg)  # with the Welcome the session took, before its actions
            self._run(actions)
            return
        for item in self.plane.incoming(msg, mid):
            if not self.alive:
                return
            self._run(self.session.on_message(item, self.clock.now))

    def deliver_local(self, msg, mid: int | None = None) -> None:
        """A message the collective plane hands the session (a healed Welcome, a commit's Result)."""
        if not self.alive:
            return
        if mid is not None:
            self._mid = mid
        self._run(self.session.on_message(msg, self.clock.now))
