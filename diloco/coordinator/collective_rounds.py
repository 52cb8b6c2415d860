"""The collective plane's half of the coordinator: readies in, reduce orders, commits and heals out.

The model never reaches this process (SPEC.md C1-C7). A Submit says "ready" with the norm of
the member's pseudo-gradient; the core orders a group to reduce, and commits the digest the
group's members agree on. This half carries those decisions out: it checks the declared norms
and counts blame (``blame.py``, SPEC.md section 7c), tells members their group's store prefix,
withdraws a heal whose joiner went away (M12), lets a joiner holding a newer state start the
run again (C6), and keeps who holds the committed state (``collective.py``).
"""

from __future__ import annotations

import math

from diloco.coordinator.blame import ContributionChecks
from diloco.coordinator.collective import CollectivePlane
from diloco.coordinator.plane import Outgoing, RoundsHost, WelcomeParts
from diloco.core import (
    AbortReduce,
    AcceptContribution,
    ApplyRound,
    ContributionSubmitted,
    DataPlane,
    DiscardContribution,
    LeaveCause,
    OrderReduce,
    Phase,
    ReduceReported,
    ReleaseWorker,
    WorkerLeft,
)
from diloco.wire.messages import (
    Command,
    ErrorCode,
    HealOrder,
    Join,
    ReduceAbort,
    ReduceOrder,
    ReduceReport,
    Result,
    Submit,
    Tensors,
)


