"""Benchmark: what making every round durable costs the hub coordinator (SPEC.md sections 5 and 12).

What it measures
----------------
Three real hub ``Coordinator``s side by side, each with ``--workers`` members
(default 4) submitting in ``--wire-dtype`` (default int8, ``diloco server``'s
default), on a model of ``--params`` fp32 parameters (default 10M; 12 tensors
as in bench_transport and bench_aggregate: four of 22.5% and eight of 1.25%)
with the default outer optimizer (SGD Nesterov: a momentum buffer too). They
take turns round by round, so that the machine's noise falls on all three:

* **none**: no persistence (the baseline);
* **full**: a full checkpoint every round (``--full-checkpoint-every 1``):
  ``save_coordinator`` (params and momentum streamed to a temporary file,
  sha256 on the way, fsync, rename, fsync of the folder, keep-3 rotation);
* **journal**: ``--full-checkpoint-every 8`` (the ``auto`` value above 128 MB):
  each contribution appended to the journal by its thread as it is accepted
  (the mean instead on an fp32 run), a commit fdatasync'd after the step, a
  full checkpoint every 8 rounds in the background.

Each round's contributions arrive ``--arrival-gap-s`` apart (default 0.25 s,
what 100 MB takes over a ~3 Gbit/s link; 0 for back to back, the worst case),
and ``--gap-s`` passes between rounds (the workers' training). What it reports:

* **the Results' extra wait** (the headline): from the arrival of a round's
  last contribution to the moment its Results may go out (that Submit's
  handling, the outer step, the durable write or commit, the audit line's
  fsync), less the same for **none**; and its share of a real 5 s round;
* **the coordinator's extra work**: all of a round's handling plus the
  durable part, less **none**'s (CPU the journal's thread takes from the loop).

Run it::

    python benchmarks/bench_durable.py                    # 10M, 20 rounds
    python benchmarks/bench_durable.py --params 100M      # the issue's size
    python benchmarks/bench_durable.py --quick            # 5 rounds

The last line printed is machine-readable::

    RESULT bench_durable params=N full_ms=X full_p90_ms=X journal_ms=X journal_p90_ms=X close_ms=X
        full_share=R journal_share=R full_busy_ms=X journal_busy_ms=X background_full_s=X workers=K wire=W
        journal_mb_per_round=X

The collective data plane (``--collective``)
--------------------------------------------
On the collective plane the coordinator never holds the model: its checkpoint is
the machine's snapshot and the plane's record (secret, spec, last commit per
fragment), no tensors. ``--collective`` drives a collective-mode ``Coordinator``
by hand (sans-IO: 4 members join, the first with ``holds_params``; each round
4 tensorless Submits, a ``ReduceOrder``, 4 ``ReduceReport`` votes and the commit)
and times ``save_coordinator`` after every commit at each ``--params`` size
(default 10M and 100M: the write must not grow with the model), next to the
disk's own floor for a durable write of that many bytes (write, fsync, rename,
fsync of the folder), a member's own checkpoint at the same size
(``save_worker_checkpoint``: its model, inner AdamW state, global copy and the
outer momentum it holds on this plane) and the hub coordinator's write::

    python benchmarks/bench_durable.py --collective            # 10M and 100M, 20 rounds, 3 worker and hub writes
    python benchmarks/bench_durable.py --collective --quick    # 1M and 10M, 5 rounds, 1 of each

    RESULT bench_durable_collective coord_write_ms_10M=X coord_write_p90_ms_10M=X coord_ckpt_kb_10M=X
        fsync_floor_ms_10M=X worker_write_ms_10M=X worker_ckpt_mb_10M=X hub_write_ms_10M=X ... (then _100M)

About 460 lines: one benchmark is one file, run and read top to bottom; its
three coordinators share one setup, and this docstring (what is measured and
how to read it) is a good part of it.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diloco.coordinator import Coordinator, CoordinatorConfig  # noqa: E402
from diloco.coordinator.audit import AuditLog, Tee  # noqa: E402
from diloco.ckptio import read_safetensors  # noqa: E402
from diloco.coordinator.checkpoint import save_coordinator  # noqa: E402
from diloco.core import FSMConfig  # noqa: E402
from diloco.deploy.tuning import keep_freed_memory  # noqa: E402
from diloco.wire.messages import (  # noqa: E402
    PROTOCOL_VERSION, Join, ReduceOrder, ReduceReport, Result, Submit, TensorSpec, Welcome, spec_of)


def make_params(num_params: int) -> dict[str, torch.Tensor]:
    big, small = int(num_params * 0.225), int(num_params * 0.0125)
    g = torch.Generator().manual_seed(0)
    out = {f"big{i}.weight": torch.randn(big, generator=g) for i in range(4)}
    out.update({f"small{i}.weight": torch.randn(small, generator=g) for i in range(8)})
    return out


def parse_count(text: str) -> int:
    """``10M``, ``100k``, ``1e6`` or ``10000000``."""
    t = text.strip().lower().replace("_", "").replace(",", "")
    scale = {"k": 10 ** 3, "m": 10 ** 6, "g": 10 ** 9}.get(t[-1:], 1)
    return int(float(t[:-1] if scale != 1 else t) * scale)


def label(n: int) -> str:
    """10000000 -> 10M (the RESULT keys)."""
    for unit, scale in (("G", 10 ** 9), ("M", 10 ** 6), ("k", 10 ** 3)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def spec_for(num_params: int) -> tuple[TensorSpec, ...]:
    """The spec of ``make_params(num_params)`` without allocating a tensor (a collective join sends none)."""
    big, small = int(num_params * 0.225), int(num_params * 0.0125)
    return (tuple(TensorSpec(f"big{i}.weight", (big,), "float32") for i in range(4))
            + tuple(TensorSpec(f"small{i}.weight", (small,), "float32") for i in range(8)))


def collective_coordinator_writes(num_params: int, rounds: int, workers: int, ck: Path) -> dict:
    """A collective-plane ``Coordinator`` driven by hand (sans-IO) through ``rounds`` committed rounds of
    ``workers`` members; after each commit, what ``runner.serve`` does before it announces it: write."""
    config = CoordinatorConfig(fsm=FSMConfig(min_workers=workers, data_plane="collective", heartbeat_timeout_s=60.0,
                                             reduce_timeout_s=80.0), collective_timeout_s=20.0)
    audit = AuditLog(ck)
    c = Coordinator(config, 0.0, observer=Tee(audit))
    audit.attach(c)
    spec = spec_for(num_params)
    ids = [f"w{k}" for k in range(workers)]
    # The first member starts the run from its own params, which it keeps (holds_params); the others heal.
    replies = c.handle("p0", Join(ids[0], PROTOCOL_VERSION, spec, {}, holds_params=True), 1.0)
    assert any(isinstance(m, Welcome) for _, m in replies), replies
    for k, wid in enumerate(ids[1:], 1):
        replies = c.handle(f"p{k}", Join(wid, PROTOCOL_VERSION, spec, {}), 1.0)
        assert any(isinstance(m, Welcome) for _, m in replies), replies
    writes, audits, handles = [], [], []
    now = 2.0
    for r in range(rounds + 1):
        t0 = time.perf_counter()
        orders = []
        for k, wid in enumerate(ids):  # "ready": a Submit without tensors
            orders += [m for _, m in c.handle(f"p{k}", Submit(wid, 0, r, {}, norm=1.0), now) if isinstance(m, ReduceOrder)]
        assert orders, f"round {r}: no ReduceOrder"
        vote = hashlib.sha256(f"round {r}".encode()).hexdigest()
        results = []
        for k, wid in enumerate(ids):
            results += [m for _, m in c.handle(f"p{k}", ReduceReport(wid, 0, r, orders[0].attempt, True, vote), now)
                        if isinstance(m, Result)]
        assert len(results) == workers and c.fsm.rounds_applied == r + 1, (results, c.fsm.rounds_applied)
        t1 = time.perf_counter()
        path = save_coordinator(c, ck, keep=3)
        t2 = time.perf_counter()
        audit.flush()
        t3 = time.perf_counter()
        now += 1.0
        if r:  # the first round pays one-time costs (imports, first file)
            handles.append(t1 - t0)
            writes.append(t2 - t1)
            audits.append(t3 - t2)
    audit.close()
    meta, tensors = read_safetensors(path, "diloco.coordinator")
    return {"writes": writes, "audits": audits, "handles": handles, "bytes": path.stat().st_size,
            "tensors": len(tensors), "collective": bool(meta.get("collective"))}


def fsync_floor(nbytes: int, reps: int, ck: Path) -> list[float]:
    """The least a durable write of ``nbytes`` costs on this disk: write a temporary file, fsync it,
    rename it, fsync the folder and delete the file three writes back (what ``save_coordinator`` does
    around its bytes, with none of its own work)."""
    import os

    from diloco.ckptio import fsync_dir

    payload = os.urandom(nbytes)
    times = []
    for r in range(reps + 1):
        t0 = time.perf_counter()
        tmp = ck / f".floor-{r}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, payload)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, ck / f"floor-{r}")
        fsync_dir(ck)
        (ck / f"floor-{r - 3}").unlink(missing_ok=True)
        if r:
            times.append(time.perf_counter() - t0)
    return times


def hub_coordinator_writes(num_params: int, rounds: int, ck: Path) -> list[float]:
    """The hub coordinator's write at the same size (params and Nesterov momentum), for comparison."""
    c = Coordinator(CoordinatorConfig(fsm=FSMConfig(min_workers=1)), 0.0)
    params = make_params(num_params)
    c.handle("p", Join("w1", PROTOCOL_VERSION, spec_of(params), params), 1.0)
    grad = {n: torch.full_like(t, 1e-3) for n, t in params.items()}
    del params
    writes = []
    for r in range(rounds + 1):
        c.handle("p", Submit("w1", 0, r, grad), 2.0 + r)
        t1 = time.perf_counter()
        save_coordinator(c, ck, keep=3)
        if r:
            writes.append(time.perf_counter() - t1)
    return writes


