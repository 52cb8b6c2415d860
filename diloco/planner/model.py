"""The bandwidth model behind ``diloco plan``: pure functions, no I/O.

One worker's timeline is simulated against one shared FIFO link, after the
simulator behind Streaming DiLoCo's Table 4 (Douillard et al., 2025):

* a step takes ``T`` seconds of compute: forward ``T/3``, backward ``2T/3``;
* what a step sends is split into ``buckets`` equal buckets, one per layer
  (default 24, the layers of Table 4's 1B model: the paper's simulator
  reduces each layer's gradients as its backward ends), released evenly over
  that step's backward pass, each at the *end* of its slice of the backward;
  the last bucket is released as the backward ends;
* the link sends buckets first in, first out, at the bandwidth; a payload of
  ``N`` parameters is ``N * bytes_per_param * 8 * c`` bits, ``c`` copies of
  it as the data plane puts them on its busiest link (below);
* every sync has a deadline, the end of a step: data parallel sends all
  gradients each step, due at that step's end; DiLoCo sends the whole model
  over the backward of the H-th inner step, due at that step's end (the outer
  step blocks); Streaming DiLoCo sends fragment ``p`` (``1/P`` of the model)
  over the backward of inner step ``ceil((p+1) H / P)`` of each round, due
  ``tau`` steps after the end of the step that released it;
* a step whose syncs are late stalls by its largest overrun, and the stall
  pushes every later step and release back in time (the timeline is
  simulated, not each step alone);
* utilisation = compute / (compute + stall), measured over one round (H
  steps) of the periodic regime, after warm-up rounds.

Each sync's last bucket arrives at ``max(link_free + S, first + S, last + S/k)``
for a transfer of ``S`` seconds in ``k`` buckets released from ``first`` to
``last``, so the simulation costs O(1) per sync, not per bucket.

Data planes (``data_plane``; ``M`` workers), each on full-duplex links (a link
sends and receives at the bandwidth at the same time):

* ``collective`` (default): the workers ring-all-reduce among themselves.
  Each worker's link sends ``2(1 - 1/M)`` copies of the payload and receives
  as many at the same time, so ``c = 2(1 - 1/M)`` on each worker's link: the
  bandwidth is each worker's, and ``c`` stays under 2 whatever ``M``.
* ``hub``: every worker sends its payload (pseudo-gradient) to one
  coordinator and receives the result (new parameters) back, as ``diloco
  server`` does. The coordinator's link carries ``M`` copies in and ``M``
  copies out per sync, one after the other: the outer step needs every
  upload before it makes any reply, so in and out do not overlap and the
  sync takes ``2M`` copies' time: ``c = 2M`` on the coordinator's link, the
  bottleneck (a worker's link carries one copy each way). Measured over
  emulated 100 Mbit/s links (``benchmarks/bench_links.py``) a hub round took
  0.96 of that. A parameter server that streams its replies bucket by bucket
  behind the uploads would overlap them and need half (``M``).

Gathered wires (``--wire sparse``, SPEC.md section 11 "The sparse wire"): a worker's payload
cannot be summed on the way (each is top-k of its own accumulator), so every payload reaches
every worker whole. On the hub each Result carries all ``M`` payloads: ``M`` in, then ``M * M``
out, ``c = M + M^2`` payloads on the coordinator's link; on the collective plane an all-gather
sends a worker's payload to the ``M - 1`` others and receives theirs at the same time,
``c = M - 1``. A sparse payload is ``2 / 64 + 4 / 4096`` bytes per parameter at the defaults
(64 kept 2-byte entries and one 4-byte scale per chunk of 4096).

The sparse wire's CPU work: a sparse sync's link time is small, and each worker's own work on
it is not: before its upload, the chunk-wise top-k of its accumulator (with the pseudo-gradient,
the accumulator's decay and its norm); after the round, checking, decoding and adding the round's
``M`` payloads into a sum, the step, its finiteness check and the install. That is a few passes
over all ``N`` of its params and one visit to each of the ``M * N * density`` payload entries, so
a gathered sync takes ``sparse_cpu_s = N / cpu_rate + M * N * density / entry_rate`` seconds of
the worker's CPU beside its link time (``sync_s``), one after the other: the top-k needs the
whole pseudo-gradient, the step every payload. ``cpu_rate`` (parameters per second) and
``entry_rate`` (payload entries per second) are one CPU core's, measured by timing that code
(``benchmarks/bench_sparse_cpu.py``); the defaults are what it measured on a 2-core x86 VM (one
thread, 10M parameters, 8 payloads; the median of its runs). The coordinator's own
work (decoding each upload as it arrives, one step) is not counted: it overlaps the uploads or
is one pass. Dense wires' CPU work (an int4 quantisation, a sum) is not modelled.

A half-duplex link carries a ring's in and out one after the other:
``4(1 - 1/M)`` copies per worker, so it needs twice the bandwidth the model
gives for the same utilisation (a hub's in and out are sequential already).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

#: Bytes per parameter on the wire for the dtype names ``--wire`` accepts (``sparse``: one worker's
#: payload at diloco's defaults, 64 of every 4096 entries at 2 bytes and a 4-byte scale per chunk).
WIRE_DTYPES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "fp8": 1.0, "int8": 1.0, "fp4": 0.5, "int4": 0.5,
               "sparse": 2 * 64 / 4096 + 4 / 4096}
#: Wire formats whose payloads reach every worker whole (module docstring, "Gathered wires").
GATHERED_WIRES = frozenset({"sparse"})
#: The share of each chunk the sparse wire keeps at diloco's defaults (64 of 4096 entries).
SPARSE_DENSITY = 64 / 4096
#: One CPU core's rate through the passes a sparse round makes over all of a worker's params, in
#: parameters per second (module docstring, "The sparse wire's CPU work"; ``diloco plan --cpu-rate``).
DEFAULT_CPU_RATE = 6.5e7
#: One CPU core's rate decoding and adding a sparse round's payload entries into the sum, in entries
#: per second (``diloco plan --entry-rate``).
DEFAULT_ENTRY_RATE = 3e7
#: The bandwidths ``--sweep`` tries (Gbit/s), as in the paper's simulator.
BANDWIDTH_GRID_GBIT_S = np.logspace(-1, 3, 50)
#: ``data_plane`` values: where a sync's bits go (module docstring).
DATA_PLANES = ("collective", "hub")
#: The link whose bandwidth the model's figures are, per data plane.
LINK_OF = {"collective": "each worker's link", "hub": "the coordinator's link"}
#: The compute-utilisation targets of the paper's Table 4.
TARGETS = (0.5, 0.8, 0.9, 0.95, 0.99)
#: Buckets a step's payload is split into: one per layer, as the paper's simulator reduces each layer's
#: gradients (Figure 3); Table 4's 1B model has 24 layers. (The later web simulator at
#: arthurdouillard.com/diloco uses 128; only data parallel at 99% tells the two apart.)
DEFAULT_BUCKETS = 24
#: Shares of a step: forward then backward.
FORWARD_SHARE = 1.0 / 3.0
#: Rounds simulated before the measured one, on top of those the overlap spans.
WARMUP_ROUNDS = 3
#: Utilisation may fall short of a target by this much and still count (float noise only).
TARGET_SLACK = 1e-12


class PlanError(ValueError):
    """An input the model cannot take: names the input, the value and what is allowed."""


def parse_wire(text: str) -> float:
    """Bytes per parameter from a dtype name (``bf16``) or a positive number (``2``, ``0.5``)."""
    key = str(text).strip().lower()
    if key in WIRE_DTYPES:
        return WIRE_DTYPES[key]
    try:
        value = float(key)
    except ValueError:
        raise PlanError(f"wire format {text!r} is neither a dtype ({', '.join(WIRE_DTYPES)}) "
                        "nor a number of bytes per parameter") from None
    if not math.isfinite(value) or value <= 0:
        raise PlanError(f"bytes per parameter must be a positive number, got {text!r}")
    return value


def link_copies(workers: int, data_plane: str = "collective", gathered: bool = False) -> float:
    """Copies' worth of time a sync takes on the data plane's busiest link: 2(1 - 1/M) for ``collective``
    (each worker's link, a ring all-reduce, as many each way at once), 2M for ``hub`` (the coordinator's
    link: M in, then M out; the replies need every upload). ``gathered`` (a sparse wire): M - 1 and
    M + M^2 (module docstring)."""
    _int_at_least("workers", workers, 1)
    _check_plane(data_plane)
    if gathered:
        return float(workers + workers * workers) if data_plane == "hub" else float(workers - 1)
    return 2.0 * workers if data_plane == "hub" else 2.0 * (1.0 - 1.0 / workers)


def sync_bits(params: float, bytes_per_param: float, workers: int, data_plane: str = "collective",
              gathered: bool = False) -> float:
    """Bits a sync of ``params`` parameters puts on the data plane's busiest link (see :func:`link_copies`)."""
    _positive("params", params)
    _positive("bytes_per_param", bytes_per_param)
    return params * bytes_per_param * 8.0 * link_copies(workers, data_plane, gathered)


