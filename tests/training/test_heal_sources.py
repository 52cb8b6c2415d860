"""C6, "Heals from several sources": a joiner copies the committed state from up to K members at
once, each sending a part; a source that dies, stalls or sends another state has its part sent by
the others; the coordinator names the sources and withdraws every one of them (M12)."""

from __future__ import annotations

import dataclasses
import multiprocessing
import threading
import time

import pytest
import torch

from diloco.collective import heal
from diloco.collective.groups import CollectiveError, build_group, connect_store
from diloco.collective.replica import Replica, digest
from diloco.collective.store import StoreHost
from diloco.outer import OuterConfig
from diloco.testing import join_message, make_coordinator, replies
from diloco.wire.messages import HealOrder, Leave, Submit

FRAGMENTS = (("a", "b", "c"), ("d",))


def replica(round_ids=(0, 0), scale: float = 1.0) -> Replica:
    params = {"a": torch.arange(600, dtype=torch.float32).reshape(20, 30) * scale, "b": torch.ones(300),
              "c": torch.full((7,), 2.0), "d": torch.linspace(0, 1, 500)}
    r = Replica(params, FRAGMENTS, list(round_ids), OuterConfig(), "fp32", 2)
    vote = r.propose(0, round_ids[0], {n: torch.full_like(params[n], 0.25) for n in FRAGMENTS[0]})
    assert r.commit(0, round_ids[0], vote)  # some momentum to carry
    return r


def serve(host: StoreHost, prefix: str, source: Replica, results: dict, key, delay_s: float = 0.0) -> threading.Thread:
    def run():
        time.sleep(delay_s)
        try:
            results[key] = heal.send_state(connect_store("127.0.0.1", host.port, 10), prefix, "127.0.0.1", 10,
                                           source.round_ids, source.params, source.optimizer_states())
        except CollectiveError as exc:
            results[key] = exc
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def assert_holds(got, source: Replica) -> None:
    round_ids, params, states = got
    assert round_ids == source.round_ids
    healed = Replica(params, FRAGMENTS, round_ids, OuterConfig(), "fp32", 2, states)
    assert digest(healed.params) == digest(source.params)
    assert torch.equal(healed.optimizer_states()[0]["state"][0]["momentum_buffer"],
                       source.optimizer_states()[0]["state"][0]["momentum_buffer"])


def test_parts_cover_every_tensor_once_in_runs_of_about_equal_bytes():
    sizes = [400, 4, 4, 1200, 400, 400, 8, 1600]
    for parts in (1, 2, 3, 5, 12):
        split = heal.part_indices(sizes, parts)
        assert len(split) == parts
        assert [i for part in split for i in part] == list(range(len(sizes)))  # each once, in order
        for part in split:
            assert sum(sizes[i] for i in part) <= sum(sizes) / parts + max(sizes)
    with pytest.raises(ValueError, match="at least one part"):
        heal.part_indices(sizes, 0)


def test_three_sources_each_send_a_part_and_the_joiner_holds_the_whole_state():
    host, source = StoreHost(), replica()
    sent: dict = {}
    threads = [serve(host, f"run/h/p{k}", source, sent, k) for k in range(3)]
    got = heal.recv_state(connect_store("127.0.0.1", host.port, 10), [f"run/h/p{k}" for k in range(3)],
                          "127.0.0.1", 10)
    for t in threads:
        t.join(20)
    assert_holds(got, source)
    whole = sum(t.numel() * 4 for t in source.params.values()) * 2  # params and momentum, roughly
    assert all(isinstance(sent[k], int) for k in range(3)), sent
    assert max(sent.values()) < 0.7 * whole, f"one source sent (nearly) everything: {sent} of {whole}"


def _dying_source(port: int, prefix: str) -> None:
    """A source that sends the header, hears its part asked, and dies before sending it (kill -9)."""
    import os

    source = replica()
    store = connect_store("127.0.0.1", port, 10)
    heal.meet(store, prefix, 0, 10)
    group = build_group(store, prefix, 0, 2, "127.0.0.1", 10)
    import msgpack
    tensors: list = list(source.params.values())
    states = [heal._plain_state(s, tensors) for s in source.optimizer_states()]
    header = msgpack.packb({"round_ids": source.round_ids, "names": list(source.params), "states": states,
                            "table": [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors]},
                           use_bin_type=True)
    heal._broadcast(group, torch.tensor([len(header)], dtype=torch.int64), 10)
    heal._broadcast(group, torch.frombuffer(bytearray(header), dtype=torch.uint8), 10)
    heal._asked(group, len(tensors), 10)
    os._exit(9)


def test_a_source_that_dies_mid_heal_has_its_part_sent_by_the_others():
    host, source = StoreHost(), replica()
    dying = multiprocessing.get_context("spawn").Process(target=_dying_source, args=(host.port, "run/d/p1"))
    dying.start()
    sent: dict = {}
    threads = [serve(host, f"run/d/p{k}", source, sent, k) for k in (0, 2)]
    try:
        got = heal.recv_state(connect_store("127.0.0.1", host.port, 10), [f"run/d/p{k}" for k in range(3)],
                              "127.0.0.1", 10)
    finally:
        dying.join(20)
        if dying.is_alive():
            dying.kill()
    for t in threads:
        t.join(20)
    assert dying.exitcode == 9, "the middle source died as planned"
    assert_holds(got, source)
    split = heal.part_indices([t.numel() * 4 for t in [*source.params.values(),
                                                       *source.optimizer_states()[0]["state"][0].values()]], 3)
    assert split[1], "the dead source had a part to send"
    assert isinstance(sent[0], int) and isinstance(sent[2], int), sent