def held_state(join: Join) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The rounds and digests of the committed state a collective joiner offers (C6); () for none
    or initial params."""
    if not join.holds_params:
        return (), ()
    return tuple(join.held_rounds), tuple(join.held_digests)


class CollectiveRounds:
    """The collective plane's ``DataPlaneRounds`` (``plane.py``)."""

    store = None

    def __init__(self, host: RoundsHost) -> None:
        self.host = host
        config = host.config
        #: Who holds the committed state, group prefixes, heals, the last commits.
        self.collective = CollectivePlane(config.fsm.num_fragments, heal_sources=config.heal_sources)
        #: Declared norms against the outlier bounds, blame, evictions, failures in a row (``blame.py``).
        self.checks = ContributionChecks(host.outliers, config.max_update_norm, config.max_failed_attempts)
        #: Why the run stops at the end of the current step (a round that cannot commit), if it must.
        self._stop_for: str | None = None

    # ------------------------------------------------------------------ state

    @property
    def has_state(self) -> bool:
        return self.collective.spec is not None

    def num_params(self) -> int:
        return sum(math.prod(s.shape) for s in self.collective.spec or ())

    def optimizer_states(self) -> list[dict]:
        return []  # the outer optimizers are the members' (their checkpoints keep them)

    def status(self) -> dict:
        return {**self.collective.status(), "checks": self.checks.status()}

    # ------------------------------------------------------------------ joins

    def check_join(self, peer: str, join: Join, out: Outgoing) -> Join | None:
        refusal = self.collective.check_join(join, self.host.fsm.is_member)
        if refusal is not None:
            self.host.refuse(peer, out, *refusal, join)
            return None
        return join

    def reseed(self, join: Join, out: Outgoing) -> None:
        """C6: when the joiner starts the run again from a newer state, the members holding (or
        healing to) the older one leave first -- so the joiner's Welcome tells the quorum as it
        is -- and are told to join again, to heal from it."""
        host = self.host
        held, digests = held_state(join)
        for wid in self.collective.reseed_for(join.worker_id, held, digests):
            peer = host.peer_of(wid)
            self.collective.forget(wid)
            self._withdraw_heals(out)
            if host.fsm.is_member(wid):
                host.step(WorkerLeft(wid, LeaveCause.RESEEDED), out)
            if peer is not None:
                out.append((peer, host.heartbeat_reply(Command.REJOIN)))
            host.notify("reseed", host.fsm.now_s, worker_id=wid, starter=join.worker_id, held_rounds=list(held))

    def welcome(self, worker_id: str, join: Join, out: Outgoing) -> WelcomeParts:
        """C6: no params; the joiner heals from a member that holds the committed state, or starts the run."""
        host, plane, config = self.host, self.collective, self.host.config
        pairs = plane.heal_sources_for(worker_id, *held_state(join))
        self._withdraw_heals(out)  # an older heal of this joiner's: before the new orders (M12)
        for source, prefix in pairs:
            source_peer = host.peer_of(source)
            assert source_peer is not None  # a heal source is a live member
            out.append((source_peer, HealOrder(worker_id, prefix)))
        (source, prefix), more = (pairs[0] if pairs else ("", "")), pairs[1:]
        return WelcomeParts(dict(
            fragments=plane.fragments, params={}, data_plane=DataPlane.COLLECTIVE.value,
            store_port=plane.store_port, heal_source=source, heal_prefix=prefix,
            more_heal_sources=tuple(s for s, _ in more), more_heal_prefixes=tuple(p for _, p in more),
            outer=config.outer.to_dict(), collective_timeout_s=config.collective_timeout_s,
            committed=tuple(plane.last_commit), layout=plane.layout,
        ), note={"heal_source": source, "heal_sources": [s for s, _ in pairs]})

    def _withdraw_heals(self, out: Outgoing) -> None:
        """M12: tell each source whose joiner left or re-joined that the heal it serves is off (an
        order with no prefix), so it does not hold itself out of the groups until the heal times out."""
        withdrawn = self.collective.withdrawn
        while withdrawn:
            source, joiner = withdrawn.popleft()
            peer = self.host.peer_of(source)
            if peer is not None:
                out.append((peer, HealOrder(joiner, "")))
                self.collective.stats["heals_withdrawn"] += 1

    # ------------------------------------------------------------ submissions

    def on_submit(self, peer: str, msg: Submit, out: Outgoing, measured) -> None:
        host, fid = self.host, msg.fragment_id
        if msg.tensors or msg.scales:
            host.refuse(peer, out, ErrorCode.BAD_MESSAGE, "this run is on the collective data plane: a Submit "
                        "says 'ready' and carries no tensors (they stay on the workers)", msg)
            return
        if host.fsm.phase is not Phase.STOPPED and type(fid) is int and 0 <= fid < host.config.fsm.num_fragments:
            refusal = self.checks.check_ready(fid, msg.norm)
            if refusal is not None:
                host.refuse(peer, out, refusal[0], refusal[1], msg)
                if refusal[0] is not ErrorCode.BAD_MESSAGE:
                    host.notify("outlier", host.fsm.now_s, worker_id=msg.worker_id, fragment_id=fid,
                                norm=str(msg.norm), detail=refusal[1])
                return
        host.step(ContributionSubmitted(msg.worker_id, fid, msg.round_id), out, peer=peer, submit=msg, tensors={})

    def on_report(self, peer: str, msg: ReduceReport, out: Outgoing) -> None:
        host, wid = self.host, msg.worker_id
        if host.peer_of(wid) != peer or not host.fsm.is_member(wid):
            host.refuse(peer, out, ErrorCode.UNKNOWN_WORKER,
                        f"worker {wid!r} is not a live member on this connection (join first)", msg)
            return
        if not msg.ok:
            host.notify("reduce_failed", host.fsm.now_s, worker_id=wid, fragment_id=msg.fragment_id,
                        round_id=msg.round_id, attempt=msg.attempt, detail=msg.detail, blame=list(msg.blame))
        # Blame counts even for an attempt the core already ended (its first failure report did).
        evict = self.checks.reported(msg)
        host.step(ReduceReported(wid, msg.fragment_id, msg.round_id, msg.attempt, msg.ok, msg.digest), out,
                  peer=peer, report=msg)
        for blamed in evict:
            self._evict(blamed, msg, out)

    def _evict(self, worker_id: str, report: ReduceReport, out: Outgoing) -> None:
        """Every member of an attempt's group blamed ``worker_id``: it leaves the round (it joins again
        and heals), and past ``MAX_STRIKES`` the run (SPEC.md section 7c)."""
        host = self.host
        if not host.fsm.is_member(worker_id):
            return
        eviction = self.checks.evicted(worker_id, report.fragment_id, report.round_id, report.attempt)
        peer = host.peer_of(worker_id)
        host.notify("evicted", host.fsm.now_s, worker_id=worker_id, fragment_id=report.fragment_id,
                    round_id=report.round_id, attempt=report.attempt, detail=eviction.detail,
                    banned=eviction.banned)
        if eviction.banned:
            host.access.ban(worker_id)
        host.step(WorkerLeft(worker_id, LeaveCause.EVICTED), out)
        if peer is not None:
            host.refuse(peer, out, ErrorCode.BANNED if eviction.banned else ErrorCode.EVICTED, eviction.detail,
                        Submit(worker_id, report.fragment_id, report.round_id, {}))

    # --------------------------------------------------------------- effects

    def accept(self, effect: AcceptContribution, submit: Submit, tensors: Tensors, peer: str, out: Outgoing,
               norm: float | None, closes: bool, owned: bool) -> None:
        # C2: "ready"; the pseudo-gradient stays on the worker. Having been ready proves it
        # holds the committed state (it healed, or was in the last group): a heal source.
        self.collective.holds_state(effect.worker_id)
        # Before the order this ready may complete (the next effect): it carries the norm.
        assert submit.norm is not None  # ``check_ready`` refused a ready without one
        self.checks.accepted(effect.fragment_id, effect.worker_id, float(submit.norm))

    def apply(self, effect: ApplyRound, now: float) -> dict:
        # C4: the commit. The group computed the step; what is durable here is the decision.
        self.collective.committed(effect.fragment_id, effect.round_id, effect.digest)
        self.checks.committed(effect.fragment_id)
        return {"digest": effect.digest}

    def release(self, effect: ReleaseWorker, peer: str, out: Outgoing) -> None:
        # C4: adopt what you proposed; the digest says which proposal was committed.
        fid = effect.fragment_id
        out.append((peer, Result(fid, effect.round_id, effect.outcome.value, effect.round_id + 1,
                                 digest=self.collective.last_commit[fid][1])))

    def discard(self, effect: DiscardContribution) -> None:
        pass  # nothing of the pseudo-gradient is here

    def order(self, effect: OrderReduce, out: Outgoing, now: float) -> None:
        host = self.host
        prefix = self.collective.group_prefix(effect.group)
        norms, gather = self.checks.order_fields(effect.fragment_id, effect.round_id, effect.attempt, effect.group)
        message = ReduceOrder(effect.fragment_id, effect.round_id, effect.attempt, effect.group, prefix, norms, gather)
        for wid in effect.group:
            peer = host.peer_of(wid)
            if peer is not None:
                out.append((peer, message))
        host.notify("reduce", now, fragment_id=effect.fragment_id, round_id=effect.round_id,
                    attempt=effect.attempt, group=list(effect.group))

    def abort(self, effect: AbortReduce, out: Outgoing, now: float) -> None:
        host = self.host
        # A failed group may be broken (a dead or wedged peer): the next order builds a new one.
        self.collective.retire_group()
        message = ReduceAbort(effect.fragment_id, effect.round_id, effect.attempt, effect.reason.value)
        for wid in effect.group:
            peer = host.peer_of(wid)
            if peer is not None and host.fsm.is_member(wid):
                out.append((peer, message))
        self.collective.stats["aborts"] += 1
        host.notify("abort", now, fragment_id=effect.fragment_id, round_id=effect.round_id,
                    attempt=effect.attempt, reason=effect.reason.value)
        stuck = self.checks.aborted(effect.fragment_id, effect.round_id, effect.group, effect.reason.value)
        if stuck is not None and self._stop_for is None:
            self._stop_for = stuck  # after this step's effects: a stop is a step of its own

    def forget(self, worker_id: str, out: Outgoing) -> None:
        """Its place among the holders of the committed state, once it is no longer a member (a refused
        leave keeps it; a dead worker never is one), and the heal a member serves it (M12)."""
        if not self.host.fsm.is_member(worker_id):
            self.collective.forget(worker_id)
            self.checks.forget(worker_id)
            self._withdraw_heals(out)

    def idle(self) -> None:
        pass  # nothing to make ahead: the outer step is the members'

    def end_step(self) -> str | None:
        stop_for, self._stop_for = self._stop_for, None
        return stop_for
