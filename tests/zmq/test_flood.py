"""No flood of incomplete messages makes the coordinator hold more than its bounds (SPEC.md section 11, "Limits").

Every part counts against the limits (its bytes plus ``PART_COST_BYTES``), all incomplete
messages together are bounded in bytes and number, one key's in number, and what goes to
make room is what has been silent longest (``framing.Assembler``).
"""

from __future__ import annotations

import random

from diloco.transport.zmq.framing import PART_COST_BYTES, Assembler, Complete, Refused, aside_tag, tag


def _start(seq: int, count: int, size: int = 0) -> list:
    return [tag(seq, 0, count), b"x" * size]


def _part(seq: int, index: int, count: int, size: int = 0) -> list:
    return [tag(seq, index, count), b"x" * size]


# --------------------------------------------------------------------------- the assembler's bounds


def test_every_part_counts_so_empty_parts_are_not_free():
    a = Assembler(max_message_bytes=64 << 10)
    results = [a.add("p", _part(1, i, 1000), 0.0) for i in range(1000)]  # 1,000 empty parts
    refused = [i for i, r in enumerate(results) if isinstance(r, Refused)]
    # Refused once the parts' cost passed 64 KiB: at part 128, not never.
    assert len(refused) == 1 and refused[0] == (64 << 10) // PART_COST_BYTES
    assert results[refused[0]].code == "too_large" and f"{PART_COST_BYTES} bytes" in results[refused[0]].detail
    assert a.partial_bytes == 0 and a.partial_count == 0
    # While held, an empty part is counted at its cost.
    a.add("q", _start(1, 3), 0.0)
    a.add("q", _part(1, 1, 3, 100), 0.0)
    assert a.partial_bytes == 2 * PART_COST_BYTES + 100
    assert isinstance(a.add("q", _part(1, 2, 3), 0.0), Complete) and a.partial_bytes == 0
    # A one-part message and an aside are judged the same way.
    small = Assembler(max_message_bytes=PART_COST_BYTES + 10)
    assert isinstance(small.add("p", [tag(1, 0, 1), b"x" * 10], 0.0), Complete)
    assert isinstance(small.add("p", [tag(2, 0, 1), b"x" * 11], 0.0), Refused)
    assert isinstance(small.add("p", [aside_tag(3), b"x" * 11], 0.0), Refused)


def test_incomplete_messages_are_bounded_in_bytes_and_the_longest_silent_go_first():
    cost = 5000 + PART_COST_BYTES
    a = Assembler(max_message_bytes=20_000, max_partial_bytes=3 * cost)
    for t, peer in enumerate("abc"):
        assert a.add(peer, _start(1, 3, 5000), float(t)) is None
    assert a.partial_bytes == 3 * cost and a.evicted == 0
    assert a.add("b", _part(1, 1, 3, 5000), 3.0) is None  # b keeps arriving; a and c are silent
    assert a.partial_count == 2 and a.evicted == 1  # a, silent longest, made room
    assert a.add("d", _start(1, 3, 5000), 4.0) is None
    assert a.partial_count == 2 and a.evicted == 2  # then c; b (still arriving) was never the one
    assert a.partial_bytes <= a.max_partial_bytes
    assert isinstance(a.add("b", _part(1, 2, 3, 10), 5.0), Complete)
    # The rest of a message dropped to make room is skipped as it arrives; the sender's next one is fine.
    assert a.add("a", _part(1, 1, 3, 5000), 6.0) is None and a.add("a", _part(1, 2, 3), 6.0) is None
    assert isinstance(a.add("a", [tag(2, 0, 1), b"hi"], 6.0), Complete)
    # The bound is never below one whole message.
    assert Assembler(max_message_bytes=1000, max_partial_bytes=10).max_partial_bytes == 1000


def test_one_owner_displaces_only_its_own_incomplete_messages():
    a = Assembler(max_message_bytes=1 << 20)
    assert a.add("worker", _start(1, 2, 100), 0.0, owner="good", owner_limit=2) is None
    for i in range(50):  # one key, 50 connections, each starting a message
        assert a.add(f"flood{i}", _start(1, 2, 100), 1.0 + i, owner="evil", owner_limit=2) is None
    assert a.partial_count == 3 and a.evicted == 48
    assert isinstance(a.add("worker", _part(1, 1, 2), 99.0, owner="good", owner_limit=2), Complete)


def test_a_flood_of_starts_displaces_silent_messages_before_one_still_arriving():
    a = Assembler(max_message_bytes=1 << 20, max_partials=4)
    a.add("worker", _start(1, 3), 0.0)
    for i in range(3):
        a.add(f"f{i}", _start(1, 2), 0.1 + 0.1 * i)
    a.add("worker", _part(1, 1, 3), 0.35)  # the worker's message keeps arriving
    for i in range(3, 6):  # three more starts push out f0, f1 and f2, not the worker's
        a.add(f"f{i}", _start(1, 2), 0.1 + 0.1 * i)
    assert a.evicted == 3 and isinstance(a.add("worker", _part(1, 2, 3), 0.65), Complete)


def test_the_bounds_hold_whatever_arrives():
    rng = random.Random(22)
    a = Assembler(max_message_bytes=50_000, max_partials=20, max_partial_bytes=120_000, partial_timeout_s=5.0)
    held: dict[str, tuple[int, int, int]] = {}  # peer -> (seq, next index, count) as the sender sees it
    now = 0.0
    for step in range(20_000):
        now += rng.random() * 0.01
        peer = f"p{rng.randrange(60)}"
        owner = f"k{int(peer[1:]) % 5}"
        seq, nxt, count = held.get(peer, (step, 0, 0))
        if nxt == 0 or rng.random() < 0.05:
            seq, nxt, count = step, 0, rng.randrange(1, 12)
        got = a.add(peer, _part(seq, nxt, count, rng.choice([0, 10, 3000, 9000])), now, owner=owner, owner_limit=3)
        held[peer] = (seq, 0, 0) if nxt + 1 >= count else (seq, nxt + 1, count)
        assert got is None or isinstance(got, (Complete, Refused))
        assert a.partial_bytes <= a.max_partial_bytes and a.partial_count <= a.max_partials
        assert a.partial_bytes == sum(p.size for p in a._partials.values())
        per_owner: dict[str, int] = {}
        for p in a._partials.values():
            per_owner[p.owner] = per_owner.get(p.owner, 0) + 1
        assert max(per_owner.values(), default=0) <= 3
    assert a.evicted > 0 and a.incomplete_dropped >= a.evicted
