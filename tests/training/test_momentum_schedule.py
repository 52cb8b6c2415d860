"""Outer-momentum schedules (Pier): a warm-up and a decay of the outer momentum, per outer step of a fragment.

``OuterConfig.momentum_warmup`` / ``momentum_decay_*`` (``diloco server
--outer-momentum-warmup ROUNDS --outer-momentum-decay START:ROUNDS[:FINAL]``).
The step count lives in the optimizer's param group, so a checkpoint, a resume
and the undo of a refused step carry it with the momentum buffers.
"""

from __future__ import annotations

import io

import pytest
import torch

from diloco.coordinator import CoordinatorConfig
from diloco.coordinator.checkpoint import load_coordinator, save_coordinator
from diloco.core import FSMConfig
from diloco.deploy.commands import momentum_decay
from diloco.outer import OptimizerBackup, OuterConfig, OuterConfigError, build_outer_optimizer
from diloco.testing import join_message, make_coordinator
from diloco.wire.messages import Submit

SCHEDULE = OuterConfig(momentum=0.8, momentum_warmup=4, momentum_decay_start=10, momentum_decay_rounds=5,
                       momentum_final=0.4)


def test_the_schedule_rises_over_the_warm_up_holds_and_falls_to_its_final_value():
    got = [SCHEDULE.momentum_at(s) for s in range(18)]
    assert got[:4] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert got[4:10] == [0.8] * 6
    assert got[10:15] == pytest.approx([0.72, 0.64, 0.56, 0.48, 0.4])
    assert got[15:] == [0.4] * 3
    # Without a schedule the momentum is the constant it always was.
    assert {OuterConfig(momentum=0.9).momentum_at(s) for s in range(50)} == {0.9}
    # Where the two overlap, the smaller wins: a decay that starts inside the warm-up.
    both = OuterConfig(momentum=0.8, momentum_warmup=10, momentum_decay_start=0, momentum_decay_rounds=2)
    assert both.momentum_at(0) == pytest.approx(min(0.08, 0.4)) and both.momentum_at(5) == 0.0


def hand_driven(grads: list[torch.Tensor], config: OuterConfig) -> torch.Tensor:
    """Nesterov SGD whose momentum is set by hand before each step: what the schedule must do."""
    p = torch.zeros(4)
    opt = torch.optim.SGD([p], lr=config.lr, momentum=config.momentum, nesterov=True)
    for step, g in enumerate(grads):
        opt.param_groups[0]["momentum"] = config.momentum_at(step)
        p.grad = g.clone()
        opt.step()
    return p


def scheduled(grads: list[torch.Tensor], config: OuterConfig, p: torch.Tensor | None = None, opt=None):
    p = torch.zeros(4) if p is None else p
    opt = opt or build_outer_optimizer([p], config, 1)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p, opt


def grads(n: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(4, generator=gen) for _ in range(n)]


def test_the_optimizer_takes_each_steps_scheduled_momentum_exactly():
    g = grads(16)
    p, opt = scheduled(g, SCHEDULE)
    assert torch.equal(p, hand_driven(g, SCHEDULE))
    assert opt.param_groups[0]["outer_steps"] == 16
    # And a schedule changes the trajectory (the test above would pass for a no-op otherwise).
    assert not torch.equal(p, scheduled(g, OuterConfig(momentum=0.8))[0])


def test_the_step_count_travels_with_the_state_dict_so_a_resumed_optimizer_goes_on_where_it_was():
    g = grads(14)
    straight, _ = scheduled(g, SCHEDULE)
    p, opt = scheduled(g[:6], SCHEDULE)
    state = opt.state_dict()
    assert state["param_groups"][0]["outer_steps"] == 6
    q = p.clone()
    fresh = build_outer_optimizer([q], SCHEDULE, 1)
    fresh.load_state_dict(state)
    resumed, _ = scheduled(g[6:], SCHEDULE, q, fresh)
    assert torch.equal(resumed, straight)