def sparse_cpu_s(params: float, workers: int, cpu_rate: float = DEFAULT_CPU_RATE,
                 entry_rate: float = DEFAULT_ENTRY_RATE, density: float = SPARSE_DENSITY) -> float:
    """Seconds of one worker's CPU a sparse sync takes beside its link time: ``params / cpu_rate`` for its
    passes over all its params (the top-k encode, the step) and ``workers * params * density / entry_rate``
    for the round's payload entries it decodes and adds (module docstring, "The sparse wire's CPU work")."""
    _positive("params", params)
    _int_at_least("workers", workers, 1)
    _positive("cpu_rate", cpu_rate)
    _positive("entry_rate", entry_rate)
    return params / cpu_rate + workers * params * density / entry_rate


def sync_s(params: float, bytes_per_param: float, workers: int, bandwidth_bit_s: float,
           data_plane: str = "collective", gathered: bool = False, cpu_rate: float = DEFAULT_CPU_RATE,
           entry_rate: float = DEFAULT_ENTRY_RATE) -> float:
    """Seconds a sync takes: its bits on the busiest link (:func:`sync_bits`) over ``bandwidth_bit_s``, and for
    a gathered (sparse) wire the worker's CPU work on it (:func:`sparse_cpu_s`), one after the other."""
    _positive("bandwidth_bit_s", bandwidth_bit_s)
    link = sync_bits(params, bytes_per_param, workers, data_plane, gathered) / bandwidth_bit_s
    return link + (sparse_cpu_s(params, workers, cpu_rate, entry_rate) if gathered else 0.0)


