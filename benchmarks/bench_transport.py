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
median is reported.

The coordinator's memory: its process runs nothing but the coordinator (``serve``, the endpoint,
libzmq's threads). Its RSS once the endpoint is bound and before any worker joined is the runtime
(Python, torch, libzmq); the peak RSS of each round (VmHWM, its window restarted after each round)
above that, divided by the model's bytes, is ``coord_peak_copies``. The report splits it: what the
coordinator's own structures hold right after an outer step, and what is in flight at the transport
(the Submits' frames, whole or being assembled) as each Submit is decoded. ``--workers K`` shows how
it grows with k.

``--profile``: where the hub's round goes in the coordinator process (each phase's ms on its main
thread, its CPU and fresh pages, a timeline against the workers' clocks) and the floor's timeline,
by wrapping functions in the bench's processes only. ``--stall-dump S``: when no result has come
for S seconds, every process of the run dumps its stacks to stderr. Last line::

    RESULT bench_transport outer_step_s=X raw_zmq_s=X gloo_s=X ratio_vs_raw=R ratio_vs_gloo=R heartbeat_p99_ms=X auth_s=X auth_ratio=R coord_peak_mb=X coord_peak_copies=R

Goals: ratio_vs_raw <= 1.3 at 10M and <= 1.5 at 100M; heartbeat p99 < 10 ms; auth_ratio <= 2.

The collective data plane (``--collective``)
--------------------------------------------
Instead of the run above: at each ``--params`` size (default 10M and 100M), interleaved in every
repetition, medians kept:

* **collective**: a coordinator process as ``diloco server --data-plane collective`` runs it (a
  ``StoreHost``, ``serve``, a collective-mode ``Coordinator``) and 4 worker processes, each a
  ``ZmqWorkerEndpoint`` wrapped in ``CollectiveEndpoint`` (as ``DilocoWorker`` wraps it) and driven with
  the session's messages. The first joins with its params (they stay on its side), the others heal from
  it; then per round every worker leaves a barrier and sends its ``Submit``; timed from the first
  Submit ("ready") to the last worker holding the new params (the ``Result`` its endpoint hands over):
  ready, ``ReduceOrder``, the gloo all-reduce among the workers, each worker's outer step and digest,
  the votes, the commit and the Result.
* **floor**: the least any replicated DiLoCo must do each round, in every process: the gloo
  all-reduce of the pseudo-gradient, the mean, and a plain ``torch.optim`` Nesterov outer step on the
  params (what a peer like torchft does; no checks, digest, backup or vote). ``ratio_vs_floor`` is
  what the commit protocol costs on top; the breakdown says where it goes.
* **torchft** (where torchft is installed; ``--skip-torchft`` leaves it out): torchft itself, its
  ``local_sgd.DiLoCo`` syncing after every inner step. A lighthouse process (its Rust server) and 4 replica
  groups of one process each, each with its own TCPStore, ``Manager`` (synchronous quorum, gloo) and the
  floor's outer optimizer. The inner step only moves the params by the floor's pseudo-gradient, untimed;
  timed is the outer sync its hook runs: the quorum at the lighthouse, the pseudo-gradient, its all-reduce
  and mean, the params restored from torchft's backup, ``should_commit``, the Nesterov step and the new
  backup. ``ratio_vs_torchft`` is the collective round against it. Where torchft is not importable the run
  says it skipped it and the RESULT line has no torchft fields.
* **gloo**: the raw gloo all-reduce of the same tensors (as above).
* **diloco** (the hub): the hub's outer step (as above).
* **collective_a1** (``--arena-variant``): the collective plane again with ``MALLOC_ARENA_MAX=1`` in its
  processes' environment (a diagnosis: see benchmarks/README.md).

Wrappers in the worker processes (this file only) time each step of a collective round; the run prints
where the time goes, per worker and along the critical path, and the workers' CPU and fresh pages per
round. ``--profile`` also times the round's local ops alone, on the main thread and on another thread.
One line per size::

    RESULT bench_transport_collective params=N collective_s=X gloo_s=X hub_s=X floor_s=X ratio_vs_gloo=R
        ratio_vs_floor=R hub_ratio_vs_gloo=R collective_vs_hub=R [torchft_s=X ratio_vs_torchft=R]
        [collective_arena1_s=X arena1_ratio_vs_gloo=R]

Goal: ratio_vs_floor <= 1.25 at 10M and at 100M.

About 1,670 lines: one benchmark is one file, run and read top to bottom; every
arm (the hub, the raw-pyzmq star, gloo, the collective plane, its floor, torchft
where installed) times the same outer step on the same processes and barrier,
and they share that harness and the report.
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
#: What the collective run says when torchft's arm does not run, with why (``torchft_missing``, --skip-torchft).
TORCHFT_SKIPPED = "torchft: skipped -- {}; ratio_vs_torchft is not measured"


def _tune() -> None:
    """Every benchmark process (diloco, raw floor, gloo alike) runs with the malloc tuning
    ``diloco server``/``worker`` apply (diloco/deploy/tuning.py), so the comparison is fair.
    And each dumps its threads' stacks to stderr on SIGUSR1: the driver sends it when a run stalls."""
    import faulthandler
    import signal
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    from diloco.deploy.tuning import keep_freed_memory
    keep_freed_memory()


#: The torch threads of the hub's coordinator and of the floor's router (``--hub-threads``), handed to
#: the spawned processes through the environment; workers and gloo ranks always run one.
HUB_THREADS_ENV = "DILOCO_BENCH_HUB_THREADS"


def _hub_threads() -> int:
    return int(os.environ.get(HUB_THREADS_ENV, "1"))


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
                       io_threads: int = 1, report_q=None, profile: bool = False) -> None:
    _tune()
    import torch
    torch.set_num_threads(_hub_threads())
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
    probe = _HubProbe(n_workers, report_q, profile) if report_q is not None else None
    if probe is not None:
        probe.install(endpoint)
    addr_q.put(endpoint.address)
    try:
        serve(endpoint, coordinator, stop_event=stop_ev, tick_interval_s=0.05)
    finally:
        endpoint.close()
        if probe is not None:
            probe.finish()


