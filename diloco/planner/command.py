"""``diloco plan``: what bandwidth a compute utilisation needs, for data parallel, DiLoCo and Streaming DiLoCo.

Pure computation (diloco.planner.model); it imports numpy (and matplotlib for
``--plot``) only when it runs, so ``diloco plan --help`` starts fast.
"""

from __future__ import annotations

import argparse
import math
import os
import re

from diloco.argtypes import flag_value

EXIT_OK = 0

#: The dtype names of diloco.planner.model.WIRE_DTYPES (tests/test_planner.py keeps them equal).
WIRE_NAMES = "fp32=4, fp16=2, bf16=2, fp8=1, int8=1, fp4=0.5, int4=0.5, sparse=0.0322265625"
#: diloco.planner.model.DEFAULT_BUCKETS, without importing numpy for --help (the tests keep them equal).
DEFAULT_BUCKETS = 24
#: diloco.planner.model.DEFAULT_CPU_RATE and DEFAULT_ENTRY_RATE, for --help (the tests keep them equal).
DEFAULT_CPU_RATE = 6.5e7
DEFAULT_ENTRY_RATE = 3e7
#: diloco.planner.model.DATA_PLANES and the link each one's figures are of (the tests keep them equal).
DATA_PLANES = ("collective", "hub")
LINK_OF = {"collective": "each worker's link", "hub": "the coordinator's link"}

DESCRIPTION = """\
Plan the bandwidth between workers: the compute utilisation (compute time over
wall time) of data parallel, DiLoCo and Streaming DiLoCo at a bandwidth, or,
with --sweep, the smallest bandwidth that reaches 50/80/90/95/99% utilisation.

The model (docs/planner.md, after the simulator of Streaming
DiLoCo's Table 4): a step is a forward of T/3 and a backward of 2T/3; what a
step sends goes out in 24 buckets (one per layer) released over its backward,
through one FIFO link; a sync of N parameters is N x bytes x 8 x c bits. Data
parallel sends every step, due at the step's end; DiLoCo sends the whole
model every H steps, due at the end of the H-th; Streaming DiLoCo sends 1/P
of the model every H/P steps, due tau steps later. A late sync stalls the
step by its overrun and every later step with it.

Data planes (--data-plane; links are full duplex):
  collective  the M workers all-reduce among themselves (ring): the bandwidth
              is each worker's link, carrying c = 2(1 - 1/M) copies of a sync
              each way at once, under 2 whatever M (a half-duplex link needs
              twice the bandwidth).
  hub         each worker sends its pseudo-gradient to one coordinator and
              gets the new parameters back, as diloco server does: the
              bandwidth is the coordinator's link, carrying M copies in and
              then M out (the replies need every upload), c = 2M, so it
              grows with M.

A sparse sync (--wire sparse) also costs each worker CPU time beside its
link time, one after the other: N / --cpu-rate seconds for its passes over
its N params (the top-k encode of its accumulator; the step and install)
and M x N x 64/4096 / --entry-rate for decoding and adding the round's M
payloads. The defaults are one core's, measured on a 2-core VM by
benchmarks/bench_sparse_cpu.py, which times this machine's (docs/planner.md)."""

EPILOG = """\
examples:
  diloco plan --bandwidth 10                       utilisation at 10 Gbit/s (1B parameters, step 0.1 s, ...)
  diloco plan --params 1B --workers 2 --inner-steps 100 --fragments 8 --overlap 1 \\
              --wire bf16 --streaming-wire int4 --sweep --plot plan.png
  diloco plan --workers 16 --data-plane hub --sweep   the coordinator's link a 16-worker hub needs

exit codes: 0 ok, 2 bad usage or input"""

_SUFFIXES = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def _params(text: str) -> float:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmbgt]?)\s*", text.lower())
    value = float(m.group(1)) * _SUFFIXES[m.group(2)] if m else float("nan")
    if not (math.isfinite(value) and value >= 1):
        raise argparse.ArgumentTypeError(
            f"--params must be a parameter count >= 1 such as 1e9, 1B, 350M or 7b, got {text!r}")
    return value


def _positive(flag: str):
    return flag_value(float, lambda v: 0 < v < math.inf, "a positive number", flag)


def _int_at_least(flag: str, low: int):
    return flag_value(int, lambda v: v >= low, f"an integer >= {low}", flag)


