"""``diloco plan``: the bandwidth model reproduces Streaming DiLoCo's Table 4, and the command behaves.

Table 4 of Streaming DiLoCo (Douillard et al., 2025): H = 100, M = 2, 1B
parameters (24 layers), a step of 0.1 s; the smallest bandwidth (Gbit/s) on
logspace(-1, 3, 50) reaching each compute utilisation. Every cell must be
within one grid step of the paper's. Most data-parallel and DiLoCo cells sit
one step above it: the paper's simulator needs about 1/1.2 of the model's
communication time (see test_the_gap_to_the_paper_is_one_scale_factor and
docs/planner.md).
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from diloco.cli import main
from diloco.planner import command, model
from diloco.planner.model import BANDWIDTH_GRID_GBIT_S as GRID

REPO = Path(__file__).resolve().parents[1]

PAPER = {  # Table 4: 50%, 80%, 90%, 95%, 99% compute utilisation
    "data parallel": (86.8, 152.6, 184.2, 222.3, 569.0),
    "DiLoCo": (1.4, 6.2, 13.3, 23.3, 86.8),
    "Streaming DiLoCo": (0.4, 0.9, 1.7, 2.0, 3.0),
}
#: Table 4's two other 1B Streaming rows, P=8 in bf16: without overlap (tau=0) and with (tau=1).
PAPER_STREAMING_BF16 = {0: (1.4, 5.2, 9.1, 16.0, 28.1), 1: (1.4, 4.3, 6.2, 9.1, 11.0)}
#: Allowed distance in grid steps from the paper's cell.
TOLERANCE = 1
SETTING = dict(params=1e9, step_time_s=0.1, workers=2)
#: The rest of Table 4 (data parallel and DiLoCo): 10B (48 layers, step 0.8 s) and 100B (108 layers, 4.9 s).
PAPER_LARGER = {
    (10e9, 48, 0.8): {"data parallel": (104.8, 222.3, 222.3, 268.3, 471.5), "DiLoCo": (1.7, 7.5, 16.0, 33.9, 104.8)},
    (100e9, 108, 4.9): {"data parallel": (184.2, 323.8, 390.7, 390.7, 471.5),
                        "DiLoCo": (3.0, 11.0, 23.3, 49.4, 184.2)},
}
BF16, INT4 = model.WIRE_DTYPES["bf16"], model.WIRE_DTYPES["int4"]


def _grid_index(bandwidth: float) -> int:
    return int(np.argmin(np.abs(np.log(GRID / bandwidth))))


def _needed(buckets: int = model.DEFAULT_BUCKETS) -> dict[str, list[float | None]]:
    ms = model.methods(100, 8, 1, BF16, INT4)
    return {m.name: model.bandwidth_needed(model.utilisation_curve(m, buckets=buckets, **SETTING)) for m in ms}


NEEDED = _needed()
#: What the model gives for Table 4 (the README and docs/planner.md show this table).
MODEL = {
    "data parallel": (104.8, 184.2, 222.3, 268.3, 686.6),
    "DiLoCo": (1.68, 6.25, 16.0, 28.1, 104.8),
    "Streaming DiLoCo": (0.37, 1.15, 1.68, 2.44, 2.95),
}


@pytest.mark.parametrize("method", list(PAPER))
@pytest.mark.parametrize("column", range(len(model.TARGETS)))
def test_table_4_cell_within_tolerance(method, column):
    target = model.TARGETS[column]
    got, paper = NEEDED[method][column], PAPER[method][column]
    assert got is not None, (method, target)
    steps = _grid_index(got) - _grid_index(paper)
    assert abs(steps) <= TOLERANCE, f"{method} {target:.0%}: model {got:.3g}, paper {paper} ({steps:+d} grid steps)"
    assert got == pytest.approx(MODEL[method][column], rel=0.01)


@pytest.mark.parametrize("tau", sorted(PAPER_STREAMING_BF16))
def test_table_4_bf16_streaming_rows_are_on_or_one_step_above_the_paper(tau):
    streaming = model.methods(100, 8, tau, BF16)[2]
    got = model.bandwidth_needed(model.utilisation_curve(streaming, **SETTING))
    steps = [_grid_index(g) - _grid_index(p) for g, p in zip(got, PAPER_STREAMING_BF16[tau])]
    assert steps == ([1, 1, 1, 0, 0] if tau == 0 else [1, 0, 1, 0, 1]), (got, steps)


def test_the_paper_bandwidth_one_step_below_misses_the_target_in_the_model():
    """The step above is not an off-by-one in bandwidth_needed: at the paper's bandwidth the model is short."""
    for method in ("data parallel", "DiLoCo"):
        m = model.methods(100, 8, 1, BF16)[0 if method == "data parallel" else 1]
        for target, got, paper in zip(model.TARGETS, NEEDED[method], PAPER[method]):
            if _grid_index(got) - _grid_index(paper) != 1:
                continue
            below = model.method_utilisation(m, bandwidth_gbit_s=float(GRID[_grid_index(paper)]), **SETTING)
            assert below < target <= model.method_utilisation(m, bandwidth_gbit_s=got, **SETTING) + 1e-12