def _proc_status_kb(field: str) -> int:
    """A ``VmRSS``/``VmHWM``-like line of /proc/self/status, in kB (0 where there is no such file)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _reset_peak_rss() -> bool:
    """Start a new VmHWM window (Linux >= 4.0: ``5`` > /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _held_bytes(coordinator) -> int:
    """Bytes of the distinct tensor memory the hub coordinator's own structures hold: the params, the
    outer optimizers' state and its backups, the running sums, held async contributions, and the views
    its pending Results carry (one storage counted once, however many tensors view it)."""
    import torch

    seen: dict[int, int] = {}

    def add(t) -> None:
        if isinstance(t, torch.Tensor) and t.numel():
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()

    store = coordinator.store
    if store is None:
        return 0
    hub = coordinator.hub
    for t in store.params.values():
        add(t)
    for s in getattr(store, "_sums", []):
        for t in (s or {}).values():
            add(t)
    for opt in hub._optimizers:
        for state in opt.state.values():
            for v in state.values():
                add(v)
    for backup in hub._optimizer_backups:
        for entry in getattr(backup, "_state", {}).values():
            for v in entry.values():
                add(v)
    for _, released in hub._released.values():
        for t in list(released.values.values()) + list(released.scales.values()):
            add(t)
    for held in hub._held.values():
        for t in held.tensors.values():
            add(t)
    return sum(seen.values())


class _HubProbe:
    """What one hub round costs inside the coordinator process, by wrapping functions in that process only
    (nothing in diloco/ changes), and the process's memory.

    Memory (always): VmRSS once the endpoint is bound and before any worker joined (the runtime: Python,
    torch, libzmq), and the peak (VmHWM) over each round -- the window restarts after each round's last
    Result is handed to the transport (``/proc/self/clear_refs``), so a round's peak includes what the
    previous round's Results still hold while they are sent.

    Phases (``profile``): wall ms on the coordinator's main thread per round, summed over the round's
    submissions; ``phase_marks`` are ``time.monotonic`` readings, comparable with the workers' t0/t1."""

    PHASES = (
        ("codec", "Submit decode: codec.decode (header, checks; chunked tensors arrive assembled)"),
        ("wire", "wire dtype decode: compression.decode (fp32: none)"),
        ("measure", "as parts arrive: each fp32 tensor's norm measured for the checks (SubmitSquares)"),
        ("check", "checks: names, shapes, dtypes, finiteness (check_submission)"),
        ("accumulate", "running sum: ParamStore.accumulate"),
        ("mean", "mean: ParamStore.take_mean"),
        ("outer_rest", "outer step: the rest (for torch.optim's step: backups, unless made in idle ticks)"),
        ("opt_step", "outer step: Nesterov step (step_in_blocks: in place or to fresh memory; or torch.optim)"),
        ("finite", "outer step: finiteness of the new params (torch.optim's step only)"),
        ("snapshot", "Result snapshot of the new params"),
        ("fsm", "everything else in Coordinator.handle (FSM, messages)"),
        ("send", "Result encode + hand-off to the transport (x k)"),
        ("recv_py", "transport, main thread: parts received, chunks copied into place (CPU; the measuring apart)"),
    )

    def __init__(self, n_workers: int, report_q, profile: bool) -> None:
        self.n_workers = n_workers
        self.report_q = report_q
        self.profile = profile
        self.base_kb = 0
        self.round: dict = {}
        self.results_sent = 0
        self.rounds = 0
        self.model_bytes = 0

    def _add(self, key: str, dt: float) -> None:
        self.round[key] = self.round.get(key, 0.0) + dt

    def _mark(self, key: str, first: bool = False) -> None:
        marks = self.round.setdefault("marks", {})
        if not (first and key in marks):
            marks[key] = time.monotonic()

    def _wrap(self, owner, name: str, key: str, mark: str | None = None, first_mark: str | None = None):
        """Time ``owner.name`` under ``key`` (wall), and its CPU on the calling thread under ``key + "_cpu"``."""
        original = getattr(owner, name)
        probe = self

        def wrapper(*args, **kwargs):
            if first_mark:
                probe._mark(first_mark, first=True)
            t, c = time.perf_counter(), time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                probe._add(key, time.perf_counter() - t)
                probe._add(key + "_cpu", time.thread_time() - c)
                if mark:
                    probe._mark(mark)
        setattr(owner, name, wrapper)
        return original

    def install(self, endpoint) -> None:
        import resource

        import torch
        import diloco.coordinator.hub_rounds as hub_mod
        import diloco.coordinator.service as service_mod
        import diloco.transport.zmq.framing as framing_mod
        import diloco.wire.codec as codec_mod
        import diloco.wire.compression as compression_mod
        import diloco.wire.measure as measure_mod
        from diloco.coordinator.params import ParamStore
        from diloco.wire.messages import Result, Submit

        self.base_kb = _proc_status_kb("VmRSS")
        _reset_peak_rss()
        probe = self
        self._ru = resource.getrusage(resource.RUSAGE_SELF)
        self._thread_cpu = time.thread_time()
        original_decode = codec_mod.decode
        assembler = getattr(endpoint.frames, "_assembler", None)

        def decode(frames, **kw):
            t, c = time.perf_counter(), time.thread_time()
            message = original_decode(frames, **kw)
            if isinstance(message, Submit):
                probe._add("codec", time.perf_counter() - t)
                probe._add("codec_cpu", time.thread_time() - c)
                probe._mark("last_submit_decoded")
                probe._mark("first_submit_decoded", first=True)
                # In flight at the transport as this Submit is decoded: its own frames, and the parts
                # of other peers' messages held until they are whole (the transport's assembler).
                held = sum(framing_mod.nbytes(f) for f in frames) + (assembler.partial_bytes if assembler else 0)
                probe.round["inflight_bytes"] = max(probe.round.get("inflight_bytes", 0), held)
            return message
        codec_mod.decode = decode
        original_census_apply = service_mod.Coordinator._apply

        def census_apply(coordinator, effect, now):
            out = original_census_apply(coordinator, effect, now)
            probe.round["held_bytes"] = max(probe.round.get("held_bytes", 0), _held_bytes(coordinator))
            return out
        service_mod.Coordinator._apply = census_apply
        if self.profile:
            self._wrap(compression_mod, "decode", "wire")
            self._wrap(ParamStore, "check_submission", "check")
            if hasattr(measure_mod, "SubmitSquares"):
                self._wrap(measure_mod.SubmitSquares, "frame", "measure")
            self._wrap(ParamStore, "accumulate", "accumulate")
            self._wrap(ParamStore, "take_mean", "mean")
            self._wrap(hub_mod, "all_finite", "finite")
            self._wrap(torch.optim.SGD, "step", "opt_step")
            self._wrap(hub_mod, "step_in_blocks", "opt_step")
            self._wrap(hub_mod.HubRounds, "idle", "prepare")
            self._wrap(framing_mod.Assembler, "add", "assemble", first_mark="first_part")
            original_outer = hub_mod.HubRounds.outer_step
            original_apply = hub_mod.HubRounds.apply
            original_handle = service_mod.Coordinator.handle

            def outer_step(hub, fid, grad, *args):
                t = time.perf_counter()
                before = dict(probe.round)
                where = [p.data_ptr() for p in hub.store.fragment_params(fid).values()]
                try:
                    return original_outer(hub, fid, grad, *args)
                finally:
                    # The params' memory unchanged: the step was made in place (``outer.step_in_blocks``).
                    same = where == [p.data_ptr() for p in hub.store.fragment_params(fid).values()]
                    probe._add("in_place", 1.0 if same else 0.0)
                    inner = sum(probe.round.get(k, 0.0) - before.get(k, 0.0) for k in ("opt_step", "finite"))
                    probe._add("outer_step", time.perf_counter() - t)
                    probe._add("outer_rest", time.perf_counter() - t - inner)

            def apply(hub, effect, now):
                t = time.perf_counter()
                before = dict(probe.round)
                try:
                    return original_apply(hub, effect, now)
                finally:
                    inner = sum(probe.round.get(k, 0.0) - before.get(k, 0.0) for k in ("mean", "outer_step"))
                    probe._add("snapshot", time.perf_counter() - t - inner)
                    probe._mark("applied")

            def handle(coordinator, peer, message, now, identity=None, **kw):
                t = time.perf_counter()
                before = dict(probe.round)
                try:
                    return original_handle(coordinator, peer, message, now, identity=identity, **kw)
                finally:
                    if isinstance(message, Submit):
                        inner = sum(probe.round.get(k, 0.0) - before.get(k, 0.0)
                                    for k in ("wire", "check", "accumulate", "mean", "outer_step", "snapshot"))
                        probe._add("fsm", time.perf_counter() - t - inner)
            hub_mod.HubRounds.outer_step = outer_step
            hub_mod.HubRounds.apply = apply
            service_mod.Coordinator.handle = handle

        original_send = type(endpoint).send
        original_recv = type(endpoint).recv

        def send(ep, peer, message):
            t = time.perf_counter()
            original_send(ep, peer, message)
            if isinstance(message, Result) and message.params:
                probe._add("send", time.perf_counter() - t)
                probe.results_sent += 1
                if not probe.model_bytes:
                    probe.model_bytes = sum(p.numel() * p.element_size() for p in message.params.values())
                if probe.results_sent % probe.n_workers == 0:
                    probe._mark("results_sent")
                    probe.end_round()

        def recv(ep, timeout_s):
            t, c = time.perf_counter(), time.thread_time()
            try:
                return original_recv(ep, timeout_s)
            finally:
                # CPU, not wall: recv mostly waits; what it computes is the parts' receive and assembly
                # (the codec's decode inside it is counted apart, and subtracted by the reader).
                probe._add("recv_cpu", time.thread_time() - c)
                probe._add("recv_wall", time.perf_counter() - t)
        type(endpoint).send = send
        type(endpoint).recv = recv

    def end_round(self) -> None:
        import resource
        ru = resource.getrusage(resource.RUSAGE_SELF)
        thread_cpu = time.thread_time()
        self.round.update(
            peak_kb=_proc_status_kb("VmHWM"), rss_kb=_proc_status_kb("VmRSS"), base_kb=self.base_kb,
            model_bytes=self.model_bytes,
            cpu_user=ru.ru_utime - self._ru.ru_utime, cpu_sys=ru.ru_stime - self._ru.ru_stime,
            main_cpu=thread_cpu - self._thread_cpu, minflt=ru.ru_minflt - self._ru.ru_minflt)
        self._ru, self._thread_cpu = ru, thread_cpu
        self.report_q.put(("round", self.rounds, self.round))
        self.rounds += 1
        self.round = {}
        _reset_peak_rss()

    def finish(self) -> None:
        self.report_q.put(("done", self.rounds, {"peak_kb": _proc_status_kb("VmHWM")}))


def diloco_worker(i: int, addr: str, shapes, rounds: int, barrier, out_q, chunk_bytes: int,
                  auth_dir: str | None = None) -> None:
    _tune()
    import torch
    torch.set_num_threads(1)
    from diloco.wire.messages import PROTOCOL_VERSION, Join, Result, Submit, Welcome, spec_of
    from diloco.wire.zmq import ZmqOptions, ZmqWorkerEndpoint

    wid = f"bench{i}"
    params = make_params(shapes, 0.0)
    if not isinstance(addr, str):  # a queue: started with the coordinator, which sends its address when bound
        addr = addr.get(timeout=300)
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
    import resource
    for r in range(rounds):
        barrier.wait()
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.monotonic()
        ep.send(Submit(wid, 0, r, grad))
        while True:
            msg = ep.recv(120.0)
            if isinstance(msg, Result):
                break
            if msg is None:
                raise RuntimeError(f"{wid}: no Result for round {r}")
        t1 = time.monotonic()
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        assert msg.outcome == "applied" and len(msg.params) == len(shapes)
        # This worker's CPU (all its threads) and fresh pages over the round (ru_ keys: not times).
        out_q.put((r, i, t0, t1, dict(ru_cpu=ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime,
                                      ru_minflt=ru1.ru_minflt - ru0.ru_minflt)))
    ep.close()


# ------------------------------------------------------------------ raw pyzmq floor


def raw_router(addr_q, n_workers: int, rounds: int, marks_q=None) -> None:
    """The floor's hub; with ``marks_q``, puts (round, first message whole, last message whole, replies
    handed over) per round, ``time.monotonic`` readings comparable with the dealers' t0/t1."""
    _tune()
    import torch
    import zmq
    torch.set_num_threads(_hub_threads())
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    addr_q.put(f"tcp://127.0.0.1:{port}")
    for r in range(rounds):
        acc = None
        ids = []
        got = []
        for _k in range(n_workers):
            frames = sock.recv_multipart(copy=False)
            got.append(time.monotonic())
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
        if marks_q is not None:
            marks_q.put((r, got[0], got[-1], time.monotonic()))
    # Close only once the last round's replies have left: linger 0 after a fixed pause (0.5 s) dropped them
    # when 4 x 400 MB took longer to send (100M params, a loaded machine), and the dealers waited forever.
    sock.close(linger=120_000)
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
    sock.rcvtimeo = 300_000  # a lost reply fails the run (zmq.Again) instead of hanging it
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


def floor_worker(rank: int, world: int, port: int, shapes, rounds: int, barrier, out_q) -> None:
    """The collective plane's floor: the least any replicated DiLoCo must do each round, in every process --
    a gloo all-reduce of the pseudo-gradient, the mean, and a plain ``torch.optim`` Nesterov outer step on
    the params (the run's default outer optimizer, lr 0.7 momentum 0.8). No checks, digest, backup or vote."""
    _tune()
    import torch
    import torch.distributed as dist
    from diloco.outer import OuterConfig
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    params = [p.requires_grad_(False) for p in make_params(shapes, 0.0).values()]
    grads = list(make_params(shapes, 0.001 * (rank + 1)).values())
    outer = OuterConfig()
    opt = torch.optim.SGD(params, lr=outer.lr, momentum=outer.momentum, nesterov=True)
    for r in range(rounds):
        barrier.wait()
        t0 = time.monotonic()
        for g in grads:
            dist.all_reduce(g)
        for p, g in zip(params, grads):
            g.div_(world)  # the mean; all-reduced again next round, it stays the mean
            p.grad = g
        opt.step()
        t1 = time.monotonic()
        out_q.put((r, rank, t0, t1))
    dist.destroy_process_group()


# ------------------------------------------------------------------ torchft


#: How long a torchft lighthouse process lives at most: past any run's results (``_collect`` gives up after
#: 900 s), so one whose driver died without stopping it still ends.
LIGHTHOUSE_LIFETIME_S = 1200.0


def torchft_missing() -> str | None:
    """Why torchft's arm cannot run here (the skip line's reason), or None where torchft imports."""
    try:
        import torchft.local_sgd  # noqa: F401
        import torchft.coordination  # noqa: F401
    except ImportError as e:  # torchft itself, a dependency of it, or its native part (the Rust servers)
        if isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] == "torchft":
            return "not installed (pip install torchft to compare)"
        return f"installed but not importable ({e})"
    return None


