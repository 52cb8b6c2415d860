"""Overlap (``overlap_steps``, SPEC.md W15-W18) with a real ``DilocoWorker`` and a real ``Coordinator``.

Single-threaded and exact, as ``test_scripted.py``: a fake clock, the sans-IO
coordinator answering at once, the other worker played by the test. With T = 1
and the quorum held the worker never enters WAITING at a sync point (the Result
comes within the window) and merges ``alpha*local + (1-alpha)*global``; its
next pseudo-gradient is measured from the merged round's params. Below quorum
it still pauses, at the end of the window.
"""

from __future__ import annotations

import pytest
import torch

from diloco.cli import main
from diloco.testing import join_message, make_coordinator
from diloco.wire.messages import Result, Submit, spec_of
from diloco.worker import DilocoWorker
from test_scripted import FakeClock, Script, ScriptEndpoint, pseudo_gradient
from training_harness import batch_at, linear, mse_loss

H = 2
ALPHA = 0.25


def overlapping(T: int = 1, **fsm):
    clock = FakeClock()
    c = make_coordinator(clock(), heartbeat_timeout_s=1000.0, **fsm)
    script = Script(c, clock)
    model = linear(0)
    seen: list[tuple[str, int]] = []
    holder: list[DilocoWorker] = []
    w = DilocoWorker(model, torch.optim.SGD(model.parameters(), lr=0.05), ScriptEndpoint(script), worker_id="a",
                     sync_every=H, clock=clock, overlap_steps=T, overlap_alpha=ALPHA,
                     on_state=lambda wid, s, t: seen.append((s, holder[0].inner_step if holder else 0)))
    holder.append(w)
    submits: list[Submit] = []
    handle = script.handle

    def recording(peer, message):
        if peer == "a" and isinstance(message, Submit):
            submits.append(message)
        handle(peer, message)

    script.handle = recording
    spec = tuple(spec_of({n: p.detach() for n, p in model.named_parameters()}))
    return clock, c, script, w, seen, spec, submits


def inner(w: DilocoWorker, step: int) -> dict[str, torch.Tensor]:
    """One inner step without ``step_done``; returns the local params after it."""
    w.inner_optimizer.zero_grad()
    mse_loss(w.model, batch_at(0, step)).backward()
    w.inner_optimizer.step()
    return {n: p.detach().clone() for n, p in w.model.named_parameters()}


def test_t1_with_quorum_held_never_waits_at_a_sync_point_and_merges_alpha_local_plus_global():
    clock, c, script, w, seen, spec, submits = overlapping(T=1, min_workers=2)
    w.join()
    script.handle("b", join_message("b", spec))
    rounds = 8
    for step in range(1, rounds * H + 1):
        if step % H == 0:                             # b's contribution is there first: a's completes the round
            script.handle("b", Submit("b", 0, step // H - 1, pseudo_gradient(0.01)))
        local = inner(w, step)
        base = dict(w.global_params)
        assert w.step_done() is True
        if step % H == 0:                             # the sync point: submitted global - local, kept training
            assert w.state == "training" and w.session.held   # its Result came at once and is held (W16)
            sub = submits[-1]
            assert sub.round_id == step // H - 1
            for n, t in sub.tensors.items():
                assert torch.allclose(t, base[n] - local[n], atol=1e-7)
        elif step > 1:                                # one step later: merged
            (res,) = [m for m in script.delivered if isinstance(m, Result) and m.round_id == step // H - 1]
            for n, p in w.model.named_parameters():
                assert torch.allclose(p, ALPHA * local[n] + (1 - ALPHA) * res.params[n], atol=1e-6)
                assert torch.equal(w.global_params[n], res.params[n])   # the next pseudo-gradient's base
    states = [s for s, _ in seen]
    assert "waiting" not in states and "paused" not in states, seen
    assert w.rounds_synced == rounds and c.status()["rounds_applied"] == rounds
    w.leave()


def test_t1_below_quorum_still_pauses_at_the_end_of_the_window():
    clock, c, script, w, seen, spec, submits = overlapping(T=1, min_workers=2)
    w.join()                                          # alone: the run is below quorum

    def scenario():
        while w.state != "paused":
            clock.advance(0.1)
            yield
        assert w.session.waiting == {0: 0} and not w.session.held      # no Result, nothing merged
        clock.advance(1.0)
        script.handle("b", join_message("b", spec))
        script.handle("b", Submit("b", 0, 0, pseudo_gradient(0.01)))   # quorum: round 0 applies
        yield

    script.scenario = scenario()
    inner(w, 1)
    assert w.step_done()
    local = inner(w, 2)
    assert w.step_done() and w.state == "training"    # submitted, trains on although below quorum (W6)
    after = inner(w, 3)
    assert w.step_done()                              # the window ends: waits, pauses, resumes, merges
    assert ("paused", 3) in seen and ("waiting", 3) in seen and ("waiting", 2) not in seen, seen
    (res,) = [m for m in script.delivered if isinstance(m, Result)]
    for n, p in w.model.named_parameters():
        assert torch.allclose(p, ALPHA * after[n] + (1 - ALPHA) * res.params[n], atol=1e-6)
    assert not torch.equal(after["weight"], local["weight"])
    assert w.state == "training" and w.rounds_synced == 1 and w.seconds_paused > 0
    w.leave()


def test_leave_with_a_merge_pending_merges_it_first():
    clock, c, script, w, seen, spec, submits = overlapping(T=1, min_workers=1)
    w.join()
    inner(w, 1)
    w.step_done()
    local = inner(w, 2)
    w.step_done()                                     # submitted; its Result came and is held
    assert w.session.held
    (res,) = [m for m in script.delivered if isinstance(m, Result)]
    w.leave()
    for n, p in w.model.named_parameters():
        assert torch.allclose(p, ALPHA * local[n] + (1 - ALPHA) * res.params[n], atol=1e-6)


@pytest.mark.parametrize("argv,words", [
    (["--overlap-steps", "10", "--sync-every", "10"], "must be less than --sync-every 10"),
    (["--overlap-steps", "20"], "must be less than --sync-every 20"),      # the demo's H
    (["--overlap-alpha", "0.5"], "needs --overlap-steps"),
    (["--overlap-steps", "-1"], "is not >= 0"),
    (["--overlap-steps", "1", "--overlap-alpha", "1"], "not in [0, 1)"),
    (["--overlap-steps", "1", "--overlap-alpha", "x"], "is not a number"),
])
def test_worker_overlap_flags_are_validated_exit_2(argv, words, capsys):
    try:
        rc = main(["worker", "--connect", "tcp://127.0.0.1:1", *argv])
    except SystemExit as exc:
        rc = exc.code
    assert rc == 2
    assert words in capsys.readouterr().err


def test_worker_help_describes_the_overlap_flags(capsys):
    with pytest.raises(SystemExit):
        main(["worker", "--help"])
    out = capsys.readouterr().out
    assert "--overlap-steps T" in out and "--overlap-alpha A" in out and "Streaming DiLoCo" in out
