"""The observatory, its HTTP app, the metrics log and ``plot-log``, without processes."""

from __future__ import annotations


import json
import subprocess
import sys
from pathlib import Path
from wsgiref.util import setup_testing_defaults

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from diloco.coordinator.audit import Tee
from diloco.observe.http import make_app, parse_host_port
from diloco.observe.metrics_log import MetricsLog, log_files, read_log
from diloco.observe.observatory import Observatory
from diloco.observe.plotlog import PlotLogError, plot_log
from diloco.testing import joined, make_coordinator
from diloco.wire.messages import AdminRequest, Heartbeat, Submit

REPO = Path(__file__).resolve().parents[2]


def _run(c, obs, log=None):
    """Two workers, three applied rounds with losses, then b leaves: what the observatory saw."""
    params = {"w": torch.zeros(4)}
    joined(c, params, "a", "b", now_s=0.5)
    t = 1.0
    for r in range(3):
        for w, loss in (("a", 2.0 - r), ("b", 3.0 - r)):
            c.handle(w, Heartbeat(w, {"step": 5 * r, "loss": loss, "steps_per_s": 5.0}), t)
            t += 0.1
        for w in ("a", "b"):
            c.handle(w, Submit(w, 0, r, {"w": torch.full((4,), 0.01)}), t)
            obs.publish(t)
            t += 0.1
    c.peer_lost("b", t)
    obs.publish(t + 0.5)
    return obs.snapshot()


def _call(app, path, method="GET"):
    env = {"PATH_INFO": path, "REQUEST_METHOD": method}
    setup_testing_defaults(env)
    got = {}
    body = b"".join(app(env, lambda status, headers: got.update(status=status, headers=dict(headers))))
    return got["status"], got["headers"], body


def test_the_observatory_sees_rounds_losses_states_and_a_crash(tmp_path):
    tee = Tee()
    c = make_coordinator(0.0, min_workers=2, observer=tee)
    c.run_id = "abc123"
    log = MetricsLog(tmp_path)
    obs = Observatory(c, version="9.9", log=log)
    tee.observers.append(obs)
    snap = _run(c, obs)
    assert snap["run_id"] == "abc123" and snap["version"] == "9.9"
    assert snap["rounds_applied"] == 3 and snap["rounds_by_fragment"] == {"0": 3}
    assert [r[3] for r in snap["rounds"]] == [2.5, 1.5, 0.5]  # mean of the contributors' latest losses
    assert snap["deaths"] == 1 and snap["phase"] == "paused" and snap["below_min_workers"]
    assert [m["worker_id"] for m in snap["members"]] == ["a"] and snap["members"][0]["loss"] == 0.0
    assert snap["timeline"]["b"][-1][0] == "dead"
    assert snap["round_duration"]["count"] == 3  # each from the previous apply, the first from the run forming
    assert set(snap["curves"]) == {"a", "b"}
    json.dumps(snap)  # plain data: what /api/status serves
    log.close()
    kinds = [line["kind"] for line in read_log(tmp_path)]
    assert kinds.count("round") == 3 and kinds.count("sample") == 6 and "state" in kinds

    app = make_app(obs)
    status, headers, body = _call(app, "/")
    assert status.startswith("200") and b"<svg" in body and b"http://" not in body.replace(b"http://www.w3.org", b"")
    status, headers, body = _call(app, "/api/status")
    assert status.startswith("200") and json.loads(body)["run_id"] == "abc123"
    status, headers, body = _call(app, "/metrics")
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    assert families["diloco_worker_deaths"].samples[0].value == 1
    assert {s.labels["worker"] for s in families["diloco_worker_loss"].samples} == {"a"}
    assert _call(app, "/nope")[0].startswith("404")
    assert _call(app, "/", "POST")[0].startswith("405")