def torchft_lighthouse(addr_q, stop_ev, n_replicas: int) -> None:
    """torchft's lighthouse (its Rust server) on loopback: a quorum once all ``n_replicas`` replica groups
    ask. Puts its address once per replica (they start with it and wait for it), then serves until stopped."""
    os.environ["RUST_LOG"] = "warn"  # its Rust side logs every quorum request at info
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=n_replicas)
    # address() names the host by its hostname: name loopback itself, where the server is bound.
    addr = "http://127.0.0.1:" + server.address().rsplit(":", 1)[1]
    for _ in range(n_replicas):
        addr_q.put(addr)
    try:
        stop_ev.wait(LIGHTHOUSE_LIFETIME_S)
    finally:
        server.shutdown()


def torchft_worker(rank: int, world: int, addr_q, shapes, rounds: int, barrier, out_q) -> None:
    """A torchft replica group of one process: its own TCPStore and ``Manager`` (synchronous quorum, as
    torchft's DiLoCo requires) and ``torchft.local_sgd.DiLoCo`` over the params, syncing after every inner
    step. The inner step, untimed, only moves the params (by the floor's pseudo-gradient, 0.001 x (rank + 1)).
    Timed is the inner optimizer's ``step`` (itself nothing: no grads), whose hook is DiLoCo's outer sync: the
    quorum, the pseudo-gradient (the backup minus the params), its all-reduce and mean, the params restored
    from the backup, ``should_commit``, the Nesterov step (the floor's lr and momentum) and the new backup."""
    os.environ["RUST_LOG"] = "warn"  # its Rust side logs every quorum and commit at info
    _tune()
    import logging
    from datetime import timedelta

    import torch
    from torch.distributed import TCPStore
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo
    from diloco.outer import OuterConfig
    torch.set_num_threads(1)
    # It warns at each new quorum that NCCL's flight recorder cannot be reset: there is no NCCL here.
    logging.getLogger("torchft").setLevel(logging.ERROR)
    lighthouse = addr_q.get(timeout=300)
    timeout = timedelta(seconds=300)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the replica group's own
    model = torch.nn.ParameterDict({name: torch.nn.Parameter(p, requires_grad=False)
                                    for name, p in make_params(shapes, 0.0).items()})
    # init_sync=False: every replica starts from the same params, so none fetches them at the first quorum.
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=None, state_dict=None,
                      min_replica_size=world, use_async_quorum=False, timeout=timeout, quorum_timeout=timeout,
                      connect_timeout=timeout, rank=0, world_size=1, store_addr="127.0.0.1", store_port=store.port,
                      lighthouse_addr=lighthouse, replica_id=f"bench{rank}", hostname="127.0.0.1", init_sync=False)
    outer = OuterConfig()
    inner_opt = torch.optim.SGD(model.parameters(), lr=0.0)
    outer_opt = torch.optim.SGD(model.parameters(), lr=outer.lr, momentum=outer.momentum, nesterov=True)
    try:
        with DiLoCo(manager, [model], inner_opt, outer_opt, sync_every=1):
            for r in range(rounds):
                with torch.no_grad():
                    for p in model.parameters():
                        p.sub_(0.001 * (rank + 1))
                barrier.wait()
                t0 = time.monotonic()
                inner_opt.step()
                t1 = time.monotonic()
                if manager.current_step() != r + 1:
                    raise RuntimeError(f"torchft replica {rank}: round {r} was not committed")
                out_q.put((r, rank, t0, t1))
    finally:
        manager.shutdown(wait=False)


# ------------------------------------------------------------------ collective plane


def collective_coordinator(addr_q, stop_ev, n_workers: int, timeout_s: float, heal_sources: int = 1) -> None:
    """``diloco server --data-plane collective`` in miniature: the store, ``serve``, a real ``Coordinator``."""
    _tune()
    import torch
    torch.set_num_threads(1)
    from diloco.collective.store import StoreHost
    from diloco.coordinator import Coordinator, CoordinatorConfig
    from diloco.coordinator.runner import serve
    from diloco.core import FSMConfig
    from diloco.deploy.server import warm_up
    from diloco.wire.zmq import ZmqCoordinatorEndpoint

    config = CoordinatorConfig(fsm=FSMConfig(min_workers=n_workers, heartbeat_timeout_s=3600.0,
                                             data_plane="collective", reduce_timeout_s=4 * timeout_s),
                               collective_timeout_s=timeout_s, heal_sources=heal_sources)
    warm_up(config)
    coordinator = Coordinator(config, time.monotonic())
    store = StoreHost("127.0.0.1")  # as diloco/deploy/server.py's _start_store
    coordinator.collective.store_port = store.port
    coordinator.collective_store = store
    endpoint = ZmqCoordinatorEndpoint("tcp://127.0.0.1:0")
    addr_q.put(endpoint.address)
    try:
        serve(endpoint, coordinator, stop_event=stop_ev, tick_interval_s=0.05)
    finally:
        endpoint.close()