def _wire():
    def parse(text: str) -> tuple[float, bool]:
        from diloco.planner.model import PlanError, parse_wire_format

        try:
            return parse_wire_format(text)
        except PlanError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return parse


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "plan", help="bandwidth planner: compute utilisation of data parallel, DiLoCo and Streaming DiLoCo",
        description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    run = p.add_argument_group("the training run (defaults: the 1B setting of Streaming DiLoCo's Table 4)")
    run.add_argument("--params", type=_params, default=1e9, metavar="N",
                     help="model parameters: 1e9, 1B, 350M, ... (default 1B)")
    run.add_argument("--step-time", type=_positive("--step-time"), default=0.1, metavar="T",
                     help="seconds of compute per inner step, forward and backward (default 0.1)")
    run.add_argument("--workers", type=_int_at_least("--workers", 1), default=2, metavar="M",
                     help="workers (replicas) that sync across the link (default 2)")
    run.add_argument("--inner-steps", type=_int_at_least("--inner-steps", 1), default=100, metavar="H",
                     help="DiLoCo inner steps per round (default 100)")
    run.add_argument("--fragments", type=_int_at_least("--fragments", 1), default=8, metavar="P",
                     help="Streaming DiLoCo fragments, at most H; one is sent every H/P steps (default 8)")
    run.add_argument("--overlap", type=_int_at_least("--overlap", 0), default=1, metavar="TAU",
                     help="Streaming DiLoCo overlap: steps a fragment may take to arrive (default 1)")
    run.add_argument("--wire", type=_wire(), default=(2.0, False), metavar="DTYPE|BYTES",
                     help=f"bytes per parameter on the wire, or a dtype ({WIRE_NAMES}); default bf16. sparse: "
                          f"diloco's sparse wire at its defaults (1/64 of each chunk, 2 bits a value), whose "
                          f"payloads reach every worker whole (an all-gather; a hub's Results carry all M)")
    run.add_argument("--streaming-wire", type=_wire(), metavar="DTYPE|BYTES",
                     help="Streaming DiLoCo's own wire format, e.g. int4 for quantised outer gradients "
                          "(default: --wire)")
    run.add_argument("--data-plane", choices=DATA_PLANES, default="collective",
                     help="where syncs go (see above): collective (default) when the workers reach each other "
                          "directly and all-reduce (the figures are each worker's link); hub to size the "
                          "coordinator's link of a diloco server run, or any parameter server (the figures are "
                          "the coordinator's link, which carries M copies in, then M out)")
    cpu = p.add_argument_group("a sparse sync's CPU work (--wire sparse; per worker, one core by default)")
    cpu.add_argument("--cpu-rate", type=_positive("--cpu-rate"), default=None, metavar="PARAMS_PER_S",
                     help="parameters per second a worker's CPU takes through a sparse round's passes over all its "
                          "params: the pseudo-gradient and the top-k encode of its accumulator before the upload, "
                          "the sum's zeros, the step, its finiteness check and the install after "
                          f"(default {DEFAULT_CPU_RATE:g}: one core's; benchmarks/bench_sparse_cpu.py measures "
                          f"this machine's)")
    cpu.add_argument("--entry-rate", type=_positive("--entry-rate"), default=None, metavar="ENTRIES_PER_S",
                     help="payload entries per second a worker checks, decodes and adds into the round's sum "
                          f"(M payloads of N x 64/4096 entries each; default {DEFAULT_ENTRY_RATE:g}: one core)")
    run.add_argument("--buckets", type=_int_at_least("--buckets", 1), default=DEFAULT_BUCKETS, metavar="K",
                     help="buckets a step's payload is split into over the backward, e.g. one per layer "
                          f"(default {DEFAULT_BUCKETS}, the layers of Table 4's 1B model)")
    out = p.add_argument_group("what to print (at least one of these)")
    out.add_argument("--bandwidth", type=_positive("--bandwidth"), metavar="GBIT_S",
                     help="print each method's utilisation at this bandwidth (Gbit/s) of the data plane's link")
    out.add_argument("--sweep", action="store_true",
                     help="print the smallest bandwidth on logspace(-1, 3, 50) Gbit/s reaching 50/80/90/95/99%% "
                          "utilisation")
    out.add_argument("--plot", metavar="FILE.png", help="write utilisation against bandwidth (log x) as a PNG")
    out.add_argument("--plane-table", action="store_true",
                     help="print the bandwidth for 90%% utilisation of the coordinator's link (hub) and of each "
                          "worker's link (collective) at 1B and 10B parameters for 4, 16 and 64 workers, with the "
                          "other flags as given (--params, --workers and --data-plane aside)")
    p.set_defaults(handler=handle)


def _usage(msg: str):
    from diloco.exits import UsageError

    return UsageError(msg)


