"""A light worker: the real wire protocol, no training.

Its "model" is a handful of small float32 tensors. A training segment is a
timer; the pseudo-gradient it submits for (fragment, round) is a seeded
function of (seed, worker id, fragment, round), so a run's numbers depend on
the seed alone. Everything else follows the worker's contract:

* joins with ``Join`` (its initial params, used only by a run that has none);
  a missing ``Welcome`` is retried on a new connection after ``join_timeout_s``;
* heartbeats every ``heartbeat_interval_s`` (a background thread in the real
  worker, so it keeps going while training or waiting) and obeys the reply's
  command: ``stop``/``save_and_stop`` stop, ``rejoin`` re-joins;
* trains one fragment per segment (sync: always the fragment whose open round
  comes first in the streaming order ``(round, fragment)``, which is the order
  every member goes through, so no two members can wait on each other; async:
  fragments in turn), then reaches its *sync point* and submits, as
  ``diloco.worker`` does;
* waits there for the ``Result`` of every contribution it has pending
  (including the ones ``Welcome.parked`` names, SPEC.md P2) before training
  again, *paused* while heartbeat replies say ``below_min_workers`` (SPEC.md
  R10); ``applied`` installs the fragment's new params, ``applied_final``
  installs them and stops, ``stop`` stops;
* ``duplicate`` means its contribution is already pending: it keeps waiting;
  ``held_limit`` (async, below quorum): it submits again a heartbeat interval
  later; ``stale_round``, ``future_round``, ``unknown_worker``: it re-joins on
  a new connection, which fetches fresh params;
* a wait longer than ``wait_timeout_s`` (its ``Result`` was lost to a
  partition) makes it ``Leave`` and join again on the same connection, like
  ``diloco.worker``'s resync: the Welcome parks it on a contribution still
  pending (P1) or brings the new params.

Frozen workers (a SIGSTOP'd process) neither send nor handle anything; what
arrives meanwhile is handled, in order, when they thaw.
"""

from __future__ import annotations

import hashlib
import struct
from typing import TYPE_CHECKING

import torch

from diloco.transport.messages import (
    PROTOCOL_VERSION,
    Accepted,
    Command,
    Error,
    Heartbeat,
    HeartbeatReply,
    Join,
    Leave,
    Result,
    Submit,
    Welcome,
)
from diloco.sim.trace import hash_values

if TYPE_CHECKING:  # pragma: no cover
    from diloco.sim.simulation import Simulation

# Timer kinds (indexes into SimWorker.tokens).
HB, TRAIN, JOIN, WAIT = 0, 1, 2, 3