class _Probe:
    """Timestamps of one collective round inside a worker process (``time.monotonic``: one clock for all
    processes), by wrapping the data plane's functions in this process only (nothing in diloco/ changes).

    Marks, in the order a round passes them: ``order`` (the ReduceOrder reached the endpoint), ``reduce0``
    (``mean_pseudo_gradient`` starts: after the job hand-off and the group lookup), ``allreduce0`` /
    ``allreduce1`` (gloo's all-reduce: before it is the flatten and copy of the pseudo-gradient),
    ``reduce1``, ``propose0`` / ``propose1`` (the proposal: backup, step, the step's norm, digest),
    ``report`` (the ReduceReport leaves through the ZeroMQ endpoint), ``verdict`` (the commit's Result
    reached the endpoint), ``commit0`` / ``commit1``, ``posted`` (the params cloned into the session's
    Result and handed over)."""

    def __init__(self) -> None:
        self.marks: dict[str, float] = {}

    def mark(self, name: str) -> None:
        self.marks[name] = time.monotonic()

    def take(self) -> dict[str, float]:
        out, self.marks = self.marks, {}
        return out

    def install(self, endpoint) -> None:
        import diloco.collective.endpoint as ep_mod
        import diloco.collective.reduce as reduce_mod
        import diloco.collective.replica as replica_mod
        from diloco.wire.messages import ReduceReport, Result

        probe = self

        def around(owner, name: str, before: str, after: str | None = None, when=None) -> None:
            original = getattr(owner, name)

            def wrapper(*args, **kwargs):
                on = when is None or when(*args, **kwargs)
                if on:
                    probe.mark(before)
                out = original(*args, **kwargs)
                if on and after:
                    probe.mark(after)
                return out
            setattr(owner, name, wrapper)

        around(ep_mod, "mean_pseudo_gradient", "reduce0", "reduce1")
        around(reduce_mod, "_wait", "allreduce0", "allreduce1")
        around(replica_mod.Replica, "propose", "propose0", "propose1")
        around(replica_mod.Replica, "commit", "commit0", "commit1")
        import diloco.collective.member as member_mod
        from diloco.collective.member import Committed
        from diloco.wire.messages import ReduceOrder

        around(member_mod.MemberMachine, "received", "order", when=lambda _s, message: isinstance(message, ReduceOrder))
        around(member_mod.MemberMachine, "received", "verdict",
               when=lambda _s, message: isinstance(message, Result) and bool(message.digest))
        around(member_mod.MemberMachine, "completed", "posted", when=lambda _s, done: isinstance(done, Committed))
        inner = endpoint.inner
        around(inner, "send", "report", when=lambda message: isinstance(message, ReduceReport))


def collective_worker(i: int, addr_q, shapes, rounds: int, barrier, out_q, welcomed, n_workers: int,
                      join_thread: bool = True) -> None:
    """A worker of the collective plane: ``ZmqWorkerEndpoint`` wrapped in ``CollectiveEndpoint``, as
    ``DilocoWorker`` wraps it; this drives the endpoint with the session's messages (Join, Submit) directly."""
    _tune()
    import torch
    torch.set_num_threads(1)
    from diloco.collective.endpoint import CollectiveEndpoint
    from diloco.wire.messages import PROTOCOL_VERSION, Error, ErrorCode, Join, Result, Submit, Welcome, spec_of
    from diloco.wire.zmq import ZmqWorkerEndpoint

    # A member builds outer optimizers; the first torch.optim optimizer of a process imports torch._dynamo
    # (seconds). A real worker has done so for its inner optimizer already: do it before joining.
    p = torch.zeros(1)
    p.grad = torch.zeros(1)
    torch.optim.SGD([p], lr=0.1, momentum=0.5, nesterov=True).step()
    wid = f"bench{i}"
    params = make_params(shapes, 0.0)
    addr = addr_q.get(timeout=300)
    spec = spec_of(params)
    ep = CollectiveEndpoint(ZmqWorkerEndpoint(addr, label=wid), wid)
    probe = _Probe()
    probe.install(ep)
    ep.send(Join(wid, PROTOCOL_VERSION, spec, {}))  # spec only: the first joiner is asked for its params
    while True:
        msg = ep.recv(120.0)
        if isinstance(msg, Welcome):
            break
        if isinstance(msg, Error) and msg.code in (ErrorCode.PARAMS_REQUIRED, ErrorCode.START_PARAMS_REQUIRED):
            ep.send(Join(wid, PROTOCOL_VERSION, spec, params))  # the endpoint keeps them (holds_params)
        elif msg is None or isinstance(msg, Error):
            raise RuntimeError(f"{wid}: no Welcome ({msg!r})")
    del params, msg
    with welcomed.get_lock():
        welcomed.value += 1
    while welcomed.value < n_workers:  # keep receiving: a member serves the joiners' heals
        ep.recv(0.05)
    grad = make_params(shapes, 0.001 * (i + 1))
    # A worker measures its pseudo-gradient's norm as it makes it (``DilocoWorker._submit``, before this
    # timing starts), and its ready declares it: so does this one, once.
    from diloco.collective.reduce import tensors_norm
    norm = tensors_norm(grad)
    import resource
    for r in range(rounds):
        barrier.wait()
        probe.take()
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.monotonic()
        ep.send(Submit(wid, 0, r, grad, norm=norm))
        while True:
            msg = ep.recv(600.0)
            if isinstance(msg, Result):
                break
            if msg is None or isinstance(msg, Error):
                raise RuntimeError(f"{wid}: no Result for round {r} ({msg!r})")
        t1 = time.monotonic()
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        assert msg.outcome == "applied" and len(msg.params) == len(shapes), msg
        del msg
        marks = probe.take()
        # This process's CPU (all its threads) and fresh pages over the round (ru_ keys: not times).
        marks.update(ru_user=ru1.ru_utime - ru0.ru_utime, ru_sys=ru1.ru_stime - ru0.ru_stime,
                     ru_minflt=ru1.ru_minflt - ru0.ru_minflt)
        out_q.put((r, i, t0, t1, marks))
    if ep.stats["internal_errors"] or ep.stats["aborted"]:
        raise RuntimeError(f"{wid}: data plane stats {dict(ep.stats)}")
    ep.close()
    # close() does not wait for the data-plane thread; a process that exits while that daemon thread is
    # still inside torch (freeing the round's buffers) dies with SIGABRT ("terminate called without an
    # active exception"): 4 of 4 workers at 100M params. Wait for it (see benchmarks/README.md).
    thread = getattr(ep, "_thread", None)
    if thread is not None and join_thread:
        thread.join(60)


def op_costs(n_params: int, k: int, out_q) -> None:
    """The collective round's local work, one op at a time, in one process with nothing else of the bench running.

    What ``mean_pseudo_gradient`` and ``Replica.propose``/``commit`` do around the all-reduce, at this
    size, timed separately (the in-run timeline shows the same work under contention): best of 3, and the
    fresh pages the last repetition faulted in. Twice: on the main thread, and on another thread, as the
    data-plane thread runs them (glibc serves a non-main thread from its own arena, whose heaps are at most
    64 MiB: larger blocks are mmap'd and unmapped on every free, whatever the malloc tuning)."""
    _tune()
    import copy
    import resource
    import threading

    import torch
    torch.set_num_threads(1)
    from diloco.blocked_step import step_in_blocks
    from diloco.collective import reduce as reduce_mod
    from diloco.collective.reduce import tensors_norm
    from diloco.collective.digest import StepWatch, digest, digest_and_step_norm
    from diloco.collective.replica import Replica
    from diloco.outer import OuterConfig

    shapes = shapes_for(n_params)
    params = make_params(shapes, 0.5)
    grad = make_params(shapes, 0.001)
    names = list(params)
    flat = torch.cat([grad[n].reshape(-1) for n in names])
    replica = Replica(params, (tuple(names),), [0], OuterConfig(), "fp32", k)
    # One committed round first: the backup buffers and the momentum exist, as in every later round.
    assert replica.commit(0, 0, replica.propose(0, 0, grad))
    reduce_buffer = torch.empty_like(flat)
    kept = replica._buffers[0]
    opt_backup = replica._optimizer_backups[0]
    opt = replica.optimizers[0]
    params = replica.params

    def step():
        for n, p in params.items():
            p.grad = grad[n]
        opt.step()
        for p in params.values():
            p.grad = None

    scratch = torch.empty(1 << 18)

    ops = {
        "flatten into the kept reduce buffer (cat out=)": lambda: torch.cat(
            [grad[n].reshape(-1).to(torch.float32) for n in names], out=reduce_buffer),
        "divide by k, measuring the mean's norm (one pass)": lambda: reduce_mod._divide_and_measure(flat, 1),
        "backup of the optimizer (copy into kept buffers)": lambda: opt_backup.take(opt),
        "(not in the round) the mean's norm alone (tensors_norm)": lambda: tensors_norm(grad),
        "Nesterov step in blocks, each backed up, measured and digested (the replica's)": lambda: step_in_blocks(
            opt, params, grad, undo_kept=True, watch=StepWatch(params, kept, scratch)).bad,
        "(not in the round) backup of the params alone (copy into kept buffers)": lambda: [
            kept[n].copy_(p) for n, p in params.items()],
        "(not in the round) torch's own Nesterov step": step,
        "(not in the round) digest and the step's norm after the step (other optimizers)": lambda: (
            digest_and_step_norm(params, kept, scratch)),
        "(not in the round) digest alone": lambda: digest(params),
        "clone for the Result": lambda: {n: t.clone() for n, t in params.items()},
        "(not in the round) fresh backup: clone + deepcopy": lambda: (
            {n: p.detach().clone() for n, p in params.items()}, copy.deepcopy(opt.state_dict())),
        "(not in the round) finiteness by isfinite().all()": lambda: [bool(torch.isfinite(p).all())
                                                                      for p in params.values()],
    }

    def measure(into: dict) -> None:
        for name, fn in ops.items():
            best, faults = float("inf"), 0
            for _ in range(3):
                r0 = resource.getrusage(resource.RUSAGE_THREAD)
                t = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - t)
                faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - r0.ru_minflt
            into[name] = (best, faults * resource.getpagesize() / 1e6)

    main: dict = {}
    other: dict = {}
    measure(main)
    thread = threading.Thread(target=measure, args=(other,))
    thread.start()
    thread.join()
    out_q.put({name: (*main[name], *other[name]) for name in ops})


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


