"""The collective plane's checks on the coordinator's side (SPEC.md section 7c, "Checks and blame").

Sans-IO like the rest of the coordinator. The coordinator never sees a pseudo-gradient on
this plane, so it checks what each member *declares* and what the group *reports*:

* **A ready's declared norm** (``Submit.norm``, the norm of the pseudo-gradient as the group
  will decode it) faces the hub's own bounds: not finite is ``non_finite``; above
  ``--max-update-norm`` or far out of line with the fragment's recent accepted norms
  (``outliers.OutlierGuard``, whose warm-up bound needs params the coordinator does not hold:
  here it starts once ``MIN_HISTORY`` norms are known) is ``update_too_large``. So an honest
  member whose training blew up is refused exactly as on the hub.
* **Each order carries the group's declared norms.** Every member holds each contribution it
  sees against its sender's declared norm (``member.judge_contributions``), or fp32's mean
  against their mean (``member.judge_mean``); one that fails is a lie or a fault between the
  measure and the wire.
* **Blame is unanimous or nothing.** A member is evicted from the round (``WorkerLeft(evicted)``:
  it joins again and heals) only when *every* member of an attempt's group -- the blamed one
  included -- reported it. The checks are deterministic over bytes every member received alike,
  so an honest member never blames itself, and a liar's blame of an honest member is never
  unanimous: it cannot get one evicted. ``MAX_STRIKES`` evictions ban a worker from the run.
* **fp32 finds its culprit.** An all-reduce shows only the sum: a report that the mean failed
  its checks makes every later attempt of that round gather the contributions, so they are
  seen and blamed.
* **No livelock.** ``max_failed_attempts`` failed attempts in a row of one round by one group
  (any reason but a member lost, which changes the group) stop the run, with a checkpoint and
  the reason in the log, the audit log and ``diloco status``; nothing unsafe was committed.

Eviction and blame only ever change who takes part; a commit still needs every member of its
group to report the same digest, and at least ``min_workers`` of them (C4).
"""

from __future__ import annotations

import collections
import dataclasses
import math

from diloco.coordinator.outliers import MIN_HISTORY, OutlierGuard
from diloco.wire.messages import ErrorCode, ReduceReport

#: Evictions after which a worker is banned from the run (``diloco unban`` lets it back).
MAX_STRIKES = 3
#: ``--max-failed-attempts``' default: failed attempts in a row of one round by one group.
DEFAULT_MAX_FAILED_ATTEMPTS = 16
#: Attempts whose reports are kept for the blame count (the newest; older ones cannot complete).
_KEPT_ATTEMPTS = 64


@dataclasses.dataclass
class _Attempt:
    group: tuple[str, ...]
    #: reporter -> what it blamed (empty when it blamed nobody)
    blames: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _Failures:
    round_id: int
    group: tuple[str, ...]
    count: int = 0
    reasons: collections.Counter = dataclasses.field(default_factory=collections.Counter)


@dataclasses.dataclass(frozen=True)
class Eviction:
    worker_id: str
    fragment_id: int
    round_id: int
    attempt: int
    detail: str
    banned: bool


