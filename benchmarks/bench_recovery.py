"""bench_recovery: how long a run takes to get a replacement contributing after a member is killed.

A coordinator process and 4 member processes on loopback (``--params``: 10M and 100M fp32 by default;
``--plane``: the hub, the collective plane, or both), ``min_workers`` 2, sync rounds, each member
"training" ``--step-s`` seconds between its contributions. After a few rounds one member gets
``kill -9``; the driver starts a replacement process at once (a new worker id, spec-only Join, as a
fresh ``diloco worker`` joins) and times, from the moment it started the process:

* **started**: the process's code runs (the interpreter and this file's imports; ``diloco worker``
  spends the same);
* **joined**: it sends its ``Join`` (torch imported, its model and optimizer built);
* **welcome**: its ``Welcome`` arrived whole at its transport (hub: with the run's params in it;
  collective: without them, naming a member to heal from);
* **params**: it holds the run's params (hub: the Welcome; collective: the heal is done and the
  endpoint hands the Welcome to the session);
* **contributing**: its first contribution is in a committed round (the ``Result`` of its first
  ``Submit`` says ``applied``).

Beside it, in the same run: **copy**, the time one copy of the model takes between two processes on
the same link (a raw pyzmq PUSH/PULL of the params' bytes, as 4 MB frames). ``fetch_vs_copy`` holds
the time from the Join to holding the params (the coordinator's answer and the params' transfer:
the Welcome on the hub, the heal on the collective plane) against it. Goal: at most 1.5.

The collective plane runs once per ``--heal-sources`` K (default 1,2,3; the three live members are
enough for three): the joiner heals from K members at once, each sending a part. ``heal_s`` is the
heal itself: from the Welcome's arrival to holding the params.

Last line per plane, size (and K)::

    RESULT bench_recovery plane=P params=N [heal_sources=K] started_s=X joined_s=X welcome_s=X params_s=X
        contributing_s=X heal_s=X copy_s=X fetch_vs_copy=R

``--quick``: 1M params, both planes, three heal sources (the CI variant, tests/test_bench_recovery_quick.py).
``BENCH_RECOVERY_DEBUG=1`` in the environment: each member prints its rounds' outcomes to stderr.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_transport import (  # noqa: E402
    _tune,
    collective_coordinator,
    diloco_coordinator,
    free_port,
    make_params,
    parse_count,
    shapes_for,
)

N_MEMBERS = 4
MIN_WORKERS = 2
#: Rounds every member contributes to before one is killed (the run is in its stride).
ROUNDS_BEFORE_KILL = 3
COPY_FRAME_BYTES = 4 << 20


def coordinator(plane: str, addr_q, stop_ev, timeout_s: float, heal_sources: int) -> None:
    """``diloco server`` in miniature, as bench_transport runs it, with ``min_workers`` = ``MIN_WORKERS``."""
    if plane == "collective":
        collective_coordinator(addr_q, stop_ev, MIN_WORKERS, timeout_s, heal_sources)
    else:
        from diloco.wire.codec import CHUNK_BYTES
        diloco_coordinator(addr_q, stop_ev, MIN_WORKERS, CHUNK_BYTES)


def member(wid: str, plane: str, addr: str, shapes, step_s: float, marks, stop_ev, first: bool) -> None:
    """A member driving its endpoint with the session's messages; sends (wid, mark, wall time) on ``marks``, a
    pipe of its own (a member killed while writing to a queue shared with others would leave its lock held)."""
    marks.send((wid, "started", time.time()))
    _tune()
    import torch
    torch.set_num_threads(1)
    from diloco.collective.reduce import tensors_norm
    from diloco.wire.messages import PROTOCOL_VERSION, Error, ErrorCode, Join, Result, Submit, Welcome, spec_of
    from diloco.wire.zmq import ZmqWorkerEndpoint

    # The first torch.optim optimizer of a process imports torch._dynamo (seconds): a real worker has
    # built its inner optimizer before it joins, so this one does too.
    p = torch.zeros(1)
    p.grad = torch.zeros(1)
    torch.optim.SGD([p], lr=0.1, momentum=0.5, nesterov=True).step()
    params = make_params(shapes, 0.0)
    spec = spec_of(params)
    inner = ZmqWorkerEndpoint(addr, label=wid)
    original_recv = inner.recv

    def recv(timeout_s):  # the Welcome's arrival at the transport (the collective endpoint may hold it)
        msg = original_recv(timeout_s)
        if isinstance(msg, Welcome):
            marks.send((wid, "welcome", time.time()))
        return msg
    inner.recv = recv
    ep = inner
    if plane == "collective":
        from diloco.collective.endpoint import CollectiveEndpoint
        ep = CollectiveEndpoint(inner, wid)
    marks.send((wid, "joined", time.time()))
    ep.send(Join(wid, PROTOCOL_VERSION, spec, {}))  # spec only: the first joiner is asked for its params
    while True:
        msg = ep.recv(300.0)
        if isinstance(msg, Welcome):
            break
        if isinstance(msg, Error) and msg.code in (ErrorCode.PARAMS_REQUIRED, ErrorCode.START_PARAMS_REQUIRED):
            ep.send(Join(wid, PROTOCOL_VERSION, spec, params))
        elif msg is None or isinstance(msg, Error):
            raise RuntimeError(f"{wid}: no Welcome ({msg!r})")
    marks.send((wid, "params", time.time()))
    round_id = msg.round_ids[0]
    del params, msg
    grad = make_params(shapes, 0.001)
    norm = tensors_norm(grad)
    applied = 0
    while not stop_ev.is_set():
        deadline = time.monotonic() + step_s
        while time.monotonic() < deadline:  # "training": the endpoint keeps serving (heals, orders)
            ep.recv(max(0.0, deadline - time.monotonic()))
        ep.send(Submit(wid, 0, round_id, grad, norm=norm))
        while not stop_ev.is_set():
            msg = ep.recv(1.0)
            if isinstance(msg, Result):
                if os.environ.get("BENCH_RECOVERY_DEBUG"):
                    print(f"{wid}: round {round_id} {msg.outcome} -> {msg.next_round_id}", file=sys.stderr, flush=True)
                if msg.outcome == "applied":
                    applied += 1
                    marks.send((wid, f"applied{applied}", time.time()))
                round_id = msg.next_round_id
                break
            if isinstance(msg, Error):
                raise RuntimeError(f"{wid}: round {round_id} refused: {msg.code.value} {msg.detail}")
    ep.close()


def copier(role: str, port: int, nbytes: int, out_q) -> None:
    """The raw copy: PUSH ``nbytes`` as 4 MB frames over TCP loopback; PULL times them from the first frame."""
    import zmq
    ctx = zmq.Context()
    if role == "pull":
        sock = ctx.socket(zmq.PULL)
        sock.bind(f"tcp://127.0.0.1:{port}")
        out_q.put("bound")
        got, t0 = 0, None
        while got < nbytes:
            frame = sock.recv(copy=False)
            t0 = t0 or time.time()
            got += len(frame.buffer)
        out_q.put(("copy", time.time()))
    else:
        sock = ctx.socket(zmq.PUSH)
        sock.connect(f"tcp://127.0.0.1:{port}")
        payload = bytearray(COPY_FRAME_BYTES)
        out_q.put(("sent0", time.time()))
        left = nbytes
        while left > 0:
            n = min(left, COPY_FRAME_BYTES)
            sock.send(memoryview(payload)[:n], copy=False)
            left -= n
    sock.close(linger=-1)
    ctx.term()


def copy_time(ctx, nbytes: int) -> float:
    out_q = ctx.Queue()
    port = free_port()
    pull = ctx.Process(target=copier, args=("pull", port, nbytes, out_q))
    pull.start()
    assert out_q.get(timeout=60) == "bound"
    push = ctx.Process(target=copier, args=("push", port, nbytes, out_q))
    push.start()
    marks = dict(out_q.get(timeout=600) for _ in range(2))
    push.join(60)
    pull.join(60)
    return marks["copy"] - marks["sent0"]


def run_once(ctx, plane: str, n_params: int, step_s: float, timeout_s: float,
             heal_sources: int = 1) -> dict[str, float]:
    shapes = shapes_for(n_params)
    addr_q, stop_ev = ctx.Queue(), ctx.Event()
    coord = ctx.Process(target=coordinator, args=(plane, addr_q, stop_ev, timeout_s, heal_sources),
                        name="coordinator")
    coord.start()
    procs = [coord]
    try:
        addr = addr_q.get(timeout=300)
        marks = Marks(ctx)
        members = {}
        for i in range(N_MEMBERS):
            wid = f"m{i}"
            members[wid] = ctx.Process(target=member, args=(wid, plane, addr, shapes, step_s, marks.pipe(), stop_ev,
                                                            i == 0), name=wid)
            members[wid].start()
            procs.append(members[wid])
            if i == 0:  # the first brings the params: the others join a run that has them
                marks.wait("m0", "params", 300)
        marks.wait("m1", f"applied{ROUNDS_BEFORE_KILL}", 600)
        os.kill(members["m1"].pid, signal.SIGKILL)
        spawned = time.time()
        new = ctx.Process(target=member, args=("r1", plane, addr, shapes, step_s, marks.pipe(), stop_ev, False),
                          name="r1")
        new.start()
        procs.append(new)
        got = marks.wait("r1", "applied1", 900)
        return {k: got[k] - spawned for k in ("started", "joined", "welcome", "params", "applied1")}
    finally:
        stop_ev.set()
        for p in procs:
            p.join(20)
            if p.is_alive():
                p.kill()


class Marks:
    """The members' marks as they arrive, each on its own pipe: wid -> mark -> wall time."""

    def __init__(self, ctx) -> None:
        self.ctx = ctx
        self.readers: list = []
        self.seen: dict[str, dict[str, float]] = {}

    def pipe(self):
        """The end a new member writes its marks to."""
        reader, writer = self.ctx.Pipe(duplex=False)
        self.readers.append(reader)
        return writer

    def wait(self, wid: str, mark: str, timeout_s: float) -> dict[str, float]:
        """Wait until ``wid`` sent ``mark``; every mark of ``wid`` so far."""
        deadline = time.monotonic() + timeout_s
        while mark not in self.seen.get(wid, {}):
            left = deadline - time.monotonic()
            if left <= 0 or not self.readers:
                raise RuntimeError(f"no {mark!r} from {wid} within {timeout_s:g} s (seen: {self.seen.get(wid)})")
            for reader in mp.connection.wait(self.readers, left):
                try:
                    who, what, t = reader.recv()
                except EOFError:  # that member exited (or was killed): nothing more comes from it
                    self.readers.remove(reader)
                    continue
                self.seen.setdefault(who, {})[what] = t
        return self.seen[wid]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default=None, help="comma list of model sizes (default 10M,100M; --quick 1M)")
    ap.add_argument("--plane", choices=("hub", "collective", "both"), default="both")
    ap.add_argument("--step-s", type=float, default=0.5, help="seconds a member trains between contributions")
    ap.add_argument("--collective-timeout", type=float, default=60.0)
    ap.add_argument("--heal-sources", default=None,
                    help=f"comma list: the collective plane runs once per K, its joiner healing from K members "
                         f"at once (1 to {N_MEMBERS - 1}: the live members; default 1,2,3; --quick 3)")
    ap.add_argument("--quick", action="store_true", help="1M params: the CI variant")
    args = ap.parse_args(argv)
    sizes = [parse_count(x) for x in (args.params or ("1M" if args.quick else "10M,100M")).split(",")]
    planes = ["hub", "collective"] if args.plane == "both" else [args.plane]
    try:
        ks = [int(k) for k in (args.heal_sources or ("3" if args.quick else "1,2,3")).split(",")]
    except ValueError:
        ap.error(f"--heal-sources {args.heal_sources!r}: a comma list of integers")
    if not all(1 <= k < N_MEMBERS for k in ks):
        ap.error(f"--heal-sources {args.heal_sources}: each from 1 to {N_MEMBERS - 1} (the live members)")
    ctx = mp.get_context("spawn")
    print(f"bench_recovery: {N_MEMBERS} members (min_workers {MIN_WORKERS}) on loopback, one killed with kill -9 "
          f"after {ROUNDS_BEFORE_KILL} rounds and replaced at once; planes {', '.join(planes)}; sizes "
          f"{', '.join(f'{n:,}' for n in sizes)} fp32 params; {os.cpu_count()} CPUs", flush=True)
    results = []
    for n_params in sizes:
        copy_s = copy_time(ctx, n_params * 4)
        print(f"  {n_params:>11,} raw copy of the params on loopback: {copy_s * 1000:.0f} ms", flush=True)
        for plane, k in [(p, k) for p in planes for k in (ks if p == "collective" else [0])]:
            t = run_once(ctx, plane, n_params, args.step_s, args.collective_timeout, k or 1)
            fetch, heal = t["params"] - t["joined"], t["params"] - t["welcome"]
            label = f"{plane} ({k} source{'s' if k > 1 else ''})" if k else plane
            print(f"  {n_params:>11,} {label:22} started {t['started']:6.2f} s  joined {t['joined']:6.2f} s  "
                  f"welcome {t['welcome']:6.2f} s  params {t['params']:6.2f} s  contributing {t['applied1']:6.2f} s  "
                  f"(heal {heal * 1000:.0f} ms; join to params {fetch * 1000:.0f} ms, {fetch / copy_s:.2f}x the copy)",
                  flush=True)
            results.append(f"RESULT bench_recovery plane={plane} params={n_params}"
                           f"{f' heal_sources={k}' if k else ''} started_s={t['started']:.3f} "
                           f"joined_s={t['joined']:.3f} welcome_s={t['welcome']:.3f} params_s={t['params']:.3f} "
                           f"contributing_s={t['applied1']:.3f} heal_s={heal:.3f} copy_s={copy_s:.3f} "
                           f"fetch_vs_copy={fetch / copy_s:.2f}")
    print("\n".join(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