def _collect(out_q, n: int, rounds: int, warmup: int, marks: list | None = None, procs=(),
             stall_s: float = 120.0) -> list[float]:
    """Seconds per timed round: from the first worker's send to the last worker's answer. With ``marks``,
    also appends each timed round's (t0 of every worker, t1 of every worker, the probe marks of every worker).
    Raises as soon as one of ``procs`` has failed, instead of waiting out the timeout. When no result has
    come for ``stall_s`` seconds (a stall), says which processes live and which results are missing, and
    has every live process dump its threads' stacks to stderr (SIGUSR1); again every ``stall_s``."""
    import queue
    import signal

    by_round: dict[int, list[tuple]] = {}
    deadline = time.monotonic() + 900
    last = time.monotonic()
    next_dump = last + stall_s
    for _ in range(n * rounds):
        while True:
            try:
                r, _i, t0, t1, *extra = out_q.get(timeout=5)
                break
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (0, None)]
                if dead:
                    raise RuntimeError(f"{dead[0].name} exited with {dead[0].exitcode}") from None
                now = time.monotonic()
                if now >= next_dump:
                    got = {r_: len(v) for r_, v in sorted(by_round.items())}
                    print(f"  STALL: no result for {now - last:.0f} s; results per round so far {got} of {n}; "
                          + ", ".join(f"{p.name} pid {p.pid} " + ("alive" if p.exitcode is None else
                                                                  f"exited {p.exitcode}") for p in procs)
                          + "; stacks follow on stderr", file=sys.stderr, flush=True)
                    for p in procs:
                        if p.exitcode is None:
                            try:
                                os.kill(p.pid, signal.SIGUSR1)
                            except OSError:
                                pass
                    next_dump = now + stall_s
                if now > deadline:
                    raise
        last = time.monotonic()
        next_dump = last + stall_s
        by_round.setdefault(r, []).append((t0, t1, extra[0] if extra else {}))
    rows = [v for r, v in sorted(by_round.items()) if r >= warmup]
    if marks is not None:
        marks.extend(([t0 for t0, _, _ in v], [t1 for _, t1, _ in v], [m for _, _, m in v]) for v in rows)
    return [max(t1 for _, t1, _ in v) - min(t0 for t0, _, _ in v) for v in rows]


def _join_all(procs, timeout_s: float = 120.0, strict: bool = True) -> None:
    """Wait for ``procs``; one that failed raises, or with ``strict=False`` (called once every result is
    in: a failure can only be in the process's teardown) is reported on stderr."""
    for p in procs:
        p.join(timeout_s)
        if p.is_alive():
            p.kill()
            p.join(10)
        if p.exitcode not in (0, None):
            if strict:
                raise RuntimeError(f"{p.name} exited with {p.exitcode}")
            print(f"  note: {p.name} exited with {p.exitcode} after sending all its results", file=sys.stderr,
                  flush=True)


def _stop(server, stop_ev) -> None:
    """Ask a server process (a coordinator, torchft's lighthouse) to stop; kill it if it has not in 30 s."""
    stop_ev.set()
    server.join(30)
    if server.is_alive():
        server.kill()


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
               io_threads: int = 1, coord_rounds: list | None = None, profile: bool = False,
               stall_s: float = 120.0) -> list[float]:
    """Seconds per timed round; with ``coord_rounds``, appends the coordinator's report of each timed round
    (``_HubProbe``: its memory, and with ``profile`` its phases) and the workers' (t0s, t1s) of that round."""
    addr_q, worker_addr_q, out_q, stop_ev = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Event()
    report_q = ctx.Queue() if coord_rounds is not None else None
    coord = ctx.Process(target=diloco_coordinator, args=(addr_q, stop_ev, N_WORKERS, chunk_bytes, auth_dir, io_threads,
                                                         report_q, profile), name="coordinator")
    barrier = ctx.Barrier(N_WORKERS)
    # The workers start with the coordinator (their imports overlap its own) and wait for its address.
    workers = [ctx.Process(target=diloco_worker, args=(i, worker_addr_q, shapes, rounds, barrier, out_q, chunk_bytes,
                                                       auth_dir), name=f"diloco-worker{i}") for i in range(N_WORKERS)]
    coord.start()
    for w in workers:
        w.start()
    marks: list = []
    try:
        addr = addr_q.get(timeout=300)
        for _ in workers:
            worker_addr_q.put(addr)
        times = _collect(out_q, N_WORKERS, rounds, warmup, marks, procs=workers + [coord], stall_s=stall_s)
        _join_all(workers)
    finally:
        for w in workers:
            if w.is_alive():
                w.kill()
        _stop(coord, stop_ev)
    if report_q is not None:
        import queue
        reports = {}
        while True:
            try:
                kind, r, data = report_q.get(timeout=5)
            except queue.Empty:
                break
            if kind == "done":
                break
            reports[r] = data
        for (t0s, t1s, per_worker), r in zip(marks, range(warmup, rounds)):
            if r in reports:
                reports[r]["workers"] = per_worker
                coord_rounds.append((reports[r], t0s, t1s))
    return times


def run_raw(ctx, shapes, rounds: int, warmup: int, chunk_bytes: int, stall_s: float = 120.0,
            phases: list | None = None) -> list[float]:
    """Seconds per timed round; with ``phases``, appends per timed round the floor's (first message whole,
    last message whole, replies handed over, last dealer holds its reply), ms after the first send."""
    addr_q, out_q = ctx.Queue(), ctx.Queue()
    marks_q = ctx.Queue() if phases is not None else None
    router = ctx.Process(target=raw_router, args=(addr_q, N_WORKERS, rounds, marks_q), name="raw-router")
    router.start()
    addr = addr_q.get(timeout=300)
    barrier = ctx.Barrier(N_WORKERS)
    workers = [ctx.Process(target=raw_dealer, args=(i, addr, shapes, rounds, barrier, out_q, chunk_bytes),
                           name=f"raw-dealer{i}") for i in range(N_WORKERS)]
    for w in workers:
        w.start()
    rows: list = []
    times = _collect(out_q, N_WORKERS, rounds, warmup, rows, procs=workers + [router], stall_s=stall_s)
    _join_all(workers + [router])
    if marks_q is not None:
        marks = dict((r, m) for r, *m in (marks_q.get(timeout=30) for _ in range(rounds)))
        for (t0s, t1s, _), r in zip(rows, range(warmup, rounds)):
            start = min(t0s)
            phases.append(tuple((t - start) * 1000 for t in (*marks[r], max(t1s))))
    return times