def worker_checkpoint_writes(num_params: int, reps: int, ck: Path) -> tuple[list[float], int]:
    """A collective member's own checkpoint (``diloco.worker.checkpoint.save_worker_checkpoint``, what
    ``DilocoWorker.save_checkpoint`` writes): its model's state, its inner AdamW state (two moments), its
    copy of the global params and the outer Nesterov momentum it holds on the collective plane."""
    from diloco.outer import OuterConfig, build_outer_optimizer
    from diloco.worker.checkpoint import WorkerCheckpoint, save_worker_checkpoint

    model = make_params(num_params)
    for t in model.values():
        t.grad = torch.full_like(t, 1e-3)
    inner = torch.optim.AdamW(list(model.values()), lr=1e-3)
    inner.step()
    global_params = {n: t.detach().clone() for n, t in model.items()}
    outer_params = [t.detach().clone() for t in global_params.values()]
    outer = build_outer_optimizer(outer_params, OuterConfig(), 4)
    for t in outer_params:
        t.grad = torch.full_like(t, 1e-3)
    outer.step()
    for t in list(model.values()) + outer_params:
        t.grad = None
    ckpt = WorkerCheckpoint(worker_id="w0", sync_every=500, inner_step=500, sched_step=500, next_close=[1000],
                            round_ids=[1], rounds_synced=1, mode="sync", fragments=(tuple(model),),
                            model_state=model, optimizer_state=inner.state_dict(), global_params=global_params,
                            outer_states=[outer.state_dict()])
    path = ck / "worker-w0.safetensors"
    writes = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        save_worker_checkpoint(path, ckpt)
        writes.append(time.perf_counter() - t0)
    return writes[1:], path.stat().st_size


