"""The sparse wire (SPEC.md section 11, "The sparse wire"): chunk-wise top-k of each worker's
error-feedback accumulator, 2 bits a value, summed by the hub without a dense copy, and the
method's outer step, bit for bit the same on the coordinator and on every worker."""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch

from diloco.coordinator import Coordinator, CoordinatorConfig
from diloco.core import ConfigError, FSMConfig
from diloco.outer import OuterConfig
from diloco.testing import joined, only
from diloco.wire import compression
from diloco.wire import sparse as sp
from diloco.wire.messages import Accepted, Error, ErrorCode, Result, Submit
from training_harness import Run, batch_at, mlp, mse_loss

SGD1 = OuterConfig("sgd", 1.0, 0.0)
FMT = sp.SparseFormat(16, 4)
WIRE = sp.SparseWire(FMT, beta=0.9, lr=1.0)


# ---------------------------------------------------------------- the codec

@pytest.mark.parametrize("shape", [(0,), (1,), (5,), (16,), (17,), (3, 50), (2, 2, 33)])
def test_a_payload_keeps_the_k_largest_of_each_chunk_within_its_levels(shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    entries, scales = sp.encode_tensor(x, FMT)
    n = x.numel()
    assert entries.dtype == torch.int16 and entries.numel() == FMT.kept(n)
    assert scales.dtype == torch.float32 and scales.numel() == FMT.chunks(n)
    back = sp.densify(sp.decode_tensor(entries, scales, n, FMT, "t", "test"), tuple(shape)).reshape(-1)
    flat = x.reshape(-1)
    for c in range(FMT.chunks(n)):
        chunk = flat[c * 16:(c + 1) * 16]
        got = back[c * 16:(c + 1) * 16]
        k = min(FMT.k, chunk.numel())
        kept = got != 0
        # The k largest magnitudes (ties aside), each sent as the nearest of -s, -s/3, s/3, s.
        assert int(kept.sum()) <= k
        want = chunk.abs().topk(k).indices
        assert set(kept.nonzero().reshape(-1).tolist()) <= set(want.tolist())
        s = float(chunk.abs().max()) if chunk.numel() else 0.0
        assert float(scales[c]) == pytest.approx(s)
        assert bool(((got[kept] - chunk[kept]).abs() <= s / 3 * (1 + 1e-6)).all())


def test_the_default_format_moves_under_a_hundredth_of_fp32():
    fmt = sp.SparseFormat.of(sp.DEFAULT_DENSITY)
    assert (fmt.chunk, fmt.k) == (4096, 64)
    assert fmt.nbytes(10_000_000) / (4 * 10_000_000) < 0.0085  # 2 bytes per kept entry, 4 per chunk
    assert sp.SparseFormat.of(1 / 32).nbytes(1 << 20) / (4 << 20) < 0.017


def refused(entries, scales, words, kind=compression.EncodingError, numel=20):
    with pytest.raises(kind, match=words):
        sp.decode({"t": entries}, {"t": scales}, [("t", (numel,))], FMT, "fragment 0 submission")


def test_every_malformed_payload_is_refused_naming_what_is_wrong():
    x = torch.arange(20, dtype=torch.float32) - 7
    e, s = sp.encode_tensor(x, FMT)
    assert e.numel() == 8 and s.numel() == 2  # 4 of the first chunk of 16, all 4 of the last
    dup = e.clone()
    dup[1] = dup[0]
    refused(dup, s, "repeats or goes back")
    back = e.clone()
    back[0], back[1] = e[1], e[0]
    refused(back, s, "repeats or goes back")
    far = e.clone()
    far[-1] = (4 << 2) | 1  # place 4 of the last chunk, which has 4 elements: element 20 of 20
    refused(far, s, "points at element 20")
    wide = e.clone()
    wide[0] = (16 << 2) | 1  # place 16 in a chunk of 16
    refused(wide, s, "points at element")
    refused(e[:-1], s, "carries 7 entries.*exactly 8", compression.EncodedMismatch)
    refused(e, s[:1], r"expected float32 of shape \[2\]")
    refused(e, torch.tensor([1.0, float("nan")]), "scale 1 .* is nan", compression.NonFiniteScale)
    refused(e, torch.tensor([1.0, -1.0]), "finite and >= 0")
    refused(e.to(torch.int32), s, "1-D int16")
    neg = e.clone()
    neg[0] = -4
    refused(neg, s, "negative entry")
    with pytest.raises(compression.EncodedMismatch, match="tensors"):
        sp.decode({"u": e}, {"u": s}, [("t", (20,))], FMT, "fragment 0 submission")


def test_formats_and_settings_out_of_range_are_refused():
    for chunk, k in ((1, 1), (8193, 4), (16, 0), (16, 16), (16, 2.0)):
        with pytest.raises(ValueError):
            sp.SparseFormat(chunk, k)
    for density in (0, 1, -0.1, True):
        with pytest.raises(ValueError):
            sp.SparseFormat.of(density)
    with pytest.raises(ValueError, match="beta"):
        sp.SparseWire(FMT, beta=1.5)
    with pytest.raises(ValueError, match="lack"):
        sp.SparseWire.from_dict({"chunk": 16})
    assert sp.SparseWire.from_dict(WIRE.to_dict()) == WIRE


# ---------------------------------------------------------------- the hub

P0 = {"w": torch.zeros(3, 30), "b": torch.zeros(5)}


def sparse_coordinator(min_workers: int = 3) -> Coordinator:
    config = CoordinatorConfig(FSMConfig(min_workers=min_workers), outer=SGD1, wire_dtype="sparse",
                               sparsity=0.25, sparse_chunk=16, sparse_beta=0.9)
    return joined(Coordinator(config, 0.0), P0, *[f"w{i}" for i in range(min_workers)])


def submit(wid: str, tensors, round_id: int = 0, **change) -> Submit:
    values, scales = sp.encode(tensors, FMT)
    values.update(change.pop("values", {}))
    scales.update(change.pop("scales", {}))
    return Submit(wid, 0, round_id, values, change.pop("wire_dtype", "sparse"), scales)


def grads(seed: int):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(t.shape, generator=g) for n, t in P0.items()}


