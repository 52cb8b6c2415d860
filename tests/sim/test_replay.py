"""--replay re-runs a trace's seed and config and stops at the first record that differs."""

from __future__ import annotations

import json

import pytest

from diloco.cli import main


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("replay") / "run.jsonl"
    assert main(["sim", "--seed", "11", "--workers", "3", "--faults", "light", "--trace", str(path)]) == 0
    return path


def test_replay_of_an_untouched_trace_matches(trace, capsys):
    capsys.readouterr()
    assert main(["sim", "--replay", str(trace)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "seed=11"
    assert any(line.startswith("replay: identical") for line in out)
    assert out[-1].startswith("RESULT sim seed=11 ") and out[-1].endswith("violations=0")


def test_replay_detects_a_tampered_record(trace, tmp_path, capsys):
    lines = trace.read_text().splitlines()
    index = next(i for i, line in enumerate(lines) if '"what":"apply"' in line and i > len(lines) // 2)
    rec = json.loads(lines[index])
    rec["contributors"] = rec["contributors"][:-1]
    lines[index] = json.dumps(rec, separators=(",", ":"))
    tampered = tmp_path / "tampered.jsonl"
    tampered.write_text("\n".join(lines) + "\n")
    capsys.readouterr()
    assert main(["sim", "--replay", str(tampered)]) == 1
    out = capsys.readouterr().out
    assert f"the replay diverges at record {index + 1}" in out
    assert "REPLAY DIVERGED" in out


def test_replay_detects_a_truncated_trace(trace, tmp_path, capsys):
    lines = trace.read_text().splitlines()
    short = tmp_path / "short.jsonl"
    short.write_text("\n".join(lines[:100]) + "\n")
    capsys.readouterr()
    assert main(["sim", "--replay", str(short)]) == 1
    assert "the replay diverges at record 101" in capsys.readouterr().out


def test_replay_of_a_file_that_is_not_a_trace_is_bad_input(tmp_path, capsys):
    junk = tmp_path / "junk.jsonl"
    junk.write_text('{"hello": 1}\n')
    assert main(["sim", "--replay", str(junk)]) == 2
    assert "not a diloco.sim.trace config record" in capsys.readouterr().err
