"""Sharded members (FSDP2): real processes, two members of two ranks each, gloo on CPU, loopback only.

Each member is a group of two ranks started the way torchrun starts them; its
model is sharded across them by ``shard_entry.py`` (``fully_shard``). The
coordinator sees one worker per member.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from diloco.wire.messages import AdminRequest
from diloco.wire.zmq import admin_request
from procs import REPO, Cluster, Proc

pytest.importorskip("torch.distributed.fsdp")

SHARD_ENTRY = f"{Path(__file__).with_name('shard_entry.py')}:make_setup"
RANKS = 2
H = 5


def start_member(cluster: Cluster, worker_id: str, trace_dir: Path, *args: str, env: dict | None = None) -> list[Proc]:
    """The ranks of one member, rank 0 first."""
    store = cluster.tmp / f"{worker_id}.{time.monotonic_ns()}.store"
    procs = []
    for rank in range(RANKS):
        penv = {**cluster.env, "RANK": str(rank), "WORLD_SIZE": str(RANKS), "LOCAL_RANK": str(rank),
                "DILOCO_GROUP_INIT": f"file://{store}", "GLOO_SOCKET_IFNAME": "lo", "RANK_TRACE_DIR": str(trace_dir),
                "PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "zmq"), cluster.env["PYTHONPATH"]]),
                **(env or {})}
        cluster._n += 1
        proc = Proc(f"{cluster._n:02d}-{worker_id}-rank{rank}",
                    ["worker", "--connect", cluster.address, "--id", worker_id, "--entry", SHARD_ENTRY,
                     "--sync-every", str(H), "--coordinator-timeout", "120", "--device", "cpu", *args],
                    cluster.tmp, penv)
        cluster.procs.append(proc)
        procs.append(proc)
    return procs


def traces(trace_dir: Path, worker_id: str) -> list[dict[int, tuple[str, float]]]:
    """Per rank: inner step -> (digest of its local shards before the step, loss of the step before)."""
    out = []
    for rank in range(RANKS):
        rows = {}
        for line in (trace_dir / f"{worker_id}.rank{rank}.trace").read_text().splitlines():
            if line.strip():
                step, digest, loss = line.split()
                rows[int(step)] = (digest, float(loss))
        out.append(rows)
    return out


def test_two_sharded_members_apply_rounds_and_hold_the_same_shards_rank_by_rank_after_every_sync(cluster, tmp_path):
    trace_dir = tmp_path / "traces"
    trace_dir.mkdir()
    cluster.server("--min-workers", "2")
    members = {w: start_member(cluster, w, trace_dir) for w in ("w1", "w2")}
    status = cluster.wait_status(lambda s: s["rounds_applied"] >= 4, 240, "4 rounds applied")
    assert cluster.members(status) == {"w1", "w2"}, "the coordinator sees one worker per member"
    assert admin_request(cluster.address, AdminRequest("shutdown", {"kind": "drain"}), timeout_s=10).ok
    for procs in members.values():
        for p in procs:
            assert p.wait_exit(60) == 0, p.output()
    w1, w2 = traces(trace_dir, "w1"), traces(trace_dir, "w2")
    for rank in range(RANKS):
        a, b = w1[rank], w2[rank]
        synced = [s for s in range(H, max(a) + 1, H) if s in a and s in b]
        assert len(synced) >= 3, synced
        # After each round every member's rank r holds the same shard: the round's params.
        assert all(a[s][0] == b[s][0] for s in synced), rank
        # ... and trained in between (the shards move).
        assert len({a[s][0] for s in range(H)}) == H
    # The two ranks of a member hold different shards (the model is sharded, not replicated).
    assert w1[0][H][0] != w1[1][H][0]