def test_the_gap_to_the_paper_is_one_scale_factor():
    """Communication time / 1.2 (here: step x 1.2) reproduces data parallel and DiLoCo of all of Table 4.

    Utilisation depends on bandwidth only through (bits / bandwidth) / step time, so this is one scalar: the
    paper's simulator needs 1/1.2 of this model's communication time per step. The paper does not say where
    such a factor would come from, so the model does not apply it (docs/planner.md).
    """
    ms = model.methods(100, 8, 1, BF16)[:2]
    rows = {(1e9, 24, 0.1): {m: PAPER[m] for m in ("data parallel", "DiLoCo")}, **PAPER_LARGER}
    off = []
    for (params, layers, step), paper in rows.items():
        for m in ms:
            curve = model.utilisation_curve(m, params=params, step_time_s=1.2 * step, workers=2, buckets=layers)
            for got, want in zip(model.bandwidth_needed(curve), paper[m.name]):
                off.append((params, m.name, _grid_index(got) - _grid_index(want)))
    assert [o for o in off if o[2] != 0] == [(10e9, "data parallel", -1)]  # 99%: 390.7 against 471.5


def test_one_bucket_per_layer_is_what_data_parallel_at_99_percent_needs():
    """With 128 buckets the tail left when the backward ends is 1/128 of the gradients: 99% at 268.3 Gbit/s,
    4 steps below the paper's 569.0. One bucket per layer (24) leaves 1/24: 686.6, one step above like the
    other cells (and 569.0 exactly with the 1.2 factor above)."""
    dp = model.methods(100, 8, 1, BF16)[0]
    at_99 = {k: model.bandwidth_needed(model.utilisation_curve(dp, buckets=k, **SETTING), targets=(0.99,))[0]
             for k in (24, 128)}
    assert at_99[128] == pytest.approx(268.3, rel=1e-3)
    assert at_99[24] == pytest.approx(686.6, rel=1e-3)
    assert model.DEFAULT_BUCKETS == command.DEFAULT_BUCKETS == 24


@pytest.mark.parametrize("method", model.methods(100, 8, 1, BF16, INT4), ids=lambda m: m.name)
def test_utilisation_rises_with_bandwidth_and_reaches_one(method):
    curve = model.utilisation_curve(method, **SETTING)
    assert np.all(np.diff(curve) >= -1e-12)
    assert np.all((curve > 0) & (curve <= 1))
    huge = model.method_utilisation(method, bandwidth_gbit_s=1e9, **SETTING)
    assert huge == pytest.approx(1.0, abs=1e-6)


