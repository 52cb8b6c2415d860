"""Benchmark: what a sharded member (FSDP2) holds per rank, and what a round costs it.

What it measures
----------------
**Memory per rank** (``--worlds``, default 1 2 4): one member of W ranks over gloo
(spawned processes, a file store), each holding diloco's char transformer at
``--d-model``/``--layers`` (default 512/8: about 25M parameters) sharded with
``fully_shard``, AdamW as its inner optimizer, and diloco's own per-shard keeping
(``ShardedParams``: the fp32 global copy and the error-feedback residual). Each
rank installs the run's params (scattered from rank 0), takes an inner step
(AdamW's state appears), and computes a pseudo-gradient (gathered whole, one
parameter at a time) and its residual, as a sync does. Per rank it reports

* ``held``: the bytes of the tensors the rank keeps between syncs -- params,
  inner optimizer state, global copy, residual -- counted exactly from the
  tensors themselves (``to_local()``);
* ``rss``: the growth of the process's peak resident memory over the run
  (``ru_maxrss`` after, less the resident memory before the model was built):
  the held bytes plus what the sync's whole-parameter buffers, gradients and the
  allocator add;

* ``held_collective``: ``held`` plus what the collective plane keeps per shard on
  top: the replica (``Replica.held_bytes``: committed params, outer momentum and
  the proposal's backup of both, built and stepped twice as rounds do). A rank
  of a collective member also keeps its reduce buffer and the committed shards it
  hands the session (one shard-sized fp32 buffer each, not counted);

and for W > 1 each against 1/W of the world-1 figure (the replicated member's):
``held_ratio = held_W / (held_1 / W)`` (1.0: exactly 1/W). ``sync_ms`` is a sync's
work on the shards (the pseudo-gradient gathered whole with its residual, the
residual scattered back, the round's params scattered and installed), best of 3.

**Time per round** on each data plane (``--planes``, default hub collective;
``--rounds``, default 6): a ``diloco server`` and one member of two ranks
training the built-in char transformer (H = ``--sync-every``), sharded
(``examples/fsdp2_member.py``) against replicated (the built-in entry, gradients
all-reduced), in the same run; from the first round applied to the last, read
from ``diloco status``.

Run::

    python benchmarks/bench_sharded.py            # both parts
    python benchmarks/bench_sharded.py --quick    # a small model, worlds 1 2, 4 rounds

Prints, per world, ``RESULT bench_sharded_memory world=W held_mb=X rss_mb=X
rss_leader_mb=X rss_other_mb=X sync_ms=X held_collective_mb=X held_ratio=X rss_ratio=X
held_collective_ratio=X`` (indented), and last ``RESULT bench_sharded held_mb_W=X
held_collective_mb_W=X rss_mb_W=X sync_ms_W=X held_ratio_W=X held_collective_ratio_W=X
rss_ratio_W=X ... round_sharded_s_P=X round_replicated_s_P=X round_ratio_P=X`` per plane P.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import resource
import socket
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _rank(rank: int, world: int, store: str, d_model: int, layers: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from diloco.models import ModelConfig, build_model
    from diloco.worker.shards import ShardedParams

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    before = _rss_mb()
    config = ModelConfig(seq_len=64, d_model=d_model, n_layers=layers, n_heads=8)
    model = build_model(config, seed=0)
    whole = {n: p.detach().clone() for n, p in model.named_parameters()} if rank == 0 else None
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    shards = ShardedParams(model, opt)  # every rank calls every operation itself: no leader needed here
    names = list(shards.params)
    assert shards.install(names, whole) == "installed"
    x = torch.randint(0, config.vocab_size, (4, 64))
    model.loss(x, x).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    # A sync's work on the shards, timed: the pseudo-gradient gathered whole, its residual scattered,
    # the round's params scattered and installed (best of 3).
    sync_s = float("inf")
    for _ in range(3):
        dist.barrier()
        began = time.perf_counter()
        pg = shards.pseudo_gradients(names, with_residual=True)
        shards.set_residual(names, {n: t * 0.01 for n, t in pg.items()})  # empty off rank 0
        assert shards.install(names, whole) == "installed"
        dist.barrier()
        sync_s = min(sync_s, time.perf_counter() - began)
        del pg
    del whole
    held = sum(p.to_local().numel() * p.to_local().element_size() for p in model.parameters())
    for state in opt.state.values():
        for t in state.values():
            if isinstance(t, torch.Tensor) and t.dim() > 0:
                local = t.to_local() if hasattr(t, "to_local") else t
                held += local.numel() * local.element_size()
    held += shards.shard_bytes()
    # The collective plane adds, per shard, the replica (committed params, outer momentum, the
    # proposal's backup of both): built and stepped once as a round does, then counted.
    from diloco.collective.replica import Replica
    from diloco.outer import OuterConfig

    local = {n: p.to_local() for n, p in shards.params.items()}
    replica = Replica(local, (tuple(names),), [0], OuterConfig(), "fp32", 1)
    mean = {n: (shards.global_shards[n] - t.detach().float()) for n, t in local.items()}
    for rid in (0, 1):  # the second proposal's backup holds the momentum the first one made
        assert replica.commit(0, rid, replica.propose(0, rid, mean))
    held_collective = held + replica.held_bytes()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    numel = sum(p.numel() for p in model.parameters())
    pathlib.Path(out).write_text(f"{held / 2**20:.2f} {peak - before:.2f} {numel} {sync_s * 1e3:.1f} "
                                 f"{held_collective / 2**20:.2f}\n")
    dist.destroy_process_group()


def memory(worlds: list[int], d_model: int, layers: int) -> dict:
    import torch.multiprocessing as mp

    figures, summary = {}, {}
    for world in worlds:
        with tempfile.TemporaryDirectory() as tmp:
            outs = [os.path.join(tmp, f"rank{r}") for r in range(world)]
            ctx = mp.get_context("spawn")
            procs = [ctx.Process(target=_rank, args=(r, world, os.path.join(tmp, "store"), d_model, layers, outs[r]))
                     for r in range(world)]
            for p in procs:
                p.start()
            for p in procs:
                p.join()
                if p.exitcode != 0:
                    raise SystemExit(f"bench_sharded: a rank of world {world} failed (exit {p.exitcode})")
            rows = [tuple(float(x) for x in pathlib.Path(o).read_text().split()) for o in outs]
        held = max(r[0] for r in rows)
        rss = max(r[1] for r in rows)
        # Rank 0 also holds the whole params it scatters (the Welcome's) and, in a real sync, the
        # fragment's pseudo-gradient it encodes: its figure and the others' are told apart.
        leader_rss = rows[0][1]
        other_rss = max((r[1] for r in rows[1:]), default=leader_rss)
        held_c = max(r[4] for r in rows)
        figures[world] = (held, rss, held_c)
        numel = int(rows[0][2])
        sync_ms = max(r[3] for r in rows)
        base_held, base_rss, base_c = figures.get(1, (None, None, None))
        ratios = ""
        if base_held is not None and world > 1:
            ratios = (f" held_ratio={held / (base_held / world):.3f} rss_ratio={rss / (base_rss / world):.3f}"
                      f" held_collective_ratio={held_c / (base_c / world):.3f}")
        print(f"  world {world}: {numel / 1e6:.1f}M params; per rank at most: held {held:.1f} MB "
              f"({held_c:.1f} MB with the collective plane's replica), peak resident growth {rss:.1f} MB; "
              f"a sync's work on the shards {sync_ms:.0f} ms", flush=True)
        print(f"  RESULT bench_sharded_memory world={world} params={numel} held_mb={held:.2f} rss_mb={rss:.2f} "
              f"rss_leader_mb={leader_rss:.2f} rss_other_mb={other_rss:.2f} sync_ms={sync_ms:.1f} "
              f"held_collective_mb={held_c:.2f}{ratios}", flush=True)
        summary[f"held_mb_{world}"] = f"{held:.2f}"
        summary[f"held_collective_mb_{world}"] = f"{held_c:.2f}"
        summary[f"rss_mb_{world}"] = f"{rss:.2f}"
        summary[f"sync_ms_{world}"] = f"{sync_ms:.1f}"
        if ratios:
            summary[f"held_ratio_{world}"] = f"{held / (base_held / world):.3f}"
            summary[f"held_collective_ratio_{world}"] = f"{held_c / (base_c / world):.3f}"
            summary[f"rss_ratio_{world}"] = f"{rss / (base_rss / world):.3f}"
    return summary


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _status(address: str) -> dict:
    from diloco.wire.messages import AdminRequest
    from diloco.wire.zmq import admin_request

    return admin_request(address, AdminRequest("status", {}), timeout_s=10).data


def one_run(kind: str, rounds: int, sync_every: int, workdir: pathlib.Path, plane: str = "hub") -> float:
    """Seconds from the first round applied to round ``rounds + 1`` for one member of two ranks."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    log = open(workdir / f"{kind}-{plane}-server.log", "wb")
    server = subprocess.Popen([sys.executable, "-m", "diloco", "server", "--bind", "tcp://127.0.0.1:0",
                               "--min-workers", "1", "--data-plane", plane], env=env, cwd=workdir,
                              stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT)
    address = None
    for raw in server.stdout:
        log.write(raw)
        line = raw.decode(errors="replace")
        if "listening on " in line:
            address = line.split("listening on ")[1].split()[0]
            break
    ranks = []
    entry = [] if kind == "replicated" else ["--entry", f"{REPO / 'examples' / 'fsdp2_member.py'}:make_setup"]
    port = _free_port()
    try:
        for rank in range(2):
            renv = {**env, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "lo"}
            ranks.append(subprocess.Popen([sys.executable, "-m", "diloco", "worker", "--connect", address, "--id", "m",
                                           "--sync-every", str(sync_every), "--device", "cpu", *entry], env=renv,
                                          cwd=workdir, stdout=open(workdir / f"{kind}-{plane}-rank{rank}.log", "wb"),
                                          stderr=subprocess.STDOUT))
        first = None
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            applied = _status(address).get("rounds_applied", 0)
            if applied >= 1 and first is None:
                first = (time.monotonic(), applied)
            if first is not None and applied >= first[1] + rounds:
                return (time.monotonic() - first[0]) / (applied - first[1])
            if any(r.poll() is not None for r in ranks):
                raise SystemExit(f"bench_sharded: a {kind} rank exited early; logs in {workdir}")
            time.sleep(0.05)
        raise SystemExit(f"bench_sharded: the {kind} run applied too few rounds; logs in {workdir}")
    finally:
        for p in ranks + [server]:
            p.kill()
            p.wait()