def main_collective(args) -> int:
    """``--collective``: the coordinator's per-round write on the collective plane at each size, next to
    a member's own checkpoint and the hub coordinator's write at the same sizes."""
    sizes = [parse_count(x) for x in (args.params or ("1M,10M" if args.quick else "10M,100M")).split(",")]
    rounds = 5 if args.quick else args.rounds
    worker_reps = 1 if args.quick else args.worker_reps
    hub_rounds = 1 if args.quick else args.hub_rounds
    print(f"bench_durable --collective: sizes {', '.join(f'{n:,}' for n in sizes)} fp32 params, "
          f"{args.workers} members, {rounds} committed rounds (+1 untimed), worker checkpoint x {worker_reps}, "
          f"hub write x {hub_rounds}", flush=True)
    result = []
    rows = []
    for n in sizes:
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            d = collective_coordinator_writes(n, rounds, args.workers, Path(tmp))
            floor = fsync_floor(d["bytes"], rounds, Path(tmp))
        w, a, h = statistics.median(d["writes"]), statistics.median(d["audits"]), statistics.median(d["handles"])
        f = statistics.median(floor)
        p90 = sorted(d["writes"])[int(0.9 * (len(d["writes"]) - 1))]
        rows.append(f"{n:>12,}  collective coordinator: write median {w * 1e3:.2f} ms, p90 {p90 * 1e3:.2f} ms, "
                    f"max {max(d['writes']) * 1e3:.2f} ms; audit line {a * 1e3:.2f} ms; file {d['bytes'] / 1e3:.1f} kB "
                    f"with {d['tensors']} tensors (collective record: {'yes' if d['collective'] else 'NO'}); "
                    f"handling the round's {2 * args.workers} messages {h * 1e3:.2f} ms")
        rows.append(f"{'':>12}  the disk's floor for a {d['bytes'] / 1e3:.1f} kB durable write (write, fsync, rename, "
                    f"fsync of the folder, delete): median {f * 1e3:.2f} ms, p90 "
                    f"{sorted(floor)[int(0.9 * (len(floor) - 1))] * 1e3:.2f} ms")
        print("\n".join(rows[-2:]), flush=True)
        result.append(f"coord_write_ms_{label(n)}={w * 1e3:.2f} coord_write_p90_ms_{label(n)}={p90 * 1e3:.2f} "
                      f"coord_ckpt_kb_{label(n)}={d['bytes'] / 1e3:.1f} fsync_floor_ms_{label(n)}={f * 1e3:.2f}")
        if worker_reps:
            with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
                ww, size = worker_checkpoint_writes(n, worker_reps, Path(tmp))
            rows.append(f"{'':>12}  worker checkpoint (a member's own): write median {statistics.median(ww) * 1e3:.0f} ms "
                        f"(of {', '.join(f'{x * 1e3:.0f}' for x in ww)}), file {size / 1e6:.0f} MB")
            print(rows[-1], flush=True)
            result.append(f"worker_write_ms_{label(n)}={statistics.median(ww) * 1e3:.0f} "
                          f"worker_ckpt_mb_{label(n)}={size / 1e6:.0f}")
        if hub_rounds:
            with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
                hw = hub_coordinator_writes(n, hub_rounds, Path(tmp))
            rows.append(f"{'':>12}  hub coordinator (params + momentum): write median {statistics.median(hw) * 1e3:.0f} ms "
                        f"(of {', '.join(f'{x * 1e3:.0f}' for x in hw)})")
            print(rows[-1], flush=True)
            result.append(f"hub_write_ms_{label(n)}={statistics.median(hw) * 1e3:.0f}")
    print(f"RESULT bench_durable_collective " + " ".join(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", default=None,
                    help="model size in fp32 params (default 10M; 10M, 100k, 1e6 accepted); with --collective a "
                         "comma list (default 10M,100M; quick 1M,10M)")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="5 rounds (--collective: also 1 worker write, 1 hub write)")
    ap.add_argument("--round-s", type=float, default=5.0, help="a real round's seconds (bench_training, H=10)")
    ap.add_argument("--gap-s", type=float, default=1.0,
                    help="seconds between rounds (the workers' training, when a background full checkpoint runs)")
    ap.add_argument("--wire-dtype", default="int8", choices=("fp32", "bf16", "int8"),
                    help="how the workers submit (default int8, diloco server's default); fp32 journals the mean")
    ap.add_argument("--full-every", type=int, default=8,
                    help="the journal way's rounds between full checkpoints (default 8, the auto value for big models)")
    ap.add_argument("--arrival-gap-s", type=float, default=0.25,
                    help="seconds between a round's contributions (default 0.25: 100 MB, an int8 contribution of a "
                         "100M model, over a ~3 Gbit/s link); 0: back to back, the worst case")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    ap.add_argument("--collective", action="store_true",
                    help="the collective plane's coordinator write (no tensors) at each --params size, beside a "
                         "member's own checkpoint and the hub coordinator's write")
    ap.add_argument("--workers", type=int, default=4, help="members of the run (default 4)")
    ap.add_argument("--worker-reps", type=int, default=3, help="--collective: worker checkpoint writes per size "
                                                               "(default 3; 0 skips)")
    ap.add_argument("--hub-rounds", type=int, default=3, help="--collective: hub coordinator writes per size "
                                                              "(default 3; 0 skips)")
    args = ap.parse_args(argv)
    keep_freed_memory()
    if args.collective:
        return main_collective(args)
    args.params = parse_count(args.params) if args.params is not None else 10_000_000
    rounds = 5 if args.quick else args.rounds
    print(f"bench_durable: {args.params:,} fp32 params, {args.workers} workers submitting {args.wire_dtype}, Nesterov "
          f"outer step, {rounds} rounds (+1 untimed) per way, {args.gap_s:g} s between rounds (the workers' "
          f"training)", flush=True)
    # The three ways take turns, round by round, so that the machine's noise falls on all of them alike.
    plan = (("full", 1), ("journal", args.full_every), ("none", None))
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        hubs = {}
        for way, full_every in plan:
            (Path(tmp) / way).mkdir()
            hubs[way] = HubWay(args, full_every, Path(tmp) / way)
        for r in range(rounds + 1):
            for way, _ in plan:
                hubs[way].round(r)
                time.sleep(args.gap_s)
            print(f"  round {r}: " + ", ".join(f"{way} {(hubs[way].steps or [0])[-1] * 1e3:.0f}+"
                                               f"{(hubs[way].durable or [0])[-1] * 1e3:.0f} ms" for way, _ in plan),
                  flush=True)
        ways = {way: hubs[way].finish() for way, _ in plan}
        del hubs
    for way, w in ways.items():
        print(f"  {way:8s} round {statistics.median(w['steps']) * 1e3:8.1f} ms  durable wait "
              f"{statistics.median(w['durable']) * 1e3:8.1f} ms  (p90 {p90_of(w['durable']) * 1e3:.1f})  "
              f"audit {statistics.median(w['audits']) * 1e3:.2f} ms  on disk {w['disk_mb']:.0f} MB", flush=True)
    base = statistics.median(ways["none"]["steps"])
    base_close = statistics.median(ways["none"]["closing"])

    def cost(way: str) -> tuple[float, float]:
        """The Results' extra wait: from the round's last contribution arriving to the Results being free to go
        (its handling, the outer step, the durable write or commit, the audit line), less the same without
        persistence."""
        w = ways[way]
        return statistics.median(w["closing"]) - base_close, p90_of(w["closing"]) - base_close

    def busy(way: str) -> float:
        """The coordinator's whole work for a round (every Submit, the step, the durable part), less without."""
        w = ways[way]
        return statistics.median([s + d + a for s, d, a in zip(w["steps"], w["durable"], w["audits"])]) - base

    full, full_p90 = cost("full")
    jour, jour_p90 = cost("journal")
    bg = ways["journal"]["background_full_s"]
    print(f"the Results' extra wait (from the last contribution's arrival; without persistence "
          f"{base_close * 1e3:.0f} ms): full checkpoint every round {full * 1e3:.0f} ms (p90 {full_p90 * 1e3:.0f}) "
          f"= {full / args.round_s:.1%} of a {args.round_s:g} s round; journal {jour * 1e3:.0f} ms (p90 "
          f"{jour_p90 * 1e3:.0f}) = {jour / args.round_s:.1%}")
    print(f"the coordinator's extra work per round (all {args.workers} Submits, {args.arrival_gap_s:g} s apart, "
          f"the step, the durable part; without persistence {base * 1e3:.0f} ms): full {busy('full') * 1e3:.0f} ms, "
          f"journal {busy('journal') * 1e3:.0f} ms; the journal's full checkpoint every {args.full_every} rounds "
          f"took {statistics.median(bg) if bg else 0:.2f} s in the background (x{len(bg)})")
    print(f"RESULT bench_durable params={args.params} full_ms={full * 1e3:.1f} full_p90_ms={full_p90 * 1e3:.1f} "
          f"journal_ms={jour * 1e3:.1f} journal_p90_ms={jour_p90 * 1e3:.1f} close_ms={base_close * 1e3:.1f} "
          f"full_share={full / args.round_s:.4f} journal_share={jour / args.round_s:.4f} "
          f"full_busy_ms={busy('full') * 1e3:.0f} journal_busy_ms={busy('journal') * 1e3:.0f} "
          f"background_full_s={statistics.median(bg) if bg else 0:.2f} workers={args.workers} wire={args.wire_dtype} "
          f"journal_mb_per_round={ways['journal']['record_mb']:.1f}")
    return 0


