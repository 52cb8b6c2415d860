"""The coordinator's ROUTER: frames in from many peers, frames out to one.

A ROUTER prepends the sender's routing id, which is how the coordinator
names peers. Every worker process picks a unique routing id (worker id,
host, pid, random suffix), so a restarted worker is a new peer and the
coordinator can tell it from a duplicated message (SPEC.md R6).

This layer moves a message's frames as parts (``framing``), bounds what a
peer may make it hold, watches connections and finds lost peers. It never
decodes a frame: ``diloco.wire.zmq`` turns frames into messages and answers
what it refuses.

libzmq takes at most ``router_sndhwm`` parts per peer. What does not fit --
the rest of a message of more parts (a Result for a model of many tensors),
or messages for a slow reader (a worker behind a slow link) -- waits in that
peer's ``framing.Outbox``, in order, and is handed over as libzmq's queue
drains: on every ``send`` and ``recv`` (which polls every few milliseconds
while anything waits), so the owner's loop must keep calling ``recv``, as the
coordinator's does. Only a message for a peer that already has
``router_sndhwm`` parts waiting behind the message in progress (it stopped
reading) is dropped.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any

import zmq

from diloco.transport.base import TransportClosed, TransportError
from diloco.transport.zmq import framing, tags
from diloco.transport.zmq.auth import KeyIdentity, ServerAuth
from diloco.transport.zmq.outbox import Outbox, PartSizer
from diloco.transport.zmq.options import ZmqOptions, close_socket, peer_name, routing_id_of, set_option

log = logging.getLogger("diloco.transport.zmq")


@dataclass(frozen=True, slots=True)
class Arrival:
    """What came from one peer: a whole message's frames (``framing.Complete``) or a refusal to answer.

    ``identity`` is the sender's key when the router authenticates, else None.
    """

    peer: str
    got: framing.Complete | framing.Refused
    identity: KeyIdentity | None = None


def _median(values) -> int | None:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else None


class FrameRouter:
    """A bound ROUTER socket, optionally a CURVE server.

    With ``auth`` only the auth directory's keys connect (a ZAP authenticator
    on this router's own context), every arrival carries its sender's
    ``KeyIdentity``, and routing ids cannot be taken over (no
    ``ROUTER_HANDOVER``: a second connection claiming a live peer's routing
    id is refused by libzmq).
    """

    #: While parts wait for a peer, ``recv`` polls in slices this long to hand them over.
    _PUMP_SLICE_S = 0.005

    def __init__(self, bind: str, *, options: ZmqOptions | None = None, monitor: bool = True,
                 auth: ServerAuth | None = None, coalescer: framing.Coalescer | None = None) -> None:
        self.options = o = options or ZmqOptions()
        self.auth = auth
        self._ctx = zmq.Context(io_threads=o.io_threads)
        self._authenticator = None
        self._sock = self._ctx.socket(zmq.ROUTER)
        set_option(self._sock, zmq.LINGER, 0)
        set_option(self._sock, zmq.ROUTER_MANDATORY, 1)  # an unknown peer raises instead of vanishing silently
        # Without auth a reconnecting worker takes its routing id back at once. With auth a
        # routing id must never move to another key's connection: the old connection has to
        # close first (libzmq notices within zmtp_heartbeat_timeout_ms) and the worker
        # reconnects on its own.
        set_option(self._sock, zmq.ROUTER_HANDOVER, 0 if auth is not None else 1)
        set_option(self._sock, zmq.SNDHWM, o.router_sndhwm)
        # No receive limit: libzmq must never stop reading a peer's connection. libzmq 4.3.5 (the
        # newest release, bundled by every pyzmq wheel up to 27.3; its master is the same) aborts
        # the whole process with "Assertion failed: !_io_error (src/stream_engine_base.cpp:310)"
        # when a connection whose input it paused (its queue at RCVHWM) is closed by the peer: the
        # hang-up marks the engine failed without tearing it down, and the next ZMTP heartbeat
        # (HEARTBEAT_IVL) or a PING still in its read buffer writes to it (libzmq issue 4841).
        # With RCVHWM 16, one DEALER that sent 17 messages and closed while the ROUTER read nothing
        # for 3 s was enough (16 were not); so were 1,100 peers flooding parts at a coordinator.
        # With RCVHWM 0 no connection is ever paused. What the endpoint holds is bounded as parts
        # arrive (``framing.Assembler``); what a peer sends faster than ``recv`` reads waits in
        # libzmq (SPEC.md section 11, "Limits").
        set_option(self._sock, zmq.RCVHWM, 0)
        set_option(self._sock, zmq.MAXMSGSIZE, o.max_frame_bytes)
        set_option(self._sock, zmq.HEARTBEAT_IVL, o.zmtp_heartbeat_ivl_ms)
        set_option(self._sock, zmq.HEARTBEAT_TIMEOUT, o.zmtp_heartbeat_timeout_ms)
        #: routing id -> when it last sent something: the peers a probe checks (``lost_peers``).
        self._heard: dict[bytes, float] = {}
        #: When to probe for peers whose connection closed (a disconnect seen, plus the grace).
        self._probe_at: float | None = None
        self._monitor = None
        try:
            if auth is not None:
                self._authenticator = auth.start_authenticator(self._ctx)
                auth.apply(self._sock)
            if monitor:
                # libzmq's I/O thread sends monitor events *blocking*: once about 2,000 are unread
                # (the default limits of both ends: 1,000 connections opened and closed) it stops,
                # and with it every connection's reads, writes and ZMTP heartbeats, and every new
                # connection, until the events are read. So this end's queue has no limit (events
                # are small, and ``recv`` reads them between parts too).
                address = f"inproc://diloco-monitor-{id(self)}"
                self._sock.monitor(address, zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
                                   | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                   | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
                self._monitor = self._ctx.socket(zmq.PAIR)
                set_option(self._monitor, zmq.RCVHWM, 0)
                set_option(self._monitor, zmq.LINGER, 0)
                self._monitor.connect(address)
            self._sock.bind(bind)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise TransportError(f"cannot bind {bind}: {exc}") from None
        #: The address actually bound (``tcp://127.0.0.1:0`` becomes the real port).
        self.address: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        if self._monitor is not None:
            self._poller.register(self._monitor, zmq.POLLIN)
        self._closed = False
        self._seq = 0
        self._assembler = framing.Assembler(o.max_message_bytes, max_partials=o.max_partials,
                                            max_partial_bytes=o.max_partial_bytes,
                                            partial_timeout_s=o.partial_timeout_s, coalescer=coalescer)
        #: routing id -> the parts libzmq had no room for yet (only peers with some waiting).
        self._outboxes: dict[bytes, Outbox] = {}
        #: routing id -> how big a part to it may be (``outbox.PartSizer``), the least recently used first.
        self._sizers: OrderedDict[bytes, PartSizer] = OrderedDict()
        #: peer -> the biggest part of its latest message of several parts (how its sender cuts frames).
        self._part_bytes_in: OrderedDict[str, int] = OrderedDict()
        self.counters: Counter[str] = Counter()

    def stats(self) -> dict:
        """Counters: traffic, drops, connections, refusals at the socket level, partial messages."""
        return {
            "address": self.address,
            "auth": self.auth is not None,
            **{k: self.counters[k] for k in (
                "messages_in", "messages_out", "bytes_in", "bytes_out", "dropped_unroutable", "dropped_queue_full",
                "connections_accepted", "disconnects", "handshake_failures", "auth_failures", "peers_lost")},
            "incomplete_dropped": self._assembler.incomplete_dropped,
            "incomplete_evicted": self._assembler.evicted,
            "partial_messages": self._assembler.partial_count,
            "partial_bytes": self._assembler.partial_bytes,
            "send_backlog_parts": sum(box.parts for box in self._outboxes.values()),
            # How frames are cut on each peer's link (SPEC.md section 11, "Parts on thin links"): the median
            # over peers of the biggest part of their latest big message, and of the part size towards them.
            "part_bytes_in": _median(self._part_bytes_in.values()),
            "part_bytes_out": _median(s.part_bytes() for s in self._sizers.values() if s.rate is not None),
        }

    def recv(self, timeout_s: float) -> Arrival | None:
        """The next whole message (or refusal) from any peer; None after ``timeout_s``."""
        if self._closed:
            raise TransportClosed("coordinator endpoint is closed")
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            if self._outboxes:
                self._pump_all()
            arrival = self._recv_ready(deadline)
            if arrival is not None:
                return arrival
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            if self._outboxes:  # wake soon to hand over more (libzmq has no per-peer "room" event)
                remaining = min(remaining, self._PUMP_SLICE_S)
            events = dict(self._poller.poll(max(0, int(remaining * 1000 + 0.999))))
            if self._monitor is not None and self._monitor in events:
                self._drain_monitor()
            if self._sock not in events and time.monotonic() >= deadline:
                return None

    def _recv_ready(self, deadline: float) -> Arrival | None:
        """Assemble queued parts until a message is whole (or refused as it arrived), or ``deadline`` passes.

        A flood of parts that never make a message must not keep the owner's loop from its
        other work (timeouts, lost peers) past the time it asked to wait.
        """
        n = 0
        while True:
            n += 1
            if n % 256 == 0:
                if self._monitor is not None:
                    self._drain_monitor()  # never only when idle: a flood keeps it from being idle
                if time.monotonic() >= deadline:
                    return None
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return None
            rid = frames[0].bytes
            self._remember(rid)
            peer = peer_name(rid)
            self.counters["bytes_in"] += framing.total_nbytes(frames[1:])
            identity = None
            if self.auth is not None:
                user_id = frames[-1].get("User-Id") if len(frames) > 1 else None
                identity = self.auth.identity(user_id)
                if identity is None:  # the authenticator let it in, so this cannot happen; never trust it
                    self.counters["auth_failures"] += 1
                    continue
            now = time.monotonic()
            if identity is None:
                got = self._assembler.add(peer, frames[1:], now)
            else:  # one key's incomplete messages displace each other, never another key's
                got = self._assembler.add(peer, frames[1:], now, owner=identity.public_key,
                                          owner_limit=self.options.partials_per_key_id * identity.max_ids)
            ack = self._assembler.take_ack()
            if ack is not None:
                self._ack(rid, *ack)
            if isinstance(got, framing.Acked):
                sizer = self._sizers.get(rid)
                if sizer is not None:
                    sizer.acked(got.seq, got.received, now)
                continue
            if got is None:
                continue
            if isinstance(got, framing.Complete):
                self.counters["messages_in"] += 1
                if got.largest_part:
                    self._part_bytes_in.pop(peer, None)
                    self._part_bytes_in[peer] = got.largest_part
                    if len(self._part_bytes_in) > self.MAX_REMEMBERED_PEERS:
                        self._part_bytes_in.popitem(last=False)
            return Arrival(peer, got, identity)

    def _ack(self, rid: bytes, seq: int, received: int) -> None:
        """Tell a peer how much of its message arrived (its ``PartSizer`` learns the link): before the rest of
        what waits for it, and dropped rather than waited for (an ack is a hint; the next one says more)."""
        part = [rid, tags.ack_tag(seq, received), b""]
        box = self._outboxes.get(rid)
        if box is not None:
            box.put([part], 0, "ack", aside=True)
            self._pump(rid, box)
            return
        try:
            self._sock.send_multipart(part, zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def arriving_peers(self) -> list[str]:
        """Peers a part of whose message arrived since the last call: their bytes keep coming, so they live,
        however long one message takes (the coordinator counts it as a heartbeat, SPEC.md section 11)."""
        return self._assembler.take_progress()

    def _sizer(self, rid: bytes) -> PartSizer:
        sizer = self._sizers.pop(rid, None)
        if sizer is None:
            o = self.options
            sizer = PartSizer(o.min_part_bytes, o.chunk_bytes, o.part_time_s)
        self._sizers[rid] = sizer
        if len(self._sizers) > self.MAX_REMEMBERED_PEERS:
            self._sizers.popitem(last=False)
        return sizer

    #: Most peers remembered for probing; the longest silent are forgotten first.
    MAX_REMEMBERED_PEERS = 100_000

    def _remember(self, rid: bytes) -> None:
        heard = self._heard
        heard.pop(rid, None)
        heard[rid] = time.monotonic()  # insertion order = order of last message
        if len(heard) > self.MAX_REMEMBERED_PEERS:
            del heard[next(iter(heard))]

    def lost_peers(self) -> list[str]:
        """Peers whose connection closed and did not come back within ``disconnect_grace_s``.

        libzmq does not say *which* peer a closed connection was (the socket
        monitor names only a file descriptor), so a closed connection schedules
        a probe ``disconnect_grace_s`` later: an empty message to every peer
        heard from. With ``ROUTER_MANDATORY`` a send to a routing id that has no
        connection fails at once (``EHOSTUNREACH``): that peer is lost, reported
        once. A worker whose process dies (``kill -9`` closes its socket at once)
        is reported about a second after; one whose connection blips and comes
        back within the window (libzmq reconnects a DEALER after 100 ms) answers
        the probe's send and is not. Receivers ignore an empty message.
        """
        if self._probe_at is None or time.monotonic() < self._probe_at:
            return []
        self._probe_at = None
        lost = []
        for rid in list(self._heard):
            try:
                self._sock.send(rid, zmq.SNDMORE | zmq.NOBLOCK)
                self._sock.send(b"", zmq.NOBLOCK)
            except zmq.Again:
                continue  # connected, just slow: its queue is full
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EHOSTUNREACH:
                    raise TransportError(f"probe of {peer_name(rid)} failed: {exc}") from None
                del self._heard[rid]
                self._sizers.pop(rid, None)
                self._part_bytes_in.pop(peer_name(rid), None)
                self._assembler.forget(peer_name(rid))
                self._drop_outbox(rid)
                lost.append(peer_name(rid))
        self.counters["peers_lost"] += len(lost)
        return lost

    def _drain_monitor(self) -> None:
        from zmq.utils.monitor import recv_monitor_message
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError:
                return
            kind = event.get("event")
            if kind == zmq.EVENT_ACCEPTED:
                self.counters["connections_accepted"] += 1
            elif kind == zmq.EVENT_DISCONNECTED:
                self.counters["disconnects"] += 1
                if self._probe_at is None:
                    self._probe_at = time.monotonic() + self.options.disconnect_grace_s
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self.counters["auth_failures"] += 1
            else:
                self.counters["handshake_failures"] += 1

    def send(self, peer: str, frames: list[Any], *, legacy: bool = False) -> None:
        """Send one message's frames to ``peer`` as parts; ``legacy``: as one multipart message (an old peer's reply).

        Never blocks. What libzmq has no room for waits in the peer's outbox
        (module docstring); a peer that already has ``router_sndhwm`` parts
        waiting behind the message in progress (it stopped reading) or is gone
        loses the message, which is counted.
        """
        if self._closed:
            raise TransportClosed("coordinator endpoint is closed")
        try:
            rid = routing_id_of(peer)
        except ValueError:
            self.counters["dropped_unroutable"] += 1
            return
        self._seq += 1
        box = self._outboxes.get(rid)
        if box is not None and box.parts_behind >= self.options.router_sndhwm:
            # The peer stopped reading: drop rather than hold ever more for it.
            self.counters["dropped_queue_full"] += 1
            log.warning("dropped a message to %s: its send queue is full", peer)
            return
        if box is None:
            box = self._outboxes[rid] = Outbox(self._sizer(rid))
        nbytes = framing.total_nbytes(frames)
        if legacy:
            box.put([[rid, *frames]], nbytes)
        else:
            box.put_frames(self._seq, frames, nbytes, prefix=(rid,))
        self._pump(rid, box)

    def _pump(self, rid: bytes, box: Outbox) -> None:
        """Hand libzmq ``rid``'s waiting parts until its queue for that peer is full."""
        while (part := box.peek()) is not None:
            try:
                self._sock.send_multipart(part, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:
                if exc.errno == zmq.EHOSTUNREACH:  # the peer went away with parts still waiting
                    self._drop_outbox(rid)
                    return
                raise TransportError(f"send to {peer_name(rid)} failed: {exc}") from None
            done = box.advance(time.monotonic())
            if done is not None and done.what != "ack":
                self.counters["messages_out"] += 1
                self.counters["bytes_out"] += done.nbytes
        if self._outboxes.get(rid) is box:
            del self._outboxes[rid]

    def _pump_all(self) -> None:
        for rid, box in list(self._outboxes.items()):
            self._pump(rid, box)

    def _drop_outbox(self, rid: bytes) -> None:
        box = self._outboxes.pop(rid, None)
        if box is not None:
            self.counters["dropped_unroutable"] += len(box.clear())

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._close_sockets()

    def _close_sockets(self) -> None:
        close_socket(self._sock, self._monitor, self._ctx, self._authenticator)