@dataclass(frozen=True)
class Method:
    """A way to synchronise: data parallel is H=1, P=1, tau=0; DiLoCo is P=1, tau=0."""

    name: str
    inner_steps: int
    fragments: int
    overlap: int
    bytes_per_param: float
    #: Its payloads reach every worker whole (a sparse wire: :func:`link_copies`).
    gathered: bool = False

    @property
    def steps_between_syncs(self) -> float:
        return self.inner_steps / self.fragments


def methods(inner_steps: int, fragments: int, overlap: int, bytes_per_param: float,
            streaming_bytes_per_param: float | None = None, gathered: bool = False,
            streaming_gathered: bool | None = None) -> tuple[Method, Method, Method]:
    """Data parallel, DiLoCo and Streaming DiLoCo for one setting (Streaming may use its own wire format)."""
    streaming = bytes_per_param if streaming_bytes_per_param is None else streaming_bytes_per_param
    s_gathered = gathered if streaming_gathered is None else streaming_gathered
    return (Method("data parallel", 1, 1, 0, bytes_per_param, gathered),
            Method("DiLoCo", inner_steps, 1, 0, bytes_per_param, gathered),
            Method("Streaming DiLoCo", inner_steps, fragments, overlap, streaming, s_gathered))


def parse_wire_format(text: str) -> tuple[float, bool]:
    """``(bytes per parameter, gathered)`` of a ``--wire`` value: a dtype name or a number of bytes."""
    return parse_wire(text), str(text).strip().lower() in GATHERED_WIRES


def release_steps(inner_steps: int, fragments: int) -> list[int]:
    """The inner step (0-based, within a round) whose backward sends each fragment; the last is H-1."""
    _check_schedule(inner_steps, fragments, 0)
    return [math.ceil((p + 1) * inner_steps / fragments) - 1 for p in range(fragments)]