def test_the_hubs_sparse_sum_is_the_dense_sum_of_the_decoded_contributions_bit_for_bit():
    import dataclasses

    c = sparse_coordinator()
    contributions = {f"w{i}": grads(i) for i in range(3)}
    out = []
    for wid, g in contributions.items():
        out = c.handle(wid, dataclasses.replace(submit(wid, g), tokens=100), 0.0)
    assert c.budget.trained == 300, "the round's tokens count towards the token budget"
    results = [m for _, m in out if isinstance(m, Result)]
    assert len(results) == 3 and all(r.outcome == "applied" and r.delta and r.wire_dtype == "sparse" for r in results)
    dense = {n: torch.zeros(t.shape) for n, t in P0.items()}
    for g in contributions.values():
        values, scales = sp.encode(g, FMT)
        for n in P0:
            dense[n] = dense[n] + sp.densify(sp.decode_tensor(values[n], scales[n], P0[n].numel(), FMT, n, "t"),
                                             tuple(P0[n].shape))
    for n in P0:
        want = torch.add(P0[n], dense[n] / 3, alpha=-1.0)
        assert torch.equal(c.store.params[n], want), n
    # What a worker makes of the Result: the same bits.
    r = results[0]
    mine = sp.apply_result(r.params, r.scales, P0, sp.SparseWire(FMT, 0.9, 1.0), "Result")
    assert all(torch.equal(mine[n], c.store.params[n]) for n in P0)
    # The Result carries the three payloads, about 3 x 4/16 of the entries: no dense tensor.
    assert r.params["w"].dtype == torch.int16 and r.params["w"].numel() == 3 * FMT.kept(90)


