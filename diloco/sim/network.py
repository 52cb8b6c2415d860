"""The simulated network: links, FIFO delays, partitions, drops and ``peer_lost`` notices.

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

``Network`` owns the links, the message ids, the partitions (which the fault injector
sets and heals) and every ``send``/``recv``/``drop`` record. It gets the clock, the
run's random stream, the trace and the stats in its constructor, and reaches the
coordinator only through ``world.CoordinatorPort``: a delivered message becomes one
coordinator step there, whose sends come back through ``send_to_worker``. It also owns
how messages look on the wire and in the trace: ``_encode`` (a message's fields,
``h``/``v`` for tensors) and ``freeze`` (the copy of the tensors a coordinator message
carries).
"""

from __future__ import annotations

from math import log as _log
from typing import TYPE_CHECKING

from diloco.sim.config import MAX_LINK_DELAY_S
from diloco.sim.trace import hash_values
import dataclasses

from diloco.wire.messages import (
    Accepted,
    AdminReply,
    AdminRequest,
    Error,
    HealOrder,
    Heartbeat,
    HeartbeatReply,
    Join,
    Leave,
    ReduceAbort,
    ReduceOrder,
    ReduceReport,
    Result,
    Submit,
    Welcome,
)

if TYPE_CHECKING:  # pragma: no cover
    import random
    from typing import Callable

    from diloco.sim.stats import SimStats
    from diloco.sim.worker import SimWorker
    from diloco.sim.world import Clock, CoordinatorPort

COORDINATOR = "coordinator"
ADMIN = "admin"
_JSON_BOOL = {True: "true", False: "false"}


def _tensor_fields_frozen(tensors: dict) -> dict:
    return {n: t.detach().clone() for n, t in tensors.items()}


