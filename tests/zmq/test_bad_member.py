"""One bad member cannot break a run, on either plane (SPEC.md section 7c; section 12's outlier bound).

A server with ``--min-workers 2`` and three workers on loopback; two train ``tiny_entry``'s MLP,
the third ``bad_entry``'s, whose inner optimizer sets every parameter to 1e30 (or NaN) after four
honest rounds. Its pseudo-gradient is refused before it enters a round: on the hub the
coordinator measures it; on the collective plane the worker declares its norm with its ready,
and the coordinator holds that against the same bounds. The run goes on with the two honest
workers, whose losses stay finite and small (their params were never poisoned), and the server
names the bad worker.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from procs import wait_until

BAD_ENTRY = Path(__file__).with_name("bad_entry.py")
H = 3


def _loss_lines(output: str) -> list[float]:
    return [float(m.group(1)) for m in re.finditer(r"synced: next round \[\d+(?:, \d+)*\], inner step \d+, "
                                                   r"loss (\S+),", output)]


@pytest.mark.parametrize("plane, kind", [("hub", "huge"), ("hub", "nan"), ("collective", "huge"),
                                         ("collective", "nan")])
def test_a_member_that_turns_bad_is_refused_and_named_and_the_run_goes_on(cluster, plane, kind):
    args = ["--min-workers", "2"] + (["--data-plane", "collective"] if plane == "collective" else [])
    server = cluster.server(*args)
    honest = [cluster.worker(w, sync_every=H) for w in ("h1", "h2")]
    bad = cluster.start("bad", ["worker", "--connect", cluster.address, "--id", "bad", "--entry",
                                f"{BAD_ENTRY}:make_{kind}", "--sync-every", str(H), "--coordinator-timeout", "120"])
    # It turns bad after 12 inner steps (4 rounds of 3): the refusal names it.
    # 1e30 is far out of line, or its square overflows fp32's norm: not finite either way.
    m = server.wait_for(r"REFUSED\s+bad's fragment 0 submission: (.*)", 120)
    assert re.search(r"not finite|is nan" if kind == "nan" else r"far out of line|not finite", m.group(1)), m.group(0)
    assert bad.wait_exit(60) != 0
    assert re.search(r"submission refused \((update_too_large|non_finite)\)", bad.output()), bad.output()[-2000:]
    # The honest two go on: ten more rounds, their losses finite and small.
    applied = cluster.status()["rounds_applied"]
    cluster.wait_status(lambda s: s["rounds_applied"] >= applied + 10, 120, "ten rounds after the refusal")
    for w in honest:
        losses = _loss_lines(w.output())
        assert len(losses) >= 8, w.output()[-2000:]
        assert all(math.isfinite(x) and x < 10.0 for x in losses), losses
    stop = cluster.start("stop", ["shutdown", "--connect", cluster.address])
    assert stop.wait_exit(30) == 0, stop.output()
    assert server.wait_exit(60) == 0, server.output()
    assert all(w.wait_exit(60) == 0 for w in honest)
