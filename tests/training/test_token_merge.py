"""Token-weighted merging (SPEC.md section 12, "Token-weighted merging"; ``diloco server --merge``).

A Submit says how many tokens it trained on; a token-weighted round's step
is the tokens-weighted mean of its contributions. Uniform runs keep their old
bits; a token-weighted run refuses a Submit that does not say its tokens;
the journal replays weighted rounds bit for bit; workers send what they
trained on since their last Submit of the fragment.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from diloco.coordinator import Coordinator, CoordinatorConfig
from diloco.coordinator.checkpoint import load_coordinator
from diloco.core import ConfigError, FSMConfig
from diloco.deploy.server import ServerSettings, build_config
from diloco.outer import OuterConfig
from diloco.testing import join_message
from diloco.wire.codec import decode, encode
from diloco.wire.messages import Error, ErrorCode, Submit
from training_harness import Run, in_thread

PARAMS = {"w": torch.zeros(4)}


def coordinator(merge: str, **fsm) -> Coordinator:
    config = CoordinatorConfig(FSMConfig(min_workers=2, **fsm), outer=OuterConfig("sgd", 1.0, 0.0), merge=merge)
    c = Coordinator(config, 0.0)
    for wid in ("w1", "w2"):
        c.handle(wid, join_message(wid, PARAMS), 0.0)
    return c


def one_round(c: Coordinator, tokens1, tokens2) -> list:
    out = c.handle("w1", Submit("w1", 0, 0, {"w": torch.ones(4)}, tokens=tokens1), 1.0)
    out += c.handle("w2", Submit("w2", 0, 0, {"w": torch.full((4,), 3.0)}, tokens=tokens2), 1.0)
    return out


def test_a_token_weighted_round_is_the_tokens_weighted_mean_and_a_uniform_one_the_plain_mean():
    weighted = coordinator("tokens")
    one_round(weighted, 30, 10)
    # (30 x 1 + 10 x 3) / 40 = 1.5, stepped with SGD lr 1: params -1.5.
    assert torch.allclose(weighted.store.params["w"], torch.full((4,), -1.5))
    uniform = coordinator("uniform")
    one_round(uniform, 30, 10)  # tokens said, but the run merges uniformly
    assert torch.equal(uniform.store.params["w"], torch.full((4,), -2.0))
    # Equal tokens weigh as a uniform mean does.
    equal = coordinator("tokens")
    one_round(equal, 7, 7)
    assert torch.equal(equal.store.params["w"], torch.full((4,), -2.0))


def test_a_token_weighted_run_refuses_a_submit_that_does_not_say_its_tokens_and_changes_nothing():
    c = coordinator("tokens")
    out = c.handle("w1", Submit("w1", 0, 0, {"w": torch.ones(4)}), 1.0)
    (err,) = [m for _, m in out if isinstance(m, Error)]
    assert err.code == ErrorCode.BAD_MESSAGE and "does not say how many tokens" in err.detail
    assert "--merge tokens" in err.detail and c.store.pending_count(0) == 0
    one_round(c, 1, 3)  # the round is still open, and takes the same worker's proper Submit
    assert torch.allclose(c.store.params["w"], torch.full((4,), -2.5))


def test_auto_weighs_by_tokens_under_dylu_only_and_old_checkpoints_merged_uniformly():
    assert CoordinatorConfig(FSMConfig(min_workers=1), dylu=True, sync_every=10).token_weighted
    assert not CoordinatorConfig(FSMConfig(min_workers=1)).token_weighted
    old = CoordinatorConfig(FSMConfig(min_workers=1), dylu=True, sync_every=10).to_dict()
    del old["merge"]
    assert CoordinatorConfig.from_dict(old).merge == "uniform"
    assert build_config(ServerSettings(min_workers=1, merge="tokens")).merge == "tokens"
    with pytest.raises(ConfigError, match="collective plane"):
        CoordinatorConfig(FSMConfig(min_workers=1, data_plane="collective"), merge="tokens",
                          collective_timeout_s=1.0)
    with pytest.raises(ConfigError, match="merge"):
        CoordinatorConfig(FSMConfig(min_workers=1), merge="loudest")


def test_tokens_travel_in_the_submit_and_only_when_said():
    assert decode(encode(Submit("w", 0, 1, {"w": torch.ones(2)}, tokens=123))).tokens == 123
    assert decode(encode(Submit("w", 0, 1, {"w": torch.ones(2)}))).tokens is None


def test_a_weighted_round_replays_from_the_journal_bit_for_bit(tmp_path):
    from test_journal import _same_state, _state_of, run

    def make() -> Coordinator:
        config = CoordinatorConfig(FSMConfig(min_workers=2, heartbeat_timeout_s=1e9), wire_dtype="int8",
                                   merge="tokens")
        return Coordinator(config, 0.0)

    g = torch.Generator().manual_seed(3)
    params = {"a": torch.randn(300, generator=g), "b": torch.randn(7, generator=g)}
    items = [("p1", join_message("w1", params)), ("p2", join_message("w2", params))]
    from diloco.wire import compression
    for r in range(6):
        for peer, wid, tokens in (("p1", "w1", 100 + r), ("p2", "w2", 37)):
            enc = compression.encode({n: torch.randn(t.shape, generator=g) * 0.1 for n, t in params.items()},
                                     "int8")
            items.append((peer, Submit(wid, 0, r, enc.values, "int8", enc.scales, tokens)))
    c = make()
    run(tmp_path / "ck", items, c, full_every=4)
    assert c.fsm.rounds_applied == 6
    back = load_coordinator(tmp_path / "ck", 0.0)
    _same_state(_state_of(back), _state_of(c))
    # The token count (budget.py) is in every journal commit too: the replayed run has it.
    assert back.budget.trained == c.budget.trained == sum(100 + r + 37 for r in range(6))
    # And the weights mattered: the same Submits merged uniformly end elsewhere.
    uniform = Coordinator(dataclasses.replace(make().config, merge="uniform"), 0.0)
    run(tmp_path / "u", items, uniform, full_every=1)
    assert not torch.equal(uniform.store.params["a"], c.store.params["a"])


def test_a_worker_sends_the_tokens_it_trained_on_since_its_last_submit():
    sent = []
    with Run(min_workers=1) as r:
        w = r.worker("w1", torch.nn.Linear(2, 1), sync_every=3)
        post = w.link.post
        w.link.post = lambda m: (sent.append(m), post(m))[1]

        def train():
            w.join()
            for step in range(6):
                w.inner_optimizer.step()
                w.step_done(tokens=10 * (step + 1) if step >= 3 else None)
            w.leave()

        in_thread(train)
        with pytest.raises(Exception, match="expected an integer >= 1"):
            w.step_done(tokens=0)
    assert [m.tokens for m in sent if isinstance(m, Submit)] == [3, 40 + 50 + 60]


def test_run_training_says_what_each_batch_trained_on_and_the_built_in_entry_counts_its_characters():
    from diloco.deploy.default_entry import make_setup
    from diloco.worker import run_training
    from training_harness import batches, linear, mse_loss

    sent = []
    with Run(min_workers=1) as r:
        w = r.worker("w1", linear(0), sync_every=3)
        post = w.link.post
        w.link.post = lambda m: (sent.append(m), post(m))[1]
        in_thread(lambda: run_training(w, batches(0), mse_loss, max_steps=6, tokens_of=lambda batch: 7))
    assert [m.tokens for m in sent if isinstance(m, Submit)] == [21, 21]
    setup = make_setup("w1")
    x, y = next(iter(setup.batches))
    assert setup.tokens_of((x, y)) == y.numel() > 1
