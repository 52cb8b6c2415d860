"""How a sharded member's leader turns its ranks' replies into the one completion its machine expects
(SPEC.md S7, S10), with the ranks' parts and the plane group stood in for in one process.

The real ranks, groups and gloo run in ``tests/zmq/test_sharded_members.py``; here each combination
rule is held to: norms combined before the checks, the vote over every rank's digest, a refusal
anywhere rolling back everywhere, and a broken plane group breaking the member.
"""

from __future__ import annotations

import math

import pytest

from diloco.collective.member import CommitJob, ReduceJob
from diloco.collective.shard_part import ReducePart, combined_digest
from diloco.collective.sharded_endpoint import MemberBroken, ShardedCollectiveEndpoint
from diloco.wire.messages import ReduceOrder, Submit


class _Inner:
    address = "tcp://127.0.0.1:1"

    def close(self) -> None:
        pass


class _Part:
    """A rank's part that answers each request kind with what the test set."""

    def __init__(self, rank: int, **replies) -> None:
        self.rank = rank
        self.replies = replies
        self.seen: list[tuple] = []
        self.replica = None

    def handle(self, request: tuple, stop) -> object:
        self.seen.append(request)
        return self.replies.get(request[0])

    def mark_abandoned(self, prefix: str) -> None:
        self.seen.append(("marked", prefix))


class _Link:
    """The plane group of a member of two ranks: the other rank is a ``_Part`` in this process."""

    def __init__(self, other: _Part, broken: bool = False) -> None:
        self.other = other
        self.broken = broken
        self.request: tuple | None = None

    def broadcast(self, request, timeout_s=None):
        if self.broken:
            raise RuntimeError("Connection reset by peer")
        self.request = request
        return request

    def gather(self, reply, timeout_s=None):
        assert self.request is not None
        return [reply, self.other.handle(self.request, lambda: "")]


ORDER = ReduceOrder(0, 4, 0, ("w1", "w2"), "g1", (5.0, 5.0), True)
JOB = ReduceJob(ORDER, Submit("w1", 0, 4, {}, "fp32", norm=5.0))


def _endpoint(leader: _Part, follower: _Part, broken: bool = False) -> ShardedCollectiveEndpoint:
    return ShardedCollectiveEndpoint(_Inner(), "w1", leader, _Link(follower, broken), "sharded over 2 ranks")


def test_shard_norms_are_combined_before_the_checks_and_blame_names_the_member():
    # w2's contribution: 3 on rank 0's shard and 4.5 on rank 1's, each within w2's declared 5; whole,
    # sqrt(9 + 20.25) = 5.4 > 5: w2 is blamed, and the ranks drop what they reduced.
    leader = _Part(0, reduce=ReducePart(norms=(1.0, 3.0), mean_norm=1.0))
    follower = _Part(1, reduce=ReducePart(norms=(1.0, 4.5), mean_norm=1.0))
    done = _endpoint(leader, follower)._reduce(JOB)
    assert done.digest == "" and done.blame == ("w2",)
    assert [r[0] for r in follower.seen] == ["reduce", "discard"]


def test_the_member_votes_the_digest_of_every_ranks_digest_and_commits_with_each_ranks_own():
    leader = _Part(0, reduce=ReducePart(norms=(1.0, 1.0), mean_norm=1.0), propose=("d0", ""), commit=True)
    follower = _Part(1, reduce=ReducePart(norms=(1.0, 1.0), mean_norm=1.0), propose=("d1", ""), commit=True)
    endpoint = _endpoint(leader, follower)
    done = endpoint._reduce(JOB)
    assert done.digest == combined_digest(["d0", "d1"]) != combined_digest(["d0", "d0"])
    bound = follower.seen[-1][3]
    assert follower.seen[-1][:3] == ("propose", 0, 4) and math.isfinite(bound) and bound >= 5.0

    class _Replica:
        @staticmethod
        def fragment(fid):
            return {"w": None}

    leader.replica = _Replica()
    endpoint._commit(CommitJob(0, 4, done.digest))
    assert follower.seen[-1] == ("commit", 0, 4, ["d0", "d1"])


def test_a_commit_of_another_digest_than_the_members_rolls_every_rank_back():
    leader = _Part(0, reduce=ReducePart(norms=(1.0, 1.0), mean_norm=1.0), propose=("d0", ""))
    follower = _Part(1, reduce=ReducePart(norms=(1.0, 1.0), mean_norm=1.0), propose=("d1", ""))
    endpoint = _endpoint(leader, follower)
    endpoint._reduce(JOB)
    with pytest.raises(RuntimeError, match="not round 4"):
        endpoint._commit(CommitJob(0, 4, combined_digest(["d0", "dX"])))
    assert follower.seen[-1] == ("rollback", (0,))


def test_a_step_refused_on_one_rank_rolls_back_every_rank_and_proposes_nothing():
    leader = _Part(0, reduce=ReducePart(norms=(1.0, 1.0), mean_norm=1.0), propose=("d0", ""))
    follower = _Part(1, reduce=ReducePart(norms=(1.0, 1.0), mean_norm=1.0),
                     propose=("", "rank 1: the outer step made 'w' non-finite"))
    done = _endpoint(leader, follower)._reduce(JOB)
    assert done.digest == "" and "non-finite" in done.detail
    assert leader.seen[-1] == follower.seen[-1] == ("rollback", (0,))


def test_a_rank_that_failed_its_reduce_fails_the_members():
    leader = _Part(0, reduce=ReducePart(norms=(1.0, 1.0), mean_norm=1.0))
    follower = _Part(1, reduce=ReducePart(error="rank 1: group 'g1/r1' did not form"))
    done = _endpoint(leader, follower)._reduce(JOB)
    assert done.digest == "" and "g1/r1" in done.detail and not done.blame


def test_a_broken_plane_group_breaks_the_member_for_good():
    endpoint = _endpoint(_Part(0), _Part(1), broken=True)
    with pytest.raises(RuntimeError, match="group broke"):
        endpoint._reduce(JOB)
    with pytest.raises(MemberBroken, match="a rank died or left"):
        endpoint.recv(0.0)