def run_ranks(ctx, target, shapes, rounds: int, warmup: int, stall_s: float = 120.0, rendezvous=None,
              server=None) -> list[float]:
    """Round times of ``N_WORKERS`` ranks running ``target`` (``gloo_worker``, ``floor_worker`` or
    ``torchft_worker``), which meet at ``rendezvous``: by default a free port for gloo's TCP store; for
    torchft a queue with the lighthouse's address. ``server`` (torchft's lighthouse) is watched with them;
    the caller stops it."""
    out_q = ctx.Queue()
    rendezvous = free_port() if rendezvous is None else rendezvous
    barrier = ctx.Barrier(N_WORKERS)
    procs = [ctx.Process(target=target, args=(r, N_WORKERS, rendezvous, shapes, rounds, barrier, out_q),
                         name=f"{target.__name__}{r}") for r in range(N_WORKERS)]
    for p in procs:
        p.start()
    try:
        times = _collect(out_q, N_WORKERS, rounds, warmup, procs=procs + ([server] if server is not None else []),
                         stall_s=stall_s)
        _join_all(procs)
    finally:
        # A failed run leaves the others waiting on the barrier or a collective: end them.
        for p in procs:
            if p.is_alive():
                p.kill()
    return times


def run_gloo(ctx, shapes, rounds: int, warmup: int, stall_s: float = 120.0) -> list[float]:
    return run_ranks(ctx, gloo_worker, shapes, rounds, warmup, stall_s)


def run_torchft(ctx, shapes, rounds: int, warmup: int, stall_s: float = 120.0) -> list[float]:
    """torchft's DiLoCo: one lighthouse process and ``N_WORKERS`` replica groups of one process each."""
    addr_q, stop_ev = ctx.Queue(), ctx.Event()
    lighthouse = ctx.Process(target=torchft_lighthouse, args=(addr_q, stop_ev, N_WORKERS), name="torchft-lighthouse")
    # The replicas start with the lighthouse (their imports overlap its own) and wait for its address.
    lighthouse.start()
    try:
        return run_ranks(ctx, torchft_worker, shapes, rounds, warmup, stall_s, rendezvous=addr_q, server=lighthouse)
    finally:
        _stop(lighthouse, stop_ev)


def run_collective(ctx, shapes, rounds: int, warmup: int, timeout_s: float, marks: list | None = None,
                   join_thread: bool = True) -> list[float]:
    addr_q, worker_addr_q, out_q, stop_ev = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Event()
    coord = ctx.Process(target=collective_coordinator, args=(addr_q, stop_ev, N_WORKERS, timeout_s),
                        name="collective-coordinator")
    barrier = ctx.Barrier(N_WORKERS)
    welcomed = ctx.Value("i", 0)
    # The workers start with the coordinator (their imports overlap its own) and wait for its address.
    workers = [ctx.Process(target=collective_worker, args=(i, worker_addr_q, shapes, rounds, barrier, out_q, welcomed,
                                                           N_WORKERS, join_thread), name=f"collective-worker{i}")
               for i in range(N_WORKERS)]
    coord.start()
    for w in workers:
        w.start()
    try:
        addr = addr_q.get(timeout=300)
        for _ in workers:
            worker_addr_q.put(addr)
        times = _collect(out_q, N_WORKERS, rounds, warmup, marks, procs=workers + [coord])
        _join_all(workers, strict=False)
    finally:
        for w in workers:
            if w.is_alive():
                w.kill()
        _stop(coord, stop_ev)
    return times


#: The collective round's segments on one worker: (from mark, to mark, what happens in between).
SEGMENTS = (
    ("t0", "order", "ready: tensorless Submit -> coordinator -> ReduceOrder back (waits for all 4 readies)"),
    ("order", "reduce0", "hand-off to the data-plane thread, group lookup"),
    ("reduce0", "allreduce0", "flatten of the pseudo-gradient into the kept reduce buffer (cat)"),
    ("allreduce0", "allreduce1", "gloo all-reduce of the flat buffer (incl. waiting for peers)"),
    ("allreduce1", "reduce1", "divide by k measuring the mean's norm, unflatten"),
    ("reduce1", "propose0", "the mean judged (its norm against the declared ones, member.judge_reduce)"),
    ("propose0", "propose1", "the proposal: backup, Nesterov step, the step's norm (M11), digest: one pass in blocks"),
    ("propose1", "report", "ReduceReport handed to the owner thread and sent"),
    ("report", "verdict", "vote: coordinator waits for every report, commits, Result(digest) back"),
    ("verdict", "commit1", "the machine queues the commit job, the data thread wakes, Replica.commit"),
    ("commit1", "posted", "copy of the params into the session's Result (kept buffers), completion back"),
    ("posted", "t1", "hand-off to the session (recv returns the Result)"),
)


def collective_breakdown(marks: list, step_s: float) -> list[str]:
    """Tables of where a collective round's time goes, from the probes' marks (medians over rounds)."""
    seg: dict[str, list[float]] = {a + ">" + b: [] for a, b, _ in SEGMENTS}
    crit: dict[str, list[float]] = {b: [] for _, b, _ in SEGMENTS}
    ru: dict[str, list[float]] = {}
    for t0s, t1s, per_worker in marks:
        start = min(t0s)
        last: dict[str, float] = {}
        for t0, t1, m in zip(t0s, t1s, per_worker):
            m = dict(m, t0=t0, t1=t1)
            for a, b, _ in SEGMENTS:
                if a in m and b in m:
                    seg[a + ">" + b].append(m[b] - m[a])
                if b in m:
                    last[b] = max(last.get(b, float("-inf")), m[b] - start)
        for b, v in last.items():
            crit[b].append(v)
        for m in per_worker:
            for key in ("ru_user", "ru_sys", "ru_minflt"):
                if key in m:
                    ru.setdefault(key, []).append(m[key])
    med = lambda v: statistics.median(v) * 1000 if v else float("nan")  # noqa: E731
    lines = [f"  {'segment (per worker, median ms over rounds x workers)':84} {'ms':>8} {'share':>6} "
             f"{'last worker done at, ms after the first Submit':>10}"]
    total = 0.0
    for a, b, what in SEGMENTS:
        ms = med(seg[a + ">" + b])
        total += ms if ms == ms else 0.0
        lines.append(f"  {what:84} {ms:8.1f} {ms / (step_s * 1000):6.1%} {med(crit[b]):10.1f}")
    lines.append(f"  {'sum of the segments (one worker: its Submit to its Result)':84} {total:8.1f}")
    lines.append(f"  {'outer step (first Submit to last Result), median':84} {step_s * 1000:8.1f}")
    if ru:
        user, sys_s = statistics.median(ru["ru_user"]), statistics.median(ru["ru_sys"])
        lines.append(f"  per worker and round (median): CPU {(user + sys_s) * 1000:.0f} ms (user {user * 1000:.0f}, "
                     f"system {sys_s * 1000:.0f}), {statistics.median(ru['ru_minflt']) * 4096 / 1e6:.0f} MB of "
                     f"fresh pages faulted in; {N_WORKERS} workers x that CPU on {os.cpu_count()} cores = "
                     f"{N_WORKERS * (user + sys_s) / (os.cpu_count() or 1) * 1000:.0f} ms of wall at best")
    return lines


def run_op_costs(ctx, n_params: int) -> dict[str, float]:
    out_q = ctx.Queue()
    p = ctx.Process(target=op_costs, args=(n_params, N_WORKERS, out_q), name="op-costs")
    p.start()
    costs = out_q.get(timeout=900)
    _join_all([p])
    return costs


def parse_count(text: str) -> int:
    """``10M``, ``1.5M``, ``100k``, ``1e6`` or ``10000000``."""
    t = text.strip().lower().replace("_", "").replace(",", "")
    scale = {"k": 10 ** 3, "m": 10 ** 6, "g": 10 ** 9}.get(t[-1:], 1)
    if scale != 1:
        t = t[:-1]
    value = int(float(t) * scale)
    if value < 16:
        raise argparse.ArgumentTypeError(f"{text!r}: at least 16 params")
    return value