def utilisation(*, params: float, step_time_s: float, workers: int, bandwidth_gbit_s: float,
                bytes_per_param: float, inner_steps: int = 1, fragments: int = 1, overlap: int = 0,
                buckets: int = DEFAULT_BUCKETS, data_plane: str = "collective", gathered: bool = False,
                cpu_rate: float = DEFAULT_CPU_RATE, entry_rate: float = DEFAULT_ENTRY_RATE) -> float:
    """Compute utilisation in (0, 1] of one method with ``bandwidth_gbit_s`` on the data plane's busiest link
    (each worker's for ``collective``, the coordinator's for ``hub``; see the module docstring). A gathered
    (sparse) sync also takes the worker's CPU work on it (``cpu_rate``, ``entry_rate``: :func:`sync_s`)."""
    _positive("step_time_s", step_time_s)
    _positive("bandwidth_gbit_s", bandwidth_gbit_s)
    _int_at_least("buckets", buckets, 1)
    _check_schedule(inner_steps, fragments, overlap)
    transfer = sync_s(params, bytes_per_param, workers, bandwidth_gbit_s * 1e9, data_plane, gathered, cpu_rate,
                      entry_rate) / fragments
    if transfer == 0.0:
        return 1.0
    t = step_time_s
    first_release = t * FORWARD_SHARE + t * (1.0 - FORWARD_SHARE) / buckets
    rounds = WARMUP_ROUNDS + math.ceil(overlap / inner_steps) + 1
    # Steps where something happens: a release or a deadline. Others last exactly t.
    releases: dict[int, int] = {}
    for r in range(rounds):
        for s in release_steps(inner_steps, fragments):
            step = r * inner_steps + s
            releases[step] = releases.get(step, 0) + 1
    deadlines: dict[int, list[float]] = {}
    link_free = 0.0
    stalled = 0.0  # stall accumulated before the current step starts
    measured_from = (rounds - 1) * inner_steps
    stall_in_measured = 0.0
    for step in sorted(set(releases) | {s + overlap for s in releases}):
        start = step * t + stalled
        for _ in range(releases.get(step, 0)):
            link_free = max(link_free + transfer, start + first_release + transfer, start + t + transfer / buckets)
            deadlines.setdefault(step + overlap, []).append(link_free)
        due = deadlines.pop(step, None)
        if due:
            over = max(0.0, max(due) - (start + t))
            stalled += over
            if measured_from <= step < measured_from + inner_steps:
                stall_in_measured += over
    compute = inner_steps * t
    return compute / (compute + stall_in_measured)


def method_utilisation(method: Method, *, params: float, step_time_s: float, workers: int,
                       bandwidth_gbit_s: float, buckets: int = DEFAULT_BUCKETS,
                       data_plane: str = "collective", cpu_rate: float = DEFAULT_CPU_RATE,
                       entry_rate: float = DEFAULT_ENTRY_RATE) -> float:
    return utilisation(params=params, step_time_s=step_time_s, workers=workers, bandwidth_gbit_s=bandwidth_gbit_s,
                       bytes_per_param=method.bytes_per_param, inner_steps=method.inner_steps,
                       fragments=method.fragments, overlap=method.overlap, buckets=buckets, data_plane=data_plane,
                       gathered=method.gathered, cpu_rate=cpu_rate, entry_rate=entry_rate)


def utilisation_curve(method: Method, *, params: float, step_time_s: float, workers: int,
                      bandwidths_gbit_s=BANDWIDTH_GRID_GBIT_S, buckets: int = DEFAULT_BUCKETS,
                      data_plane: str = "collective", cpu_rate: float = DEFAULT_CPU_RATE,
                      entry_rate: float = DEFAULT_ENTRY_RATE) -> np.ndarray:
    """Utilisation at each bandwidth of ``bandwidths_gbit_s``."""
    return np.array([method_utilisation(method, params=params, step_time_s=step_time_s, workers=workers,
                                        bandwidth_gbit_s=float(b), buckets=buckets, data_plane=data_plane,
                                        cpu_rate=cpu_rate, entry_rate=entry_rate)
                     for b in bandwidths_gbit_s])


def bandwidth_needed(curve, bandwidths_gbit_s=BANDWIDTH_GRID_GBIT_S, targets=TARGETS) -> list[float | None]:
    """For each target, the smallest bandwidth whose utilisation reaches it (None: none on the grid does)."""
    curve = np.asarray(curve, dtype=float)
    grid = np.asarray(bandwidths_gbit_s, dtype=float)
    if curve.shape != grid.shape:
        raise PlanError(f"curve has {curve.size} points but the grid has {grid.size}")
    out: list[float | None] = []
    for target in targets:
        if not 0.0 < target <= 1.0:
            raise PlanError(f"utilisation target must be in (0, 1], got {target}")
        hits = np.nonzero(curve >= target - TARGET_SLACK)[0]
        out.append(float(grid[hits[0]]) if hits.size else None)
    return out