class ContributionChecks:
    """Per run: the declared norms, the blame of each attempt, the strikes and the failures in a row."""

    def __init__(self, outliers: OutlierGuard, max_update_norm: float | None,
                 max_failed_attempts: int = DEFAULT_MAX_FAILED_ATTEMPTS) -> None:
        self.outliers = outliers
        self.max_update_norm = max_update_norm
        self.max_failed_attempts = max_failed_attempts
        #: (fragment, worker) -> the norm its accepted ready declared, for the round's order.
        self._declared: dict[tuple[int, str], float] = {}
        self._attempts: collections.OrderedDict[tuple[int, int, int], _Attempt] = collections.OrderedDict()
        #: fragment -> the round whose attempts gather every contribution (its fp32 mean failed).
        self._gather: dict[int, int] = {}
        self._failures: dict[int, _Failures] = {}
        self.strikes: collections.Counter = collections.Counter()
        self.stats: collections.Counter = collections.Counter()
        #: The newest evictions, for ``diloco status``.
        self.recent: collections.deque[Eviction] = collections.deque(maxlen=16)

    # -- readies

    def check_ready(self, fid: int, norm: object) -> tuple[ErrorCode, str] | None:
        """Why a collective ready is refused, if it is: its declared norm against the run's bounds."""
        if norm is None:
            return ErrorCode.BAD_MESSAGE, (f"fragment {fid} ready: a collective ready declares its "
                                           f"pseudo-gradient's norm (Submit.norm; diloco >= protocol 7 does)")
        if isinstance(norm, bool) or not isinstance(norm, (int, float)):
            return ErrorCode.BAD_MESSAGE, f"fragment {fid} ready: Submit.norm is {norm!r:.60}, expected a number"
        value = float(norm)
        if not math.isfinite(value):
            return ErrorCode.NON_FINITE, f"fragment {fid} ready: the pseudo-gradient's norm is {value} (not finite)"
        if self.max_update_norm is not None and value > self.max_update_norm:
            return ErrorCode.UPDATE_TOO_LARGE, (f"fragment {fid} ready: L2 norm {value:.6g} exceeds the "
                                                f"coordinator's --max-update-norm {self.max_update_norm:g}")
        if self.outliers.factor > 0 and self.outliers.known(fid) >= MIN_HISTORY:
            why = self.outliers.check(fid, value, {})
            if why is not None:
                return ErrorCode.UPDATE_TOO_LARGE, f"fragment {fid} ready: {why}"
        return None

    def accepted(self, fid: int, worker_id: str, norm: float) -> None:
        self._declared[(fid, worker_id)] = norm
        self.outliers.accepted(fid, norm)

    # -- orders and reports

    def order_fields(self, fid: int, rid: int, attempt: int, group: tuple[str, ...]) -> tuple[tuple[float, ...], bool]:
        """(declared norms in group order, gather) for a new order; the attempt's reports are kept."""
        self._attempts[(fid, rid, attempt)] = _Attempt(group)
        while len(self._attempts) > _KEPT_ATTEMPTS:
            self._attempts.popitem(last=False)
        norms = tuple(self._declared.get((fid, w), 0.0) for w in group)
        return norms, self._gather.get(fid) == rid

    def reported(self, report: ReduceReport) -> tuple[str, ...]:
        """Take ``report`` into its attempt's blame count (even after the attempt aborted); the workers
        to evict when this report makes the blame unanimous, else ()."""
        if report.mean_refused:
            self._gather[report.fragment_id] = report.round_id
        attempt = self._attempts.get((report.fragment_id, report.round_id, report.attempt))
        if attempt is None or report.worker_id not in attempt.group or report.worker_id in attempt.blames:
            return ()
        attempt.blames[report.worker_id] = tuple(sorted(set(report.blame) & set(attempt.group)))
        if len(attempt.blames) < len(attempt.group):
            return ()
        verdicts = set(attempt.blames.values())
        if len(verdicts) != 1 or not next(iter(verdicts)):
            if any(attempt.blames.values()):
                self.stats["blames_disputed"] += 1
            return ()
        return next(iter(verdicts))

    def evicted(self, worker_id: str, fid: int, rid: int, attempt: int) -> Eviction:
        self.strikes[worker_id] += 1
        self.stats["evictions"] += 1
        strikes = self.strikes[worker_id]
        banned = strikes >= MAX_STRIKES
        detail = (f"every member of fragment {fid} round {rid} attempt {attempt}'s group found its contribution "
                  f"failing the checks (norm as decoded beyond the one it declared, or not finite); "
                  f"eviction {strikes} of {MAX_STRIKES}" + (": banned from the run" if banned else ""))
        eviction = Eviction(worker_id, fid, rid, attempt, detail, banned)
        self.recent.append(eviction)
        return eviction

    # -- the end of attempts

    def aborted(self, fid: int, rid: int, group: tuple[str, ...], reason: str) -> str | None:
        """An attempt failed; why the run must stop now (this group failed this round too often), or None."""
        if reason in ("member_lost", "group_below_quorum", "shutdown"):
            return None  # the group changes (or the run stops): not the same failure again
        failures = self._failures.get(fid)
        if failures is None or failures.round_id != rid or failures.group != group:
            failures = self._failures[fid] = _Failures(rid, group)
        failures.count += 1
        failures.reasons[reason] += 1
        if failures.count < self.max_failed_attempts:
            return None
        self.stats["stuck"] += 1
        reasons = ", ".join(f"{r} x{n}" for r, n in failures.reasons.most_common())
        return (f"fragment {fid} round {rid}: {failures.count} attempts in a row by the group "
                f"{', '.join(group)} failed ({reasons}); nothing was committed from them. The run stops "
                f"with a checkpoint rather than retry forever (--max-failed-attempts "
                f"{self.max_failed_attempts}); see docs/collective.md, 'When a round cannot commit'")

    def committed(self, fid: int) -> None:
        self._failures.pop(fid, None)
        self._gather.pop(fid, None)

    def forget(self, worker_id: str) -> None:
        """A member left: its declared norms go with its readiness (C2)."""
        for key in [k for k in self._declared if k[1] == worker_id]:
            del self._declared[key]

    def status(self) -> dict:
        return {"strikes": dict(self.strikes), "gathering": {str(f): r for f, r in self._gather.items()},
                "recent_evictions": [dataclasses.asdict(e) for e in self.recent], **dict(self.stats)}
