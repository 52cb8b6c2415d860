"""Every knob of a simulated run, derived from one seed.

One ``random.Random(seed)`` (never the global ``random``) draws a fixed
sequence of uniform numbers, in a fixed order, *before* any command-line
override is applied; the knobs are then computed from those numbers. So
``--workers 7`` changes the worker count without shifting any other knob of
the same seed, and a run is reproduced exactly by its seed plus the
overrides, both of which the trace's first record carries.

The simulation's own randomness during the run (which worker crashes, link
jitter, ...) comes from a second stream, ``random.Random(f"{seed}/run")``,
so adding a knob here does not reshuffle every run's fault schedule.

About 440 lines, one file on purpose: the knobs, the order their numbers are
drawn in and the overrides that replace them must be read together, or a new
knob drawn in the wrong place silently reshuffles every seed's run.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field, fields, replace

from diloco.collective.member import HEAL_TIMEOUTS, MAX_HEAL_ATTEMPTS
from diloco.worker.session import JOIN_RESEND_MAX_S, RESYNC_INTERVALS

#: Fault levels ``--faults`` accepts.
FAULT_LEVELS = ("none", "light", "heavy")
#: Shutdown kinds a run may end with ("none": the run is cut off after the liveness phase).
SHUTDOWN_KINDS = ("none", "drain", "save_and_stop", "abort")
#: Fault kinds the safety phase injects.
FAULT_KINDS = ("crash", "leave", "kick", "freeze", "partition", "coord_crash", "straggle",
               "min_workers", "join")
#: Where rounds are combined (SPEC.md C1): the coordinator (hub) or the workers' groups (collective).
DATA_PLANES = ("hub", "collective")
#: Wire dtypes a simulated run may send on (``--wire-dtype``): fp32, or the sparse wire (SPEC.md
#: section 11), whose accumulators, payloads and method step the checker follows.
WIRE_DTYPES = ("fp32", "sparse")
#: Collective plane: faults a group member's reduce may be given (``diloco.sim.collective``): it dies
#: inside the reduce, its report is lost, it reports another digest, it reports failure, or its
#: data plane wedges after the collective (no report: the core's reduce timeout ends the attempt).
REDUCE_FAULT_KINDS = ("reduce_crash", "report_lost", "digest_mismatch", "report_fail", "wedge")

#: Heals a joiner tries before it gives up, and how many collective timeouts bound one heal: the
#: member machine's own (the simulator drives it).
COLLECTIVE_HEAL_ATTEMPTS = MAX_HEAL_ATTEMPTS
COLLECTIVE_HEAL_TIMEOUTS = HEAL_TIMEOUTS

#: Hard limits on the overrides (a limit on everything that grows).
MAX_WORKERS = 100_000
MAX_ROUNDS = 1_000_000
MAX_FRAGMENTS = 8

#: Longest ``--grace-window`` (the shortest heartbeat timeout a seed draws: a window past the
#: timeout would keep fast workers idle longer than a death takes to notice).
MAX_GRACE_WINDOW_S = 4.0

#: Link delays are capped here, so the liveness bound below can be finite.
MAX_LINK_DELAY_S = 0.25


#: ``derive_config``'s overrides, as ``diloco sim`` and ``run_seed`` name them.
OVERRIDE_NAMES = ("workers", "rounds", "faults", "mode", "fragments", "shutdown", "data_plane", "grace_window",
                  "worker_checkpoints", "wire_dtype")


class SimConfigError(ValueError):
    """A bad override: names the option, the value and what is allowed."""


@dataclass(frozen=True)
class SimConfig:
    """A simulated run. Times are simulated seconds."""

    seed: int
    #: Workers started at the beginning (ids worker-0 .. worker-{workers-1}).
    workers: int
    #: The safety phase ends once this many outer steps have applied (all fragments together).
    rounds: int
    faults: str
    mode: str
    num_fragments: int
    min_workers: int
    heartbeat_timeout_s: float
    heartbeat_interval_s: float
    #: The coordinator is ticked this often when no message arrives (the runner's recv timeout).
    tick_interval_s: float
    #: One training segment at speed 1: one inner step of a simulated worker, which closes one
    #: fragment (its session runs with sync_every = the number of fragments).
    train_s: float
    #: Per-worker speed factors are drawn from [1, speed_spread]; > 1 is slower.
    speed_spread: float
    #: Fraction of workers that are permanent stragglers, and how much slower they are.
    straggler_fraction: float
    straggler_factor: float
    #: Fraction of the initial workers that start late (within a few rounds).
    late_fraction: float
    #: Per-link base delay is drawn from [link_delay_min_s, link_delay_max_s]; jitter on top.
    link_delay_min_s: float
    link_delay_max_s: float
    #: Mean jitter as a fraction of the link's base delay (exponential, capped at MAX_LINK_DELAY_S).
    jitter: float
    #: Fault injection: mean faults per simulated second (0 for faults=none).
    fault_rate_per_s: float
    #: Relative weight of each fault kind, in FAULT_KINDS order.
    fault_weights: tuple[float, ...]
    #: After a crash: chance the transport reports the peer lost; chance it restarts (same id);
    #: otherwise chance a replacement (new id) starts.
    peer_lost_p: float
    restart_p: float
    replace_p: float
    #: Mean durations of the timed faults.
    partition_mean_s: float
    freeze_mean_s: float
    coord_down_mean_s: float
    straggle_mean_s: float
    straggle_max_factor: float
    #: The coordinator's in-memory snapshot for crash/restart is taken this often.
    snapshot_interval_s: float
    shutdown: str
    #: The shutdown comes this long (in segments) after the liveness phase passed, so rounds are in flight.
    shutdown_delay_segments: float
    #: Pause the run first (raise min_workers above the live members), then shut down: a paused
    #: run must always be stoppable, and its parked workers must be released.
    shutdown_paused: bool
    outer_lr: float
    outer_momentum: float
    #: Delayed Nesterov's delay (async); 0 = the coordinator's default (min_workers at install).
    outer_delay: int
    max_staleness: int
    #: The core's limits (SPEC.md section 2); some seeds make them tight to exercise the
    #: held_limit, stale_round and too_many_workers rejections.
    max_held_per_fragment: int
    max_workers: int
    #: Element count of each model tensor (the light worker's "model" is these float32 vectors).
    param_sizes: tuple[int, ...]
    #: Overrides given on the command line (for the record; the values above already include them).
    overrides: dict = field(default_factory=dict)
    #: "hub" or "collective" (an override only: a seed alone always means a hub run). The knobs
    #: below are the collective plane's, drawn from their own stream ``f"{seed}/collective"``;
    #: a hub run's trace leaves them out of its config record.
    data_plane: str = "hub"
    #: The core's reduce timeout (an attempt missing reports this long after its order aborts).
    reduce_timeout_s: float = 0.0
    #: Each group creation, collective and heal transfer on a worker is bounded by this.
    collective_timeout_s: float = 0.0
    #: A group's creation (store rendezvous and barrier), one all-reduce, one heal transfer.
    group_build_s: float = 0.0
    reduce_s: float = 0.0
    heal_s: float = 0.0
    #: Chance that an attempt's reduce gets one of ``REDUCE_FAULT_KINDS`` (0 without faults; each of
    #: its k members draws with ``reduce_fault_p / k``), their
    #: relative weights, and how long a wedged data plane stays wedged (in reduce timeouts).
    reduce_fault_p: float = 0.0
    reduce_fault_weights: tuple[float, ...] = ()
    wedge_factor: float = 0.0
    #: Async grace window (SPEC.md P5), seconds; an override only (``--grace-window``): a seed alone
    #: always means no window, and a run without one leaves it out of its config record.
    grace_window_s: float = 0.0
    #: ``--grace-window auto`` (SPEC.md P5): each window as long as the recent arrivals say, within
    #: ``grace_window_s`` (then ``MAX_GRACE_WINDOW_S``, the ceiling). Left out of a record without it.
    grace_auto: bool = False
    #: Each worker writes a checkpoint at every sync point it may (``--checkpoint-every 1``; W18,
    #: M10: not while its round labels do not name its state), traced as ``ckpt`` records the
    #: checker holds against the commits; a crashed worker's restart resumes from its last one.
    #: An override only (``--worker-checkpoints``); a run without it leaves it out of its config.
    worker_checkpoints: bool = False
    #: ``--wire-dtype sparse`` (SPEC.md section 11): every worker keeps an error-feedback accumulator
    #: and sends ``sparse_k`` entries of each chunk of ``sparse_chunk``, 2 bits a value; the outer step
    #: is plain SGD (momentum 0). An override only, sync on the hub plane; its knobs come from their
    #: own stream ``f"{seed}/sparse"``, and an fp32 run leaves them out of its config record.
    wire_dtype: str = "fp32"
    sparse_chunk: int = 0
    sparse_k: int = 0
    sparse_beta: float = 0.0

    # ------------------------------------------------------------ derived timings

    @property
    def max_segment_s(self) -> float:
        """Longest training segment outside a straggle episode."""
        slow = self.straggler_factor if self.straggler_fraction > 0 else 1.0
        return self.train_s * self.speed_spread * slow

    @property
    def coordinator_timeout_s(self) -> float:
        """A worker gives up on a coordinator silent this long (``--coordinator-timeout``).

        Short enough that the longer partitions and coordinator outages of a faulty run
        make workers give up (exit 3; their supervisor restarts them from their checkpoint),
        which the real default (600 s) never would in a simulated run.
        """
        return 6 * self.heartbeat_timeout_s

    @property
    def liveness_bound_s(self) -> float:
        """After healing, every fragment must apply another round within this (SPEC.md I7).

        The real worker's timers (``diloco.worker.session``) set it. Dead members are
        declared dead within one heartbeat timeout plus a tick; a worker the coordinator
        forgot learns it from its next heartbeat reply and joins again; a worker whose
        Join was lost sends it again after at most ``JOIN_RESEND_MAX_S``; one that gave
        up just before the heal is restarted within two heartbeat timeouts. A Result lost
        before the heal is noticed by the resync after ``RESYNC_INTERVALS`` heartbeat
        intervals of waiting -- doubled after each resync of the same wait, so up to that
        many intervals more than the wait itself, which waiting for a straggler can make
        as long as a straggled segment. A segment started during a straggle episode may
        still be running; then every fragment needs one training step (fragments go in
        turn). Two heartbeat timeouts of slack on top.
        """
        straggled = self.max_segment_s * self.straggle_max_factor
        rejoin = 3 * self.heartbeat_timeout_s + JOIN_RESEND_MAX_S
        resync = RESYNC_INTERVALS * self.heartbeat_interval_s + straggled + self.heartbeat_timeout_s
        bound = (4 * self.heartbeat_timeout_s + rejoin + resync + straggled
                 + (self.num_fragments + 1) * self.max_segment_s + 10.0
                 # A grace window holds a fragment's step back by up to its length (P5).
                 + 2 * self.grace_window_s)
        if self.collective:
            # Collective: an attempt ordered before the heal may run out its reduce timeout (a
            # wedge its reduce timeouts more), a joiner may need a few heals (each bounded by the
            # collective timeout) and every fragment a reduce and a retry.
            heal = COLLECTIVE_HEAL_ATTEMPTS * (2 * COLLECTIVE_HEAL_TIMEOUTS * self.collective_timeout_s + self.heal_s)
            bound += ((2 + self.wedge_factor) * self.reduce_timeout_s + heal
                      + 2 * self.num_fragments * (self.group_build_s + self.reduce_s + self.collective_timeout_s))
        return bound

    @property
    def linger_s(self) -> float:
        """After the stop the coordinator keeps answering this long (the runner's linger)."""
        return 3 * self.heartbeat_interval_s + 4 * MAX_LINK_DELAY_S + 1.0

    @property
    def safety_cap_s(self) -> float:
        """The safety phase ends at this simulated time even if ``rounds`` did not apply."""
        per_round = self.max_segment_s * (1.0 if self.mode == "sync" else 1.0 / max(1, self.workers))
        return 20 * self.heartbeat_timeout_s + 4 * self.rounds * per_round + 60.0

    @property
    def collective(self) -> bool:
        return self.data_plane == "collective"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["fault_weights"] = list(self.fault_weights)
        d["param_sizes"] = list(self.param_sizes)
        if self.collective:
            d["reduce_fault_weights"] = list(self.reduce_fault_weights)
        else:
            # A hub run's config record is what it was before the collective plane existed.
            for name in _COLLECTIVE_FIELDS:
                del d[name]
        if not self.grace_window_s:
            del d["grace_window_s"]  # as before the grace window existed
        if not self.grace_auto:
            del d["grace_auto"]
        if not self.worker_checkpoints:
            del d["worker_checkpoints"]
        if not self.sparse:
            for name in _SPARSE_FIELDS:
                del d[name]
        return d

    @property
    def sparse(self) -> bool:
        return self.wire_dtype == "sparse"

    def describe(self) -> str:
        plane = (f"data_plane=collective reduce_timeout_s={self.reduce_timeout_s:.1f} "
                 f"collective_timeout_s={self.collective_timeout_s:.2f} " if self.collective else "")
        window = f"grace_window_s={self.grace_window_s:g}{' auto' if self.grace_auto else ''} " \
            if self.grace_window_s else ""
        window += "worker_checkpoints " if self.worker_checkpoints else ""
        if self.sparse:
            window += (f"wire_dtype=sparse sparse_chunk={self.sparse_chunk} sparse_k={self.sparse_k} "
                       f"sparse_beta={self.sparse_beta:g} ")
        return (f"{plane}{window}mode={self.mode} workers={self.workers} min_workers={self.min_workers} "
                f"fragments={self.num_fragments} faults={self.faults} rounds={self.rounds} "
                f"shutdown={self.shutdown} heartbeat_timeout_s={self.heartbeat_timeout_s:.1f} "
                f"train_s={self.train_s:.1f}")


_SPARSE_FIELDS = ("wire_dtype", "sparse_chunk", "sparse_k", "sparse_beta")
_COLLECTIVE_FIELDS = ("data_plane", "reduce_timeout_s", "collective_timeout_s", "group_build_s", "reduce_s",
                      "heal_s", "reduce_fault_p", "reduce_fault_weights", "wedge_factor")


def _check_override(name: str, value, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise SimConfigError(f"{name}={value!r} is invalid: expected an integer in {low}..{high}")
    return value


def derive_config(seed: int, *, workers: int | None = None, rounds: int | None = None,
                  faults: str | None = None, mode: str | None = None,
                  fragments: int | None = None, shutdown: str | None = None,
                  data_plane: str | None = None, grace_window: float | str | None = None,
                  worker_checkpoints: bool | None = None, wire_dtype: str | None = None) -> SimConfig:
    """The run that ``seed`` (plus the given overrides) stands for.

    ``data_plane="collective"`` runs the coordinator on the collective plane (SPEC.md C1-C7),
    which is sync only: the seed's mode draw is ignored, and ``mode="async"`` with it is refused.
    ``wire_dtype="sparse"`` is a sync hub run too (SPEC.md section 11), with plain SGD outside.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise SimConfigError(f"seed={seed!r} is invalid: expected an integer >= 0")
    overrides = {}
    if workers is not None:
        overrides["workers"] = _check_override("workers", workers, 1, MAX_WORKERS)
    if rounds is not None:
        overrides["rounds"] = _check_override("rounds", rounds, 1, MAX_ROUNDS)
    if faults is not None:
        if faults not in FAULT_LEVELS:
            raise SimConfigError(f"faults={faults!r} is invalid: expected one of {', '.join(FAULT_LEVELS)}")
        overrides["faults"] = faults
    if mode is not None:
        if mode not in ("sync", "async"):
            raise SimConfigError(f"mode={mode!r} is invalid: expected sync or async")
        overrides["mode"] = mode
    if fragments is not None:
        overrides["fragments"] = _check_override("fragments", fragments, 1, MAX_FRAGMENTS)
    if shutdown is not None:
        if shutdown not in SHUTDOWN_KINDS:
            raise SimConfigError(f"shutdown={shutdown!r} is invalid: expected one of {', '.join(SHUTDOWN_KINDS)}")
        overrides["shutdown"] = shutdown
    if data_plane is not None:
        if data_plane not in DATA_PLANES:
            raise SimConfigError(f"data_plane={data_plane!r} is invalid: expected one of {', '.join(DATA_PLANES)}")
        if data_plane == "collective" and overrides.get("mode") == "async":
            raise SimConfigError("mode='async' is invalid with data_plane='collective': the collective plane "
                                 "is sync only (SPEC.md C1)")
        if data_plane != "hub":
            overrides["data_plane"] = data_plane
    collective = overrides.get("data_plane") == "collective"
    if grace_window == "auto":
        if collective or overrides.get("mode") == "sync":
            raise SimConfigError("grace_window='auto' is invalid with mode='sync' or the collective plane: the "
                                 "grace window is async only (SPEC.md P5)")
        overrides["grace_window"] = "auto"
    elif grace_window is not None:
        if (isinstance(grace_window, bool) or not isinstance(grace_window, (int, float))
                or not 0 <= grace_window <= MAX_GRACE_WINDOW_S):
            raise SimConfigError(f"grace_window={grace_window!r} is invalid: expected a number of seconds in "
                                 f"0..{MAX_GRACE_WINDOW_S:g} (at most the shortest heartbeat timeout a seed draws), "
                                 f"or 'auto'")
        if grace_window and (collective or overrides.get("mode") == "sync"):
            raise SimConfigError(f"grace_window={grace_window!r} is invalid with mode='sync' or the collective "
                                 f"plane: the grace window is async only (SPEC.md P5)")
        if grace_window:
            overrides["grace_window"] = grace_window
    if worker_checkpoints:
        overrides["worker_checkpoints"] = True
    if wire_dtype is not None:
        if wire_dtype not in WIRE_DTYPES:
            raise SimConfigError(f"wire_dtype={wire_dtype!r} is invalid: expected one of {', '.join(WIRE_DTYPES)}")
        if wire_dtype == "sparse" and (collective or overrides.get("mode") == "async"
                                       or overrides.get("grace_window")):
            raise SimConfigError("wire_dtype='sparse' is invalid with the collective plane, mode='async' or a "
                                 "grace window: the simulator runs the sparse wire sync on the hub plane (the "
                                 "collective plane's gather is tested on real processes)")
        if wire_dtype != "fp32":
            overrides["wire_dtype"] = wire_dtype
    sparse = overrides.get("wire_dtype") == "sparse"

    rng = random.Random(seed)
    # A fixed number of draws in a fixed order, before any override is looked at.
    u = [rng.random() for _ in range(40)]
    weights_u = [rng.random() for _ in FAULT_KINDS]
    sizes_u = [rng.random() for _ in range(MAX_FRAGMENTS + 3)]

    def pick(x: float, table: list[tuple[float, object]]):
        acc = 0.0
        for p, value in table:
            acc += p
            if x < acc:
                return value
        return table[-1][1]

    n_workers = overrides.get("workers") or pick(u[0], [(0.05, 1), (0.45, None), (0.50, -1)])
    if n_workers is None:
        n_workers = 2 + int(u[1] * 3)          # 2..4
    elif n_workers == -1:
        n_workers = 5 + int(u[1] * 8)          # 5..12
    n_rounds = overrides.get("rounds") or 8 + int(u[2] * 33)
    level = overrides.get("faults") or pick(u[3], [(0.15, "none"), (0.40, "light"), (0.45, "heavy")])
    run_mode = "sync" if collective else overrides.get("mode") or ("sync" if u[4] < 0.65 else "async")
    if overrides.get("grace_window"):
        run_mode = "async"  # a window is async only: the seed's mode draw is ignored
    if sparse:
        run_mode = "sync"  # the sparse wire is sync only: the seed's mode draw is ignored
    n_frag = overrides.get("fragments") or pick(u[5], [(0.6, 1), (0.25, 2), (0.1, 3), (0.05, 4)])
    if u[6] < 0.3:
        min_w = n_workers
    else:
        min_w = 1 + int(u[7] * n_workers)
    timeout = 4.0 + 16.0 * u[8]
    interval = timeout * (0.15 + 0.1 * u[9])
    train = timeout * (0.3 + 2.7 * u[10])
    heavy = level == "heavy"
    rate = {"none": 0.0, "light": 1.0 / (60 + 120 * u[11]), "heavy": 1.0 / (5 + 15 * u[11])}[level]
    weights = tuple(round(0.2 + w, 6) for w in weights_u)
    if heavy:
        weights = tuple(w / 3 if k == "coord_crash" else w for k, w in zip(FAULT_KINDS, weights))
    else:
        # Light faults: no coordinator crashes, fewer admin changes.
        weights = tuple(0.0 if k == "coord_crash" else (w / 3 if k in ("min_workers", "kick") else w)
                        for k, w in zip(FAULT_KINDS, weights))
    n_tensors = max(n_frag, 1 + int(sizes_u[0] * 4))
    sizes = tuple(1 + int(sizes_u[1 + i] * 4) for i in range(n_tensors))
    delay_lo = 0.0005 + 0.01 * u[12]
    delay_hi = delay_lo + (0.05 if u[13] < 0.8 else 0.15) * u[14]
    shutdown_kind = overrides.get("shutdown") or pick(u[15], [(0.25, "none"), (0.35, "drain"),
                                                              (0.2, "save_and_stop"), (0.2, "abort")])
    # Limits come from their own stream, so adding them did not change any other knob of a seed.
    lim = random.Random(f"{seed}/limits")
    lu = [lim.random() for _ in range(8)]
    max_held = 1024 if lu[0] < 0.7 else 1 + int(lu[1] * 3)
    # Tight staleness: about what a worker's base ages in one pass over the fragments.
    max_staleness = max(8, 4 * n_workers * n_frag) if lu[2] < 0.7 else max(1, n_workers)
    max_workers = 10_000 if lu[3] < 0.75 else n_workers + 1 + int(lu[4] * 3)
    cfg = SimConfig(
        seed=seed,
        workers=n_workers,
        rounds=n_rounds,
        faults=level,
        mode=run_mode,
        num_fragments=n_frag,
        min_workers=min(min_w, n_workers),
        heartbeat_timeout_s=round(timeout, 6),
        heartbeat_interval_s=round(interval, 6),
        tick_interval_s=round(min(0.5, timeout / 8), 6),
        train_s=round(train, 6),
        speed_spread=round(1.0 + 0.5 * u[16], 6),
        straggler_fraction=0.0 if u[17] < 0.5 else round(0.3 * u[18], 6),
        straggler_factor=round(1.5 + 2.5 * u[19], 6),
        late_fraction=0.0 if u[20] < 0.5 else round(0.5 * u[21], 6),
        link_delay_min_s=round(delay_lo, 6),
        link_delay_max_s=round(min(delay_hi, MAX_LINK_DELAY_S), 6),
        jitter=round(0.1 + 0.5 * u[22], 6),
        fault_rate_per_s=round(rate, 9),
        fault_weights=weights,
        peer_lost_p=round(u[23], 6),
        restart_p=round(0.3 + 0.6 * u[24], 6),
        replace_p=round(0.5 + 0.5 * u[25], 6),
        partition_mean_s=round(timeout * (0.3 + 2.7 * u[26]), 6),
        freeze_mean_s=round(timeout * (0.3 + 2.0 * u[27]), 6),
        coord_down_mean_s=round(timeout * (0.2 + 1.5 * u[28]), 6),
        straggle_mean_s=round(train * (1.0 + 4.0 * u[29]), 6),
        straggle_max_factor=round(2.0 + 6.0 * u[30], 6),
        snapshot_interval_s=round(train * (0.5 + 5.0 * u[31]), 6),
        shutdown=shutdown_kind,
        shutdown_delay_segments=round(1.5 * u[37], 6),
        shutdown_paused=u[38] < 0.3,
        outer_lr=round(0.3 + 0.7 * u[32], 6),
        # The sparse wire's step has no global momentum (the worker's accumulator stands for it).
        outer_momentum=round(0.9 * u[33], 6) if u[34] < 0.85 and not sparse else 0.0,
        outer_delay=0 if u[35] < 0.6 else 1 + int(u[36] * 4),
        max_staleness=max_staleness,
        max_held_per_fragment=max_held,
        max_workers=max_workers,
        param_sizes=sizes,
        overrides=overrides,
        grace_window_s=(MAX_GRACE_WINDOW_S if overrides.get("grace_window") == "auto"
                        else float(overrides.get("grace_window", 0.0))),
        grace_auto=overrides.get("grace_window") == "auto",
        worker_checkpoints=bool(overrides.get("worker_checkpoints", False)),
    )
    if collective:
        cfg = replace(cfg, **_collective_knobs(seed, cfg))
    if sparse:
        cfg = replace(cfg, **_sparse_knobs(seed))
    return cfg


def _sparse_knobs(seed: int) -> dict:
    """The sparse wire's knobs, from their own stream: chunks of 2-4 elements (the simulated tensors
    have 1-4), so payloads leave entries out and short last chunks occur; any decay in [0.5, 1)."""
    rng = random.Random(f"{seed}/sparse")
    u = [rng.random() for _ in range(3)]
    chunk = 2 + int(u[0] * 3)
    return dict(wire_dtype="sparse", sparse_chunk=chunk, sparse_k=1 + int(u[1] * (chunk - 1)),
                sparse_beta=round(0.5 + 0.5 * u[2], 6))


def _collective_knobs(seed: int, cfg: SimConfig) -> dict:
    """The collective plane's knobs, from their own stream (the hub knobs of the seed stay as they are).

    The coordinator's rules (``CoordinatorConfig``): the collective timeout is below the
    heartbeat timeout and the reduce timeout well above it (SPEC.md C7: at least four times).
    A heal may take longer than a session's join resend (2.5 s), as a real model's does.
    """
    rng = random.Random(f"{seed}/collective")
    u = [rng.random() for _ in range(12)]
    weights_u = [rng.random() for _ in REDUCE_FAULT_KINDS]
    timeout = cfg.heartbeat_timeout_s
    collective_timeout = timeout * (0.1 + 0.2 * u[0])
    p = {"none": 0.0, "light": 0.01 + 0.04 * u[5], "heavy": 0.05 + 0.15 * u[5]}[cfg.faults]
    return dict(
        data_plane="collective",
        collective_timeout_s=round(collective_timeout, 6),
        reduce_timeout_s=round(collective_timeout * (4.0 + 6.0 * u[1]), 6),
        group_build_s=round(collective_timeout * (0.01 + 0.1 * u[2]), 6),
        reduce_s=round(min(collective_timeout * (0.02 + 0.3 * u[3]), cfg.train_s * 0.2), 6),
        heal_s=round(collective_timeout * (0.05 + 0.6 * u[4]), 6),
        reduce_fault_p=round(p, 6),
        reduce_fault_weights=tuple(round(0.2 + w, 6) for w in weights_u),
        wedge_factor=round(1.0 + 1.5 * u[6], 6),
    )

def config_from_dict(d: dict) -> SimConfig:
    """Rebuild a config from a trace's first record (``--replay``)."""
    names = {f.name for f in fields(SimConfig)}
    missing = sorted(names - set(d) - set(_COLLECTIVE_FIELDS) - set(_SPARSE_FIELDS)
                     - {"grace_window_s", "grace_auto", "worker_checkpoints"})
    if missing:
        raise SimConfigError(f"the trace's config record lacks {missing}")
    kwargs = {k: d[k] for k in names if k in d}
    kwargs["fault_weights"] = tuple(kwargs["fault_weights"])
    if "reduce_fault_weights" in kwargs:
        kwargs["reduce_fault_weights"] = tuple(kwargs["reduce_fault_weights"])
    kwargs["param_sizes"] = tuple(kwargs["param_sizes"])
    return SimConfig(**kwargs)