_STOP_COMMANDS = (Command.STOP, Command.SAVE_AND_STOP)


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

    def __init__(self, sim: "Simulation", worker_id: str, incarnation: int, link_delay_s: float,
                 speed: float) -> None:
        self.sim = sim
        self.wid = worker_id
        self.inc = incarnation
        self.link_delay_s = link_delay_s
        self.speed = speed
        self.straggle = 1.0
        self.conn = 0
        self.peer = ""
        self.alive = True
        self.frozen = False
        self.state = ""
        self._state_before_freeze = ""
        self._buffer: list = []
        self._deferred: list = []
        self.tokens = [0, 0, 0, 0]
        self.params: dict[str, torch.Tensor] = {}
        self.fragments: tuple[tuple[str, ...], ...] = ()
        self.rounds: list[int] = []
        self.below = True
        self.hb_interval_s = sim.cfg.heartbeat_interval_s
        #: (fragment_id, round_id) -> True: contributions whose Result we wait for.
        self.waits: dict[tuple[int, int], bool] = {}
        #: The segment being trained or held at the sync point: (fragment_id, round_id).
        self.current: tuple[int, int] | None = None
        self.next_fragment = 0
        self.segments = 0

    # ------------------------------------------------------------ plumbing

    def set_state(self, state: str) -> None:
        if state != self.state:
            self.state = state
            now = self.sim.now
            self.sim.emit({"k": "worker", "t": now, "w": self.wid, "p": self.peer, "state": state},
                          f'{{"k":"worker","t":{now!r},"w":"{self.wid}","p":"{self.peer}","state":"{state}"}}')

    def arm(self, kind: int, delay_s: float) -> None:
        self.tokens[kind] += 1
        self.sim.schedule(self.sim.now + delay_s, self._timer, (kind, self.tokens[kind]))

    def cancel(self, kind: int) -> None:
        self.tokens[kind] += 1

    def _cancel_all(self) -> None:
        t = self.tokens
        t[0] += 1
        t[1] += 1
        t[2] += 1
        t[3] += 1

    def _timer(self, arg: tuple[int, int]) -> None:
        if not self.alive:
            return
        if self.frozen:
            self._deferred.append(arg)
            return
        kind, token = arg
        if token != self.tokens[kind]:
            return
        if kind == HB:
            self.sim.send_from_worker(self, Heartbeat(self.wid))
            self.arm(HB, self.hb_interval_s)
        elif kind == TRAIN:
            self._sync_point()
        elif kind == JOIN:
            if self.state == "joining":
                self.rejoin(new_connection=True)
        elif kind == WAIT:
            if self.waits:
                # A lost Result: leave and join again (diloco.worker's resync).
                self.sim.send_from_worker(self, Leave(self.wid))
                self.rejoin(new_connection=False)

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self.sim.open_connection(self)
        self._send_join()

    def _send_join(self) -> None:
        self._cancel_all()
        self.waits = {}
        self.current = None
        self.set_state("joining")
        # Light workers always send their (tiny) params, so no params_required round trip:
        # the coordinator uses the first join's and drops the rest on arrival (SPEC.md
        # section 11, "Joining"); the checker reads the run's params off the first Join.
        init = self.sim.initial_params
        self.sim.send_from_worker(self, Join(self.wid, PROTOCOL_VERSION, self.sim.param_spec, init))
        self.arm(JOIN, self.sim.cfg.join_timeout_s)

    def rejoin(self, new_connection: bool) -> None:
        if new_connection:
            self.sim.open_connection(self)
        self._send_join()

    def stop(self) -> None:
        self._cancel_all()
        self.waits = {}
        self.set_state("stopped")
        self.alive = False
        self.sim.close_connection(self, notice=False)

    def crash(self) -> None:
        self._cancel_all()
        self.set_state("dead")
        self.alive = False
        self.frozen = False
        self._buffer = []
        self._deferred = []
        self.sim.close_connection(self, notice=True)

    def leave(self) -> None:
        self.sim.send_from_worker(self, Leave(self.wid))
        self.stop()

    def freeze(self) -> None:
        self.frozen = True
        self._state_before_freeze = self.state
        self.set_state("frozen")

    def thaw(self) -> None:
        if not self.frozen:
            return
        self.frozen = False
        self.set_state(self._state_before_freeze)
        buffered, self._buffer = self._buffer, []
        deferred, self._deferred = self._deferred, []
        for mid, peer, src, message in buffered:
            if not self.alive or peer != self.peer:
                self.sim.record_drop(mid, src, peer, message, "closed")
                continue
            self.sim.record_recv(mid, src, peer, message)
            self.on_message(mid, message)
        for arg in deferred:
            self._timer(arg)

    def buffer(self, mid: int, peer: str, src: str, message) -> None:
        self._buffer.append((mid, peer, src, message))

    # ------------------------------------------------------------ the protocol

    def on_message(self, mid: int, msg) -> None:
        typ = type(msg)
        if typ is HeartbeatReply:
            self._on_heartbeat_reply(msg)
        elif typ is Result:
            self._on_result(mid, msg)
        elif typ is Accepted:
            if (msg.fragment_id, msg.round_id) in self.waits:
                self.arm(WAIT, self.sim.cfg.wait_timeout_s)
        elif typ is Welcome:
            self._on_welcome(mid, msg)
        elif typ is Error:
            self._on_error(msg)

    def _on_welcome(self, mid: int, msg: Welcome) -> None:
        if self.state != "joining":
            return
        self.cancel(JOIN)
        self.fragments = msg.fragments
        self.params = dict(msg.params)
        self.rounds = list(msg.round_ids)
        self.below = msg.below_min_workers
        self.hb_interval_s = msg.heartbeat_interval_s
        for fid in range(len(self.fragments)):
            self._adopted(mid, fid)
        self.arm(HB, self.hb_interval_s)
        self.waits = {(f, r): True for f, r in msg.parked}
        if self.waits:
            self.set_state("paused" if self.below else "waiting")
            self.arm(WAIT, self.sim.cfg.wait_timeout_s)
        else:
            self._begin_segment()

    def _adopted(self, mid: int, fid: int) -> None:
        params = self.params
        names = self.fragments[fid]
        h = hash_values((n, params[n].tolist()) for n in names)
        now = self.sim.now
        self.sim.emit({"k": "adopt", "t": now, "w": self.wid, "m": mid, "f": fid, "h": h},
                      f'{{"k":"adopt","t":{now!r},"w":"{self.wid}","m":{mid},"f":{fid},"h":"{h}"}}')

    def _begin_segment(self) -> None:
        nfrag = len(self.fragments)
        if self.sim.sync:
            rounds = self.rounds
            fid = 0
            for f in range(1, nfrag):
                if rounds[f] < rounds[fid]:
                    fid = f
        else:
            fid = self.next_fragment % nfrag
            self.next_fragment = fid + 1
        self.current = (fid, self.rounds[fid])
        self.segments += 1
        self.set_state("training")
        self.arm(TRAIN, self.sim.segment_time(self))

    def _sync_point(self) -> None:
        self._submit()

    def _submit(self) -> None:
        assert self.current is not None
        fid, rid = self.current
        names = self.fragments[fid]
        tensors = seeded_update(self.sim.cfg.seed, self.wid, fid, rid, names, self.sim.param_sizes)
        self.sim.send_from_worker(self, Submit(self.wid, fid, rid, tensors))
        self.waits[(fid, rid)] = True
        self.set_state("paused" if self.below else "waiting")
        self.arm(WAIT, self.sim.cfg.wait_timeout_s)

    def _on_result(self, mid: int, msg: Result) -> None:
        key = (msg.fragment_id, msg.round_id)
        if key not in self.waits:
            return
        del self.waits[key]
        outcome = msg.outcome
        if outcome == "stop":
            self.stop()
            return
        fid = msg.fragment_id
        for name, t in msg.params.items():
            self.params[name] = t
        self.rounds[fid] = msg.next_round_id
        self._adopted(mid, fid)
        if outcome == "applied_final":
            self.stop()
        elif not self.waits:
            self.cancel(WAIT)
            self._begin_segment()

    def _on_heartbeat_reply(self, msg: HeartbeatReply) -> None:
        if self.state == "joining":
            return
        command = msg.command
        if command in _STOP_COMMANDS:
            self.stop()
            return
        if command is Command.REJOIN:
            # The coordinator forgot us (declared dead, kicked, or it restarted).
            self.rejoin(new_connection=False)
            return
        self.below = msg.below_min_workers
        if self.waits:
            # SPEC.md R10: idle at the sync point while below quorum, polling for a stop.
            self.set_state("paused" if self.below else "waiting")

    def _on_error(self, msg: Error) -> None:
        code = msg.code.value if hasattr(msg.code, "value") else str(msg.code)
        if code == "stopped":
            self.stop()
            return
        what = msg.in_reply_to
        if what == "Join":
            if self.state != "joining":
                return
            if code == "shutting_down":
                self.stop()
            elif code == "already_member":
                self.rejoin(new_connection=True)
            # too_many_workers and the rest: the join timer retries.
        elif what == "Submit":
            if not self.waits or self.state == "joining":
                return
            if code == "duplicate":
                return  # it is already pending: keep waiting for its Result
            if code == "held_limit" and self.current is not None:
                # Async, below quorum, the fragment holds max_held_per_fragment: submit again later.
                self.waits.pop(self.current, None)
                self.cancel(WAIT)
                self.arm(TRAIN, self.hb_interval_s)
                return
            self.rejoin(new_connection=True)
