"""``ShardedCollectiveEndpoint``: the collective driver of a member whose model is sharded (FSDP2).

The member machine, its decisions and its owner thread are ``CollectiveEndpoint``'s, unchanged:
the core and the coordinator see one member. Only the jobs differ: each runs on every rank of
the member, on the rank's own shard (``diloco.collective.shard_part``). The leader's data-plane
thread sends the job's request over the member's plane group, carries out its own part, gathers
the others' replies and combines them into the one completion the machine expects:

* a reduce in two steps: every rank reduces its shard with the same rank of the other members;
  the leader combines the shard norms and runs the checks (M9) once, for the whole member; then
  every rank proposes (M11 per shard) and the member votes the digest of its ranks' digests;
* a commit, rollback, start or heal on every rank; a rank that fails fails the job;
* the params a commit, start or heal hands the session are rank 0's shards: the session
  installs them through ``ShardedParams``, each rank taking its own committed shards.

A sharded member does not offer a checkpoint's committed state at Join (C6): it resumes its
shards from its checkpoint and heals from a live member, or starts the run from them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from diloco.collective.endpoint import CollectiveEndpoint
from diloco.collective.member import (
    HEAL_TIMEOUTS,
    Committed,
    Completion,
    HealFailed,
    HealJob,
    HealServed,
    Healed,
    JobFailed,
    ReduceJob,
    Reduced,
    RolledBack,
    RollbackJob,
    ServeHealJob,
    Started,
    StartJob,
    CommitJob,
    judge_reduce,
    mean_bound,
)
from diloco.collective.shard_part import STOP, PlaneLink, ReducePart, ShardPart, combined_digest, combined_norm
from diloco.wire.messages import Join, Message, Submit


class MemberBroken(RuntimeError):
    """The member lost a rank: the worker stops with this as its error (``group_failed``)."""


class ShardedCollectiveEndpoint(CollectiveEndpoint):
    """A ``CollectiveEndpoint`` whose jobs run on every rank of a sharded member."""

    def __init__(self, inner, worker_id: str, part: ShardPart, link: PlaneLink | None, layout: str, *,
                 device=None) -> None:
        super().__init__(inner, worker_id, device=device)
        #: Every Join names it: the coordinator refuses a member laid out unlike the run's (S8).
        self.layout = layout
        self.part = part
        part.store_host = self._store_host
        self.link = link
        #: fragment -> its open proposal's digest on each rank (rank order).
        self._rank_digests: dict[int, list[str]] = {}
        #: Why the member's plane group failed ("" while it works): the member must go.
        self._broken = ""

    # ------------------------------------------------------------------ the owner thread

    def send(self, message: Message) -> None:
        if isinstance(message, Join):
            message = dataclasses.replace(message, layout=self.layout)
        if isinstance(message, Submit) and self.machine.collective and message.norm is None:
            raise ValueError("a sharded member's Submit declares its norm (ShardedParams.submit_shards)")
        super().send(message)  # a Join's params are rank 0's shards: the machine keeps them, never sends them

    def restore(self, *args, **kwargs) -> None:
        raise ValueError("a sharded member does not offer a checkpoint's committed state on the collective plane")

    def committed_outer_states(self) -> list[dict] | None:
        return None

    def close(self) -> None:
        super().close()
        thread = self._thread
        if self.link is not None and not self._broken and (thread is None or not thread.is_alive()):
            try:
                self.link.broadcast(STOP, self._timeout_s)  # the other ranks' data planes end
            except Exception:
                pass  # a rank is gone already

    def recv(self, timeout_s: float) -> Message | None:
        message = None if self._broken else super().recv(timeout_s)
        if self._broken:
            # The member lost a rank: it cannot reduce, commit or heal any more. It goes as a whole
            # (the coordinator sees one death), as it does when a collective of its training fails.
            raise MemberBroken(self._broken)
        return message

    # ------------------------------------------------------------------ the data-plane thread

    def _member(self, what: str, call, *args) -> Any:
        """A collective on the member's plane group; its failure breaks the member."""
        if self._broken:
            raise RuntimeError(self._broken)
        try:
            return call(*args)
        except Exception as exc:
            self._broken = f"this worker's group broke while {what} (a rank died or left): {exc}"
            self.wake()
            raise RuntimeError(self._broken) from None

    def _bound_s(self) -> float:
        """How long the leader waits for the other ranks' part of any job: the longest a job may take
        (a heal's transfer, after a formation that waits out gloo's connect), and some."""
        return (HEAL_TIMEOUTS + 6) * self._timeout_s + 30.0

    def _ask(self, request: tuple, job: Any = None) -> list[Any]:
        """Every rank's reply to ``request``, in rank order (this rank's carried out here)."""
        if self.link is not None:
            self._member(f"asking the other ranks to {request[0]}", self.link.broadcast, request, self._bound_s())
        stop = self._stop_for(job) if job is not None else (lambda: "")
        try:
            mine = self.part.handle(request, stop)
        except Exception as exc:  # the others' replies must still be gathered
            mine = _Raised(f"{type(exc).__name__}: {exc}")
        if isinstance(job, ReduceJob) and stop():
            # M13: the attempt is over; the other ranks may still wait in their group's formation.
            self.part.mark_abandoned(job.order.prefix)
        if self.link is None:
            replies = [mine]
        else:
            gathered = self._member(f"hearing the other ranks {request[0]}", self.link.gather, mine, self._bound_s())
            assert gathered is not None
            replies = gathered
        if isinstance(mine, _Raised):
            raise RuntimeError(mine.detail)
        return replies

    def _where(self) -> tuple[str, int, float]:
        return self._store_host, self._store_port, self._timeout_s

    def _reduce(self, job: ReduceJob) -> Completion:
        order = job.order
        fid, rid = order.fragment_id, order.round_id
        parts: list[ReducePart] = self._ask(("reduce", order, *self._where()), job)
        self._job_stats["bytes_sent"] += sum(p.bytes_sent for p in parts)
        failed = [p.error for p in parts if p.error]
        if failed:
            self._ask(("discard", fid))
            return Reduced("", "; ".join(failed))
        size = len(order.group)
        norms = tuple(combined_norm([p.norms[m] for p in parts]) for m in range(size)) if parts[0].norms else ()
        refused = judge_reduce(order, norms, lambda: combined_norm([p.mean_norm for p in parts]))
        if refused is not None:
            self._ask(("discard", fid))
            return refused
        votes = self._ask(("propose", fid, rid, mean_bound(order)))
        why = [detail for _, detail in votes if detail]
        if why:
            self._ask(("rollback", (fid,)))  # the ranks that stepped go back: the member proposes nothing
            return Reduced("", "; ".join(why))
        digests = [d for d, _ in votes]
        self._rank_digests[fid] = digests
        return Reduced(combined_digest(digests))

    def _commit(self, job: CommitJob) -> Completion:
        digests = self._rank_digests.pop(job.fragment_id, None)
        if digests is None or combined_digest(digests) != job.digest:
            self._ask(("rollback", (job.fragment_id,)))
            raise RuntimeError(f"fragment {job.fragment_id}: the member's proposal is not round {job.round_id} "
                               f"with digest {job.digest[:12]}")
        ok = self._ask(("commit", job.fragment_id, job.round_id, digests))
        if not all(ok):
            raise RuntimeError(f"fragment {job.fragment_id}: ranks {[r for r, o in enumerate(ok) if not o]} "
                               f"could not commit round {job.round_id}")
        replica = self.part.replica
        assert replica is not None
        # The session installs each rank's handed shards (``ShardPart.handed``): what it is given here
        # only names the fragment's params, so no copy of them is kept.
        return Committed(replica.fragment(job.fragment_id))

    def _rollback(self, job: RollbackJob) -> Completion:
        for fid in job.fragment_ids:
            self._rank_digests.pop(fid, None)
        self._ask(("rollback", tuple(job.fragment_ids)))
        return RolledBack()

    def _start(self, job: StartJob) -> Completion:
        replies = self._ask(("start", job.welcome, job.keep, tuple(job.adopt), tuple(job.rollback)))
        failed = [r for r in replies if isinstance(r, str)]
        if failed:
            return JobFailed("; ".join(failed))
        self.replica = self.part.replica
        return Started(self._member_digests(replies), dict(self.part.replica.params))

    def _heal(self, job: HealJob) -> Completion:
        self._rank_digests.clear()
        replies = self._ask(("heal", job.welcome, *self._where()), job)
        failed = [error for error, _, _ in replies if error]
        if failed:
            return HealFailed("; ".join(failed))
        round_ids = replies[0][1]
        if any(r[1] != round_ids for r in replies):
            return HealFailed(f"the source's ranks sent different rounds: {[r[1] for r in replies]}")
        self.replica = self.part.replica
        return Healed(tuple(round_ids), self._member_digests([r[2] for r in replies]), dict(self.part.replica.params))

    def _serve_heal(self, job: ServeHealJob) -> Completion:
        replies = self._ask(("serve", job.order, *self._where()), job)
        failed = [r for r in replies if r]
        if failed:
            return HealServed(False, "; ".join(failed))
        return HealServed(True)

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _member_digests(per_rank: list[list[str]]) -> tuple[str, ...]:
        return tuple(combined_digest([d[f] for d in per_rank]) for f in range(len(per_rank[0])))


class _Raised:
    def __init__(self, detail: str) -> None:
        self.detail = detail