def test_a_malformed_sparse_submission_is_refused_and_changes_nothing():
    c = sparse_coordinator()
    g = grads(0)
    values, scales = sp.encode(g, FMT)
    bad = values["w"].clone()
    bad[1] = bad[0]
    before = {n: t.clone() for n, t in c.store.params.items()}
    cases = [
        (submit("w0", g, values={"w": bad}), ErrorCode.BAD_MESSAGE, "repeats"),
        (submit("w0", g, values={"w": values["w"][:-1]}), ErrorCode.TENSOR_MISMATCH, "exactly"),
        (submit("w0", g, scales={"b": torch.tensor([float("inf")])}), ErrorCode.NON_FINITE, "is inf"),
        (submit("w0", g, wire_dtype="int8"), ErrorCode.BAD_MESSAGE, "this run's wire dtype is sparse"),
    ]
    for msg, code, words in cases:
        err = only(c.handle("w0", msg, 0.0), Error)
        assert err.code is code and words in err.detail, err
    assert all(torch.equal(c.store.params[n], before[n]) for n in P0)
    assert not c.hub._sparse.summing(), "a refused payload left a trace in the round's sum"
    # The good one is still taken.
    assert isinstance(only(c.handle("w0", submit("w0", g), 0.0), Accepted), Accepted)


def test_the_norm_bound_holds_a_sparse_contribution_by_its_entries():
    config = CoordinatorConfig(FSMConfig(min_workers=1), outer=SGD1, wire_dtype="sparse", sparsity=0.25,
                               sparse_chunk=16, max_update_norm=0.5)
    c = joined(Coordinator(config, 0.0), P0, "w0")
    err = only(c.handle("w0", submit("w0", grads(1)), 0.0), Error)
    assert err.code is ErrorCode.UPDATE_TOO_LARGE and "--max-update-norm" in err.detail


# ---------------------------------------------------------------- what it composes with

@pytest.mark.parametrize("change, words", [
    ({"fsm": FSMConfig(min_workers=1, mode="async")}, "sync run"),
    ({"outer": OuterConfig()}, "no global momentum"),
    ({"merge": "tokens"}, "uniform"),
    ({"sparsity": 1.5}, "valid sparse settings"),
    ({"sparse_chunk": 9000}, "valid sparse settings"),
])
def test_what_sparse_does_not_compose_with_is_refused_at_startup(change, words):
    kwargs = {"fsm": FSMConfig(min_workers=1), "outer": SGD1, "wire_dtype": "sparse", **change}
    with pytest.raises(ConfigError, match=words):
        CoordinatorConfig(**kwargs)


def test_the_server_makes_a_sparse_runs_outer_step_plain_sgd_and_keeps_its_settings():
    from diloco.deploy.server import ServerError, ServerSettings, build_config
    from diloco.deploy.startup import wire_line

    cfg = build_config(ServerSettings(wire_dtype="sparse", sparsity=1 / 32))
    assert (cfg.outer.name, cfg.outer.momentum, cfg.outer.lr) == ("sgd", 0.0, sp.DEFAULT_OUTER_LR)
    assert cfg.sparse_wire.fmt == sp.SparseFormat(4096, 128)
    assert CoordinatorConfig.from_dict(cfg.to_dict()).sparse_wire == cfg.sparse_wire
    assert "top 128 of every 4096" in wire_line(cfg)
    assert build_config(ServerSettings(wire_dtype="sparse", outer_lr=0.7)).outer.lr == 0.7
    with pytest.raises(ServerError, match="need --wire-dtype sparse"):
        build_config(ServerSettings(wire_dtype="int8", sparsity=0.02))
    with pytest.raises(ServerError, match="no global momentum"):
        build_config(ServerSettings(wire_dtype="sparse", outer_optimizer="nesterov"))


# ---------------------------------------------------------------- workers

