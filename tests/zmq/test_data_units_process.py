"""Data work units with real processes: workers killed with ``kill -9`` while they hold units, and a
coordinator stopped and resumed, and still every unit of an epoch is finished exactly once (SPEC.md
section 12, "Data work units", U1-U5).

A server with ``--data-units 8`` and three workers (the tiny MLP; what they train on does not matter to
the ledger, whose accounting is what is under test). While they train, w2 and then w3 are killed with
SIGKILL: each held a unit at that moment, the coordinator gives it back (``unit ... back from``) and
hands it out again, and each is restarted under its id. Mid-run the coordinator saves and stops
(``shutdown --save``) and a new one resumes the run (``--resume``): the ledger comes back from the
checkpoint. Once two whole epochs are done (or more, up to the epoch of the last unit a killed worker held), the
audit logs of both incarnations list, in their ``units_finished`` lines, each unit of those epochs
exactly once, including the units the killed workers held.
"""

from __future__ import annotations

import collections
import json
import re

from procs import wait_until

UNITS = 8


def _finished_total(cluster) -> int:
    status = cluster.status_or_none()
    return -1 if status is None or not status.get("units") else status["units"]["finished_total"]


def _kill_holding(cluster, server, worker, worker_id: str) -> int:
    """SIGKILL a worker that holds a unit; wait for the coordinator to give that unit back."""
    # With min_workers 1 the others may finish units before this one is even welcomed (a loaded
    # machine): wait until it was handed one.
    pattern = rf'"event":"unit"[^\n]*"worker_id":"{worker_id}","unit":(\d+)'
    wait_until(lambda: re.search(pattern, _log(cluster)) is not None, 60, f"{worker_id} handed a unit")
    worker.kill9()
    m = server.wait_for(rf"unit\s+(\d+) back from {worker_id}: handed out again", 30)
    return int(m.group(1))


def _log(cluster) -> str:
    return (cluster.tmp / "ckpt" / "events.jsonl").read_text()


def test_every_unit_of_an_epoch_is_finished_exactly_once_through_kills_and_a_restart(cluster):
    args = ("--min-workers", "1", "--data-units", str(UNITS), "--checkpoint-dir", "ckpt")
    server = cluster.server(*args)
    workers = {wid: cluster.worker(wid, sync_every=3) for wid in ("w1", "w2", "w3")}

    wait_until(lambda: _finished_total(cluster) >= 3, 120, "three units finished")
    back = [_kill_holding(cluster, server, workers["w2"], "w2")]
    workers["w2"] = cluster.worker("w2", sync_every=3)
    wait_until(lambda: _finished_total(cluster) >= 6, 120, "six units finished")
    back.append(_kill_holding(cluster, server, workers["w3"], "w3"))
    workers["w3"] = cluster.worker("w3", sync_every=3)
    wait_until(lambda: _finished_total(cluster) >= 10, 120, "ten units finished (into epoch 1)")

    # Save and stop; a new coordinator resumes the ledger with the run. Every worker has joined first:
    # one still joining when the coordinator exits would wait out its --coordinator-timeout (120 s).
    cluster.wait_status(lambda s: cluster.members(s) == {"w1", "w2", "w3"}, 120, "the three workers members")
    saved = cluster.status()["units"]
    admin = cluster.start("save", ["shutdown", "--save", "--connect", cluster.address])
    assert admin.wait_exit(30) == 0, admin.output()
    assert server.wait_exit(60) == 0, server.output()
    for w in workers.values():
        w.wait_exit(60)
    server = cluster.server(*args, "--resume", "ckpt")
    resumed = cluster.status()["units"]
    assert resumed["finished_total"] >= saved["finished_total"] and resumed["epoch"] >= saved["epoch"], \
        (saved, resumed)
    assert resumed["held"] == resumed["in_flight"] == 0, resumed  # what was held came back as given back
    workers = {wid: cluster.worker(wid, sync_every=3) for wid in ("w1", "w2", "w3")}
    # Units are numbered across epochs, and a fast run hands out the next epoch's before this one is
    # finished: a killed worker may have held a unit of epoch 2. Wait for every epoch a unit given
    # back belongs to, and at least two.
    epochs = max(2, max(back) // UNITS + 1)
    wait_until(lambda: (cluster.status_or_none() or {}).get("units", {}).get("epochs_done", 0) >= epochs, 180,
               f"{epochs} epochs done")
    admin = cluster.start("stop", ["shutdown", "--connect", cluster.address])
    assert admin.wait_exit(30) == 0, admin.output()

    finished = collections.Counter()
    handed = collections.Counter()
    for raw in _log(cluster).splitlines():
        line = json.loads(raw)
        if line.get("event") == "units_finished":
            finished.update(line["units"])
        elif line.get("event") == "unit":
            handed[line["unit"]] += 1
    done_epochs = range(epochs * UNITS)
    assert {u: finished[u] for u in done_epochs} == {u: 1 for u in done_epochs}, finished
    assert all(u in finished for u in back), (back, finished)
    # The killed workers' units were handed out at least twice: to them, and again after the kill.
    assert all(handed[u] >= 2 for u in back), (back, handed)