def test_an_undone_step_takes_its_step_count_back():
    g = grads(8)
    straight, _ = scheduled(g, SCHEDULE)
    p, opt = scheduled(g[:3], SCHEDULE)
    backup, keep = OptimizerBackup(), p.clone()
    backup.take(opt)
    p.grad = torch.full((4,), 1e3)
    opt.step()  # a step refused after the fact: undone, as the coordinator does for a non-finite one
    backup.restore(opt)
    p.copy_(keep)
    assert opt.param_groups[0]["outer_steps"] == 3
    assert torch.equal(scheduled(g[3:], SCHEDULE, p, opt)[0], straight)


def test_bad_schedules_are_refused_with_what_was_expected():
    for kwargs, words in ((dict(momentum_warmup=-1), "momentum_warmup=-1"),
                          (dict(momentum_decay_rounds=2.5), "momentum_decay_rounds=2.5"),
                          (dict(momentum_final=1.0), "momentum_final=1.0"),
                          (dict(name="adam", momentum_warmup=3), "needs a momentum optimizer")):
        with pytest.raises(OuterConfigError, match=words):
            OuterConfig(**kwargs)
    for text in ("5", "a:b", "1:2:3:4", "-1:5", "3:4:1.5"):
        with pytest.raises(Exception, match="START:ROUNDS|must be >= 0"):
            momentum_decay(text)
    assert momentum_decay("100:50") == (100, 50, 0.0) and momentum_decay("100:50:0.5") == (100, 50, 0.5)


def test_a_run_without_a_schedule_says_what_it_always_said_and_one_with_a_schedule_saves_it():
    assert set(OuterConfig().to_dict()) == {"name", "lr", "momentum", "delay"}
    cfg = CoordinatorConfig(FSMConfig(min_workers=1), outer=SCHEDULE)
    back = CoordinatorConfig.from_dict(cfg.to_dict())
    assert back.outer == SCHEDULE
    # Async mode turns the default nesterov into delayed Nesterov: the schedule stays.
    async_cfg = CoordinatorConfig(FSMConfig(min_workers=1, mode="async"), outer=SCHEDULE)
    assert async_cfg.outer.name == "delayed_nesterov" and async_cfg.outer.momentum_warmup == 4


def run_rounds(c, n: int) -> None:
    params = {"w": torch.zeros(3)}
    if not c.fsm.is_member("w1"):
        c.handle("p", join_message("w1", params), 1.0)
    for _ in range(n):
        rid = c.fsm.open_round_ids()[0]
        c.handle("p", Submit("w1", 0, rid, {"w": torch.full((3,), 0.1 * (rid + 1))}), 2.0 + rid)


def test_a_coordinator_checkpoint_keeps_the_schedule_and_its_place_in_it(tmp_path):
    straight = make_coordinator(min_workers=1, outer=SCHEDULE)
    run_rounds(straight, 12)
    c = make_coordinator(min_workers=1, outer=SCHEDULE)
    run_rounds(c, 7)
    save_coordinator(c, tmp_path)
    back = load_coordinator(tmp_path, 50.0)
    assert back.config.outer == SCHEDULE
    assert back.optimizer_states()[0]["param_groups"][0]["outer_steps"] == 7
    run_rounds(back, 5)
    assert torch.equal(back.store.params["w"], straight.store.params["w"])


def test_the_server_flags_set_the_schedule_and_a_resume_may_change_it(tmp_path):
    from diloco.deploy.server import EventPrinter, ServerSettings, build_config
    from diloco.deploy.server import make_coordinator as server_coordinator

    cfg = build_config(ServerSettings(min_workers=1, outer_momentum_warmup=20, outer_momentum_decay=(100, 50, 0.5)))
    assert (cfg.outer.momentum_warmup, cfg.outer.momentum_decay_start, cfg.outer.momentum_decay_rounds,
            cfg.outer.momentum_final) == (20, 100, 50, 0.5)
    c = make_coordinator(min_workers=1, outer=cfg.outer)
    run_rounds(c, 2)
    save_coordinator(c, tmp_path)
    out = io.StringIO()
    resumed = server_coordinator(ServerSettings(resume=str(tmp_path), checkpoint_dir=str(tmp_path),
                                                outer_momentum_decay=(0, 0, 0.0)), EventPrinter(out), 10.0, out=out)
    assert resumed.config.outer.momentum_warmup == 20 and resumed.config.outer.momentum_decay_rounds == 0
