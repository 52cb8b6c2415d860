"""Snapshot format of ``RoundFSM``: dump to plain data, load with full validation.

A snapshot is a dict of str/int/float/bool/list only, so msgpack and JSON
both carry it. ``load`` trusts nothing: a checkpoint file may be truncated,
edited or from another version, and a machine rebuilt from a bad snapshot
would break the quorum rule silently. Every problem raises ``SnapshotError``
naming the path of the bad field.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from diloco.core.config import DataPlane, FSMConfig, Mode
from diloco.core.errors import ConfigError, SnapshotError
from diloco.core.fragments import AsyncLane, ReduceAttempt, SyncBarrier
from diloco.core.phases import Phase

FORMAT = "diloco.round_fsm"
VERSION = 1


def dump(*, config: dict, phase: Phase, min_workers: int, now_s: float,
         members: "OrderedDict[str, float]", barriers: list[SyncBarrier],
         lanes: list[AsyncLane], window_s: float = 0.0) -> dict:
    if barriers:
        fragments = [{"round_id": b.round_id, "contributed": list(b.contributed)} for b in barriers]
        if config.get("data_plane") == DataPlane.COLLECTIVE.value:
            for f, b in zip(fragments, barriers):
                f.update(attempts=b.attempts, reducing=_dump_attempt(b.reducing))
    else:
        fragments = [
            {"version": lane.version,
             "held": [[w, base] for w, base in lane.held.items()],
             "last_base": [[w, base] for w, base in lane.last_base.items()]}
            for lane in lanes
        ]
        if config.get("grace_window_s"):
            # P5: the open window's deadline (None while nothing is held).
            for f, lane in zip(fragments, lanes):
                f["deadline_s"] = lane.deadline_s
    out = {
        "format": FORMAT,
        "version": VERSION,
        "config": config,
        "phase": phase.value,
        "min_workers": min_workers,
        "now_s": now_s,
        # Order matters: it is the last-seen order the heartbeat timer relies on.
        "members": [[w, last] for w, last in members.items()],
        "fragments": fragments,
    }
    if config.get("grace_window_s") and window_s != config["grace_window_s"]:
        out["window_s"] = window_s  # P5: the next window's length, as ``GraceWindowChanged`` set it
    return out


def _dump_attempt(attempt: ReduceAttempt | None) -> dict | None:
    if attempt is None:
        return None
    return {"attempt": attempt.attempt, "reports": [[w, d] for w, d in attempt.reports.items()],
            "deadline_s": attempt.deadline_s}


@dataclass
class Parsed:
    config: FSMConfig
    phase: Phase
    min_workers: int
    now_s: float
    members: "OrderedDict[str, float]"
    barriers: list[SyncBarrier]
    lanes: list[AsyncLane]
    #: P5: the next window's length (the configured one unless ``GraceWindowChanged`` set another).
    window_s: float = 0.0


def load(snap: object) -> Parsed:
    d = _dict(snap, "snapshot")
    if d.get("format") != FORMAT:
        raise SnapshotError(f"snapshot.format={d.get('format')!r}: expected {FORMAT!r}")
    if d.get("version") != VERSION:
        raise SnapshotError(
            f"snapshot.version={d.get('version')!r} is not supported: this diloco reads version {VERSION}"
        )
    try:
        config = FSMConfig.from_dict(_dict(d.get("config"), "snapshot.config"))
    except ConfigError as exc:
        raise SnapshotError(f"snapshot.config: {exc}") from None
    try:
        phase = Phase(d.get("phase"))
    except ValueError:
        raise SnapshotError(f"snapshot.phase={d.get('phase')!r}: expected one of "
                            f"{[p.value for p in Phase]}") from None
    min_workers = _int(d.get("min_workers"), "snapshot.min_workers", 1, config.max_workers)
    now_s = _num(d.get("now_s"), "snapshot.now_s")
    members: OrderedDict[str, float] = OrderedDict()
    previous = float("-inf")
    for i, item in enumerate(_list(d.get("members"), "snapshot.members")):
        wid, last = _pair(item, f"snapshot.members[{i}]")
        _wid(wid, f"snapshot.members[{i}][0]", config)
        last = _num(last, f"snapshot.members[{i}][1]")
        if wid in members:
            raise SnapshotError(f"snapshot.members[{i}]: worker {wid!r} listed twice")
        if last < previous or last > now_s:
            raise SnapshotError(f"snapshot.members[{i}]: last seen {last} out of order (must be "
                                f"non-decreasing and <= now_s={now_s})")
        previous = last
        members[wid] = last
    if len(members) > config.max_workers:
        raise SnapshotError(f"snapshot.members: {len(members)} members > max_workers={config.max_workers}")
    frags = _list(d.get("fragments"), "snapshot.fragments")
    if len(frags) != config.num_fragments:
        raise SnapshotError(f"snapshot.fragments has {len(frags)} entries; config says "
                            f"num_fragments={config.num_fragments}")
    barriers: list[SyncBarrier] = []
    lanes: list[AsyncLane] = []
    for fid, raw in enumerate(frags):
        path = f"snapshot.fragments[{fid}]"
        f = _dict(raw, path)
        if config.mode is Mode.SYNC:
            rid = _int(f.get("round_id"), f"{path}.round_id", 0, None)
            contributed: dict[str, None] = {}
            for j, wid in enumerate(_list(f.get("contributed"), f"{path}.contributed")):
                # A departed contributor stays listed (P1), so membership is not required.
                _wid(wid, f"{path}.contributed[{j}]", config)
                if wid in contributed:
                    raise SnapshotError(f"{path}.contributed[{j}]={wid!r}: listed twice")
                contributed[wid] = None
            live = sum(1 for wid in contributed if wid in members)
            # Collective fields (absent from snapshots of hub runs written before they existed).
            attempts = _int(f.get("attempts", 0), f"{path}.attempts", 0, None)
            reducing = _load_attempt(f.get("reducing"), f"{path}.reducing", config, members, contributed,
                                     attempts)
            if config.data_plane is DataPlane.COLLECTIVE:
                gone = [w for w in contributed if w not in members]
                if gone:
                    # C2: a departed member's readiness left with it.
                    raise SnapshotError(f"{path}.contributed: {gone[0]!r} is not a member (collective plane)")
            elif attempts or reducing is not None:
                raise SnapshotError(f"{path}: a reduce attempt in a hub run")
            barriers.append(SyncBarrier(rid, contributed, live, attempts, reducing))
        else:
            version = _int(f.get("version"), f"{path}.version", 0, None)
            held: dict[str, int] = {}
            for j, item in enumerate(_list(f.get("held"), f"{path}.held")):
                wid, base = _pair(item, f"{path}.held[{j}]")
                _wid(wid, f"{path}.held[{j}][0]", config)
                if wid in held:
                    raise SnapshotError(f"{path}.held[{j}]={wid!r}: listed twice")
                held[wid] = _int(base, f"{path}.held[{j}][1]", 0, version)
            if len(held) > config.max_held_per_fragment:
                raise SnapshotError(f"{path}.held: more than max_held_per_fragment entries")
            last_base: dict[str, int] = {}
            for j, item in enumerate(_list(f.get("last_base"), f"{path}.last_base")):
                wid, base = _pair(item, f"{path}.last_base[{j}]")
                _wid(wid, f"{path}.last_base[{j}][0]", config)
                if wid not in members:
                    raise SnapshotError(f"{path}.last_base[{j}]={wid!r}: not a member")
                last_base[wid] = _int(base, f"{path}.last_base[{j}][1]", -1, version)  # -1: joined at version 0
            for wid, base in held.items():
                # P3: a member's last base is at least its held contribution's base (more when
                # it re-joined onto that contribution: then the version before its join).
                if wid in members and last_base.get(wid, -1) < base:
                    raise SnapshotError(f"{path}: held contribution of {wid!r} disagrees with last_base")
            for wid in members:
                # P3: every member has a last base (from its join on); without it old work could count twice.
                if wid not in last_base:
                    raise SnapshotError(f"{path}.last_base: member {wid!r} has none (P3)")
            deadline = f.get("deadline_s")
            window = config.grace_window_s
            if not window:
                if deadline is not None:
                    raise SnapshotError(f"{path}.deadline_s={deadline!r}: a grace window deadline in a run "
                                        f"without one (grace_window_s=0)")
            elif not held:
                if deadline is not None:
                    raise SnapshotError(f"{path}.deadline_s={deadline!r}: expected None (nothing is held, P5)")
            else:
                deadline = _num(deadline, f"{path}.deadline_s")
                # P5: set at the first held contribution's acceptance (<= now) plus the window, or
                # moved back to a departure's clock.
                if deadline > now_s + window:
                    raise SnapshotError(f"{path}.deadline_s={deadline!r}: later than now_s + grace_window_s "
                                        f"({now_s} + {window})")
            live_held = sum(1 for wid in held if wid in members) if window else 0
            lanes.append(AsyncLane(version, held, last_base, deadline, live_held))
    below = len(members) < min_workers
    # I12: RUNNING and DRAINING imply quorum (a drain that loses it stops, P4); FORMING and PAUSED imply none.
    if (phase in (Phase.RUNNING, Phase.DRAINING) and below
            or phase in (Phase.FORMING, Phase.PAUSED) and not below):
        raise SnapshotError(f"snapshot.phase={phase.value!r} contradicts {len(members)} members "
                            f"and min_workers={min_workers}")
    if phase is Phase.DRAINING and config.mode is not Mode.SYNC:
        raise SnapshotError("snapshot.phase='draining' contradicts mode='async' (an async drain stops at once, P4)")
    for fid, b in enumerate(barriers):
        if b.contributed and phase is Phase.STOPPED:
            raise SnapshotError(f"snapshot.fragments[{fid}]: contributions pending in a stopped run (I5)")
        if b.reducing is not None and phase is Phase.STOPPED:
            raise SnapshotError(f"snapshot.fragments[{fid}]: a reduce attempt open in a stopped run (R12)")
        if (b.contributed and b.live_contributed == len(members) and not below and phase is not Phase.STOPPED
                and b.reducing is None):
            raise SnapshotError(f"snapshot.fragments[{fid}]: round {b.round_id} is complete with quorum "
                                f"but did not apply (I7)")
    for fid, lane in enumerate(lanes):
        # P5: above quorum only an open window holds contributions: its deadline has not passed and
        # some live member has none in it (else it would have closed).
        window_open = (config.grace_window_s and lane.deadline_s is not None and now_s < lane.deadline_s
                       and lane.live_held < len(members))
        if lane.held and (phase is Phase.STOPPED or not (below or window_open)):
            raise SnapshotError(f"snapshot.fragments[{fid}]: contributions held in a stopped run or "
                                f"although quorum holds (I5, I7)")
    window_s = config.grace_window_s
    if "window_s" in d:
        window_s = _num(d["window_s"], "snapshot.window_s")
        if not 0 < window_s <= config.grace_window_s:
            raise SnapshotError(f"snapshot.window_s={window_s!r}: expected seconds in (0, "
                                f"grace_window_s={config.grace_window_s:g}]")
    return Parsed(config, phase, min_workers, now_s, members, barriers, lanes, window_s)


def _load_attempt(raw: object, path: str, config: FSMConfig, members, contributed: dict,
                  attempts: int) -> ReduceAttempt | None:
    """C3: an open attempt's group is ready members in rank order; each report is "" or a digest."""
    if raw is None:
        return None
    d = _dict(raw, path)
    attempt = _int(d.get("attempt"), f"{path}.attempt", 0, attempts - 1)
    reports: dict[str, str] = {}
    for j, item in enumerate(_list(d.get("reports"), f"{path}.reports")):
        wid, digest = _pair(item, f"{path}.reports[{j}]")
        _wid(wid, f"{path}.reports[{j}][0]", config)
        if wid not in members or wid not in contributed or wid in reports:
            raise SnapshotError(f"{path}.reports[{j}]={wid!r}: not a ready member, or listed twice")
        if not isinstance(digest, str) or len(digest) > 128:
            raise SnapshotError(f"{path}.reports[{j}][1]={digest!r:.80}: expected a digest string")
        reports[wid] = digest
    if not reports or list(reports) != sorted(reports):
        raise SnapshotError(f"{path}.reports: expected a non-empty group in rank (sorted id) order")
    filled = [x for x in reports.values() if x]
    if len(set(filled)) > 1:
        raise SnapshotError(f"{path}.reports: two digests in one open attempt (it would have aborted, C4)")
    return ReduceAttempt(attempt, reports, _num(d.get("deadline_s"), f"{path}.deadline_s"), len(filled))


def _dict(v: object, path: str) -> dict:
    if not isinstance(v, dict):
        raise SnapshotError(f"{path} must be a dict, got {type(v).__name__}")
    return v


def _list(v: object, path: str) -> list:
    if not isinstance(v, (list, tuple)):
        raise SnapshotError(f"{path} must be a list, got {type(v).__name__}")
    return list(v)


def _pair(v: object, path: str) -> tuple:
    items = _list(v, path)
    if len(items) != 2:
        raise SnapshotError(f"{path} must be a pair, got {len(items)} items")
    return items[0], items[1]


def _int(v: object, path: str, low: int, high: int | None) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < low or (high is not None and v > high):
        allowed = f"{low}..{high}" if high is not None else f">= {low}"
        raise SnapshotError(f"{path}={v!r}: expected an integer {allowed}")
    return v


def _num(v: object, path: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
        raise SnapshotError(f"{path}={v!r}: expected a number")
    return float(v)


def _wid(v: object, path: str, config: FSMConfig) -> None:
    if not isinstance(v, str) or not 0 < len(v) <= config.max_worker_id_len:
        raise SnapshotError(f"{path}={v!r}: expected a worker id string")