def test_diloco_needs_less_bandwidth_than_data_parallel_and_streaming_less_than_diloco():
    for dp, di, st in zip(NEEDED["data parallel"], NEEDED["DiLoCo"], NEEDED["Streaming DiLoCo"]):
        assert st <= di < dp
    same_wire = model.methods(100, 8, 1, BF16)
    for b in (1.0, 10.0, 100.0):
        dp, di, st = (model.method_utilisation(m, bandwidth_gbit_s=b, **SETTING) for m in same_wire)
        assert dp < di <= st


def test_one_worker_sends_nothing_and_more_workers_send_more():
    assert model.sync_bits(1e9, 2, 1) == 0
    assert model.utilisation(bandwidth_gbit_s=0.1, bytes_per_param=4, workers=1, params=1e9, step_time_s=0.1) == 1
    assert model.sync_bits(1e9, 2, 2) == 16e9
    assert model.sync_bits(1e9, 2, 8) == pytest.approx(28e9)


def test_hub_puts_k_copies_in_then_k_out_on_the_coordinator_link_and_collective_under_two_on_each_worker_link():
    for k in (1, 2, 4, 16, 64):
        assert model.link_copies(k, "hub") == 2 * k
        assert model.link_copies(k, "collective") == pytest.approx(2 * (1 - 1 / k))
        assert model.sync_bits(1e9, 2, k, "hub") == pytest.approx(2 * k * 16e9)
    assert model.sync_bits(1e9, 2, 2) == model.sync_bits(1e9, 2, 2, "collective")


@pytest.mark.parametrize("method", model.methods(100, 8, 1, BF16), ids=lambda m: m.name)
def test_hub_coordinator_load_grows_linearly_with_workers_and_collective_stays_about_constant(method):
    """k workers through a hub at k x b Gbit/s do exactly as well as one at b; a ring barely notices k."""
    common = dict(params=1e9, step_time_s=0.1, buckets=model.DEFAULT_BUCKETS)
    for b in (2.0, 20.0, 200.0):
        one = model.method_utilisation(method, workers=1, bandwidth_gbit_s=b, data_plane="hub", **common)
        for k in (4, 16, 64):
            at_k = model.method_utilisation(method, workers=k, bandwidth_gbit_s=k * b, data_plane="hub", **common)
            assert at_k == pytest.approx(one, rel=1e-9)
            same_b = model.method_utilisation(method, workers=k, bandwidth_gbit_s=b, data_plane="hub", **common)
            assert same_b <= one
        ring = [model.method_utilisation(method, workers=k, bandwidth_gbit_s=b, **common) for k in (4, 16, 64)]
        hub = [model.method_utilisation(method, workers=k, bandwidth_gbit_s=b, data_plane="hub", **common)
               for k in (4, 16, 64)]
        assert ring[0] >= ring[1] >= ring[2] and all(r >= h for r, h in zip(ring, hub))
        # a ring's load goes from 1.5 copies (k=4) to 1.97 (k=64): at 1.5/1.97 of the bandwidth, k=4 does
        # no better than k=64 does at the full bandwidth
        assert model.method_utilisation(method, workers=4, bandwidth_gbit_s=b * 1.5 / (2 - 2 / 64),
                                        **common) == pytest.approx(ring[2], rel=1e-9)


def test_data_planes_and_their_links_match_between_command_and_model():
    assert command.DATA_PLANES == model.DATA_PLANES
    assert command.LINK_OF == model.LINK_OF


@pytest.mark.parametrize("plane, link", [("collective", "each worker's link"), ("hub", "the coordinator's link")])
def test_plan_says_which_link_the_bandwidth_is_of(plane, link, capsys):
    argv = ["plan", "--bandwidth", "10", "--sweep", "--workers", "4"]
    assert main(argv + ([] if plane == "collective" else ["--data-plane", plane])) == 0
    out = capsys.readouterr().out
    assert f"data plane: {plane}" in out
    assert f"compute utilisation at 10 Gbit/s on {link}:" in out
    assert f"bandwidth (Gbit/s) of {link} needed" in out
    gbit = "128" if plane == "hub" else "24"  # 16 Gbit x 4 copies in, then 4 out, or x 2(1 - 1/4) = 1.5
    assert f"  DiLoCo                       2 {gbit:>13} " in out