def test_a_source_with_another_state_is_let_go_and_its_part_comes_from_the_others():
    host, good, other = StoreHost(), replica(), replica(round_ids=(3, 0), scale=2.0)
    sent: dict = {}
    threads = [serve(host, "run/m/p0", good, sent, 0), serve(host, "run/m/p1", good, sent, 1),
               serve(host, "run/m/p2", other, sent, 2, delay_s=1.0)]  # its header comes last
    got = heal.recv_state(connect_store("127.0.0.1", host.port, 10), [f"run/m/p{k}" for k in range(3)],
                          "127.0.0.1", 10)
    for t in threads:
        t.join(20)
    assert_holds(got, good)
    header_only = sent[2]
    assert isinstance(header_only, int) and header_only < 4096, "the other state's source sent only its header"


def test_a_heal_whose_every_source_fails_says_so_for_each():
    host = StoreHost()
    started = time.monotonic()
    with pytest.raises(CollectiveError, match=r"source 1 of 2: .*did not come.*source 2 of 2: .*did not come"):
        heal.recv_state(connect_store("127.0.0.1", host.port, 10), ["run/x/p0", "run/x/p1"], "127.0.0.1", 1)
    assert time.monotonic() - started < 5, "the sources were waited for one after the other"


def test_a_joiner_asking_outside_the_table_is_refused_by_the_source():
    host, source = StoreHost(), replica()
    sent: dict = {}
    t = serve(host, "run/bad", source, sent, 0)
    store = connect_store("127.0.0.1", host.port, 10)
    heal.meet(store, "run/bad", 1, 10)
    group = build_group(store, "run/bad", 1, 2, "127.0.0.1", 10)
    heal._recv_header(group, 10)
    heal._ask(group, [0, 99], 10)
    t.join(20)
    assert isinstance(sent[0], CollectiveError) and "outside the table" in str(sent[0])


# ---------------------------------------------------------------- the coordinator names them

PARAMS = {"w": torch.zeros(3)}


def join(c, wid: str, now: float, held=(0,), layout=None):
    msg = dataclasses.replace(join_message(wid, list(join_message(wid, PARAMS).spec)), layout=layout)
    if held is not None:
        msg = dataclasses.replace(msg, holds_params=True, held_rounds=held)
    return c.handle(wid, msg, now)


def welcome_of(out, wid):
    from diloco.wire.messages import Welcome
    return next(m for peer, m in out if peer == wid and isinstance(m, Welcome))


def three_holders(heal_sources: int):
    """w0 starts the run; w1 and w2 heal and get ready: three members hold the state."""
    c = make_coordinator(0.0, min_workers=1, data_plane="collective", heartbeat_timeout_s=10.0,
                         reduce_timeout_s=30.0, collective_timeout_s=5.0, heal_sources=heal_sources)
    join(c, "w0", 1.0)
    c.handle("w0", Submit("w0", 0, 0, {}, norm=1.0), 1.2)
    for k, wid in enumerate(("w1", "w2"), start=1):
        join(c, wid, 1.5 + k)
        c.collective.holds_state(wid)
    return c


def test_the_coordinator_orders_up_to_k_sources_each_with_its_own_prefix():
    c = three_holders(heal_sources=3)
    out = join(c, "w3", 5.0)
    orders = replies(out, HealOrder)
    sources = [peer for peer, _ in orders]
    assert sorted(sources) == ["w0", "w1", "w2"]
    prefixes = [m.prefix for _, m in orders]
    assert len(set(prefixes)) == 3 and all(prefixes)
    w = welcome_of(out, "w3")
    assert [w.heal_source, *w.more_heal_sources] == sources
    assert [w.heal_prefix, *w.more_heal_prefixes] == prefixes
    # Withdrawn, every source is told (M12).
    out = c.handle("w3", Leave("w3"), 6.0)
    assert sorted((peer, m.joiner, m.prefix) for peer, m in replies(out, HealOrder)) == [
        ("w0", "w3", ""), ("w1", "w3", ""), ("w2", "w3", "")]


def test_fewer_holders_than_k_give_fewer_sources_and_one_source_is_the_old_welcome():
    c = three_holders(heal_sources=8)
    assert len(replies(join(c, "w3", 5.0), HealOrder)) == 3
    c = three_holders(heal_sources=1)
    out = join(c, "w3", 5.0)
    w = welcome_of(out, "w3")
    assert len(replies(out, HealOrder)) == 1 and w.heal_source and w.more_heal_sources == ()


def test_sharded_members_heal_from_one_source():
    c = three_holders(heal_sources=3)
    c.collective.layout = "fsdp:2"  # the holders' layout
    out = join(c, "w3", 5.0, layout="fsdp:2")
    assert len(replies(out, HealOrder)) == 1 and welcome_of(out, "w3").more_heal_sources == ()


@pytest.mark.parametrize("bad", [0, 9, True, 2.0])
def test_heal_sources_out_of_range_is_refused(bad):
    from diloco.core import ConfigError
    with pytest.raises(ConfigError, match="heal_sources"):
        make_coordinator(0.0, data_plane="collective", heal_sources=bad)
