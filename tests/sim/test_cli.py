"""``diloco sim`` on the command line: output, RESULT line, exit codes, bad flags."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from diloco.cli import main

RESULT = re.compile(r"^RESULT sim seed=(\d+) events=(\d+) applied_rounds=(\d+) trace_sha256=([0-9a-f]{64}) "
                    r"violations=(\d+)$")


def test_single_run_summary_and_result_line(tmp_path, capsys):
    trace, plot = tmp_path / "t.jsonl", tmp_path / "t.png"
    code = main(["sim", "--seed", "11", "--workers", "4", "--rounds", "12", "--faults", "light",
                 "--trace", str(trace), "--plot", str(plot)])
    out = capsys.readouterr().out.splitlines()
    assert code == 0
    assert out[0] == "seed=11"
    assert out[1].startswith("config: ") and "workers=4" in out[1] and "faults=light" in out[1]
    for label in ("simulated time", "events", "applied rounds", "contributions", "invariants"):
        assert any(line.strip().startswith(label) for line in out), label
    m = RESULT.match(out[-1])
    assert m and m.group(1) == "11" and m.group(5) == "0"
    assert int(m.group(3)) >= 12
    assert trace.stat().st_size > 0 and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_entry_point_in_a_subprocess():
    proc = subprocess.run([sys.executable, "-m", "diloco", "sim", "--seed", "2", "--faults", "none"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "seed=2" and RESULT.match(lines[-1])


def test_help_explains_itself(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["sim", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for words in ("--replay", "--swarm", "liveness", "RESULT sim seed=N", "exit codes", "seed derives every knob"):
        assert words in out, words


@pytest.mark.parametrize("argv, message", [
    (["--workers", "0"], "--workers must be an integer in 1..100000, got 0"),
    (["--workers", "many"], "--workers must be an integer in 1..100000, got 'many'"),
    (["--faults", "medium"], "argument --faults: invalid choice: 'medium'"),
    (["--seed", "-3"], "--seed must be an integer"),
    (["--plot", "out.jpg"], "--plot 'out.jpg': the file name must end in .png"),
    (["--replay", "x.jsonl", "--seed", "3"], "--replay takes the seed and config from the trace; drop --seed"),
    (["--replay", "/nonexistent/x.jsonl"], "no such file"),
    (["--swarm", "3", "--trace", "t.jsonl"], "--trace and --plot write one run"),
    (["--jobs", "2"], "--jobs only applies to --swarm"),
    (["--trace", "/nonexistent/dir/t.jsonl"], "does not exist"),
    (["--swarm", "0"], "--swarm must be an integer in 1..1000000, got 0"),
])
def test_bad_flags_exit_2_with_a_precise_message(argv, message, capsys):
    try:
        code = main(["sim", *argv])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_swarm_prints_a_line_per_seed_and_a_result(capsys):
    assert main(["sim", "--swarm", "3", "--seed", "20", "--faults", "light"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "seed=20"
    assert [line.split()[1] for line in out if line.startswith("[")] == ["seed=20", "seed=21", "seed=22"]
    assert out[-1] == "RESULT sim_swarm seeds=3 failed=0 failing_seeds=-"
