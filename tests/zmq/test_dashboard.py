"""``diloco server --http``: the dashboard in a real browser, and ``/metrics`` as Prometheus reads it.

Real processes on loopback (procs.py): a server with ``--http 127.0.0.1:0``
(it prints the address it got) and two workers. The browser is the system's
Chromium (``/usr/bin/chromium``, which ``.ci/run`` installs), driven by
Playwright with a fresh profile and no network beyond loopback; Playwright
never downloads a browser here.
"""

from __future__ import annotations

import os
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from procs import wait_until

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]

pytestmark = pytest.mark.slow


def _start(cluster, tmp_path, *extra):
    server = cluster.server("--min-workers", "2", "--http", "127.0.0.1:0", "--log-dir", str(tmp_path / "logs"),
                            *extra)
    http = server.wait_for(r"dashboard (http://127\.0\.0\.1:\d+)/").group(1)
    workers = [cluster.worker(w) for w in ("w1", "w2")]
    return server, http, workers


def _get(url: str, timeout_s: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return r.read().decode()


def _scrape(http: str) -> dict[tuple, float]:
    """``{(sample name, ((label, value), ...)): value}`` of one /metrics scrape, parsed as Prometheus does."""
    out = {}
    for family in text_string_to_metric_families(_get(f"{http}/metrics")):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_the_dashboard_shows_the_phase_the_reason_both_workers_and_their_loss(cluster, tmp_path):
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"no Chromium at {CHROMIUM} (.ci/run installs Debian's chromium package)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the test extra")
    _, http, _ = _start(cluster, tmp_path)
    cluster.wait_status(lambda s: s["rounds_applied"] >= 3, 90, "three applied rounds")
    requested = []
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True,
            viewport={"width": 1280, "height": 900}, timeout=60_000)
        try:
            page = browser.new_page()
            page.on("request", lambda req: requested.append(req.url))
            page.goto(f"{http}/", timeout=30_000)
            page.wait_for_function(
                "document.querySelectorAll('#members tbody tr[data-worker]').length === 2"
                " && document.querySelectorAll('#loss-chart polyline.curve').length === 2"
                " && document.querySelectorAll('#loss-chart circle.round-point').length > 0",
                timeout=60_000)
            assert page.inner_text("#phase").strip() == "RUNNING"
            assert page.inner_text("#reason").strip() == "quorum met: 2 live workers >= min_workers 2"
            rows = page.locator("#members tbody tr")
            assert rows.count() == 2
            assert [rows.nth(i).get_attribute("data-worker") for i in range(2)] == ["w1", "w2"]
            first = rows.nth(0).inner_text()
            assert "training" in first or "waiting" in first
            assert "ago" in first
            summary = page.inner_text("#summary")
            assert "live 2 / min_workers 2" in summary and "rounds applied" in summary
            points = page.locator("#loss-chart polyline.curve").first.get_attribute("points")
            assert len(points.split()) >= 2  # a drawn line, not an empty chart
            assert page.locator("#timeline-chart rect.segment").count() >= 2
            assert "run id" in page.inner_text("#config")
            page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
        finally:
            browser.close()
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000
    assert requested and all(u.startswith(http) for u in requested), requested  # nothing from elsewhere


def test_metrics_follow_rounds_and_a_killed_worker(cluster, tmp_path):
    _, http, workers = _start(cluster, tmp_path)
    # A worker's series appear with its first heartbeat that carries metrics (one heartbeat
    # interval after it trained a step), which may come after the first applied round.
    first = wait_until(lambda: (lambda m: m if m.get(("diloco_rounds_applied", ()))
                                and all(("diloco_worker_step", (("worker", w),)) in m for w in ("w1", "w2"))
                                else None)(_scrape(http)),
                       90, "an applied round and both workers' step in /metrics")
    assert first[("diloco_live_workers", ())] == 2 and first[("diloco_min_workers", ())] == 2
    assert first[("diloco_below_min_workers", ())] == 0
    assert first[("diloco_phase", (("phase", "running"),))] == 1
    assert first[("diloco_worker_deaths_total", ())] == 0
    assert first[("diloco_payload_bytes_received_total", ())] > 0 and first[("diloco_transport_bytes_sent_total", ())] > 0
    for wid in ("w1", "w2"):
        assert first[("diloco_worker_step", (("worker", wid),))] >= 0
    later = wait_until(lambda: (lambda m: m if m[("diloco_rounds_applied", ())] > first[("diloco_rounds_applied", ())]
                                and ("diloco_worker_loss", (("worker", "w2"),)) in m else None)(_scrape(http)),
                       30, "more rounds, and w2's loss")
    assert later[("diloco_fragment_rounds_applied_total", (("fragment", "0"),))] >= later[("diloco_rounds_applied", ())] - 1
    assert later[("diloco_round_duration_seconds_count", ())] >= 1
    assert later[("diloco_worker_steps_per_second", (("worker", "w1"),))] > 0

    workers[1].kill9()  # w2 dies without a word: below quorum, the run pauses
    paused = wait_until(lambda: (lambda m: m if m[("diloco_below_min_workers", ())] == 1 else None)(_scrape(http)),
                        30, "the run below quorum in /metrics")
    assert paused[("diloco_worker_deaths_total", ())] == 1
    assert paused[("diloco_live_workers", ())] == 1
    assert paused[("diloco_phase", (("phase", "paused"),))] == 1
    assert ("diloco_worker_step", (("worker", "w2"),)) not in paused
    assert ("diloco_worker_step", (("worker", "w1"),)) in paused
    time.sleep(1.5)
    again = _scrape(http)
    assert again[("diloco_paused_seconds_total", ())] > paused[("diloco_paused_seconds_total", ())]
    assert again[("diloco_rounds_applied", ())] == paused[("diloco_rounds_applied", ())]  # nothing applies
    # The JSON behind the page and the metrics log say the same.
    import json
    status = json.loads(_get(f"{http}/api/status"))
    assert status["phase"] == "paused" and status["deaths"] == 1
    assert [seg[0] for seg in status["timeline"]["w2"]][-1] == "dead"
    from diloco.observe.metrics_log import read_log
    kinds = {line["kind"] for line in read_log(tmp_path / "logs")}
    assert {"start", "sample", "round", "state", "event"} <= kinds