class _environ:
    """Set (or, with None, remove) environment variables for the processes started inside the block."""

    def __init__(self, **values: str | None) -> None:
        self.values, self.saved = values, {}

    def __enter__(self) -> None:
        for k, v in self.values.items():
            self.saved[k] = os.environ.get(k)
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    def __exit__(self, *exc) -> None:
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main_collective(args, ctx) -> int:
    """``--collective``: the collective plane beside raw gloo and the hub, at each of ``--params`` sizes."""
    skip = set(filter(None, args.skip.split(",")))
    sizes = [parse_count(x) for x in (args.params or ("1M" if args.quick else "10M,100M")).split(",")]
    reps = args.reps if args.reps is not None else (1 if args.quick else 3)
    n_rounds = args.rounds if args.rounds is not None else (1 if args.quick else 3)
    # Two warm-up rounds: a process's heap reaches its steady state (freed model-sized blocks reused, no
    # fresh pages faulted in) only in the second round with the malloc tuning.
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    rounds = n_rounds + warmup
    from diloco.wire.codec import CHUNK_BYTES
    chunk = CHUNK_BYTES if args.chunk_mb is None else int(args.chunk_mb * (1 << 20))
    print(f"bench_transport --collective: sizes {', '.join(f'{n:,}' for n in sizes)} fp32 params, {N_WORKERS} worker "
          f"processes on loopback, {reps} reps x {n_rounds} rounds (+{warmup} warm-up), collective timeout "
          f"{args.collective_timeout:g} s, {os.cpu_count()} CPUs", flush=True)
    torchft_skipped = ("left out by request (--skip-torchft)" if args.skip_torchft or "torchft" in skip
                       else torchft_missing())
    methods = [m for m in ("collective", "floor", "torchft", "gloo", "diloco")
               if m not in skip and not (m == "diloco" and "hub" in skip)
               and not (m == "torchft" and torchft_skipped is not None)]
    if args.arena_variant and "collective" in methods:
        methods.insert(1, "collective_a1")
    result_lines, reports = [], []
    for n_params in sizes:
        shapes = shapes_for(n_params)
        results: dict[str, list[float]] = {m: [] for m in methods}
        marks: dict[str, list] = {"collective": [], "collective_a1": []}
        for rep in range(reps):
            for name in methods:
                if name.startswith("collective"):
                    # collective_a1: the same with MALLOC_ARENA_MAX=1 in the worker processes' environment
                    # (diagnosis: every thread allocates from glibc's main arena, where the malloc tuning
                    # keeps freed model-sized blocks for reuse).
                    with _environ(MALLOC_ARENA_MAX="1" if name == "collective_a1" else None):
                        times = run_collective(ctx, shapes, rounds, warmup, args.collective_timeout, marks[name],
                                               join_thread=not args.no_thread_join)
                elif name == "gloo":
                    times = run_gloo(ctx, shapes, rounds, warmup)
                elif name == "floor":
                    times = run_ranks(ctx, floor_worker, shapes, rounds, warmup)
                elif name == "torchft":
                    times = run_torchft(ctx, shapes, rounds, warmup)
                else:
                    times = run_diloco(ctx, shapes, rounds, warmup, chunk)
                results[name].extend(times)
                print(f"  {n_params:>11,} rep {rep + 1}/{reps} {name:13} "
                      + " ".join(f"{t * 1000:8.1f}" for t in times) + " ms", flush=True)
        med = {k: statistics.median(v) if v else float("nan") for k, v in results.items()}
        lines = [f"{n_params:,} params ({n_params * 4 / 1e6:.0f} MB):",
                 f"  {'method':13} {'median s':>9} {'min s':>8} {'max s':>8}  samples"]
        for k, v in results.items():
            if v:
                lines.append(f"  {k:13} {med[k]:9.3f} {min(v):8.3f} {max(v):8.3f}  {len(v)}")
        for name, m in marks.items():
            if m:
                lines.append(f"  where a collective round's time goes ({name}):")
                lines.extend(collective_breakdown(m, med[name]))
        if args.profile:
            costs = run_op_costs(ctx, n_params)
            lines.append("  the same local work alone, one op at a time (one process, best of 3; MB: fresh pages "
                         "faulted in by the last repetition):")
            lines.append(f"    {'':50} {'main thread':>20} {'another thread':>20}")
            for what, (t_main, mb_main, t_other, mb_other) in costs.items():
                lines.append(f"    {what:50} {t_main * 1000:9.1f} ms {mb_main:6.0f} MB {t_other * 1000:9.1f} ms "
                             f"{mb_other:6.0f} MB")
            in_round = [c for what, c in costs.items() if not what.startswith("(")]
            lines.append(f"    {'sum (the round)':50} {sum(c[0] for c in in_round) * 1000:9.1f} ms "
                         f"{sum(c[1] for c in in_round):6.0f} MB {sum(c[2] for c in in_round) * 1000:9.1f} ms "
                         f"{sum(c[3] for c in in_round):6.0f} MB")
        reports.append(lines)
        nan = float("nan")
        c, g, h, f, t = (med.get(k, nan) for k in ("collective", "gloo", "diloco", "floor", "torchft"))
        if c == c and f == f:
            lines.append(f"  the collective round against its floor (all-reduce + plain Nesterov step): {c / f:.2f}x "
                         f"({(c - f) * 1000:+.1f} ms: checks, digest, backup, copies, the vote and its messages; the "
                         f"breakdown above says which)")
        if c == c and t == t:
            lines.append(f"  the collective round against torchft's DiLoCo outer sync: {c / t:.2f}x "
                         f"({(c - t) * 1000:+.1f} ms); torchft against the floor {t / f:.2f}x (its quorum, "
                         f"pseudo-gradient, restore, should_commit and backup on top of the all-reduce and step)")
        tft = f" torchft_s={t:.3f} ratio_vs_torchft={c / t:.2f}" if "torchft" in med else ""
        a1 = (f" collective_arena1_s={med['collective_a1']:.3f} arena1_ratio_vs_gloo={med['collective_a1'] / g:.2f}"
              if "collective_a1" in med else "")
        result_lines.append(f"RESULT bench_transport_collective params={n_params} collective_s={c:.3f} gloo_s={g:.3f} "
                            f"hub_s={h:.3f} floor_s={f:.3f} ratio_vs_gloo={c / g:.2f} ratio_vs_floor={c / f:.2f} "
                            f"hub_ratio_vs_gloo={h / g:.2f} collective_vs_hub={c / h:.2f}{tft}{a1}")
    print()
    for lines in reports:
        print("\n".join(lines))
        print()
    if torchft_skipped is not None:
        print(TORCHFT_SKIPPED.format(torchft_skipped))
    for line in result_lines:
        print(line)
    return 0


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
        _stop(coord, stop_ev)
    return rtts


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def hub_report(coord_rounds: list, step_s: float, profile: bool) -> tuple[list[str], float, float]:
    """The coordinator's memory (and with ``profile`` where its round goes) over the timed rounds:
    (lines to print, peak RSS above the runtime in model copies, peak RSS in MB)."""
    med = lambda v: statistics.median(v) if v else float("nan")  # noqa: E731
    reports = [r for r, _, _ in coord_rounds]
    model = reports[0]["model_bytes"] or 1
    base_mb = reports[0]["base_kb"] / 1024
    peaks = [r["peak_kb"] / 1024 for r in reports]
    copies = (max(peaks) - base_mb) * (1 << 20) / model
    held = max(r.get("held_bytes", 0) for r in reports) / model
    inflight = max(r.get("inflight_bytes", 0) for r in reports) / model
    lines = [f"coordinator process: RSS before any join (Python, torch, libzmq) {base_mb:.0f} MB; peak RSS per "
             f"round {min(peaks):.0f}-{max(peaks):.0f} MB (median {med(peaks):.0f}); above the runtime: "
             f"{copies:.2f} model copies at the most ({model / 1e6:.0f} MB each), {N_WORKERS} workers",
             f"  of which: held by the coordinator's structures right after an outer step (params, optimizer state "
             f"and backups, sums, Results' views) {held:.2f} copies; in flight at the transport as a Submit is "
             f"decoded (its frames + other peers' parts being assembled) up to {inflight:.2f} copies"]
    if not profile:
        return lines, copies, max(peaks)
    lines.append(f"  where the hub's round goes in the coordinator process (median over {len(reports)} rounds; "
                 f"ms of the main thread, summed over the round's {N_WORKERS} submissions):")
    total = 0.0
    for key, what in _HubProbe.PHASES:
        if key == "recv_py":
            values = [r.get("recv_cpu", 0.0) - r.get("codec_cpu", 0.0) - r.get("measure_cpu", 0.0) for r in reports]
        else:
            values = [r.get(key, 0.0) for r in reports]
        ms = med(values) * 1000
        total += ms
        lines.append(f"    {what:86} {ms:8.1f}")
    lines.append(f"    {'sum':86} {total:8.1f}")
    prepare = med([r.get("prepare", 0.0) for r in reports]) * 1000
    lines.append(f"    {'not on the round path: the next step prepared in idle ticks (HubRounds.idle)':86} {prepare:8.1f}")
    in_place = sum(r.get("in_place", 0.0) for r in reports)
    lines.append(f"    outer steps made in place (no Result held the params' memory; bounds proved them finite): "
                 f"{in_place:.0f} of {len(reports)}")
    user = med([r["cpu_user"] for r in reports])
    sys_s = med([r["cpu_sys"] for r in reports])
    main = med([r["main_cpu"] for r in reports])
    faults = med([r["minflt"] for r in reports]) * 4096 / 1e6
    lines.append(f"    process CPU per round: {(user + sys_s) * 1000:.0f} ms (user {user * 1000:.0f}, system "
                 f"{sys_s * 1000:.0f}); main thread {main * 1000:.0f} ms, the rest (libzmq I/O thread, pyzmq's "
                 f"gc thread) {(user + sys_s - main) * 1000:.0f} ms; {faults:.0f} MB of fresh pages faulted in")
    spans = {"first Submit sent -> first part at the coordinator": ("t0", "first_part"),
             "first Submit sent -> first Submit decoded": ("t0", "first_submit_decoded"),
             "first Submit sent -> last Submit decoded": ("t0", "last_submit_decoded"),
             "last Submit decoded -> outer step applied": ("last_submit_decoded", "applied"),
             "outer step applied -> last Result handed to the transport": ("applied", "results_sent"),
             "last Result handed over -> last worker holds it": ("results_sent", "t1")}
    workers = [w for r in reports for w in r.get("workers", []) if w]
    if workers:
        lines.append(f"    each worker per round (median): CPU {med([w['ru_cpu'] for w in workers]) * 1000:.0f} ms, "
                     f"{med([w['ru_minflt'] for w in workers]) * 4096 / 1e6:.0f} MB of fresh pages faulted in")
    lines.append("    per timed round, in order (rounds of one run follow each other): outer step s / coordinator's "
                 "fresh pages MB / its peak RSS MB:")
    lines.append("      " + "  ".join(f"{max(t1s) - min(t0s):.2f}/{r['minflt'] * 4096 / 1e6:.0f}/{r['peak_kb'] / 1024:.0f}"
                                      for r, t0s, t1s in coord_rounds))
    lines.append(f"    timeline (median ms; the outer step, first Submit to last Result, {step_s * 1000:.0f} ms):")
    for what, (a, b) in spans.items():
        values = []
        for r, t0s, t1s in coord_rounds:
            m = dict(r.get("marks", {}), t0=min(t0s), t1=max(t1s))
            if a in m and b in m:
                values.append(m[b] - m[a])
        lines.append(f"      {what:84} {med(values) * 1000:8.1f}")
    return lines, copies, max(peaks)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default=None,
                    help="model size in fp32 parameters (default 10M; 10M, 100k, 1e6 accepted). With --collective a "
                         "comma list of sizes (default 10M,100M; quick 1M)")
    ap.add_argument("--reps", type=int, default=None,
                    help="interleaved repetitions of the methods (default 3; quick 1)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="timed outer steps per repetition (default 5, --collective 3; quick 2, --collective 1)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed outer steps first (default 2; quick "
                                                             "--collective 1)")
    ap.add_argument("--collective", action="store_true",
                    help="compare the collective data plane with raw gloo and the hub at each --params size "
                         "(one RESULT bench_transport_collective line per size) instead of the default run")
    ap.add_argument("--collective-timeout", type=float, default=120.0,
                    help="--collective: the coordinator's collective timeout, s (default 120)")
    # Diagnosis (benchmarks/README.md): exit right after CollectiveEndpoint.close(), as a worker process does.
    ap.add_argument("--no-thread-join", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--arena-variant", action="store_true",
                    help="--collective: also run the collective plane with MALLOC_ARENA_MAX=1 in its worker "
                         "processes (collective_a1; see benchmarks/README.md)")
    ap.add_argument("--profile", action="store_true",
                    help="where the hub's round goes in the coordinator process (phases, CPU, fresh pages, "
                         "memory per round); --collective: also time the round's local ops alone, one by one")
    ap.add_argument("--stall-dump", type=float, default=60.0,
                    help="seconds without a result after which the run's processes dump their stacks (default 60)")
    ap.add_argument("--chunk-mb", type=float, default=None,
                    help="diloco: the codec's frame size for tensors, MiB (default: the codec's, 16)")
    ap.add_argument("--raw-chunk-mb", type=float, default=4.0, help="the floor's frame size, MiB (default 4)")
    ap.add_argument("--workers", type=int, default=N_WORKERS,
                    help=f"worker processes of the outer step (default {N_WORKERS})")
    ap.add_argument("--hub-threads", type=int, default=1,
                    help="torch threads of the hub's coordinator and, alike, of the floor's router (default 1; "
                         "diloco server itself runs torch's default, one per core)")
    ap.add_argument("--hb-workers", type=int, default=100)
    ap.add_argument("--hb-clients", type=int, default=4, help="processes holding the heartbeat sockets")
    ap.add_argument("--hb-interval", type=float, default=0.1, help="seconds between one socket's heartbeats")
    ap.add_argument("--hb-seconds", type=float, default=10.0)
    ap.add_argument("--quick", action="store_true", help="1 repetition, 2 rounds, 5 s of heartbeats "
                                                         "(--collective: 1M params, 1 repetition, 1 round)")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: diloco,auth,raw,gloo,heartbeat "
                                               "(--collective: collective,floor,torchft,gloo,hub)")
    ap.add_argument("--skip-torchft", action="store_true",
                    help="--collective: do not run torchft's arm even where torchft is installed (as --skip "
                         "torchft)")
    ap.add_argument("--auth-io-threads", type=int, default=2,
                    help="ZeroMQ I/O threads of the coordinator with CURVE (default 2, as `diloco server --auth`)")
    args = ap.parse_args(argv)
    globals()["N_WORKERS"] = args.workers  # the driver's count; each process gets its own as an argument
    if args.hub_threads < 1:
        ap.error(f"--hub-threads {args.hub_threads}: expected at least 1")
    os.environ[HUB_THREADS_ENV] = str(args.hub_threads)  # the spawned processes read it (``_hub_threads``)
    ctx = mp.get_context("spawn")
    if args.collective:
        return main_collective(args, ctx)
    if args.params is not None and "," in args.params:
        ap.error("--params: one size (a list only with --collective)")
    args.params = parse_count(args.params) if args.params is not None else 10_000_000
    args.reps = 3 if args.reps is None else args.reps
    args.rounds = 5 if args.rounds is None else args.rounds
    args.warmup = 2 if args.warmup is None else args.warmup
    if args.quick:
        args.reps, args.rounds, args.hb_seconds = 1, 2, 5.0
    skip = set(filter(None, args.skip.split(",")))
    from diloco.wire.codec import CHUNK_BYTES
    chunk = CHUNK_BYTES if args.chunk_mb is None else int(args.chunk_mb * (1 << 20))
    raw_chunk = int(args.raw_chunk_mb * (1 << 20))
    shapes = shapes_for(args.params)
    rounds = args.rounds + args.warmup
    print(f"bench_transport: {args.params:,} fp32 params ({args.params * 4 / 1e6:.0f} MB) in {len(shapes)} tensors, "
          f"{N_WORKERS} workers, frames of {chunk / (1 << 20):g} MiB (floor {args.raw_chunk_mb:g} MiB), "
          f"{args.reps} reps x {args.rounds} rounds "
          f"(+{args.warmup} warm-up), {os.cpu_count()} CPUs", flush=True)
    import tempfile
    auth_dir = make_auth_dir(os.path.join(tempfile.mkdtemp(prefix="bench-auth-"), "auth"))
    results: dict[str, list[float]] = {"diloco": [], "diloco_auth": [], "raw_zmq": [], "gloo": []}
    coord_rounds: list = []
    raw_phases: list = []
    stall = args.stall_dump
    for rep in range(args.reps):
        for name, fn in (("diloco", lambda: run_diloco(ctx, shapes, rounds, args.warmup, chunk,
                                                       coord_rounds=coord_rounds, profile=args.profile,
                                                       stall_s=stall)),
                         ("diloco_auth", lambda: run_diloco(ctx, shapes, rounds, args.warmup, chunk, auth_dir,
                                                            args.auth_io_threads, stall_s=stall)),
                         ("raw_zmq", lambda: run_raw(ctx, shapes, rounds, args.warmup, raw_chunk, stall_s=stall,
                                                     phases=raw_phases if args.profile else None)),
                         ("gloo", lambda: run_gloo(ctx, shapes, rounds, args.warmup, stall_s=stall))):
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
    copies = float("nan")
    peak_mb = float("nan")
    if coord_rounds:
        lines, copies, peak_mb = hub_report(coord_rounds, med["diloco"], args.profile)
        print("\n".join(lines))
    if raw_phases:
        m = [statistics.median(v) for v in zip(*raw_phases)]
        print(f"  the floor (raw_zmq), median ms after the first send: first message whole {m[0]:.1f}, last message "
              f"whole {m[1]:.1f}, sum sent back {m[2]:.1f}, last dealer holds it {m[3]:.1f}")
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
          f"heartbeat_p99_ms={hb_p99:.2f} auth_s={med['diloco_auth']:.3f} auth_ratio={auth_ratio:.2f} "
          f"coord_peak_mb={peak_mb:.0f} coord_peak_copies={copies:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