def round_time(rounds: int, sync_every: int, planes: list[str]) -> dict:
    summary = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(tmp)
        for plane in planes:
            # Alternated, so that the machine's noise falls on both.
            times: dict[str, list[float]] = {"sharded": [], "replicated": []}
            for _ in range(2):
                for kind in ("sharded", "replicated"):
                    times[kind].append(one_run(kind, rounds, sync_every, work, plane))
            sharded, replicated = min(times["sharded"]), min(times["replicated"])
            print(f"  {plane} plane, one member of 2 ranks, H={sync_every}: {sharded:.3f} s per round sharded, "
                  f"{replicated:.3f} s replicated (best of 2 runs each)", flush=True)
            summary.update({f"round_sharded_s_{plane}": f"{sharded:.3f}",
                            f"round_replicated_s_{plane}": f"{replicated:.3f}",
                            f"round_ratio_{plane}": f"{sharded / replicated:.3f}"})
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4], help="member sizes to measure memory at")
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=6, help="rounds timed per run")
    parser.add_argument("--sync-every", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="a small model, worlds 1 2, 4 rounds")
    parser.add_argument("--only", choices=("memory", "round"), help="one part only")
    parser.add_argument("--planes", nargs="+", choices=("hub", "collective"), default=["hub", "collective"],
                        help="data planes to time a round on")
    args = parser.parse_args(argv)
    if args.quick:
        args.worlds, args.d_model, args.layers, args.rounds = [1, 2], 256, 4, 4
    if 1 not in args.worlds:
        parser.error("--worlds must include 1 (the replicated figure the others are compared with)")
    summary = {}
    if args.only != "round":
        summary.update(memory(sorted(args.worlds), args.d_model, args.layers))
    if args.only != "memory":
        summary.update(round_time(args.rounds, args.sync_every, args.planes))
    print("RESULT bench_sharded " + " ".join(f"{k}={v}" for k, v in summary.items()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