def handle(args) -> int:
    if args.fragments > args.inner_steps:
        raise _usage(f"--fragments {args.fragments} is more than --inner-steps {args.inner_steps}: "
                     "each fragment needs a step of its own")
    if args.bandwidth is None and not args.sweep and args.plot is None and not args.plane_table:
        raise _usage("nothing to do: give --bandwidth GBIT_S, --sweep, --plot FILE.png or --plane-table")
    if args.plot is not None:
        if not args.plot.lower().endswith(".png"):
            raise _usage(f"--plot {args.plot!r}: the file name must end in .png")
        parent = os.path.dirname(os.path.abspath(args.plot))
        if not os.path.isdir(parent):
            raise _usage(f"--plot {args.plot!r}: directory {parent!r} does not exist")
    from diloco.planner import model

    cpu_rate = args.cpu_rate or model.DEFAULT_CPU_RATE
    entry_rate = args.entry_rate or model.DEFAULT_ENTRY_RATE
    args.cpu_rate, args.entry_rate = cpu_rate, entry_rate
    streaming = args.streaming_wire or args.wire
    ms = model.methods(args.inner_steps, args.fragments, args.overlap, args.wire[0], streaming[0],
                       gathered=args.wire[1], streaming_gathered=streaming[1])
    common = dict(params=args.params, step_time_s=args.step_time, workers=args.workers, buckets=args.buckets,
                  data_plane=args.data_plane, cpu_rate=cpu_rate, entry_rate=entry_rate)
    if args.plane_table:
        table = model.plane_table(ms, step_time_s=args.step_time, buckets=args.buckets, cpu_rate=cpu_rate,
                                  entry_rate=entry_rate)
        for line in format_plane_table(table, ms, step_time_s=args.step_time, buckets=args.buckets):
            print(line)
        if args.bandwidth is None and not args.sweep and args.plot is None:
            return EXIT_OK
        print()
    for line in describe(args, ms):
        print(line)
    if args.bandwidth is not None:
        print()
        for line in format_utilisation(ms, args.bandwidth, common):
            print(line)
    curves = None
    if args.sweep or args.plot is not None:
        curves = {m.name: model.utilisation_curve(m, **common) for m in ms}
    if args.sweep:
        print()
        for line in format_sweep(curves, args.data_plane):
            print(line)
    if args.plot is not None:
        from diloco.plots.bandwidth import plot_utilisation_curves

        labels = {_label(m): curves[m.name] for m in ms}
        path = plot_utilisation_curves(args.plot, model.BANDWIDTH_GRID_GBIT_S, labels, model.TARGETS,
                                       title=f"{_count(args.params)} parameters, step {args.step_time:g} s, "
                                             f"M={args.workers}, H={args.inner_steps}, {args.data_plane} "
                                             f"(bandwidth of {LINK_OF[args.data_plane]})")
        print(f"\nplot: {path}")
    return EXIT_OK


def _count(n: float) -> str:
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n / div:g}{suffix}"
    return f"{n:g}"


def _label(m) -> str:
    if m.fragments > 1 or m.overlap:
        return f"{m.name} (P={m.fragments}, tau={m.overlap}, {m.bytes_per_param:g} B/param)"
    if m.inner_steps > 1:
        return f"{m.name} (H={m.inner_steps}, {m.bytes_per_param:g} B/param)"
    return f"{m.name} ({m.bytes_per_param:g} B/param)"


def _copies(c: float) -> str:
    return f"{c:g} cop{'y' if c == 1 else 'ies'}"


def describe(args, ms) -> list[str]:
    from diloco.planner.model import SPARSE_DENSITY, sparse_cpu_s, sync_bits

    if args.data_plane == "hub":
        plane = (f"data plane: hub (one coordinator); bandwidth = {LINK_OF['hub']}, carrying M = "
                 f"{_copies(args.workers)} of each sync in, then {args.workers} out: 2M = "
                 f"{_copies(2 * args.workers)}' time")
    else:
        plane = (f"data plane: collective (ring all-reduce); bandwidth = {LINK_OF['collective']}, carrying "
                 f"2(1 - 1/M) = {_copies(2 * (1 - 1 / args.workers))} of each sync each way")
    lines = [f"plan: {_count(args.params)} parameters, step {args.step_time:g} s (forward 1/3, backward 2/3), "
             f"M={args.workers} workers, {args.buckets} buckets per step over one FIFO link",
             plane,
             f"  {'method':<18} {'bytes/param':>11} {'Gbit per sync':>13} {'sync every':>12} {'deadline':>19}"]
    if any(m.gathered for m in ms):
        lines[1] += (f"; a sparse sync gathers every worker's payload instead: "
                     f"{_copies(args.workers * (args.workers + 1)) if args.data_plane == 'hub' else _copies(args.workers - 1)}"
                     f" of one")
    if any(m.gathered for m in ms):
        cpu_s = sparse_cpu_s(args.params, args.workers, args.cpu_rate, args.entry_rate)
        lines.insert(2, f"sparse CPU work per sync and worker: {cpu_s:.4g} s = {_count(args.params)} params / "
                        f"{args.cpu_rate:.3g} params/s (--cpu-rate) + M x {_count(args.params * SPARSE_DENSITY)} "
                        f"entries / {args.entry_rate:.3g} entries/s (--entry-rate), after its link time")
    for m in ms:
        gbit = sync_bits(args.params, m.bytes_per_param, args.workers, args.data_plane, m.gathered) / m.fragments / 1e9
        every = m.steps_between_syncs
        deadline = "end of its step" if m.overlap == 0 else f"end of its step +{m.overlap}"
        lines.append(f"  {m.name:<18} {m.bytes_per_param:>11g} {gbit:>13.4g} "
                     f"{every:>6g} step{'s' if every != 1 else ' '} {deadline:>19}")
    return lines


