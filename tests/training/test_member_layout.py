"""S8: on the collective plane every member shards its model as the run's members do.

Rank r of each sharded member reduces with rank r of the others, so a member laid out
differently (another number of ranks, other placements, or not sharded at all) could only
fail every reduce it joins: the coordinator refuses it at Join, naming both layouts.
"""

from __future__ import annotations

from diloco.coordinator.collective import CollectivePlane
from diloco.wire.codec import decode, encode
from diloco.wire.messages import PROTOCOL_VERSION, REPLICATED_LAYOUT, ErrorCode, Join, TensorSpec, Welcome

SPEC = (TensorSpec("w", (4, 4), "float32"),)
TWO = "sharded over 2 ranks (mesh [2], placements Shard(dim=0))"
FOUR = "sharded over 4 ranks (mesh [4], placements Shard(dim=0))"


def join(wid: str, layout: str | None, holds: bool = True) -> Join:
    return Join(wid, PROTOCOL_VERSION, SPEC, holds_params=holds, layout=layout)


def plane_held_by(wid: str, layout: str | None) -> CollectivePlane:
    plane = CollectivePlane(1)
    assert plane.check_join(join(wid, layout), lambda w: False) is None
    plane.holds_state(wid)
    return plane


def test_a_member_laid_out_unlike_the_runs_members_is_refused_naming_both_layouts():
    plane = plane_held_by("w1", TWO)
    members = {"w1"}
    refused = plane.check_join(join("w2", FOUR), members.__contains__)
    assert refused is not None and refused[0] is ErrorCode.MODEL_MISMATCH
    assert FOUR in refused[1] and TWO in refused[1]
    refused = plane.check_join(join("w3", None), members.__contains__)
    assert refused is not None and REPLICATED_LAYOUT in refused[1] and TWO in refused[1]
    assert plane.check_join(join("w4", TWO), members.__contains__) is None
    assert plane.layout == TWO


def test_a_sharded_member_is_refused_by_a_run_of_replicated_members():
    plane = plane_held_by("w1", None)
    refused = plane.check_join(join("w2", TWO), {"w1"}.__contains__)
    assert refused is not None and refused[0] is ErrorCode.MODEL_MISMATCH and TWO in refused[1]


def test_once_no_member_holds_the_state_the_next_member_sets_the_runs_layout():
    plane = plane_held_by("w1", TWO)
    # w1 is gone (not a member): nobody holds the run's state, so a member of another layout
    # starts it, and that layout is now the run's.
    assert plane.check_join(join("w2", FOUR), lambda w: False) is None
    assert plane.layout == FOUR
    plane.holds_state("w2")
    refused = plane.check_join(join("w3", TWO), {"w2"}.__contains__)
    assert refused is not None and FOUR in refused[1]


def test_the_layout_crosses_the_wire_in_the_join_and_the_welcome():
    sent = join("w1", TWO)
    assert decode(encode(sent)).layout == TWO
    assert decode(encode(join("w1", None))).layout is None
    welcome = Welcome("w1", (0,), (), "sync", (("w",),), 1, False, 1.0, {}, layout=TWO)
    assert decode(encode(welcome)).layout == TWO