def test_bandwidth_for_is_the_threshold_the_grid_rounds_up():
    """DiLoCo at 90%: the stall may be HT/9 = 1.111 s, and the transfer starts (2T/3)(1 - 1/24) before the step
    ends, so it may take 1.175 s: 16 Gbit x copies / 1.175 s."""
    diloco = model.methods(100, 8, 1, BF16)[1]
    for plane, k, copies in (("collective", 2, 1), ("collective", 4, 1.5), ("hub", 4, 8), ("hub", 1, 2)):
        got = model.bandwidth_for(diloco, 0.9, params=1e9, step_time_s=0.1, workers=k, data_plane=plane)
        assert got == pytest.approx(16 * copies / 1.175, rel=1e-5)
    for m in model.methods(100, 8, 1, BF16, INT4):
        for target, cell in zip(model.TARGETS[:4], NEEDED[m.name]):
            exact = model.bandwidth_for(m, target, **SETTING)
            assert cell == min(b for b in GRID if b >= exact * (1 - 1e-6))
    assert model.bandwidth_for(diloco, 0.9, params=1e9, step_time_s=0.1, workers=1) == 0.0  # a ring of one
    with pytest.raises(model.PlanError, match="target"):
        model.bandwidth_for(diloco, 1.0, **SETTING)


def test_plane_table_hub_grows_with_workers_and_collective_does_not():
    ms = model.methods(100, 8, 1, BF16)
    table = model.plane_table(ms, step_time_s=0.1)
    assert len(table) == 2 * 3 * 2 * 3
    for name in ("data parallel", "DiLoCo", "Streaming DiLoCo"):
        for n in (1e9, 10e9):
            hub = [table[(name, n, "hub", k)] for k in (4, 16, 64)]
            ring = [table[(name, n, "collective", k)] for k in (4, 16, 64)]
            assert hub[1] / hub[0] == pytest.approx(4, rel=1e-5) and hub[2] / hub[0] == pytest.approx(16, rel=1e-5)
            assert ring[2] / ring[0] == pytest.approx((2 - 2 / 64) / 1.5, rel=1e-5)  # 1.97 copies against 1.5
        assert table[(name, 10e9, "hub", 4)] == pytest.approx(10 * table[(name, 1e9, "hub", 4)], rel=1e-5)
    diloco_1b = [table[("DiLoCo", 1e9, plane, k)] for plane in ("hub", "collective") for k in (4, 16, 64)]
    assert diloco_1b == pytest.approx([16 * c / 1.175 for c in (8, 32, 128, 1.5, 1.875, 2 - 2 / 64)], rel=1e-5)


def test_plan_plane_table_prints_the_known_rows(capsys):
    assert main(["plan", "--plane-table"]) == 0
    out = capsys.readouterr().out
    assert "bandwidth (Gbit/s) for 90% compute utilisation, by data plane and workers k" in out
    assert "(step 0.1 s, H=100, P=8, tau=1, 2 bytes/param on the wire, 24 buckets, full-duplex links)" in out
    assert "hub: the coordinator's link  collective: each worker's link" in out
    assert "  1B      DiLoCo                    109      436     1743       20.4     25.5     26.8" in out
    assert "  10B     DiLoCo                   1089     4357    17430        204      255      268" in out
    assert "plan: " not in out  # the table alone unless --bandwidth, --sweep or --plot asks for more


def test_data_parallel_below_the_knee_is_link_bound():
    """16 Gbit a step at 80 Gbit/s: 0.2 s on the link from the first bucket, and the forward waits for it."""
    u = model.utilisation(bandwidth_gbit_s=80, bytes_per_param=2, **SETTING)
    first_bucket = 0.1 / 3 + (0.2 / 3) / model.DEFAULT_BUCKETS
    assert u == pytest.approx(0.1 / (first_bucket + 0.2))