class Network:
    """The links between the worker processes and the coordinator."""

    def __init__(self, clock: Clock, rng: random.Random, *, jitter: float, peer_lost_p: float, stats: SimStats,
                 emit: Callable[..., None], port: CoordinatorPort) -> None:
        self._clock = clock
        # Bound methods kept as attributes: the hot path calls them once or more per event.
        self._schedule = clock.schedule
        self._random = rng.random
        self._jitter = jitter
        self._peer_lost_p = peer_lost_p
        self.stats = stats
        self.emit = emit
        self._port = port
        self._step_coord = port.step
        self._mid = 0
        #: peer -> the "not before" delivery time of each direction of its link (FIFO).
        self._up_last: dict[str, float] = {}
        self._down_last: dict[str, float] = {}
        #: worker id -> how many partitions it is in now.
        self._partitioned: dict[str, int] = {}
        self.peers: dict[str, SimWorker] = {}
        self._peer_wid: dict[str, str] = {}
        self._peer_delay: dict[str, float] = {}

    # ------------------------------------------------------------------ connections

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
            if notice and self._random() < self._peer_lost_p:
                t = max(self._clock.now + w.link_delay_s, self._up_last.get(peer, 0.0))
                self._up_last[peer] = t
                self._schedule(t, self._peer_lost, peer)

    # ------------------------------------------------------------------ partitions (the fault injector's)

    def partition(self, wids: list[str]) -> None:
        """Cut ``wids`` off the coordinator (partitions nest: each heals on its own)."""
        for wid in wids:
            self._partitioned[wid] = self._partitioned.get(wid, 0) + 1

    def heal_partition(self, wids: list[str]) -> list[str]:
        """End one partition of ``wids``; returns those it reconnects (in no other partition)."""
        healed = []
        for wid in wids:
            n = self._partitioned.get(wid, 0)
            if n > 1:
                self._partitioned[wid] = n - 1
            elif n == 1:
                del self._partitioned[wid]
                healed.append(wid)
        return healed

    def heal_all_partitions(self) -> list[str]:
        """End every partition; returns the worker ids that were cut off."""
        healed = [wid for wid, n in self._partitioned.items() if n]
        self._partitioned.clear()
        return healed

    # ------------------------------------------------------------------ worker -> coordinator

    def _delay(self, base: float) -> float:
        # base + exponential jitter with mean jitter * base (random.expovariate, inlined), capped.
        d = base - _log(1.0 - self._random()) * self._jitter * base
        return d if d < MAX_LINK_DELAY_S else MAX_LINK_DELAY_S

    def send_from_worker(self, w: SimWorker, msg, lose: str = "") -> None:
        """Hand a worker's message to the network. It is traced when delivered (``recv``, with
        its fields and ``ts``, the send time) or lost (``drop``, the same fields). ``lose``: an
        injected fault loses it (the ``drop`` record's ``why``)."""
        self._mid += 1
        mid = self._mid
        peer = w.peer
        now = self._clock.now
        self.stats.messages_sent += 1
        if lose:
            self._drop_from_worker(mid, peer, msg, now, lose)
            return
        if self._partitioned and self._partitioned.get(w.wid):
            self._drop_from_worker(mid, peer, msg, now, "partition")
            return
        t = now + self._delay(w.link_delay_s)
        last = self._up_last.get(peer, 0.0)
        if t < last:
            t = last
        self._up_last[peer] = t
        self._schedule(t, self._deliver_to_coord, (mid, peer, msg, now))

    def _drop_from_worker(self, mid: int, peer: str, msg, sent_s: float, why: str) -> None:
        self.stats.messages_dropped += 1
        rec = {"k": "drop", "t": self._clock.now, "m": mid, "src": peer, "dst": COORDINATOR, "ts": sent_s,
               "why": why}
        rec.update(_encode(msg))
        self.emit(rec)

    def _deliver_to_coord(self, arg) -> None:
        mid, peer, msg, sent_s = arg
        if self._partitioned and self._partitioned.get(self._peer_wid[peer]):
            self._drop_from_worker(mid, peer, msg, sent_s, "partition")
            return
        coord = self._port.coord
        if coord is None:
            self._drop_from_worker(mid, peer, msg, sent_s, "coordinator down")
            return
        self.stats.messages_delivered += 1
        now = self._clock.now
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
        self._step_coord(header, coord.handle, peer, msg, now, line=line)

    def _peer_lost(self, peer: str) -> None:
        coord = self._port.coord
        if coord is None or self._partitioned.get(self._peer_wid[peer]):
            return
        now = self._clock.now
        self._step_coord({"k": "lost", "t": now, "peer": peer}, coord.peer_lost, peer, now)

    # ------------------------------------------------------------------ coordinator -> worker

    def send_admin_reply(self, step: int, msg) -> None:
        """Trace the coordinator's reply to an admin command (the admin channel has no link)."""
        self._mid += 1
        rec = {"k": "send", "t": self._clock.now, "s": step, "m": self._mid, "src": COORDINATOR, "dst": ADMIN}
        rec.update(_encode(msg))
        self.emit(rec)

    def send_to_worker(self, peer: str, msg, fields: dict | None, step: int) -> None:
        """Trace a coordinator message of step ``step`` (``fields``: its record, from ``freeze``) and send it."""
        self._mid += 1
        mid = self._mid
        now = self._clock.now
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
            self._transmit(peer, mid, msg, now)
            return
        rec = {"k": "send", "t": now, "s": step, "m": mid, "src": COORDINATOR, "dst": peer}
        rec.update(fields)
        if typ is Accepted:
            self.emit(rec, f'{head}"type":"Accepted","fragment_id":{msg.fragment_id},"round_id":{msg.round_id}}}')
        elif typ is Result and not msg.digest:
            self.emit(rec, f'{head}"type":"Result","fragment_id":{msg.fragment_id},"round_id":{msg.round_id},'
                           f'"outcome":"{msg.outcome}","next_round_id":{msg.next_round_id},"h":"{fields["h"]}"}}')
        else:
            self.emit(rec)
        self._transmit(peer, mid, msg, now)

    def _transmit(self, peer: str, mid: int, msg, now: float) -> None:
        self.stats.messages_sent += 1
        wid = self._peer_wid.get(peer)
        if wid is None or (self._partitioned and self._partitioned.get(wid)):
            self.record_drop(mid, COORDINATOR, peer, msg, "partition" if wid else "unknown peer")
            return
        t = now + self._delay(self._peer_delay[peer])
        last = self._down_last.get(peer, 0.0)
        if t < last:
            t = last
        self._down_last[peer] = t
        self._schedule(t, self._deliver_to_worker, (mid, peer, wid, msg))

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

    def record_drop(self, mid: int, src: str, dst: str, msg, why: str) -> None:
        self.stats.messages_dropped += 1
        self.emit({"k": "drop", "t": self._clock.now, "m": mid, "src": src, "dst": dst, "type": type(msg).__name__,
                   "why": why})

    def record_recv(self, mid: int, src: str, dst: str, msg) -> None:
        self.stats.messages_delivered += 1
        now = self._clock.now
        typ = type(msg).__name__
        self.emit({"k": "recv", "t": now, "m": mid, "src": src, "dst": dst, "type": typ},
                  f'{{"k":"recv","t":{now!r},"m":{mid},"src":"{src}","dst":"{dst}","type":"{typ}"}}')


