"""Sharded members (FSDP2): real processes, two members of two ranks each, gloo on CPU, loopback only.

Each member is a group of two ranks started the way torchrun starts them; its
model is sharded across them by ``shard_entry.py`` (``fully_shard``). The
coordinator sees one worker per member.
"""

from __future__ import annotations

import json
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
    return cluster.worker_ranks(worker_id, SHARD_ENTRY, RANKS, trace_dir, *args, sync_every=H, env=env)


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


@pytest.mark.parametrize("plane", ["hub", "collective"])
def test_two_sharded_members_apply_rounds_and_hold_the_same_shards_rank_by_rank_after_every_sync(cluster, tmp_path,
                                                                                                  plane):
    trace_dir = tmp_path / "traces"
    trace_dir.mkdir()
    cluster.server("--min-workers", "2", "--data-plane", plane)
    members = {w: start_member(cluster, w, trace_dir) for w in ("w1", "w2")}
    status = cluster.wait_status(lambda s: s["rounds_applied"] >= 4, 240, "4 rounds applied")
    assert cluster.members(status) == {"w1", "w2"}, "the coordinator sees one worker per member"
    assert admin_request(cluster.address, AdminRequest("shutdown", {"kind": "drain"}), timeout_s=10).ok
    for procs in members.values():
        for p in procs:
            assert p.wait_exit(60) == 0, p.output()
    assert not list(trace_dir.glob("*.finalized")), "a rank ended through the interpreter's finalization"
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


def _cli(*args: str) -> int:
    from diloco.cli import main

    return main(list(args))


def test_sharded_members_save_with_dcp_resume_from_it_and_export_the_coordinators_params(cluster, tmp_path):
    import torch
    from safetensors.torch import load_file

    trace_dir = tmp_path / "traces"
    trace_dir.mkdir()
    server = cluster.server("--min-workers", "2", "--checkpoint-dir", "ckpt-server", heartbeat_timeout_s=5.0)
    members = {w: start_member(cluster, w, trace_dir, "--checkpoint-dir", f"ckpt-{w}") for w in ("w1", "w2")}
    cluster.wait_status(lambda s: s["rounds_applied"] >= 3, 240, "three rounds applied")
    # Raise the quorum so that nothing moves while the run saves: both members park at their next sync.
    assert _cli("set-min-workers", "3", "--connect", cluster.address) == 0
    before = cluster.wait_status(lambda s: set(s["parked_workers"]) == {"w1", "w2"}, 60, "both members parked")
    assert _cli("shutdown", "--save", "--connect", cluster.address) == 0
    for procs in members.values():
        for p in procs:
            assert p.wait_exit(60) == 0, p.output()
    assert server.wait_exit(30) == 0
    from diloco.deploy.export import read_run_params

    coordinator = read_run_params(cluster.tmp / "ckpt-server").params
    assert coordinator
    for w in ("w1", "w2"):
        dcp_dir = cluster.tmp / f"ckpt-{w}" / f"worker-{w}.dcp"
        assert (dcp_dir / "diloco.json").is_file(), "the checkpoint is sealed"
        assert not list((cluster.tmp / f"ckpt-{w}").glob("*.partial")), "nothing is left half written"
        # The member's shards of the global copy, joined, are the coordinator's params bit for bit.
        out = tmp_path / f"{w}.safetensors"
        assert _cli("export", str(dcp_dir), str(out)) == 0
        exported = load_file(out)
        assert set(exported) == set(coordinator)
        for name, t in coordinator.items():
            assert torch.equal(exported[name], t), (w, name)

    # The run and the members come back from their checkpoints and go on from the same round.
    address = cluster.address
    cluster.server("--resume", "ckpt-server", "--checkpoint-dir", "ckpt-server", bind=address,
                   heartbeat_timeout_s=5.0)
    members = {w: start_member(cluster, w, trace_dir, "--checkpoint-dir", f"ckpt-{w}") for w in ("w1", "w2")}
    for w, procs in members.items():
        saved = json.loads((cluster.tmp / f"ckpt-{w}" / f"worker-{w}.dcp" / "diloco.json").read_text())
        assert saved["layout"]["world_size"] == RANKS
        procs[0].wait_for(rf"restored from its checkpoint at inner step {saved['inner_step']}\b", 120)
    assert _cli("set-min-workers", "2", "--connect", cluster.address) == 0
    cluster.wait_status(lambda s: s["rounds_applied"] >= before["rounds_applied"] + 2, 240,
                        "the resumed run applies rounds")
    assert _cli("shutdown", "--abort", "--connect", cluster.address) == 0
    for procs in members.values():
        for p in procs:
            assert p.wait_exit(60) == 0, p.output()