def test_the_measured_round_is_the_periodic_regime(monkeypatch):
    kw = dict(bytes_per_param=0.5, inner_steps=100, fragments=8, **SETTING)
    cases = [(tau, b) for tau in (0, 1, 5, 150) for b in (0.1, 0.5, 2.0, 20.0)]
    short = [model.utilisation(overlap=tau, bandwidth_gbit_s=b, **kw) for tau, b in cases]
    monkeypatch.setattr(model, "WARMUP_ROUNDS", 8)
    longer = [model.utilisation(overlap=tau, bandwidth_gbit_s=b, **kw) for tau, b in cases]
    assert short == pytest.approx(longer, rel=1e-9)


def test_fragments_are_released_every_h_over_p_steps_ending_with_the_round():
    assert model.release_steps(100, 8) == [12, 24, 37, 49, 62, 74, 87, 99]
    assert model.release_steps(100, 1) == [99]
    assert model.release_steps(4, 4) == [0, 1, 2, 3]


def test_wire_formats():
    assert model.parse_wire("bf16") == 2 and model.parse_wire("FP32") == 4
    assert model.parse_wire("int8") == 1 and model.parse_wire("int4") == 0.5 and model.parse_wire("0.75") == 0.75
    names = [part.split("=")[0] for part in command.WIRE_NAMES.split(", ")]
    assert names == list(model.WIRE_DTYPES)
    assert all(model.WIRE_DTYPES[n] == float(part.split("=")[1])
               for n, part in zip(names, command.WIRE_NAMES.split(", ")))


@pytest.mark.parametrize("text", ["fp7", "", "-2", "0", "nan", "inf"])
def test_bad_wire_formats_raise(text):
    with pytest.raises(model.PlanError):
        model.parse_wire(text)


@pytest.mark.parametrize("bad, match", [
    (dict(params=0), "params"),
    (dict(params=float("nan")), "params"),
    (dict(step_time_s=-1), "step_time_s"),
    (dict(workers=0), "workers"),
    (dict(workers=2.5), "workers"),
    (dict(bandwidth_gbit_s=0), "bandwidth_gbit_s"),
    (dict(bytes_per_param=0), "bytes_per_param"),
    (dict(inner_steps=0), "inner_steps"),
    (dict(fragments=0), "fragments"),
    (dict(fragments=101), "at most inner_steps"),
    (dict(overlap=-1), "overlap"),
    (dict(buckets=0), "buckets"),
    (dict(overlap=True), "overlap"),
    (dict(data_plane="ring"), "data_plane must be one of collective, hub"),
])
def test_bad_inputs_raise(bad, match):
    kw = dict(params=1e9, step_time_s=0.1, workers=2, bandwidth_gbit_s=10, bytes_per_param=2,
              inner_steps=100, fragments=8, overlap=1, buckets=128)
    kw.update(bad)
    with pytest.raises(model.PlanError, match=match):
        model.utilisation(**kw)


def test_bandwidth_needed_says_none_when_the_grid_never_reaches_the_target():
    assert model.bandwidth_needed([0.1, 0.6, 0.95], [1, 2, 3], (0.5, 0.9, 0.99)) == [2.0, 3.0, None]
    with pytest.raises(model.PlanError):
        model.bandwidth_needed([0.1], [1, 2])


def test_plan_sweep_prints_the_table_and_writes_the_plot(tmp_path, capsys):
    png = tmp_path / "plan.png"
    rc = main(["plan", "--params", "1B", "--workers", "2", "--inner-steps", "100", "--fragments", "8",
               "--overlap", "1", "--wire", "bf16", "--streaming-wire", "int4", "--bandwidth", "10",
               "--sweep", "--plot", str(png)])
    out = capsys.readouterr().out
    assert rc == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "data parallel         104.8    184.2    222.3    268.3    686.6" in out
    assert "DiLoCo                 1.68     6.25     16.0     28.1    104.8" in out
    assert "Streaming DiLoCo       0.37     1.15     1.68     2.44     2.95" in out
    assert "DiLoCo               86.7%" in out


