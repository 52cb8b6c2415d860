"""Poisoning a run from an authenticated worker key (SPEC.md section 12: non-finite steps, --max-update-norm).

A real ``diloco server --auth`` on 127.0.0.1; the attackers are raw
protocol clients holding valid worker keys, so authentication lets them in
and only the coordinator's value checks stand between them and the run.
"""

from __future__ import annotations

import math
import time

import pytest
import torch

from diloco.testing import join_message, params_of
from diloco.wire.messages import Accepted, Error, ErrorCode, Leave, Result, Submit, Welcome, spec_of
from diloco.wire.zmq import ZmqWorkerEndpoint
from diloco.transport.zmq.auth import ClientAuth

pytestmark = pytest.mark.slow


def tiny_params() -> dict[str, torch.Tensor]:
    from tiny_entry import make_setup  # tests/zmq is on sys.path
    return params_of(make_setup("probe").model)


class Attacker:
    """A raw protocol client with a valid worker key: joins, submits what it likes, reads what it gets back."""

    def __init__(self, cluster, key: str, worker_id: str) -> None:
        self.worker_id = worker_id
        self.ep = ZmqWorkerEndpoint(cluster.address, label=worker_id,
                                    auth=ClientAuth.load(cluster.keys[key][1], cluster.server_key))

    def expect(self, kinds, timeout_s: float = 20.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            msg = self.ep.recv(0.1)
            if isinstance(msg, kinds):
                return msg
        raise AssertionError(f"{self.worker_id}: no {kinds} within {timeout_s} s")

    def join(self, params: dict[str, torch.Tensor]) -> Welcome:
        self.ep.send(join_message(self.worker_id, spec_of(params)))
        msg = self.expect((Welcome, Error))
        if isinstance(msg, Error) and msg.code is ErrorCode.PARAMS_REQUIRED:
            self.ep.send(join_message(self.worker_id, params))
            msg = self.expect((Welcome, Error))
        assert isinstance(msg, Welcome), msg
        return msg

    def submit(self, round_id: int, value: float, like: dict[str, torch.Tensor]):
        self.ep.send(Submit(self.worker_id, 0, round_id, {n: torch.full_like(t, value) for n, t in like.items()}))
        return self.expect((Accepted, Error))

    def close(self) -> None:
        self.ep.close()


def all_finite(params: dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in params.values())


def test_contributions_that_overflow_the_step_never_reach_a_worker(cluster):
    """Two keys submit 3e38 everywhere: the float64 mean is finite, the Nesterov step is not, and is refused."""
    cluster.make_keys(workers=("a1", "a2"))
    # fp32 on the wire: the attackers send raw fp32 values (an int8 run refuses them as bad_message).
    # --outlier-factor 0: these contributions are huge on purpose, to reach the step's own refusal.
    server = cluster.server("--min-workers", "2", "--auth", str(cluster.auth_dir), "--wire-dtype", "fp32",
                            "--outlier-factor", "0",
                            heartbeat_timeout_s=30.0)
    params = tiny_params()
    a1, a2 = Attacker(cluster, "a1", "evil1"), Attacker(cluster, "a2", "evil2")
    try:
        # A NaN first join is refused, naming the tensor; the run stays without params.
        nan_params = {n: torch.full_like(t, math.nan) for n, t in params.items()}
        a1.ep.send(join_message("evil1", params, params=nan_params))
        refused = a1.expect(Error)
        assert refused.code is ErrorCode.NON_FINITE and next(iter(params)) in refused.detail, refused
        assert cluster.status()["num_params"] == 0
        welcome = a1.join(params)
        a2.join(params)
        initial = welcome.params
        assert all_finite(initial)
        for a in (a1, a2):
            assert isinstance(a.submit(0, 3e38, params), Accepted)
        results = [a.expect(Result) for a in (a1, a2)]
        for r in results:
            assert r.outcome == "applied" and r.round_id == 0
            assert all_finite(r.params)
            # The step was refused: the params are exactly the ones before it.
            assert all(torch.equal(r.params[n], initial[n]) for n in initial)
        st = cluster.status()
        assert st["steps_refused"] == 1 and st["rounds_applied"] == 1
        assert "REFUSED" in server.output()
        # A sane round afterwards applies and moves the params.
        for a in (a1, a2):
            assert isinstance(a.submit(1, 0.01, params), Accepted)
        r = a1.expect(Result)
        assert all_finite(r.params) and not all(torch.equal(r.params[n], initial[n]) for n in initial)
        # 1e30 everywhere (finite, absurd) without --max-update-norm: applied, and still finite.
        for a in (a1, a2):
            assert isinstance(a.submit(2, 1e30, params), Accepted)
        assert all_finite(a1.expect(Result).params)
    finally:
        a1.close()
        a2.close()


def test_max_update_norm_keeps_absurd_values_out_and_real_workers_keep_training(cluster):
    cluster.make_keys(workers=("k1", "k2", "evil", "probe"))
    cluster.server("--min-workers", "2", "--max-update-norm", "100", "--auth", str(cluster.auth_dir),
                   "--wire-dtype", "fp32", heartbeat_timeout_s=10.0)  # the attacker sends raw fp32 values
    w1 = cluster.worker("w1", *cluster.key_args("k1"))
    w2 = cluster.worker("w2", *cluster.key_args("k2"))
    start = cluster.wait_status(lambda s: s["rounds_applied"] >= 2, 120, "rounds applied")
    params = tiny_params()
    evil = Attacker(cluster, "evil", "evil")
    try:
        welcome = evil.join(params)
        round_id = welcome.round_ids[0]
        for value, code in ((3e38, ErrorCode.UPDATE_TOO_LARGE), (1e30, ErrorCode.UPDATE_TOO_LARGE),
                            (math.nan, ErrorCode.NON_FINITE), (math.inf, ErrorCode.NON_FINITE)):
            reply = evil.submit(round_id, value, params)
            assert isinstance(reply, Error) and reply.code is code, (value, reply)
        before_leave = cluster.status()
        assert before_leave["contributions_accepted"] >= start["contributions_accepted"]
        evil.ep.send(Leave("evil"))
    finally:
        evil.close()
    # The run goes on with the real workers, and the params they train from stay finite.
    st = cluster.wait_status(lambda s: s["rounds_applied"] >= before_leave["rounds_applied"] + 3, 90, "more rounds")
    assert {m["worker_id"] for m in st["members"]} == {"w1", "w2"}
    assert st["steps_refused"] == 0
    assert w1.alive() and w2.alive()
    probe = Attacker(cluster, "probe", "probe")
    try:
        assert all_finite(probe.join(params).params)
        probe.ep.send(Leave("probe"))
    finally:
        probe.close()


def test_by_default_one_key_can_neither_fill_the_quorum_nor_poison_the_run(cluster):
    """Issue scenario: one authorized key joined under two ids and submitted 3e38 (and 1e30) from each; the
    round applied and every param became about 1e38. Now, with the defaults: the second id is refused
    (key_id_limit) and the huge contributions are refused as far out of line (update_too_large)."""
    from diloco.wire import compression

    cluster.make_keys(workers=("k1", "k2", "evil", "probe"))
    cluster.server("--min-workers", "2", "--auth", str(cluster.auth_dir), heartbeat_timeout_s=10.0)  # int8
    w1 = cluster.worker("w1", *cluster.key_args("k1"))
    w2 = cluster.worker("w2", *cluster.key_args("k2"))
    cluster.wait_status(lambda s: s["rounds_applied"] >= 4, 120, "rounds applied")
    params = tiny_params()
    first, second = Attacker(cluster, "evil", "evil1"), Attacker(cluster, "evil", "evil2")
    try:
        welcome = first.join(params)
        second.ep.send(join_message("evil2", spec_of(params)))
        refused = second.expect(Error)
        assert refused.code is ErrorCode.KEY_ID_LIMIT and "workers/evil.max_ids" in refused.detail, refused
        keys = {k["key"]: k for k in cluster.status()["keys"]}
        assert keys["evil"]["worker_ids"] == ["evil1"] and keys["evil"]["max_ids"] == 1
        round_id = welcome.round_ids[0]
        for value in (3e38, 1e30, -1e30):
            enc = compression.encode({n: torch.full_like(t, value) for n, t in params.items()}, "int8")
            first.ep.send(Submit("evil1", 0, round_id, enc.values, "int8", enc.scales))
            reply = first.expect((Accepted, Error))
            assert isinstance(reply, Error) and reply.code is ErrorCode.UPDATE_TOO_LARGE, (value, reply)
            assert "far out of line" in reply.detail
        before = cluster.status()
        first.ep.send(Leave("evil1"))
    finally:
        first.close()
        second.close()
    st = cluster.wait_status(lambda s: s["rounds_applied"] >= before["rounds_applied"] + 3, 90, "more rounds")
    assert {m["worker_id"] for m in st["members"]} == {"w1", "w2"} and st["steps_refused"] == 0
    assert w1.alive() and w2.alive()
    probe = Attacker(cluster, "probe", "probe")
    try:
        now = probe.join(params).params
        assert all_finite(now) and max(float(t.abs().max()) for t in now.values()) < 100.0  # a normal range
    finally:
        probe.close()
