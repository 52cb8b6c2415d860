"""The simulator must catch a broken core: the quorum gate skipped on the membership path.

The fixture ``broken_membership_gate`` (conftest.py) patches the core at test time
only. The swarm must report an I1 (quorum safety) violation and name the seed.
"""

from __future__ import annotations

from diloco.cli import main
from diloco.sim import run_seed

#: The first seeds of the CI swarm: 5 of these 16 trip it (sync and async). Seed 4 (sync,
#: 2 workers, min_workers 2, light faults) at t=125 s: a departure completes round 1 with
#: one live member left.
SEEDS = range(0, 16)


def test_swarm_reports_quorum_safety_violation_with_its_seed(broken_membership_gate):
    caught = {}
    for seed in SEEDS:
        r = run_seed(seed)
        i1 = [v for v in r.violations if v.rule == "I1"]
        if i1:
            caught[seed] = i1[0]
    assert caught, "the simulator did not notice a core that applies rounds below quorum"
    assert {3, 4, 5, 8, 13} <= set(caught), caught
    assert "min_workers" in caught[4].detail or "live members" in caught[4].detail


def test_cli_swarm_exits_1_and_prints_the_failing_seed(broken_membership_gate, capsys):
    code = main(["sim", "--swarm", "3", "--seed", "3"])
    out = capsys.readouterr().out
    assert code == 1
    assert "[I1]" in out
    # seed 3: sync, heavy faults; seed 4: sync, light faults; seed 5: async (a held contribution
    # applied by a membership change below quorum).
    assert out.splitlines()[-1] == "RESULT sim_swarm seeds=3 failed=3 failing_seeds=3,4,5"
    assert "seed=4" in out and "re-run: diloco sim --seed 4" in out


def test_single_run_prints_the_seed_again_on_failure(broken_membership_gate, capsys):
    code = main(["sim", "--seed", "4"])
    out = capsys.readouterr().out.splitlines()
    assert code == 1
    assert out[0] == "seed=4"
    assert any(line.startswith("seed=4 FAILED") and "diloco sim --seed 4" in line for line in out)
    assert out[-1].startswith("RESULT sim seed=4 ") and not out[-1].endswith("violations=0")