def test_every_worker_holds_the_coordinators_params_bit_for_bit_and_sends_a_fraction_of_the_bytes():
    config = CoordinatorConfig(FSMConfig(min_workers=2), outer=SGD1, wire_dtype="sparse", sparsity=0.25,
                               sparse_chunk=16)
    coordinator = Coordinator(config, time.monotonic())
    errors: list = []
    logs: dict[str, list] = {"w0": [], "w1": []}
    with Run(coordinator=coordinator) as run:
        workers = [run.worker(wid, mlp(0), sync_every=5, lr=0.05) for wid in logs]

        def train(w, seed):
            try:
                w.join()
                for step in range(20):
                    w.inner_optimizer.zero_grad()
                    mse_loss(w.model, batch_at(seed, step)).backward()
                    w.inner_optimizer.step()
                    assert w.step_done()
                    if w.inner_step % 5 == 0:
                        logs[w.worker_id].append((w.rounds_synced, {n: t.clone() for n, t in w.global_params.items()}))
                w.leave()
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=train, args=(w, i)) for i, w in enumerate(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        after = {r: p for _, r, p in run.applied}
    assert sorted(after) == [0, 1, 2, 3]
    for wid, log in logs.items():
        assert [r for r, _ in log] == [1, 2, 3, 4]
        for synced, copy in log:
            assert all(torch.equal(copy[n], after[synced - 1][n]) for n in copy), (wid, synced)
    w = workers[0]
    assert w.wire_dtype == "sparse" and w.sparse_wire == sp.SparseWire(sp.SparseFormat(16, 4), 0.95, 1.0)
    dense = sum(p.numel() for p in w.model.parameters()) * 4
    payload = sum(sp.SparseFormat(16, 4).nbytes(p.numel()) for p in w.model.parameters())
    assert payload < 0.2 * dense  # 2 bytes for each of 4 in 16 entries, 4 per chunk: about a fifth here
    for w in workers:  # four Submits each (and the first joiner's fp32 params)
        assert w.bytes_sent in (4 * payload, 4 * payload + dense), (w.worker_id, w.bytes_sent, payload)
    assert w._keeper.residual and all(math.isfinite(float(t.norm())) for t in w._keeper.residual.values())


def test_the_accumulator_decays_by_beta_and_a_welcome_past_it_drops_it():
    from diloco.worker.keeper import ReplicaKeeper

    model = torch.nn.Linear(16, 1, bias=False)
    keeper = ReplicaKeeper(dict(model.named_parameters()))
    keeper.set_global("weight", torch.zeros(1, 16))
    with torch.no_grad():
        model.weight.copy_(-torch.arange(16.0).view(1, 16))  # delta = global - local = 0..15
    wire = sp.SparseWire(FMT, beta=0.5, lr=1.0)
    enc, _, _ = keeper.pseudo_gradient(0, 7, ["weight"], "sparse", True, False, wire)
    sent = sp.densify(sp.decode_tensor(enc.values["weight"], enc.scales["weight"], 16, FMT, "weight", "t"), (1, 16))
    e1 = torch.arange(16.0).view(1, 16) - sent
    assert torch.equal(keeper.residual["weight"], e1)
    keeper.pseudo_gradient(0, 8, ["weight"], "sparse", True, False, wire)
    # e <- beta * e + delta, then minus what it sent: the unsent small entries carry half their mass on.
    assert keeper.residual_round == {0: 9}
    assert keeper.settle_residual([9], [["weight"]]) == [] and "weight" in keeper.residual
    assert keeper.settle_residual([12], [["weight"]]) == ["weight"] and keeper.residual == {}


# ---------------------------------------------------------------- both planes

def _run_plane(plane: str):
    """Two workers (the same init, their own data) for 24 steps at H = 4 on ``plane``: the final params
    of every member (hub: the coordinator's too) and the held-out loss of the first's."""
    from diloco.collective.store import StoreHost

    fsm = {"min_workers": 2, "heartbeat_timeout_s": 3.0}
    extra = {}
    store = None
    if plane == "collective":
        store = StoreHost()
        fsm.update(data_plane="collective", reduce_timeout_s=4.0)
        extra["collective_timeout_s"] = 1.0
    config = CoordinatorConfig(FSMConfig(**fsm), outer=SGD1, wire_dtype="sparse", sparsity=0.25, sparse_chunk=16,
                               **extra)
    coordinator = Coordinator(config, time.monotonic())
    if store is not None:
        coordinator.collective.store_port = store.port
    from training_harness import batches

    with Run(coordinator=coordinator, linger_s=2.0) as run:
        workers = [run.worker(f"w{i}", mlp(0), sync_every=4) for i in range(2)]
        for i, w in enumerate(workers):
            run.start(w, batches(i), max_steps=24)
        reports = run.join_workers(60)
        assert all(r.rounds_synced == 6 for r in reports.values()), reports
        finals = [{n: t.clone() for n, t in w.global_params.items()} for w in workers]
    model = mlp(0)
    model.load_state_dict(finals[0])
    with torch.no_grad():
        loss = float(mse_loss(model, batch_at(99, 0)))
    return finals, loss, workers


def test_a_collective_sparse_run_holds_one_state_and_ends_where_the_hubs_run_does():
    hub_finals, hub_loss, _ = _run_plane("hub")
    coll_finals, coll_loss, workers = _run_plane("collective")
    for finals in (hub_finals, coll_finals):
        assert all(torch.equal(finals[0][n], finals[1][n]) for n in finals[0])
    # The same sums, the same outer step (SGD, lr 1, momentum 0): the planes differ by the last bits
    # of the step's arithmetic at most.
    assert abs(coll_loss - hub_loss) <= 1e-4 * max(1.0, abs(hub_loss)), (hub_loss, coll_loss)
    assert all(w.data_plane.replica.sparse_fmt == sp.SparseFormat(16, 4) for w in workers)


def test_a_malformed_payload_in_the_groups_gather_gets_its_sender_blamed_by_every_member():
    from diloco.collective.groups import build_group, connect_store
    from diloco.collective.member import judge_reduce
    from diloco.collective.reduce import mean_pseudo_gradient
    from diloco.collective.store import StoreHost
    from diloco.wire.messages import ReduceOrder

    host = StoreHost()
    shapes = {"w": torch.Size([40])}
    good = grads(5)["w"].reshape(-1)[:40]
    values, scales = sp.encode({"w": good}, FMT)
    bad = values["w"].clone()
    bad[1] = bad[0]  # a repeated place
    payloads = [compression.Encoded(values, scales), compression.Encoded({"w": bad}, scales)]
    got: dict = {}

    def member(rank: int) -> None:
        group = build_group(connect_store("127.0.0.1", host.port, 10), "run/sparse", rank, 2, "127.0.0.1", 10)
        got[rank] = mean_pseudo_gradient(group, payloads[rank], "sparse", shapes, 10, fmt=FMT)

    threads = [threading.Thread(target=member, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    order = ReduceOrder(0, 0, 0, ("w0", "w1"), "run/sparse", norms=(100.0, 100.0))
    for rank in range(2):
        mean, norms, _ = got[rank]
        assert math.isfinite(norms[0]) and math.isnan(norms[1]), norms
        refused = judge_reduce(order, norms, lambda: 0.0)
        assert refused is not None and refused.blame == ("w1",), refused
        # The rest of the sum is rank 0's alone: never a dense copy of the bad one.
        want = sp.densify(sp.decode_tensor(values["w"], scales["w"], 40, FMT, "w", "t"), (40,)) / 2
        assert torch.equal(mean["w"], want)


# ---------------------------------------------------------------- the accumulator across a restart

def _train_rounds(w, seed: int, rounds: int, save: bool = False) -> None:
    errors: list = []

    def body():
        try:
            w.join()
            for step in range(rounds * 5):
                w.inner_optimizer.zero_grad()
                mse_loss(w.model, batch_at(seed, step)).backward()
                w.inner_optimizer.step()
                assert w.step_done()
            if save:
                w.save_checkpoint()
            w.leave()
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=body)
    t.start()
    t.join(60)
    assert not t.is_alive() and not errors, errors


def test_a_restarted_worker_keeps_its_accumulator_and_drops_it_when_the_run_moved_on(tmp_path):
    config = CoordinatorConfig(FSMConfig(min_workers=1), outer=SGD1, wire_dtype="sparse", sparsity=0.25,
                               sparse_chunk=16)
    with Run(coordinator=Coordinator(config, time.monotonic())) as run:
        a = run.worker("a", mlp(0), sync_every=5, checkpoint_dir=tmp_path)
        _train_rounds(a, 0, 2, save=True)  # its checkpoint holds the accumulator; then it is gone
        saved = {n: t.clone() for n, t in a._keeper.residual.items()}
        assert saved and any(bool(t.abs().sum() > 0) for t in saved.values())
        # Restarted from its checkpoint while the run waited (no one else trained): the same mass.
        again = run.worker("a", mlp(7), sync_every=5, checkpoint_dir=tmp_path)
        assert again.restored and all(torch.equal(again._keeper.residual[n], saved[n]) for n in saved)
        _train_rounds(again, 1, 0)
        assert again.residuals_dropped == 0
        # Another worker moves the run on two rounds; the next restart's accumulator is stale: dropped.
        b = run.worker("b", mlp(0), sync_every=5)
        _train_rounds(b, 2, 2)
        late = run.worker("a", mlp(7), sync_every=5, checkpoint_dir=tmp_path)
        assert late.restored and late._keeper.residual
        _train_rounds(late, 1, 0)
        assert late.residuals_dropped == len(saved) and late._keeper.residual == {}


# ---------------------------------------------------------------- hostile payloads

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 40), st.lists(st.integers(-(1 << 15), (1 << 15) - 1), max_size=12),
       st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), max_size=4))