def freeze(msg, cache: dict):
    """Copy the tensors a coordinator message carries, as the wire would (the coordinator's are live).

    Returns the copy and its trace fields; ``cache`` shares one copy among the sends of one step.
    """
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
        # (A sparse Result keeps its wire fields: its params are the round's payloads, which the
        # worker adds to its copy; the coordinator's step traces the params they resolve to.)
        msg = dataclasses.replace(msg, params=frozen, scales=_tensor_fields_frozen(msg.scales)) if msg.delta \
            else Result(msg.fragment_id, msg.round_id, msg.outcome, msg.next_round_id, frozen)
        return msg, {"type": "Result", "fragment_id": msg.fragment_id, "round_id": msg.round_id,
                     "outcome": msg.outcome, "next_round_id": msg.next_round_id, "h": h}
    if typ is Welcome:
        if msg.data_plane == "collective":
            return msg, _encode(msg)  # no params: the joiner heals from a member (SPEC.md C6)
        frozen = _tensor_fields_frozen(msg.params)
        values = {n: t.tolist() for n, t in frozen.items()}
        hf = [hash_values((n, values[n]) for n in names) for names in msg.fragments]
        msg = dataclasses.replace(msg, params=frozen)
        rec = _encode(msg)
        rec["hf"] = hf
        return msg, rec
    return msg, _encode(msg)


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
        rec = {"type": "Submit", "worker_id": msg.worker_id, "fragment_id": msg.fragment_id,
               "round_id": msg.round_id, "h": hash_values(v.items()), "v": v}
        if msg.wire_dtype != "fp32":
            # A sparse payload: ``v`` holds its entries (``place << 2 | code``), ``sc`` its chunk scales.
            rec.update(wire_dtype=msg.wire_dtype, sc=_values(msg.scales))
        return rec
    if typ is Accepted:
        return {"type": "Accepted", "fragment_id": msg.fragment_id, "round_id": msg.round_id}
    if typ is Result:
        h = hash_values((n, t.tolist()) for n, t in msg.params.items()) if msg.params else ""
        rec = {"type": "Result", "fragment_id": msg.fragment_id, "round_id": msg.round_id,
               "outcome": msg.outcome, "next_round_id": msg.next_round_id, "h": h}
        if msg.digest:
            rec["digest"] = msg.digest
        return rec
    if typ is Error:
        code = msg.code.value if hasattr(msg.code, "value") else str(msg.code)
        return {"type": "Error", "code": code, "detail": msg.detail, "in_reply_to": msg.in_reply_to}
    if typ is Join:
        v = _values(msg.params)
        rec = {"type": "Join", "worker_id": msg.worker_id, "protocol_version": msg.protocol_version,
               "spec": [[s.name, list(s.shape), s.dtype] for s in msg.spec], "h": hash_values(v.items()), "v": v}
        if msg.holds_params:
            rec["holds_params"] = True
            if msg.held_rounds:
                rec["held_rounds"] = list(msg.held_rounds)
                rec["held_digests"] = list(msg.held_digests)
        return rec
    if typ is Welcome:
        rec = {"type": "Welcome", "worker_id": msg.worker_id, "round_ids": list(msg.round_ids),
               "parked": [list(p) for p in msg.parked], "mode": msg.mode,
               "fragments": [list(f) for f in msg.fragments], "min_workers": msg.min_workers,
               "below_min_workers": msg.below_min_workers, "heartbeat_interval_s": msg.heartbeat_interval_s}
        if msg.data_plane == "collective":
            rec.update(data_plane=msg.data_plane, heal_source=msg.heal_source, heal_prefix=msg.heal_prefix,
                       committed=[list(c) for c in msg.committed])
        return rec
    if typ is ReduceOrder:
        return {"type": "ReduceOrder", "fragment_id": msg.fragment_id, "round_id": msg.round_id,
                "attempt": msg.attempt, "group": list(msg.group), "prefix": msg.prefix}
    if typ is ReduceReport:
        return {"type": "ReduceReport", "worker_id": msg.worker_id, "fragment_id": msg.fragment_id,
                "round_id": msg.round_id, "attempt": msg.attempt, "ok": msg.ok, "digest": msg.digest,
                "detail": msg.detail}
    if typ is ReduceAbort:
        return {"type": "ReduceAbort", "fragment_id": msg.fragment_id, "round_id": msg.round_id,
                "attempt": msg.attempt, "reason": msg.reason}
    if typ is HealOrder:
        return {"type": "HealOrder", "joiner": msg.joiner, "prefix": msg.prefix}
    if typ is Leave:
        return {"type": "Leave", "worker_id": msg.worker_id}
    if typ is AdminReply:
        return {"type": "AdminReply", "ok": msg.ok, "error": msg.error}
    if typ is AdminRequest:
        return {"type": "AdminRequest", "command": msg.command, "args": dict(msg.args)}
    raise TypeError(f"cannot encode {typ.__name__}")