def p90_of(values: list[float]) -> float:
    return sorted(values)[int(0.9 * (len(values) - 1))]


class HubWay:
    """A hub ``Coordinator`` with ``--workers`` members submitting in ``--wire-dtype``, made durable one way
    (``full_every``: None, no persistence; 1, a full checkpoint every round; N, the journal). Per round:
    the round's handling (every Submit and the outer step, ``handle``), what ``runner.serve`` then waits
    for before sending (``Durability.after_step``) and the audit line."""

    def __init__(self, args, full_every: int | None, ck: Path) -> None:
        from diloco.coordinator.persist import Durability
        from diloco.wire import compression

        self.args, self.full_every, self.ck = args, full_every, ck
        self.audit = AuditLog(ck)
        config = CoordinatorConfig(fsm=FSMConfig(min_workers=args.workers, heartbeat_timeout_s=1e9),
                                   wire_dtype=args.wire_dtype)
        self.c = c = Coordinator(config, 0.0, observer=Tee(self.audit))
        self.audit.attach(c)
        params = make_params(args.params)
        self.ids = [f"w{k}" for k in range(args.workers)]
        for k, wid in enumerate(self.ids):
            c.handle(f"p{k}", Join(wid, PROTOCOL_VERSION, spec_of(params), params if k == 0 else {}), 1.0)
        del params
        self.durability = Durability(ck, 3, full_every) if full_every is not None else None
        if self.durability is not None:
            self.durability.attach(c)
            self.durability.after_step(False)  # the params exist: the journal starts (as the runner's loop does)
        g = torch.Generator().manual_seed(1)
        self.grads = [compression.encode({n: torch.randn(t.shape, generator=g) * 1e-3
                                          for n, t in c.store.params.items()}, args.wire_dtype) for _ in self.ids]
        self.steps, self.durable, self.audits, self.closing = [], [], [], []

    def round(self, r: int) -> None:
        c, wire = self.c, self.args.wire_dtype
        t0 = time.perf_counter()
        for k, (wid, enc) in enumerate(zip(self.ids, self.grads)):
            if k:
                time.sleep(self.args.arrival_gap_s)  # the next contribution is still on the wire
            t_last = time.perf_counter()
            c.handle(f"p{k}", Submit(wid, 0, r, enc.values, wire, enc.scales), 2.0 + r)
        assert c.fsm.rounds_applied == r + 1, c.fsm.rounds_applied
        t1 = time.perf_counter()
        if self.durability is not None:
            self.durability.after_step(True)
        t2 = time.perf_counter()
        self.audit.flush()
        t3 = time.perf_counter()
        if r:  # the first round pays one-time costs (imports, the first full checkpoint)
            self.steps.append(t1 - t0 - (len(self.ids) - 1) * self.args.arrival_gap_s)
            self.durable.append(t2 - t1)
            self.audits.append(t3 - t2)
            self.closing.append(t3 - t_last)

    def finish(self) -> dict:
        from diloco.wire import compression

        if self.durability is not None:
            self.durability.close()
        self.audit.close()
        c = self.c
        disk = sum(p.stat().st_size for p in self.ck.iterdir() if p.is_file())
        record = sum(compression.tensor_nbytes(e.values) + compression.tensor_nbytes(e.scales) for e in self.grads)
        if self.args.wire_dtype == "fp32":
            record = compression.tensor_nbytes(self.grads[0].values)  # the mean
        background = []
        if self.full_every not in (None, 1):
            # Background full checkpoints (beyond the first, synchronous one): their own seconds.
            background = [c.stats.checkpoint_write_s / max(1, c.stats.checkpoints_written)] * (
                c.stats.checkpoints_written - 1)
        return {"steps": self.steps, "durable": self.durable, "audits": self.audits, "closing": self.closing,
                "disk_mb": disk / 1e6,
                "record_mb": record / 1e6, "background_full_s": background}


if __name__ == "__main__":
    raise SystemExit(main())
