"""The journal on real processes: kill -9 of a journaling coordinator, then ``--resume`` replays it.

The server runs ``--full-checkpoint-every 3`` (the test model is tiny, so ``auto`` would write a
full checkpoint every round): most rounds are only in the journal when the kill comes. Checked
from the files it leaves and from the workers' lines: every announced round is durable (the
checkpoint plus the journal), the resumed server says how many steps it replayed and goes on
from exactly there, and the audit log's rules hold across the restart.
"""

from __future__ import annotations

import random
import time

import pytest

from test_durable import audit_lines, check_audit, worker_max_round

from diloco.coordinator import journal
from diloco.coordinator.checkpoint import find_newest, list_checkpoints
from diloco.coordinator.tracecheck import check_log

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("wire", ["int8", "fp32"])
def test_kill9_of_a_journaling_coordinator_loses_at_most_the_open_round(cluster, wire):
    ck = cluster.tmp / "ck"
    args = ("--min-workers", "2", "--checkpoint-dir", "ck", "--resume", "ck", "--full-checkpoint-every", "3",
            "--wire-dtype", wire)
    server = cluster.server(*args, heartbeat_timeout_s=5.0)
    address = cluster.address
    assert "full checkpoints every 3 rounds, a journal in between" in server.output()
    workers = [cluster.worker(w, "--coordinator-timeout", "120") for w in ("w1", "w2")]
    rng = random.Random()
    target = rng.randint(5, 9)
    cluster.wait_status(lambda s: s["rounds_applied"] >= target and s["journal_records"] >= 2, 120,
                        f"{target} rounds applied, some journaled")
    time.sleep(rng.uniform(0.0, 0.3))  # a random moment: in a round, or in the middle of an append
    server.kill9()
    announced = max(worker_max_round(w.output()) for w in workers)

    assert journal.list_segments(ck)
    found = find_newest(ck)
    durable = found.meta["rounds_applied"]
    newest_full = max(int(p.name.split("-")[1].split(".")[0]) for p in list_checkpoints(ck))
    # Persist before announce, through the journal: no worker heard of a round the checkpoint and
    # the journal do not hold together.
    assert announced <= durable, (announced, durable)
    assert durable >= target - 1 and newest_full <= durable
    assert found.replayed >= durable - newest_full  # the rounds after the newest full checkpoint came from the journal

    server2 = cluster.server(*args, bind=address, heartbeat_timeout_s=5.0)
    m = server2.wait_for(r"resumed from (\S+): open rounds \[(\d+)\], rounds applied (\d+)", 30)
    assert int(m.group(3)) == durable
    if found.replayed:
        server2.wait_for(rf"replayed {found.replayed} journal step\(s\) after it", 5)
    cluster.wait_status(lambda s: s["rounds_applied"] >= durable + 3, 120, "the resumed run goes on")
    assert cluster.status()["incarnation"] == 2
    server2.kill9()
    lines = audit_lines(ck)
    check_audit(lines)
    starts = [line for line in lines if line["event"] == "start"]
    assert [s["incarnation"] for s in starts] == [1, 2] and starts[1]["replayed"] == found.replayed
    # The second incarnation journaled too, on top of what it replayed.
    again = find_newest(ck)
    assert again.meta["rounds_applied"] >= durable + 3 and again.meta["incarnation"] == 2
    report = check_log(ck)  # trace validation across the kill
    assert report.ok and report.incarnations == 2, report.summary()