def bandwidth_for(method: Method, target: float, *, params: float, step_time_s: float, workers: int,
                  buckets: int = DEFAULT_BUCKETS, data_plane: str = "collective", rel_tol: float = 1e-6,
                  cpu_rate: float = DEFAULT_CPU_RATE, entry_rate: float = DEFAULT_ENTRY_RATE) -> float:
    """The smallest bandwidth (Gbit/s, to ``rel_tol``) of the data plane's busiest link at which ``method``
    reaches ``target`` utilisation: a bisection, not the sweep's grid. 0.0 when a sync sends nothing (a ring
    of one worker). Utilisation depends on the bandwidth only through bits / bandwidth, so the answer is
    proportional to the bits per sync: ``2M`` times one copy for a hub, ``2(1 - 1/M)`` times for a ring.
    A sparse sync's CPU work does not shrink with the bandwidth: ``PlanError`` when it alone misses the
    target."""
    if not 0.0 < target < 1.0:
        raise PlanError(f"utilisation target must be in (0, 1), got {target}")
    common = dict(params=params, step_time_s=step_time_s, workers=workers, buckets=buckets, data_plane=data_plane,
                  cpu_rate=cpu_rate, entry_rate=entry_rate)

    def reaches(b: float) -> bool:
        return method_utilisation(method, bandwidth_gbit_s=b, **common) >= target - TARGET_SLACK

    if sync_bits(params, method.bytes_per_param, workers, data_plane, method.gathered) == 0.0:
        if reaches(1.0):
            return 0.0
        raise PlanError(f"{method.name} does not reach {target:.0%} utilisation at any bandwidth")

    lo = hi = 1.0
    while not reaches(hi):
        lo, hi = hi, hi * 2.0
        if hi > 1e30:
            raise PlanError(f"{method.name} does not reach {target:.0%} utilisation at any bandwidth")
    while reaches(lo):
        lo, hi = lo / 2.0, lo
    while hi / lo > 1.0 + rel_tol:
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if reaches(mid) else (mid, hi)
    return hi


#: What ``diloco plan --plane-table`` tabulates: model sizes, workers and the utilisation target.
PLANE_TABLE_PARAMS = (1e9, 10e9)
PLANE_TABLE_WORKERS = (4, 16, 64)
PLANE_TABLE_TARGET = 0.9


def plane_table(ms, *, step_time_s: float, buckets: int = DEFAULT_BUCKETS, params=PLANE_TABLE_PARAMS,
                workers=PLANE_TABLE_WORKERS, target: float = PLANE_TABLE_TARGET, cpu_rate: float = DEFAULT_CPU_RATE,
                entry_rate: float = DEFAULT_ENTRY_RATE) -> dict:
    """The bandwidth (Gbit/s) each data plane's busiest link needs for ``target`` utilisation, for each method
    of ``ms``, model size and number of workers: ``{(method name, params, data plane, workers): Gbit/s}``.
    For ``hub`` that is the coordinator's link, for ``collective`` each worker's (see :data:`LINK_OF`);
    ``math.inf`` where none does (a sparse sync's CPU work alone misses the target)."""
    def needed(m: Method, n: float, plane: str, k: int) -> float:
        try:
            return bandwidth_for(m, target, params=n, step_time_s=step_time_s, workers=k, buckets=buckets,
                                 data_plane=plane, cpu_rate=cpu_rate, entry_rate=entry_rate)
        except PlanError:
            return math.inf

    return {(m.name, n, plane, k): needed(m, n, plane, k)
            for n in params for m in ms for plane in ("hub", "collective") for k in workers}


def _check_schedule(inner_steps: int, fragments: int, overlap: int) -> None:
    _int_at_least("inner_steps (H)", inner_steps, 1)
    _int_at_least("fragments (P)", fragments, 1)
    _int_at_least("overlap (tau)", overlap, 0)
    if fragments > inner_steps:
        raise PlanError(f"fragments (P) must be at most inner_steps (H) = {inner_steps}, got {fragments}")


def _check_plane(data_plane) -> None:
    if data_plane not in DATA_PLANES:
        raise PlanError(f"data_plane must be one of {', '.join(DATA_PLANES)}, got {data_plane!r}")


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise PlanError(f"{name} must be a positive finite number, got {value!r}")


def _int_at_least(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise PlanError(f"{name} must be an integer >= {low}, got {value!r}")
