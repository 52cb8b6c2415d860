"""The default bound on contributions out of line (``outliers.py``) and one key, one live worker id
(``access.py``; SPEC.md sections 11 and 12)."""

from __future__ import annotations

import pytest
import torch

from diloco import cli
from diloco.coordinator import CoordinatorConfig
from diloco.coordinator.outliers import MIN_HISTORY, OutlierGuard, fast_norm
from diloco.core import ConfigError
from diloco.testing import join_message, joined, make_coordinator, only
from diloco.transport.zmq.auth import AuthError, KeyIdentity, Role, ServerAuth, generate_keypair
from diloco.wire.messages import Accepted, Error, ErrorCode, Leave, Result, Submit

P0 = {"w": torch.zeros(64), "b": torch.zeros(8)}


def grads(scale: float, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(t.shape, generator=g) * scale for n, t in P0.items()}


def applied(out) -> None:
    assert any(isinstance(m, Result) and m.outcome == "applied" for _, m in out), out


def test_the_guard_bounds_by_the_recent_median_and_by_the_params_before_that():
    guard = OutlierGuard(1, factor=10.0)
    params = {"w": torch.full((100,), 0.5)}  # norm 5
    assert guard.check(0, 4000.0, params) is None  # warm-up: 1000 x 5
    assert "parameter norm" in guard.check(0, 6000.0, params)
    for n in (1.0, 2.0, 3.0):
        guard.accepted(0, n)
    assert guard.check(0, 19.0, params) is None
    why = guard.check(0, 21.0, params)
    assert "10 x the median norm 2" in why and guard.refused == 2
    assert OutlierGuard(1, factor=0.0).check(0, 1e30, params) is None
    assert fast_norm({"x": torch.full((4,), 3e38)}) == float("inf")


def test_a_huge_contribution_is_refused_and_the_round_applies_without_it():
    c = joined(make_coordinator(min_workers=2), P0, "a", "b")
    for r in range(MIN_HISTORY):
        c.handle("a", Submit("a", 0, r, grads(0.01, r)), float(r))
        applied(c.handle("b", Submit("b", 0, r, grads(0.01, 100 + r)), float(r)))
    for value in (1e30, 3e38):
        err = only(c.handle("a", Submit("a", 0, MIN_HISTORY, {n: torch.full_like(t, value) for n, t in P0.items()}),
                            9.0), Error)
        assert err.code is ErrorCode.UPDATE_TOO_LARGE and "far out of line" in err.detail
    assert isinstance(only(c.handle("a", Submit("a", 0, MIN_HISTORY, grads(0.02, 7)), 9.5), Accepted), Accepted)
    applied(c.handle("b", Submit("b", 0, MIN_HISTORY, grads(0.01, 8)), 9.6))
    assert all(float(t.abs().max()) < 1.0 for t in c.store.params.values())
    assert c.outliers.refused == 2


def test_a_huge_contribution_in_the_first_round_is_refused_too():
    c = joined(make_coordinator(min_workers=2), P0, "a", "b")
    err = only(c.handle("a", Submit("a", 0, 0, {n: torch.full_like(t, 1e30) for n, t in P0.items()}), 1.0), Error)
    assert err.code is ErrorCode.UPDATE_TOO_LARGE and "parameter norm" in err.detail


def test_honest_contributions_that_shrink_and_grow_a_few_fold_pass():
    c = joined(make_coordinator(min_workers=1), P0, "a")
    for r, scale in enumerate([0.1, 0.05, 0.2, 0.02, 0.1, 0.3, 0.01, 0.08]):
        applied(c.handle("a", Submit("a", 0, r, grads(scale, r)), float(r)))
    assert c.outliers.refused == 0


def test_outlier_factor_is_validated_and_saved():
    for bad in (-1, 1.5, float("nan"), float("inf"), True):
        with pytest.raises(ConfigError):
            CoordinatorConfig(outlier_factor=bad)
    assert CoordinatorConfig.from_dict(CoordinatorConfig(outlier_factor=0).to_dict()).outlier_factor == 0.0
    old = CoordinatorConfig().to_dict()
    del old["outlier_factor"]
    assert CoordinatorConfig.from_dict(old).outlier_factor == 10.0


@pytest.mark.parametrize("value", ["1", "-2", "x"])
def test_a_bad_outlier_factor_flag_is_a_usage_error(value, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["server", "--outlier-factor", value])
    assert info.value.code == 2 and "--outlier-factor" in capsys.readouterr().err


# ---------------------------------------------------------------- one key, one live id


def key(name: str, max_ids: int = 1) -> KeyIdentity:
    return KeyIdentity(f"pk-{name}", name, Role.WORKER, max_ids)


def test_one_key_holds_one_live_worker_id_unless_allowed_more():
    c = make_coordinator(min_workers=1)
    assert not [m for _, m in c.handle("p1", join_message("w1", P0), 1.0, identity=key("k")) if isinstance(m, Error)]
    err = only(c.handle("p2", join_message("w2", P0), 1.1, identity=key("k")), Error)
    assert err.code is ErrorCode.KEY_ID_LIMIT and "already holds 1 live worker id(s) ['w1']" in err.detail
    assert not c.fsm.is_member("w2")
    # Rejoining its own id is not a second id.
    c.handle("p1", Leave("w1"), 1.2, identity=key("k"))
    assert not [m for _, m in c.handle("p2", join_message("w2", P0), 1.3, identity=key("k")) if isinstance(m, Error)]
    assert c.status()["keys"] == [{"key": "k", "worker_ids": ["w2"], "max_ids": 1}]
    # An allowance of 2: a second id joins, a third does not.
    c.handle("p3", join_message("h1", P0), 2.0, identity=key("host", 2))
    c.handle("p4", join_message("h2", P0), 2.1, identity=key("host", 2))
    err = only(c.handle("p5", join_message("h3", P0), 2.2, identity=key("host", 2)), Error)
    assert err.code is ErrorCode.KEY_ID_LIMIT and c.fsm.is_member("h1") and c.fsm.is_member("h2")
    assert {k["key"]: k["max_ids"] for k in c.status()["keys"]} == {"k": 1, "host": 2}


def test_the_allowance_file_is_read_and_checked(tmp_path):
    generate_keypair("server", tmp_path)
    (tmp_path / "workers").mkdir()
    for name in ("solo", "host"):
        public, _ = generate_keypair(name, tmp_path / "keys")
        (tmp_path / "workers" / public.name).write_bytes(public.read_bytes())
    (tmp_path / "workers" / "host.max_ids").write_text("# four GPUs, four workers\n4\n")
    auth = ServerAuth.load(tmp_path)
    assert {i.name: i.max_ids for i in auth.clients.values()} == {"solo": 1, "host": 4}
    for bad in ("0", "many", "2\n3", "99999999"):
        (tmp_path / "workers" / "host.max_ids").write_text(bad)
        with pytest.raises(AuthError, match="host.max_ids"):
            ServerAuth.load(tmp_path)
