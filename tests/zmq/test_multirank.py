"""Multi-rank workers (SPEC.md section 14, "Multi-rank workers"): real processes, gloo on CPU, loopback only.

Each worker is a group of two ranks started the way torchrun starts them
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` in the environment); the group meets
through a file store (``DILOCO_GROUP_INIT``) and gloo on the loopback
interface, so nothing listens beyond 127.0.0.1. The ranks train on different
data; ``rank_entry.py`` traces a digest of each rank's params before every
step.
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

pytest.importorskip("torch.distributed")

RANK_ENTRY = f"{Path(__file__).with_name('rank_entry.py')}:make_setup"
RANKS = 2
H = 5


def start_group(cluster: Cluster, worker_id: str, trace_dir: Path, *args: str) -> list[Proc]:
    """The ranks of one worker, rank 0 first."""
    return cluster.worker_ranks(worker_id, RANK_ENTRY, RANKS, trace_dir, *args, sync_every=H)


def traces(trace_dir: Path, worker_id: str) -> list[dict[int, str]]:
    """Per rank: inner step -> digest of the params before that step."""
    out = []
    for rank in range(RANKS):
        lines = (trace_dir / f"{worker_id}.rank{rank}.trace").read_text().splitlines()
        out.append({int(step): digest for step, digest in (line.split() for line in lines if line.strip())})
    return out


@pytest.fixture
def two_groups(cluster, tmp_path):
    trace_dir = tmp_path / "traces"
    trace_dir.mkdir()
    server = cluster.server("--min-workers", "2")
    groups = {w: start_group(cluster, w, trace_dir) for w in ("w1", "w2")}
    return server, groups, trace_dir


def test_two_workers_of_two_ranks_apply_rounds_with_identical_params_on_every_rank(cluster, two_groups):
    server, groups, trace_dir = two_groups
    status = cluster.wait_status(lambda s: s["rounds_applied"] >= 4, 180, "4 rounds applied")
    # The coordinator sees two members, not four ranks.
    assert cluster.members(status) == {"w1", "w2"}
    reply = admin_request(cluster.address, AdminRequest("shutdown", {"kind": "drain"}), timeout_s=10)
    assert reply.ok, reply
    for procs in groups.values():
        for p in procs:
            assert p.wait_exit(60) == 0, p.output()
    for w in ("w1", "w2"):
        rank0, rank1 = traces(trace_dir, w)
        steps = sorted(set(rank0) & set(rank1))
        assert len(steps) >= 4 * H, (w, len(steps))
        # Bit-identical params on both ranks before every step: the gradients were averaged and
        # every Result reached both ranks at the same step.
        assert [rank0[s] for s in steps] == [rank1[s] for s in steps], w
    # After each applied round every rank of every worker starts from the same global params.
    w1, w2 = traces(trace_dir, "w1")[0], traces(trace_dir, "w2")[0]
    synced = [s for s in range(H, max(w1) + 1, H) if s in w1 and s in w2]
    assert len(synced) >= 3
    assert all(w1[s] == w2[s] for s in synced), synced
    # ... and the ranks did train between syncs (the digests move).
    assert len({w1[s] for s in range(H)}) == H


def test_killing_one_rank_takes_its_worker_out_as_one_member_and_the_run_pauses(cluster, two_groups):
    server, groups, trace_dir = two_groups
    cluster.wait_status(lambda s: s["rounds_applied"] >= 2, 180, "2 rounds applied")
    victim_pid = int((trace_dir / "w2.rank1.pid").read_text())
    assert victim_pid == groups["w2"][1].pid
    os.kill(victim_pid, signal.SIGKILL)
    # Rank 0 of w2 finds its group broken at its next collective and leaves the run: exit 1, one departure.
    assert groups["w2"][0].wait_exit(60) == 1, groups["w2"][0].output()
    assert "group broke" in groups["w2"][0].output()
    status = cluster.wait_status(lambda s: cluster.members(s) == {"w1"}, 60, "w2 gone from the members")
    # min_workers 2 and one member left: below quorum, the run pauses (SPEC.md R5) and applies nothing.
    status = cluster.wait_status(lambda s: s["phase"] == "paused", 30, "the run paused")
    applied = status["rounds_applied"]
    groups["w1"][0].wait_for(r"paused: the run is below quorum", 60)
    time.sleep(2)
    assert cluster.status()["rounds_applied"] == applied
    # Both ranks of the paused worker stop cleanly when the run ends.
    assert admin_request(cluster.address, AdminRequest("shutdown", {"kind": "abort"}), timeout_s=10).ok
    for p in groups["w1"]:
        assert p.wait_exit(60) == 0, p.output()
