"""bench_transport: one outer step over ZeroMQ vs the raw-pyzmq floor and gloo; heartbeat round trips.

Outer step: 4 worker processes and one coordinator process on loopback, a
10M-parameter fp32 model (40 MB). Every worker submits its pseudo-gradient at
the same instant (a multiprocessing barrier) and the step is timed from the
first submit to the moment the last worker holds the new params (the
``Result`` decoded). Measured, in the same run, three ways:

* **diloco**: the real path -- ``ZmqWorkerEndpoint`` -> codec -> ROUTER ->
  ``coordinator.runner.serve`` -> ``Coordinator`` (checks, running sum, outer
  Nesterov step) -> codec -> each worker.
* **raw_zmq** (the floor): raw pyzmq doing the same star exchange: each worker
  sends its 40 MB as frames of a few MB to one ROUTER process, which sums them
  and sends the sum back to each worker. No codec, no checks, no optimizer.
* **gloo**: ``torch.distributed`` gloo ``all_reduce`` of the same tensors among
  4 processes (``init_method tcp://127.0.0.1:PORT``), for reference.
* **diloco_auth**: the real path again with CURVE authentication and
  encryption on every connection (``diloco server --auth``; keys made as
  ``diloco keygen`` makes them); ``auth_ratio`` = diloco_auth / diloco.

Heartbeats: 100 connected DEALER sockets (spread over 4 client processes) each
heartbeat every ``--hb-interval`` seconds (random phase) against the real
server loop; round trip p50 and p99 from send to decoded ``HeartbeatReply``.

Repetitions are interleaved (diloco, raw, gloo in each repetition) and the
median is reported. Last line::

    RESULT bench_transport outer_step_s=X raw_zmq_s=X gloo_s=X ratio_vs_raw=R ratio_vs_gloo=R heartbeat_p99_ms=X auth_s=X auth_ratio=R

Goals: ratio_vs_raw <= 1.3; heartbeat p99 < 10 ms; auth_ratio <= 2.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import socket
import statistics
import sys
import time

N_WORKERS = 4


def _tune() -> None:
    """Every benchmark process (diloco, raw floor, gloo alike) runs with the malloc tuning
    ``diloco server``/``worker`` apply (diloco/deploy/tuning.py), so the comparison is fair."""
    from diloco.deploy.tuning import keep_freed_memory
    keep_freed_memory()


def shapes_for(n_params: int) -> list[tuple[int, ...]]:
    """A model-like mix: four large matrices (chunked on the wire) and several small tensors."""
    big = n_params * 9 // 40  # 4 x 22.5% = 90%
    rest = n_params - 4 * big
    small = [rest // 8] * 7
    small.append(rest - sum(small))
    return [(big,)] * 4 + [(s,) for s in small]


def make_params(shapes, fill: float):
    import torch
    return {f"p{i}": torch.full(s, fill, dtype=torch.float32) for i, s in enumerate(shapes)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ diloco path


def diloco_coordinator(addr_q, stop_ev, n_workers: int, chunk_bytes: int, auth_dir: str | None = None,
                       io_threads: int = 1) -> None:
    _tune()
    import torch
    torch.set_num_threads(1)
    from diloco.coordinator import Coordinator, CoordinatorConfig
    from diloco.coordinator.runner import serve
    from diloco.core import FSMConfig
    from diloco.deploy.server import warm_up
    from diloco.wire.zmq import ZmqCoordinatorEndpoint, ZmqOptions

    config = CoordinatorConfig(fsm=FSMConfig(min_workers=n_workers, heartbeat_timeout_s=3600.0))
    warm_up(config)
    coordinator = Coordinator(config, time.monotonic())
    auth = None
    if auth_dir is not None:
        from diloco.transport.zmq.auth import ServerAuth
        auth = ServerAuth.load(auth_dir)
    endpoint = ZmqCoordinatorEndpoint("tcp://127.0.0.1:0", auth=auth,
                                      options=ZmqOptions(chunk_bytes=chunk_bytes, io_threads=io_threads))
    addr_q.put(endpoint.address)
    try:
        serve(endpoint, coordinator, stop_event=stop_ev, tick_interval_s=0.05)
    finally:
        endpoint.close()


def diloco_worker(i: int, addr: str, shapes, rounds: int, barrier, out_q, chunk_bytes: int,
                  auth_dir: str | None = None) -> None:
    _tune()
    import torch
    torch.set_num_threads(1)
    from diloco.wire.messages import PROTOCOL_VERSION, Join, Result, Submit, Welcome, spec_of
    from diloco.wire.zmq import ZmqOptions, ZmqWorkerEndpoint

    wid = f"bench{i}"
    params = make_params(shapes, 0.0)
    auth = None
    if auth_dir is not None:
        from diloco.transport.zmq.auth import ClientAuth
        auth = ClientAuth.load(os.path.join(auth_dir, "keys", f"{wid}.key_secret"),
                               os.path.join(auth_dir, "server.key"))
    ep = ZmqWorkerEndpoint(addr, label=wid, options=ZmqOptions(chunk_bytes=chunk_bytes), auth=auth)
    ep.send(Join(wid, PROTOCOL_VERSION, spec_of(params), params))
    while not isinstance(ep.recv(60.0), Welcome):
        pass
    grad = make_params(shapes, 0.001 * (i + 1))
    for r in range(rounds):
        barrier.wait()
        t0 = time.monotonic()
        ep.send(Submit(wid, 0, r, grad))
        while True:
            msg = ep.recv(120.0)
            if isinstance(msg, Result):
                break
            if msg is None:
                raise RuntimeError(f"{wid}: no Result for round {r}")
        t1 = time.monotonic()
        assert msg.outcome == "applied" and len(msg.params) == len(shapes)
        out_q.put((r, i, t0, t1))
    ep.close()


# ------------------------------------------------------------------ raw pyzmq floor


def raw_router(addr_q, n_workers: int, rounds: int) -> None:
    _tune()
    import torch
    import zmq
    torch.set_num_threads(1)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    addr_q.put(f"tcp://127.0.0.1:{port}")
    for _ in range(rounds):
        acc = None
        ids = []
        for _k in range(n_workers):
            frames = sock.recv_multipart(copy=False)
            ids.append(frames[0].bytes)
            parts = [torch.frombuffer(f.buffer, dtype=torch.float32) for f in frames[1:]]
            if acc is None:
                acc = [p.clone() for p in parts]
            else:
                for a, p in zip(acc, parts):
                    a.add_(p)
        out = [a.numpy() for a in acc]
        for rid in ids:
            sock.send_multipart([rid, *out], copy=False)
    time.sleep(0.5)  # let the last sends drain
    sock.close(0)
    ctx.term()


def raw_dealer(i: int, addr: str, shapes, rounds: int, barrier, out_q, chunk_bytes: int) -> None:
    _tune()
    import torch
    import zmq
    torch.set_num_threads(1)
    flat = torch.full((sum(s[0] for s in shapes),), 0.001 * (i + 1), dtype=torch.float32)
    view = memoryview(flat.numpy()).cast("B")
    chunks = [view[k:k + chunk_bytes] for k in range(0, len(view), chunk_bytes)]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(addr)
    for r in range(rounds):
        barrier.wait()
        t0 = time.monotonic()
        sock.send_multipart(chunks, copy=False)
        frames = sock.recv_multipart(copy=False)
        t1 = time.monotonic()
        assert len(frames) == len(chunks)
        out_q.put((r, i, t0, t1))
    sock.close(0)
    ctx.term()


# ------------------------------------------------------------------ gloo


def gloo_worker(rank: int, world: int, port: int, shapes, rounds: int, barrier, out_q) -> None:
    _tune()
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    tensors = list(make_params(shapes, 0.001 * (rank + 1)).values())
    for r in range(rounds):
        barrier.wait()
        t0 = time.monotonic()
        for t in tensors:
            dist.all_reduce(t)
        t1 = time.monotonic()
        out_q.put((r, rank, t0, t1))
    dist.destroy_process_group()


# ------------------------------------------------------------------ heartbeats


def hb_client(i: int, addr: str, n_sockets: int, interval_s: float, duration_s: float, start_at: float,
              out_q) -> None:
    _tune()
    import torch
    import zmq
    from diloco.wire import codec
    from diloco.wire.messages import PROTOCOL_VERSION, Heartbeat, HeartbeatReply, Join, Welcome, spec_of
    from diloco.wire.zmq import make_routing_id
    from diloco.transport.zmq.framing import parts

    def send(sock, message) -> None:  # protocol 2: one [tag, frame] part per codec frame
        for part in parts(1, codec.encode(message)):
            sock.send_multipart(part, copy=False)

    def recv(sock):  # skips the coordinator's liveness probes (empty messages); one-part replies only
        while True:
            frames = sock.recv_multipart(copy=False)
            if len(frames) == 2:
                return codec.decode([frames[1]])

    ctx = zmq.Context()
    poller = zmq.Poller()
    socks = []
    params = {"w": torch.zeros(4)}
    for k in range(n_sockets):
        s = ctx.socket(zmq.DEALER)
        s.linger = 0
        s.setsockopt(zmq.ROUTING_ID, make_routing_id(f"hb{i}_{k}"))
        s.connect(addr)
        socks.append(s)
        poller.register(s, zmq.POLLIN)
    wids = [f"hb{i}_{k}" for k in range(n_sockets)]
    for s, wid in zip(socks, wids):
        send(s, Join(wid, PROTOCOL_VERSION, spec_of(params), params))
        assert s.poll(60_000), "no Welcome"
        welcome = s.recv_multipart(copy=False)  # header part, then the params' part
        assert isinstance(codec.decode([welcome[1], s.recv_multipart(copy=False)[1]]), Welcome)
    index = {s: k for k, s in enumerate(socks)}
    rng = random.Random(i)
    while time.monotonic() < start_at:
        time.sleep(0.005)
    next_at = [start_at + rng.random() * interval_s for _ in socks]
    sent_at = [None] * n_sockets
    rtts = []
    end = start_at + duration_s
    while True:
        now = time.monotonic()
        if now >= end and all(t is None for t in sent_at):
            break
        for k in range(n_sockets):
            if sent_at[k] is None and now >= next_at[k] and now < end:
                sent_at[k] = time.monotonic()
                send(socks[k], Heartbeat(wids[k]))
                next_at[k] += interval_s
        wait_ms = max(0, min([int((t - time.monotonic()) * 1000) for t in next_at] + [5]))
        for s, _ in poller.poll(wait_ms):
            k = index[s]
            msg = recv(s)
            t = time.monotonic()
            if isinstance(msg, HeartbeatReply) and sent_at[k] is not None:
                rtts.append(t - sent_at[k])
                sent_at[k] = None
        if time.monotonic() > end + 10:
            break
    for s in socks:
        s.close(0)
    ctx.term()
    out_q.put(rtts)


# ------------------------------------------------------------------ driver


def _collect(out_q, n: int, rounds: int, warmup: int) -> list[float]:
    by_round: dict[int, list[tuple[float, float]]] = {}
    for _ in range(n * rounds):
        r, _i, t0, t1 = out_q.get(timeout=600)
        by_round.setdefault(r, []).append((t0, t1))
    return [max(t1 for _, t1 in v) - min(t0 for t0, _ in v) for r, v in sorted(by_round.items()) if r >= warmup]


def _join_all(procs, timeout_s: float = 120.0) -> None:
    for p in procs:
        p.join(timeout_s)
        if p.is_alive():
            p.kill()
            p.join(10)
        if p.exitcode not in (0, None):
            raise RuntimeError(f"{p.name} exited with {p.exitcode}")


def make_auth_dir(path: str) -> str:
    """A server key, and one worker key per benchmark worker (``keys/benchN``), as `diloco keygen` makes them."""
    from diloco.transport.zmq.auth import generate_keypair

    generate_keypair("server", path)
    os.makedirs(os.path.join(path, "workers"), exist_ok=True)
    for i in range(N_WORKERS):
        public, _ = generate_keypair(f"bench{i}", os.path.join(path, "keys"))
        with open(os.path.join(path, "workers", public.name), "wb") as f:
            f.write(public.read_bytes())
    return path


def run_diloco(ctx, shapes, rounds: int, warmup: int, chunk_bytes: int, auth_dir: str | None = None,
               io_threads: int = 1) -> list[float]:
    addr_q, out_q, stop_ev = ctx.Queue(), ctx.Queue(), ctx.Event()
    coord = ctx.Process(target=diloco_coordinator, args=(addr_q, stop_ev, N_WORKERS, chunk_bytes, auth_dir, io_threads),
                        name="coordinator")
    coord.start()
    try:
        addr = addr_q.get(timeout=300)
        barrier = ctx.Barrier(N_WORKERS)
        workers = [ctx.Process(target=diloco_worker, args=(i, addr, shapes, rounds, barrier, out_q, chunk_bytes,
                                                           auth_dir), name=f"diloco-worker{i}") for i in range(N_WORKERS)]
        for w in workers:
            w.start()
        times = _collect(out_q, N_WORKERS, rounds, warmup)
        _join_all(workers)
    finally:
        stop_ev.set()
        coord.join(30)
        if coord.is_alive():
            coord.kill()
    return times


def run_raw(ctx, shapes, rounds: int, warmup: int, chunk_bytes: int) -> list[float]:
    addr_q, out_q = ctx.Queue(), ctx.Queue()
    router = ctx.Process(target=raw_router, args=(addr_q, N_WORKERS, rounds), name="raw-router")
    router.start()
    addr = addr_q.get(timeout=300)
    barrier = ctx.Barrier(N_WORKERS)
    workers = [ctx.Process(target=raw_dealer, args=(i, addr, shapes, rounds, barrier, out_q, chunk_bytes),
                           name=f"raw-dealer{i}") for i in range(N_WORKERS)]
    for w in workers:
        w.start()
    times = _collect(out_q, N_WORKERS, rounds, warmup)
    _join_all(workers + [router])
    return times


def run_gloo(ctx, shapes, rounds: int, warmup: int) -> list[float]:
    out_q = ctx.Queue()
    port = free_port()
    barrier = ctx.Barrier(N_WORKERS)
    procs = [ctx.Process(target=gloo_worker, args=(r, N_WORKERS, port, shapes, rounds, barrier, out_q),
                         name=f"gloo{r}") for r in range(N_WORKERS)]
    for p in procs:
        p.start()
    times = _collect(out_q, N_WORKERS, rounds, warmup)
    _join_all(procs)
    return times


def run_heartbeats(ctx, n_workers: int, n_clients: int, interval_s: float, duration_s: float) -> list[float]:
    addr_q, out_q, stop_ev = ctx.Queue(), ctx.Queue(), ctx.Event()
    coord = ctx.Process(target=diloco_coordinator, args=(addr_q, stop_ev, 1, 16 << 20), name="coordinator")
    coord.start()
    try:
        addr = addr_q.get(timeout=300)
        per = [n_workers // n_clients + (1 if k < n_workers % n_clients else 0) for k in range(n_clients)]
        start_at = time.monotonic() + 25.0  # after every client has started and joined
        clients = [ctx.Process(target=hb_client, args=(k, addr, per[k], interval_s, duration_s, start_at, out_q),
                               name=f"hb-client{k}") for k in range(n_clients)]
        for c in clients:
            c.start()
        rtts: list[float] = []
        for _ in clients:
            rtts.extend(out_q.get(timeout=600))
        _join_all(clients)
    finally:
        stop_ev.set()
        coord.join(30)
        if coord.is_alive():
            coord.kill()
    return rtts


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=int, default=10_000_000, help="model size in fp32 parameters (default 10M)")
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions of the three methods (default 3)")
    ap.add_argument("--rounds", type=int, default=5, help="timed outer steps per repetition (default 5)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed outer steps first (default 2)")
    ap.add_argument("--chunk-mb", type=float, default=None,
                    help="diloco: the codec's frame size for tensors, MiB (default: the codec's, 16)")
    ap.add_argument("--raw-chunk-mb", type=float, default=4.0, help="the floor's frame size, MiB (default 4)")
    ap.add_argument("--hb-workers", type=int, default=100)
    ap.add_argument("--hb-clients", type=int, default=4, help="processes holding the heartbeat sockets")
    ap.add_argument("--hb-interval", type=float, default=0.1, help="seconds between one socket's heartbeats")
    ap.add_argument("--hb-seconds", type=float, default=10.0)
    ap.add_argument("--quick", action="store_true", help="1 repetition, 2 rounds, 5 s of heartbeats")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: diloco,auth,raw,gloo,heartbeat")
    ap.add_argument("--auth-io-threads", type=int, default=2,
                    help="ZeroMQ I/O threads of the coordinator with CURVE (default 2, as `diloco server --auth`)")
    args = ap.parse_args(argv)
    if args.quick:
        args.reps, args.rounds, args.hb_seconds = 1, 2, 5.0
    skip = set(filter(None, args.skip.split(",")))
    from diloco.wire.codec import CHUNK_BYTES
    chunk = CHUNK_BYTES if args.chunk_mb is None else int(args.chunk_mb * (1 << 20))
    raw_chunk = int(args.raw_chunk_mb * (1 << 20))
    shapes = shapes_for(args.params)
    rounds = args.rounds + args.warmup
    ctx = mp.get_context("spawn")
    print(f"bench_transport: {args.params:,} fp32 params ({args.params * 4 / 1e6:.0f} MB) in {len(shapes)} tensors, "
          f"{N_WORKERS} workers, frames of {chunk / (1 << 20):g} MiB (floor {args.raw_chunk_mb:g} MiB), "
          f"{args.reps} reps x {args.rounds} rounds "
          f"(+{args.warmup} warm-up), {os.cpu_count()} CPUs", flush=True)
    import tempfile
    auth_dir = make_auth_dir(os.path.join(tempfile.mkdtemp(prefix="bench-auth-"), "auth"))
    results: dict[str, list[float]] = {"diloco": [], "diloco_auth": [], "raw_zmq": [], "gloo": []}
    for rep in range(args.reps):
        for name, fn in (("diloco", lambda: run_diloco(ctx, shapes, rounds, args.warmup, chunk)),
                         ("diloco_auth", lambda: run_diloco(ctx, shapes, rounds, args.warmup, chunk, auth_dir,
                                                            args.auth_io_threads)),
                         ("raw_zmq", lambda: run_raw(ctx, shapes, rounds, args.warmup, raw_chunk)),
                         ("gloo", lambda: run_gloo(ctx, shapes, rounds, args.warmup))):
            if name.split("_")[0] in skip or (name == "diloco_auth" and "auth" in skip):
                continue
            times = fn()
            results[name].extend(times)
            print(f"  rep {rep + 1}/{args.reps} {name:8} " + " ".join(f"{t * 1000:7.1f}" for t in times) + " ms",
                  flush=True)
    med = {k: statistics.median(v) if v else float("nan") for k, v in results.items()}
    print()
    print(f"{'method':10} {'median s':>9} {'min s':>8} {'max s':>8}  samples")
    for k, v in results.items():
        if v:
            print(f"{k:10} {med[k]:9.3f} {min(v):8.3f} {max(v):8.3f}  {len(v)}")
    hb_p50 = hb_p99 = float("nan")
    if "heartbeat" not in skip:
        rtts = run_heartbeats(ctx, args.hb_workers, args.hb_clients, args.hb_interval, args.hb_seconds)
        hb_p50, hb_p99 = pct(rtts, 50) * 1000, pct(rtts, 99) * 1000
        rate = args.hb_workers / args.hb_interval
        print(f"heartbeats: {args.hb_workers} DEALERs in {args.hb_clients} processes, one every {args.hb_interval:g} s "
              f"each ({rate:.0f}/s in total), {len(rtts)} round trips: p50 {hb_p50:.2f} ms, p99 {hb_p99:.2f} ms, "
              f"max {max(rtts) * 1000:.2f} ms")
    ratio_raw = med["diloco"] / med["raw_zmq"]
    ratio_gloo = med["diloco"] / med["gloo"]
    auth_ratio = med["diloco_auth"] / med["diloco"]
    print(f"RESULT bench_transport outer_step_s={med['diloco']:.3f} raw_zmq_s={med['raw_zmq']:.3f} "
          f"gloo_s={med['gloo']:.3f} ratio_vs_raw={ratio_raw:.2f} ratio_vs_gloo={ratio_gloo:.2f} "
          f"heartbeat_p99_ms={hb_p99:.2f} auth_s={med['diloco_auth']:.3f} auth_ratio={auth_ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
