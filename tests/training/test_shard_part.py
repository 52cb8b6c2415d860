"""The pieces of a sharded member's collective data plane that need no second process (S6, S7, S9).

The whole protocol runs in ``tests/zmq/test_sharded_members.py`` with real ranks; here each rank's
arithmetic: norms and digests combined from shards, the M13 mark a leader leaves for its other
ranks, and the refusals of a rank that has nothing to reduce.
"""

from __future__ import annotations

import datetime
import math

import pytest
import torch
import torch.distributed as dist

from diloco.collective.digest import digest
from diloco.collective.reduce import tensors_norm
from diloco.collective.shard_part import ShardPart, combined_digest, combined_norm
from diloco.collective.store import StoreHost, rank_prefix
from diloco.wire import compression
from diloco.wire.messages import ReduceOrder


def test_the_norm_of_a_whole_is_combined_from_its_shards_norms():
    torch.manual_seed(0)
    whole = torch.randn(17, 5)
    shards = torch.tensor_split(whole, 3)
    assert combined_norm([tensors_norm({"w": s}) for s in shards]) == pytest.approx(tensors_norm({"w": whole}),
                                                                                   rel=1e-6)
    assert math.isnan(combined_norm([1.0, math.nan])) and math.isinf(combined_norm([math.inf, 1.0]))


def test_the_members_digest_depends_on_every_ranks_digest_and_their_order():
    a, b = digest({"w": torch.zeros(3)}), digest({"w": torch.ones(3)})
    assert combined_digest([a, b]) == combined_digest([a, b])
    assert combined_digest([a, b]) != combined_digest([b, a])
    assert combined_digest([a, b]) != combined_digest([a, a])
    assert rank_prefix("g7", 1) == "g7/r1" != rank_prefix("g7", 0)


def _order(prefix: str) -> ReduceOrder:
    return ReduceOrder(0, 3, 0, ("w1", "w2"), prefix, (1.0, 1.0), False)


def test_a_rank_without_its_shard_of_the_rounds_pseudo_gradient_refuses_the_reduce():
    part = ShardPart("w1", 1, "127.0.0.1")
    never = lambda: ""  # noqa: E731
    assert "holds no replica" in part.handle(("reduce", _order("p"), "127.0.0.1", 1, 1.0), never).error
    part.snapshot_start({"w": torch.zeros(4)})
    from diloco.collective.replica import Replica
    from diloco.outer import OuterConfig

    part.replica = Replica(part.start_params, (("w",),), [3], OuterConfig(), "fp32", 1)
    part.post(0, 2, compression.encode({"w": torch.ones(4)}, "fp32"))  # an older round's
    reply = part.handle(("reduce", _order("p"), "127.0.0.1", 1, 1.0), never)
    assert "no pseudo-gradient of fragment 0 round 3" in reply.error
    assert part.handle(("propose", 0, 3, 1.0), never)[1].startswith("rank 1 has no mean")


def test_a_leaders_mark_stops_its_other_ranks_formation_of_that_attempt_only():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=5))
    leader, follower = ShardPart("w1", 0, "127.0.0.1"), ShardPart("w1", 1, "127.0.0.1")
    for part in (leader, follower):
        part._configure("127.0.0.1", store.port, 5.0)
    current = ["g1"]
    stop = follower.follower_stop(lambda: current[0])
    assert stop() == ""
    leader.mark_abandoned("g1")
    assert "abandoned" in stop()
    current[0] = "g2"  # the next attempt's formation is not stopped by the last one's mark
    assert stop() == ""
    current[0] = None
    assert stop() == ""


def test_a_retired_prefix_leaves_no_key_of_its_sharded_members_behind():
    host = StoreHost("127.0.0.1", 0, 5.0)
    for prefix in ("g3", rank_prefix("g3", 0), rank_prefix("g3", 1)):
        for rank in range(2):
            host.store.set(f"{prefix}/0/{rank}", b"addr")
    host.store.set("g3/cancelled", b"1")
    host.store.set("g4/0/0", b"another group's")
    assert host.forget("g3", 2) == 7  # two ranks in the group and in each rank index, and the mark
    assert host.num_keys() == 1 and host.store.check(["g4/0/0"])