def test_plan_prints_a_cell_the_grid_cannot_reach(capsys):
    assert main(["plan", "--params", "100B", "--sweep"]) == 0
    assert "> 1000" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["plan"], "nothing to do"),
    (["plan", "--sweep", "--fragments", "200"], "--fragments 200 is more than --inner-steps 100"),
    (["plan", "--sweep", "--params", "0"], "--params must be a parameter count"),
    (["plan", "--sweep", "--params", "3X"], "--params must be a parameter count"),
    (["plan", "--sweep", "--wire", "fp7"], "wire format 'fp7' is neither a dtype"),
    (["plan", "--bandwidth", "-3"], "--bandwidth must be a positive number"),
    (["plan", "--sweep", "--step-time", "0"], "--step-time must be a positive number"),
    (["plan", "--sweep", "--workers", "0"], "--workers must be an integer >= 1"),
    (["plan", "--sweep", "--overlap", "x"], "--overlap must be an integer >= 0"),
    (["plan", "--sweep", "--plot", "plan.jpg"], "must end in .png"),
    (["plan", "--sweep", "--plot", "/no/such/dir/plan.png"], "does not exist"),
    (["plan", "--sweep", "--data-plane", "ring"], "argument --data-plane: invalid choice: 'ring'"),
    (["plan", "--sweep", "--data-plane"], "argument --data-plane: expected one argument"),
])
def test_bad_usage_exits_2_with_a_precise_error(argv, message, capsys):
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse
        rc = exc.code
    assert rc == 2
    assert message in capsys.readouterr().err