def test_a_sharded_members_layout_is_what_its_checkpoint_resumes_with(cluster, tmp_path):
    """A checkpoint written by two ranks is refused by a member of one, with both layouts named."""
    trace_dir = tmp_path / "traces"
    trace_dir.mkdir()
    cluster.server("--min-workers", "1", "--checkpoint-dir", "ckpt-server")
    procs = start_member(cluster, "w1", trace_dir, "--checkpoint-dir", "ckpt-w1")
    cluster.wait_status(lambda s: s["rounds_applied"] >= 1, 240, "a round applied")
    assert _cli("shutdown", "--save", "--connect", cluster.address) == 0
    for p in procs:
        assert p.wait_exit(60) == 0, p.output()
    store = cluster.tmp / "single.store"
    env = {**cluster.env, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "DILOCO_GROUP_INIT": f"file://{store}",
           "RANK_TRACE_DIR": str(trace_dir),
           "PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "zmq"), cluster.env["PYTHONPATH"]])}
    cluster._n += 1
    one = Proc(f"{cluster._n:02d}-w1-alone", ["worker", "--connect", "tcp://127.0.0.1:9", "--id", "w1", "--entry",
                                             SHARD_ENTRY, "--sync-every", str(H), "--checkpoint-dir", "ckpt-w1",
                                             "--device", "cpu"], cluster.tmp, env)
    cluster.procs.append(one)
    assert one.wait_exit(120) != 0
    out = one.output()
    assert "'world_size': 2" in out and "'world_size': 1" in out, out


@pytest.mark.parametrize("plane", ["hub", "collective"])
def test_a_sharded_run_and_a_replicated_run_of_the_same_seed_and_data_train_the_same(cluster, tmp_path, plane):
    # On the collective plane each rank encodes its own shard: int8's scales would be per shard
    # there and per tensor in the replicated run, so the two compare in fp32.
    wire = ("--wire-dtype", "fp32") if plane == "collective" else ()
    losses = {}
    for kind in ("sharded", "replicated"):
        trace_dir = tmp_path / kind
        trace_dir.mkdir()
        server = cluster.server("--min-workers", "1", "--data-plane", plane, *wire)
        env = {"SHARD_ENTRY_REPLICATED": "1"} if kind == "replicated" else {}
        # The same id in both runs: the data is seeded by it.
        procs = start_member(cluster, "m", trace_dir, "--max-steps", str(4 * H), env=env)
        for p in procs:
            assert p.wait_exit(240) == 0, p.output()
        assert _cli("shutdown", "--abort", "--connect", cluster.address) == 0
        server.wait_exit(30)
        rank0 = traces(trace_dir, "m")[0]
        losses[kind] = [rank0[s][1] for s in sorted(rank0) if s > 0]
    assert len(losses["sharded"]) == len(losses["replicated"]) == 4 * H - 1
    for a, b in zip(losses["sharded"], losses["replicated"]):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (losses["sharded"], losses["replicated"])


@pytest.mark.parametrize("plane", ["hub", "collective"])
def test_killing_one_rank_takes_its_member_out_as_one_death_and_a_replacement_catches_up(cluster, tmp_path, plane):
    trace_dir, later = tmp_path / "traces", tmp_path / "replacement"
    trace_dir.mkdir()
    later.mkdir()
    cluster.server("--min-workers", "2", "--data-plane", plane)
    members = {w: start_member(cluster, w, trace_dir) for w in ("w1", "w2")}
    cluster.wait_status(lambda s: s["rounds_applied"] >= 2, 240, "2 rounds applied")
    victim = int((trace_dir / "w2.rank1.pid").read_text())
    assert victim == members["w2"][1].pid
    os.kill(victim, signal.SIGKILL)
    # Its leader's next collective inside the member fails: the whole member goes, as one death.
    assert members["w2"][0].wait_exit(120) != 0, members["w2"][0].output()
    cluster.wait_status(lambda s: cluster.members(s) == {"w1"}, 60, "w2 gone from the members")
    status = cluster.wait_status(lambda s: s["phase"] == "paused", 60, "the run paused below quorum")
    applied = status["rounds_applied"]
    time.sleep(1.0)
    assert cluster.status()["rounds_applied"] == applied, "no round applied below min_workers"
    # A replacement member (same id, two fresh ranks) joins with the run's params and contributes.
    replacement = start_member(cluster, "w2", later)
    cluster.wait_status(lambda s: s["rounds_applied"] >= applied + 3, 240, "rounds applied with the replacement")
    assert admin_request(cluster.address, AdminRequest("shutdown", {"kind": "drain"}), timeout_s=10).ok
    for p in members["w1"] + replacement:
        assert p.wait_exit(60) == 0, p.output()
    # The replacement's ranks hold, after its first sync, the same shards as w1's at the same round.
    w1, w2 = traces(trace_dir, "w1"), traces(later, "w2")
    for rank in range(RANKS):
        after_join = {d for s, (d, _) in w2[rank].items() if s % H == 0 and s > 0}
        assert after_join & {d for s, (d, _) in w1[rank].items() if s % H == 0}, rank


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_example_runs_sharded_members_in_a_loop_of_its_own_with_diloco_worker(cluster):
    """``examples/fsdp2_member.py`` under a torchrun-like launch: ``diloco.Worker`` on every rank."""
    cluster.server("--min-workers", "2")
    procs = []
    for w in ("w1", "w2"):
        port = _free_port()
        for rank in range(RANKS):
            env = {**cluster.env, "RANK": str(rank), "WORLD_SIZE": str(RANKS), "LOCAL_RANK": str(rank),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "lo"}
            cluster._n += 1
            proc = Proc(f"{cluster._n:02d}-{w}-rank{rank}",
                        ["--connect", cluster.address, "--worker-id", w, "--sync-every", "5", "--steps", "20"],
                        cluster.tmp, env, program=(str(REPO / "examples" / "fsdp2_member.py"),))
            cluster.procs.append(proc)
            procs.append(proc)
    for p in procs:
        assert p.wait_exit(240) == 0, p.output()
    results = [p.output() for p in procs if "RESULT" in p.output()]
    assert len(results) == 2, "rank 0 of each member reports"
    assert all("inner_steps=20 rounds=4" in r for r in results), results
    assert cluster.members(cluster.status()) <= {"w1", "w2"}


def test_a_member_laid_out_unlike_the_collective_runs_members_is_refused_naming_both_layouts(cluster, tmp_path):
    trace_dir = tmp_path / "traces"
    trace_dir.mkdir()
    cluster.server("--min-workers", "1", "--data-plane", "collective")
    sharded = start_member(cluster, "w1", trace_dir)
    cluster.wait_status(lambda s: s["rounds_applied"] >= 1, 240, "a round applied by the sharded member")
    # The same model, not sharded (two ranks, each the whole model): its rank 0 cannot reduce with
    # the sharded member's rank 0, which holds half of each tensor.
    replicated = start_member(cluster, "w2", trace_dir, env={"SHARD_ENTRY_REPLICATED": "1"})
    assert replicated[0].wait_exit(120) == 1, replicated[0].output()
    out = replicated[0].output()
    assert "replicated (one rank holds the whole model)" in out and "sharded over 2 ranks" in out, out
    assert replicated[1].wait_exit(60) is not None
    assert cluster.members() == {"w1"}
    assert admin_request(cluster.address, AdminRequest("shutdown", {"kind": "drain"}), timeout_s=10).ok
    for p in sharded:
        assert p.wait_exit(60) == 0, p.output()


def test_collective_sharded_members_save_the_same_committed_shards_and_resume_from_them(cluster, tmp_path):
    import torch
    from safetensors.torch import load_file

    trace_dir = tmp_path / "traces"
    trace_dir.mkdir()
    server = cluster.server("--min-workers", "2", "--data-plane", "collective", "--checkpoint-dir", "ckpt-server",
                            heartbeat_timeout_s=5.0)
    members = {w: start_member(cluster, w, trace_dir, "--checkpoint-dir", f"ckpt-{w}") for w in ("w1", "w2")}
    cluster.wait_status(lambda s: s["rounds_applied"] >= 3, 240, "three rounds applied")
    assert _cli("set-min-workers", "3", "--connect", cluster.address) == 0
    before = cluster.wait_status(lambda s: s["below_min_workers"], 60, "the run below its new quorum")
    assert _cli("shutdown", "--save", "--connect", cluster.address) == 0
    for procs in members.values():
        for p in procs:
            assert p.wait_exit(60) == 0, p.output()
    assert server.wait_exit(30) == 0
    # Both members hold the run's committed params, shard by shard (S6, S7): joined, they are equal.
    exported = {}
    for w in ("w1", "w2"):
        dcp_dir = cluster.tmp / f"ckpt-{w}" / f"worker-{w}.dcp"
        assert (dcp_dir / "diloco.json").is_file(), "the checkpoint is sealed"
        assert _cli("export", str(dcp_dir), str(tmp_path / f"{w}.safetensors")) == 0
        exported[w] = load_file(tmp_path / f"{w}.safetensors")
    assert set(exported["w1"]) == set(exported["w2"])
    for name, t in exported["w1"].items():
        assert torch.equal(t, exported["w2"][name]), name

    # Restarted, the members resume their shards and the run goes on: nobody offers a committed
    # state (S9), so one member starts it from its checkpoint's shards and the other heals from it.
    address = cluster.address
    cluster.server("--resume", "ckpt-server", "--checkpoint-dir", "ckpt-server", bind=address,
                   heartbeat_timeout_s=5.0)
    members = {w: start_member(cluster, w, trace_dir, "--checkpoint-dir", f"ckpt-{w}") for w in ("w1", "w2")}
    for w, procs in members.items():
        saved = json.loads((cluster.tmp / f"ckpt-{w}" / f"worker-{w}.dcp" / "diloco.json").read_text())
        procs[0].wait_for(rf"restored from its checkpoint at inner step {saved['inner_step']}\b", 120)
    assert _cli("set-min-workers", "2", "--connect", cluster.address) == 0
    resumed = cluster.wait_status(lambda s: s["rounds_applied"] >= before["rounds_applied"] + 2, 240,
                                  "the resumed run applies rounds")
    assert resumed["data_plane"] == "collective"
    assert _cli("shutdown", "--abort", "--connect", cluster.address) == 0
    for procs in members.values():
        for p in procs:
            assert p.wait_exit(60) == 0, p.output()
