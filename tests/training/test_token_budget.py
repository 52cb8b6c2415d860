"""The token budget (SPEC.md section 12, "Token budget"; ``diloco server --token-budget``, ``set-token-budget``).

Applied rounds count the tokens their contributions trained on; at the
budget the run stops as ``shutdown --save`` does. The count and the budget
survive a checkpoint and a journal replay, ``set-token-budget`` changes the
budget at run time, and ``status`` shows the progress with an ETA.
"""

from __future__ import annotations

import io

import pytest
import torch

from diloco import cli
from diloco.coordinator import Coordinator, CoordinatorConfig
from diloco.coordinator.budget import TokenBudget
from diloco.coordinator.checkpoint import load_coordinator, save_coordinator
from diloco.core import ConfigError, FSMConfig
from diloco.deploy.admin import render_status
from diloco.deploy.events import EventPrinter
from diloco.testing import join_message
from diloco.wire.messages import AdminRequest, Submit


def coordinator(budget: int | None) -> Coordinator:
    c = Coordinator(CoordinatorConfig(FSMConfig(min_workers=1), token_budget=budget), 0.0)
    c.handle("w1", join_message("w1", {"w": torch.zeros(3)}), 0.0)
    return c


def submit(c: Coordinator, tokens: int | None, now: float) -> list:
    rid = c.fsm.open_round_ids()[0]
    return c.handle("w1", Submit("w1", 0, rid, {"w": torch.full((3,), 0.01)}, tokens=tokens), now)


def admin(c: Coordinator, command: str, now: float = 50.0, **args):
    return c.handle("ops", AdminRequest(command, args), now)[-1][1]


def test_the_run_stops_as_shutdown_save_does_once_applied_rounds_reach_the_budget():
    c = coordinator(25)
    for i in range(2):
        submit(c, 10, 1.0 + i)
    assert not c.stopped and c.status()["tokens"]["trained"] == 20
    submit(c, 10, 3.0)
    assert c.stopped and c.stop_kind.value == "save_and_stop"
    tokens = c.status()["tokens"]
    assert (tokens["trained"], tokens["budget"], tokens["left"], tokens["fraction"]) == (30, 25, 0, 1.0)
    # A contribution that does not say its tokens counts none.
    quiet = coordinator(25)
    for i in range(5):
        submit(quiet, None, 1.0 + i)
    assert not quiet.stopped and quiet.status()["tokens"]["trained"] == 0


def test_the_status_shows_the_rate_and_an_eta_once_two_rounds_applied():
    c = coordinator(1000)
    submit(c, 10, 1.0)
    assert c.status()["tokens"]["eta_s"] is None  # one point is no rate
    submit(c, 10, 3.0)  # 10 tokens in 2 s: 5 tokens/s, 980 left
    tokens = c.status()["tokens"]
    assert tokens["tokens_per_s"] == 5.0 and tokens["eta_s"] == 196.0
    page = render_status(c.status())
    assert "token budget: 20 of 1,000 tokens trained (2.0 %); ETA 3.3 min at 5.0 tokens/s" in page


def test_set_token_budget_changes_it_at_run_time_stops_at_once_below_the_count_and_refuses_nonsense():
    c = coordinator(None)
    for i in range(3):
        submit(c, 10, 1.0 + i)
    reply = admin(c, "set_token_budget", budget="many")
    assert not reply.ok and "expected an integer >= 1" in reply.error and not c.stopped
    assert admin(c, "set_token_budget", budget=100).ok and c.budget.budget == 100 and not c.stopped
    assert admin(c, "set_token_budget", budget=None).ok and c.budget.budget is None
    assert admin(c, "set_token_budget", budget=30).ok
    assert c.stopped and c.stop_kind.value == "save_and_stop"


def test_the_count_and_the_budget_survive_a_checkpoint(tmp_path):
    c = coordinator(500)
    for i in range(4):
        submit(c, 7, 1.0 + i)
    save_coordinator(c, tmp_path)
    back = load_coordinator(tmp_path, 10.0)
    assert (back.budget.trained, back.budget.budget) == (28, 500)
    with pytest.raises(ValueError, match="trained"):
        TokenBudget.from_dict({"trained": -1})
    with pytest.raises(ConfigError, match="token_budget"):
        CoordinatorConfig(FSMConfig(min_workers=1), token_budget=0)


def test_the_server_and_the_cli_take_the_budget(capsys):
    from diloco.deploy.server import ServerSettings, build_config

    assert build_config(ServerSettings(min_workers=1, token_budget=10**9)).token_budget == 10**9
    with pytest.raises(SystemExit) as info:
        cli.main(["set-token-budget", "0"])
    assert info.value.code == 2 and "0 is not >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["set-token-budget", "abc"])
    assert "'abc' is not an integer" in capsys.readouterr().err
    out = io.StringIO()
    EventPrinter(out)("budget", 5.0, {"trained": 1200, "budget": 1000})
    assert "budget   reached: 1,200 tokens trained of 1,000 (--token-budget): stopping as shutdown --save does" \
        in out.getvalue()