def test_the_metrics_log_rotates_within_its_bound_and_reads_back_in_order(tmp_path):
    log = MetricsLog(tmp_path, max_bytes=2000, backups=2)
    for i in range(200):
        log.write("sample", float(i), worker_id="w", step=i, loss=1.0)
    log.close()
    files = log_files(tmp_path)
    assert [p.name for p in files] == ["metrics.jsonl.2", "metrics.jsonl.1", "metrics.jsonl"]
    assert sum(p.stat().st_size for p in files) <= 3 * 2000 + 200
    steps = [line["step"] for line in read_log(tmp_path)]
    assert steps == sorted(steps) and steps[-1] == 199


def test_plot_log_draws_a_png_and_says_what_is_missing(tmp_path):
    with pytest.raises(PlotLogError, match="no metrics log there"):
        plot_log(tmp_path / "empty", tmp_path / "x.png")
    tee = Tee()
    c = make_coordinator(0.0, min_workers=2, observer=tee)
    log = MetricsLog(tmp_path / "logs")
    obs = Observatory(c, version="1", log=log)
    tee.observers.append(obs)
    _run(c, obs)
    log.close()
    proc = subprocess.run([sys.executable, "-m", "diloco", "plot-log", str(tmp_path / "logs"), "--out",
                           str(tmp_path / "run.png")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_http_addresses_and_the_loopback_rule():
    assert parse_host_port("127.0.0.1:0") == ("127.0.0.1", 0)
    assert parse_host_port("[::1]:8080") == ("::1", 8080)
    for bad in ("8080", "host:port", "127.0.0.1:70000"):
        with pytest.raises(ValueError):
            parse_host_port(bad)
    proc = subprocess.run([sys.executable, "-m", "diloco", "server", "--http", "0.0.0.0:0"], cwd=REPO,
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2
    assert "--http 0.0.0.0:0: serving the dashboard beyond loopback needs --auth DIR or --insecure" in proc.stderr


def test_the_status_carries_the_transport_figures_and_version_the_server_gives_it():
    """``diloco server`` hands the coordinator its release and its endpoint's counters; the status
    (admin replies and the dashboard alike) carries them, read when the status is built."""
    from diloco.deploy.admin import render_status

    c = make_coordinator(0.0, min_workers=1)
    assert "transport" not in c.status() and "version" not in c.status()   # no server: none to tell
    calls = []
    c.version = "9.9"
    c.transport_stats = lambda: calls.append(1) or {"peers_lost": len(calls)}
    reply = c.handle("admin", AdminRequest("status"), 1.0)[-1][1]
    assert reply.data["transport"] == {"peers_lost": 1} and reply.data["version"] == "9.9"
    assert "diloco 9.9" in render_status(reply.data, "tcp://127.0.0.1:5555")
    obs = Observatory(c, version="9.9")
    obs.publish(2.0)
    assert obs.snapshot()["transport"] == {"peers_lost": 2} and len(calls) == 2   # once per snapshot


def test_status_renders_what_an_operator_acts_on():
    from diloco.deploy.admin import render_status

    c = make_coordinator(0.0, min_workers=1, heartbeat_timeout_s=1e5)
    joined(c, {"w": torch.zeros(2)}, "a")
    c.handle("a", Heartbeat("a", {"step": 120, "loss": 0.75, "steps_per_s": 3.5}), 4000.0)
    c.run_id = "feedbeef"
    text = render_status({**c.status(), "version": "0.1.0"}, "tcp://127.0.0.1:5555")
    assert "run feedbeef (incarnation 1, diloco 0.1.0): up 1.1 h; last round none yet" in text
    assert "120" in text and "0.7500" in text and "3.5" in text
    assert "config: mode sync" in text
    assert "outer nesterov lr 0.7 momentum 0.8, max update norm off, wire dtype fp32, DyLU off" in text
    from diloco.coordinator import Coordinator, CoordinatorConfig
    from diloco.core import FSMConfig

    dylu = Coordinator(CoordinatorConfig(FSMConfig(min_workers=1), wire_dtype="int8", dylu=True, sync_every=20), 0.0)
    assert "wire dtype int8, DyLU on at H 20" in render_status(dylu.status(), "tcp://127.0.0.1:5555")