def test_any_payload_decodes_to_distinct_in_range_entries_or_is_refused(numel, entries, scales):
    """Whatever a peer sends: an EncodingError naming the problem, or entries a sum can take as they are
    (each index in the tensor, none twice, finite values)."""
    e = torch.tensor(entries, dtype=torch.int16)
    s = torch.tensor(scales, dtype=torch.float32)
    try:
        p = sp.decode_tensor(e, s, numel, FMT, "t", "fuzz")
    except compression.EncodingError as exc:
        assert str(exc).startswith("fuzz: ")
        return
    assert p.index.numel() == FMT.kept(numel) and p.value.numel() == p.index.numel()
    assert bool(((p.index >= 0) & (p.index < max(numel, 1))).all())
    assert p.index.unique().numel() == p.index.numel()
    assert bool(torch.isfinite(p.value).all())


def test_the_collective_sparse_sum_made_in_a_kept_buffer_is_the_one_made_in_fresh_zeros():
    from diloco.collective.groups import build_group, connect_store
    from diloco.collective.reduce import mean_pseudo_gradient
    from diloco.collective.store import StoreHost

    host = StoreHost()
    shapes = {"w": torch.Size([8, 5]), "b": torch.Size([7])}
    g = grads(3)
    tensors = {"w": g["w"].reshape(-1)[:40].reshape(8, 5), "b": g["w"].reshape(-1)[40:47]}
    payload = compression.Encoded(*sp.encode(tensors, FMT))
    buffer = torch.full((47,), float("nan"))  # a previous round's leftovers: zeroed before the sum
    group = build_group(connect_store("127.0.0.1", host.port, 10), "run/buffer", 0, 1, "127.0.0.1", 10)
    fresh, norms, _ = mean_pseudo_gradient(group, payload, "sparse", shapes, 10, fmt=FMT)
    kept, kept_norms, _ = mean_pseudo_gradient(group, payload, "sparse", shapes, 10, buffer=buffer, fmt=FMT)
    assert norms == kept_norms
    assert all(torch.equal(fresh[n], kept[n]) for n in shapes)
    assert kept["w"].data_ptr() == buffer.data_ptr()  # made in the buffer, no fresh tensor