def test_plan_help_starts_without_numpy_or_torch():
    code = ("import runpy, sys\n"
            "sys.argv = ['diloco', 'plan', '--help']\n"
            "try:\n"
            "    runpy.run_module('diloco', run_name='__main__', alter_sys=True)\n"
            "except SystemExit:\n"
            "    pass\n"
            "heavy = [m for m in ('torch', 'numpy', 'matplotlib') if m in sys.modules]\n"
            "assert not heavy, heavy\n"
            "print('LIGHT_OK')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "LIGHT_OK" in proc.stdout, proc.stdout + proc.stderr
    assert "usage: diloco plan" in proc.stdout
    assert "24 buckets" in proc.stdout
    assert "--data-plane {collective,hub}" in proc.stdout
    assert "each worker's link" in proc.stdout and "coordinator's link" in proc.stdout


def test_a_sparse_wire_gathers_every_payload_whole_on_both_planes():
    bpp, gathered = model.parse_wire_format("sparse")
    assert gathered and bpp == 2 * 64 / 4096 + 4 / 4096  # 64 two-byte entries and a scale per 4096
    assert model.parse_wire_format("int4") == (0.5, False)
    # Hub: M payloads in, then M Results of M payloads each; collective: an all-gather, M - 1 each way.
    assert model.link_copies(4, "hub", gathered=True) == 20
    assert model.link_copies(4, "collective", gathered=True) == 3
    assert model.sync_bits(1e6, bpp, 4, "hub", True) == 1e6 * bpp * 8 * 20
    dense, sparse = model.methods(100, 1, 0, 4.0)[1], model.methods(100, 1, 0, bpp, gathered=True)[1]
    # The link alone (a CPU so fast its work is nothing): 1/124 of fp32's bytes, gathered.
    common = dict(params=1e9, step_time_s=0.1, workers=4, data_plane="collective", cpu_rate=1e30, entry_rate=1e30)
    assert model.bandwidth_for(sparse, 0.9, **common) < model.bandwidth_for(dense, 0.9, **common) / 40


def test_a_sparse_sync_costs_its_cpu_work_beside_its_link_time():
    bpp = model.WIRE_DTYPES["sparse"]
    # N / cpu_rate for the passes over every param, M x N x 64/4096 / entry_rate for the payloads' entries.
    assert model.sparse_cpu_s(1e7, 4, cpu_rate=1e8, entry_rate=1e7) == pytest.approx(0.1 + 4 * 1e7 / 64 / 1e7)
    assert model.sparse_cpu_s(1e7, 4) == pytest.approx(1e7 / model.DEFAULT_CPU_RATE
                                                        + 4 * 1e7 * 64 / 4096 / model.DEFAULT_ENTRY_RATE)
    link = model.sync_bits(1e7, bpp, 4, "hub", True) / 1e8
    assert model.sync_s(1e7, bpp, 4, 1e8, "hub", True, 1e8, 1e7) == pytest.approx(link + 0.1 + 0.0625)
    # A dense wire's sync is its link time alone.
    assert model.sync_s(1e7, 0.5, 4, 1e8, "hub") == model.sync_bits(1e7, 0.5, 4, "hub") / 1e8
    # The term is in the utilisation: a slower CPU lowers it at the same bandwidth, and no bandwidth
    # makes up for a CPU whose work alone outlasts the round's compute.
    ms = model.methods(5, 1, 0, bpp, gathered=True)
    common = dict(params=1e7, step_time_s=0.02, workers=4, bandwidth_gbit_s=0.1, data_plane="hub")
    fast = model.method_utilisation(ms[1], **common, cpu_rate=1e30, entry_rate=1e30)
    slow = model.method_utilisation(ms[1], **common, cpu_rate=1e8, entry_rate=1e7)
    assert slow < fast
    # DiLoCo's round: 5 steps of 0.02 s, its sync 0.515 s on the link and 0.1625 s of CPU work.
    assert 0.1 / slow == pytest.approx(0.1 + link + 0.1625 - 2 / 3 * 0.02 * (1 - 1 / 24), rel=1e-6)
    with pytest.raises(model.PlanError, match="at any bandwidth"):
        model.bandwidth_for(ms[1], 0.9, params=1e7, step_time_s=0.02, workers=4, cpu_rate=1e7)
    table = model.plane_table(ms, step_time_s=0.1, params=(1e9,), workers=(4,), cpu_rate=1e6)
    assert table[("DiLoCo", 1e9, "hub", 4)] == math.inf
    assert command.DEFAULT_CPU_RATE == model.DEFAULT_CPU_RATE and command.DEFAULT_ENTRY_RATE == model.DEFAULT_ENTRY_RATE


def test_plan_wire_sparse_prints_its_cpu_work_and_takes_the_rates(capsys):
    from diloco.cli import main

    argv = ["plan", "--wire", "sparse", "--params", "10M", "--workers", "4", "--data-plane", "hub",
            "--inner-steps", "5", "--fragments", "1", "--step-time", "0.02", "--bandwidth", "0.1"]
    assert main(argv) == 0
    default = capsys.readouterr().out
    assert "sparse CPU work per sync and worker: 0.1747 s" in default
    assert "6.5e+07 params/s (--cpu-rate)" in default and "3e+07 entries/s (--entry-rate)" in default
    assert main(argv + ["--cpu-rate", "1e8", "--entry-rate", "1e7"]) == 0
    given = capsys.readouterr().out
    assert "sparse CPU work per sync and worker: 0.1625 s" in given
    util = [line.split()[-1] for line in given.splitlines() if line.strip().startswith("DiLoCo ")]
    assert util[-1] == "13.1%"  # 0.1 s of compute in 0.1 + 0.515 + 0.1625 s, less the sync's overlap
    assert main(["plan", "--wire", "int4", "--bandwidth", "0.1"]) == 0
    assert "sparse CPU work" not in capsys.readouterr().out


def test_plan_wire_sparse_says_it_gathers(capsys):
    from diloco.cli import main

    assert main(["plan", "--wire", "sparse", "--bandwidth", "0.1", "--workers", "4", "--data-plane", "hub"]) == 0
    out = capsys.readouterr().out
    assert "a sparse sync gathers every worker's payload instead: 20 copies of one" in out
    assert "0.0322266" in out
