"""Partitions between a real ``diloco worker`` and a real ``diloco server`` (SPEC.md section 13, "Partitions").

Worker ``w1`` reaches the server through a ``FaultLink`` (``scripts/faultlink.py``,
a forwarding port on loopback); ``w2`` connects directly and keeps the run
going (``min_workers`` 1). Each test applies one kind of fault to w1's link,
checks what SPEC.md says happens during it, heals the link and checks that
w1 is a contributing member again, as the same process. ``scripts/chaos.py
--partition-every S`` does the same at random.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from faultlink import FaultLink  # noqa: E402
from procs import wait_until  # noqa: E402

pytestmark = pytest.mark.slow

HEARTBEAT_TIMEOUT_S = 3.0
WAITING = r"coordinator unreachable for \d+ s: waiting for"


def events(cluster) -> list[dict]:
    return [json.loads(line) for line in (cluster.tmp / "ckpt" / "events.jsonl").read_text().splitlines()]


def applied_with(cluster, worker: str, after: float, before: float = float("inf")) -> int:
    """Rounds applied within (after, before) wall clock with ``worker`` among the contributors."""
    return sum(1 for e in events(cluster) if e["event"] == "apply" and after < e["t"] < before
               and worker in e["contributors"])


def losses_of(cluster, worker: str, after: float) -> list[dict]:
    """``dead`` and ``left`` lines about ``worker`` after wall clock ``after``."""
    return [e for e in events(cluster) if e["event"] in ("dead", "left") and e["t"] > after
            and e.get("worker_id") == worker]


@pytest.fixture
def partitioned(cluster):
    """A server, w1 behind a FaultLink and w2 direct, both training; yields (cluster, link, w1, server)."""
    server = cluster.server("--min-workers", "1", "--checkpoint-dir", "ckpt", heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
    host, port = cluster.address.removeprefix("tcp://").rsplit(":", 1)
    with FaultLink((host, int(port)), name="w1") as link:
        w1 = cluster.worker("w1", "--connect", link.address)
        cluster.worker("w2")
        cluster.wait_status(lambda s: cluster.members(s) == {"w1", "w2"} and s["rounds_applied"] >= 3, 120,
                            "both workers training")
        yield cluster, link, w1, server


def heal_and_check_w1_contributes(cluster, link, w1, pid: int, rejoins: bool) -> None:
    link.set("pass")
    healed = time.time()
    cluster.wait_status(lambda s: "w1" in cluster.members(s), 30, "w1 a member after the heal")
    deadline = time.monotonic() + 60
    while not applied_with(cluster, "w1", healed):
        assert time.monotonic() < deadline, "no round with w1 as a contributor after the heal"
        time.sleep(0.5)
    assert w1.alive() and w1.pid == pid, "w1 goes on as the same process"
    assert "giving up" not in w1.output()
    if rejoins:
        w1.wait_for(r"w1 joining again", 10)
    else:
        assert "joining again" not in w1.output()


@pytest.mark.parametrize("kind", ["blackhole", "cut up"])
def test_a_worker_whose_traffic_vanishes_past_the_heartbeat_timeout_is_declared_dead_and_rejoins(partitioned, kind):
    """Black-hole (both ways) or cut up (what w1 sends is lost): the server hears nothing from w1."""
    cluster, link, w1, server = partitioned
    pid, t0 = w1.pid, time.time()
    link.set(kind)
    server.wait_for(r"dead +w1 \(silent for", 30)
    rounds = cluster.status()["rounds_applied"]
    cluster.wait_status(lambda s: s["rounds_applied"] > rounds, 30, "w2 trains on alone")
    if kind == "blackhole":
        w1.wait_for(WAITING, 30)  # and w1 hears nothing: it reports the outage and waits
    assert [e["event"] for e in losses_of(cluster, "w1", t0)] == ["dead"]
    heal_and_check_w1_contributes(cluster, link, w1, pid, rejoins=True)


def test_a_worker_whose_connection_is_reset_and_refused_is_a_lost_peer_and_rejoins(partitioned):
    """Drop: the connection is reset and new ones are refused; the server loses the peer at once (R7)."""
    cluster, link, w1, server = partitioned
    pid, t0 = w1.pid, time.time()
    link.set("drop")
    cluster.wait_status(lambda s: cluster.members(s) == {"w2"}, 15, "w1 no longer a member")
    lost = losses_of(cluster, "w1", t0)
    assert lost and lost[0]["event"] == "left" and lost[0].get("cause") == "crashed", lost
    assert time.time() - t0 < HEARTBEAT_TIMEOUT_S + 2, "a reset connection is a loss now, not after the timeout"
    rounds = cluster.status()["rounds_applied"]
    cluster.wait_status(lambda s: s["rounds_applied"] > rounds, 30, "w2 trains on alone")
    # w1 keeps reconnecting and being refused: until a refusal was counted, not for a fixed while.
    wait_until(lambda: link.stats["refused"] >= 1, 60, "w1's reconnects refused by the dropping link")
    heal_and_check_w1_contributes(cluster, link, w1, pid, rejoins=True)


def test_a_delay_within_the_heartbeat_timeout_changes_nothing_but_time(partitioned):
    cluster, link, w1, _ = partitioned
    pid, t0 = w1.pid, time.time()
    link.set("delay 0.8")  # 1.6 s round trip, each heartbeat 0.8 s late: within the 3 s timeout
    deadline = time.monotonic() + 60
    while applied_with(cluster, "w1", t0 + 2) < 2:
        assert time.monotonic() < deadline, "no rounds with w1 while its link is slow"
        time.sleep(0.5)
    assert not losses_of(cluster, "w1", t0), "a slow link is not a death"
    heal_and_check_w1_contributes(cluster, link, w1, pid, rejoins=False)


def test_a_half_open_link_where_only_the_replies_are_lost_keeps_the_worker_a_member(partitioned):
    """Cut down: the server hears w1's heartbeats (so w1 stays a member) but w1 hears nothing; it reports the
    outage and waits, and when the link heals it takes the replies that were held and goes on, no re-join."""
    cluster, link, w1, _ = partitioned
    pid, t0 = w1.pid, time.time()
    link.set("cut down")
    w1.wait_for(WAITING, 30)
    assert "w1" in cluster.members(), "its heartbeats arrive: w1 is alive to the server"
    assert not losses_of(cluster, "w1", t0)
    heal_and_check_w1_contributes(cluster, link, w1, pid, rejoins=False)
    w1.wait_for(r"coordinator answered again after \d+ s", 10)
