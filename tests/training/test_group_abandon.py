"""M13, the driver's side: a reduce group still forming when its attempt ends is abandoned.

gloo cannot be interrupted, and a peer that registered its address and then died
holds every other rank in gloo's connect for five collective timeouts (16.5 s at
3.3 s, measured). ``GroupCache.get`` with a stop check forms the group on a helper
thread, over a store client of its own, and leaves it behind as soon as the check
gives a reason, so the member is free for the attempt that follows.
"""

from __future__ import annotations

import gc
import os
import threading
import time

import pytest

from diloco.collective.groups import CollectiveError, GroupCache, connect_store
from diloco.collective.store import StoreHost

TIMEOUT_S = 5.0


def _cache(host: StoreHost) -> GroupCache:
    return GroupCache(lambda: connect_store("127.0.0.1", host.port, TIMEOUT_S), "127.0.0.1", TIMEOUT_S)


def test_m13_a_group_still_forming_when_its_attempt_ends_is_abandoned_at_once():
    """A rank whose peer never comes (the same uninterruptible wait as one whose peer died after
    registering) leaves the formation when the stop check fires, not at gloo's timeout."""
    host = StoreHost()
    ended_at = time.monotonic() + 0.3
    stop = lambda: "the attempt is over" if time.monotonic() >= ended_at else ""  # noqa: E731
    began = time.monotonic()
    with pytest.raises(CollectiveError, match=r"abandoned while it formed: the attempt is over"):
        _cache(host).get("g1", 0, 2, stop)
    assert time.monotonic() - began < 2.0, "it waited for gloo's timeout"
    # The helper left behind ends on its own, within gloo's bound.
    for t in [t for t in threading.enumerate() if t.name.startswith("diloco-group-")]:
        t.join(TIMEOUT_S + 5)
        assert not t.is_alive()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_formation_that_failed_or_was_abandoned_closes_its_sockets_at_once():
    """No reference cycle keeps gloo's device (a listening socket) or the helper's store client open
    until a garbage collection: under churn those piled up by the dozen."""
    host = StoreHost()
    cache = _cache(host)
    cache.store  # the cache's own client, kept
    gc.disable()
    try:
        before = _open_fds()
        with pytest.raises(CollectiveError, match="did not form"):
            GroupCache(lambda: connect_store("127.0.0.1", host.port, 1.0), "127.0.0.1", 1.0).get("g3", 0, 2, lambda: "")
        assert _open_fds() == before
        ended_at = time.monotonic() + 0.2
        with pytest.raises(CollectiveError, match="abandoned"):
            GroupCache(lambda: connect_store("127.0.0.1", host.port, 1.0), "127.0.0.1", 1.0).get(
                "g4", 0, 2, lambda: "over" if time.monotonic() >= ended_at else "")
        for t in [t for t in threading.enumerate() if t.name.startswith("diloco-group-")]:
            t.join(10)
        assert _open_fds() == before
    finally:
        gc.enable()


def test_a_group_formed_with_a_stop_check_that_never_fires_is_the_same_group():
    import torch

    host = StoreHost()
    caches = [_cache(host) for _ in range(2)]
    groups = {}

    def rank(r: int) -> None:
        groups[r] = caches[r].get("g2", r, 2, lambda: "")

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    out = {}

    def reduce(r: int) -> None:
        t = torch.tensor([float(r + 1)])
        groups[r].allreduce([t]).wait()
        out[r] = float(t)

    threads = [threading.Thread(target=reduce, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert out == {0: 3.0, 1: 3.0}
    assert caches[0].get("g2", 0, 2, lambda: "stop") is groups[0], "a cached group is not formed again"