def format_utilisation(ms, bandwidth: float, common: dict) -> list[str]:
    from diloco.planner.model import method_utilisation

    lines = [f"compute utilisation at {bandwidth:g} Gbit/s on {LINK_OF[common.get('data_plane', 'collective')]}:"]
    for m in ms:
        u = method_utilisation(m, bandwidth_gbit_s=bandwidth, **common)
        lines.append(f"  {m.name:<18} {100 * u:6.1f}%")
    return lines


def format_sweep(curves: dict, data_plane: str = "collective") -> list[str]:
    from diloco.planner.model import BANDWIDTH_GRID_GBIT_S, TARGETS, bandwidth_needed

    top = float(BANDWIDTH_GRID_GBIT_S[-1])
    lines = [f"bandwidth (Gbit/s) of {LINK_OF[data_plane]} needed for a compute utilisation "
             "(smallest of logspace(-1, 3, 50)):",
             f"  {'method':<18}" + "".join(f"{f'{100 * t:g}%':>9}" for t in TARGETS)]
    for name, curve in curves.items():
        cells = [f"> {top:g}" if b is None else (f"{b:.2f}" if b < 10 else f"{b:.1f}")
                 for b in bandwidth_needed(curve)]
        lines.append(f"  {name:<18}" + "".join(f"{c:>9}" for c in cells))
    return lines


def _gbit(b: float) -> str:
    if math.isinf(b):
        return "never"  # a sparse sync's CPU work alone misses the target
    return f"{b:.2f}" if b < 10 else (f"{b:.1f}" if b < 100 else f"{b:.0f}")


def format_plane_table(table: dict, ms, *, step_time_s: float, buckets: int) -> list[str]:
    """``diloco plan --plane-table``: :func:`diloco.planner.model.plane_table` as text, one row per model size
    and method, the hub's columns (the coordinator's link) then the collective's (each worker's link)."""
    from diloco.planner.model import PLANE_TABLE_PARAMS, PLANE_TABLE_TARGET, PLANE_TABLE_WORKERS

    ks = PLANE_TABLE_WORKERS
    st = ms[-1]
    wire = f"{ms[0].bytes_per_param:g} bytes/param on the wire"
    if st.bytes_per_param != ms[0].bytes_per_param:
        wire += f" (Streaming {st.bytes_per_param:g})"
    width = 9 * len(ks)
    lines = [f"bandwidth (Gbit/s) for {100 * PLANE_TABLE_TARGET:g}% compute utilisation, by data plane and workers k",
             f"(step {step_time_s:g} s, H={ms[1].inner_steps}, P={st.fragments}, tau={st.overlap}, {wire}, "
             f"{buckets} buckets, full-duplex links)",
             f"  {'':<8}{'':<18}  {'hub: ' + LINK_OF['hub']:<{width}}  collective: {LINK_OF['collective']}",
             f"  {'params':<8}{'method':<18}  " + "".join(f"{f'k={k}':>9}" for k in ks)
             + "  " + "".join(f"{f'k={k}':>9}" for k in ks)]
    for n in PLANE_TABLE_PARAMS:
        for m in ms:
            hub = "".join(f"{_gbit(table[(m.name, n, 'hub', k)]):>9}" for k in ks)
            ring = "".join(f"{_gbit(table[(m.name, n, 'collective', k)]):>9}" for k in ks)
            lines.append(f"  {_count(n):<8}{m.name:<18}  {hub}  {ring}")
    return lines
