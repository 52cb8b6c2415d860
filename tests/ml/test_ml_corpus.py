"""Corpus: deterministic, fixed byte vocabulary, clean splits and shards, seeded batches, clear errors."""

from __future__ import annotations

import sysconfig

import pytest
import torch

from diloco.data import (
    MIN_CORPUS_BYTES,
    VOCAB_SIZE,
    BatchSampler,
    Corpus,
    CorpusError,
    decode,
    derive_seed,
    encode,
    load_stdlib_text,
    load_text,
    make_shards,
    split_train_eval,
    stdlib_source_files,
)


def test_stdlib_files_sorted_and_filtered():
    files = stdlib_source_files()
    base = sysconfig.get_paths()["stdlib"]
    rel = [str(p.relative_to(base)) for p in files]
    assert rel == sorted(rel, key=lambda r: r.replace("\\", "/"))
    assert len(files) > 50
    for r in rel:
        parts = r.split("/")
        assert "site-packages" not in parts and "test" not in parts and "__pycache__" not in parts
        assert r.endswith(".py")


def test_stdlib_text_is_deterministic_and_capped():
    a = load_stdlib_text(100_000)
    b = load_stdlib_text(100_000)
    assert a == b and len(a) == 100_000
    # A larger cap extends the same prefix (sorted order, no reshuffling).
    assert load_stdlib_text(150_000)[:100_000] == a


def test_encode_decode_roundtrip_any_bytes():
    raw = bytes(range(256)) * 3
    t = encode(raw)
    assert t.dtype == torch.uint8 and t.numel() == 768 and int(t.max()) == VOCAB_SIZE - 1
    assert encode("héllo").tolist() == list("héllo".encode())
    assert decode(encode("def f(x):\n    return x")) == "def f(x):\n    return x"


def test_split_is_deterministic_disjoint_and_complete():
    tokens = encode(load_stdlib_text(50_000))
    tr, ev = split_train_eval(tokens, eval_every=10, chunk_len=1000)
    tr2, ev2 = split_train_eval(tokens, eval_every=10, chunk_len=1000)
    assert torch.equal(tr, tr2) and torch.equal(ev, ev2)
    assert tr.numel() + ev.numel() == tokens.numel()
    assert ev.numel() == 5 * 1000  # chunks 9, 19, 29, 39, 49
    assert torch.equal(ev[:1000], tokens[9000:10000])  # every 10th chunk, not a tail


def test_shards_iid_equal_disjoint_and_seeded():
    tokens = torch.arange(40 * 64, dtype=torch.int64)  # distinct values: block identity is visible
    shards = make_shards(tokens, 4, seed=3, block_len=64)
    assert [s.numel() for s in shards] == [640] * 4
    allv = torch.cat(shards)
    assert allv.unique().numel() == allv.numel() == tokens.numel()  # disjoint, nothing lost
    again = make_shards(tokens, 4, seed=3, block_len=64)
    assert all(torch.equal(a, b) for a, b in zip(shards, again))
    other = make_shards(tokens, 4, seed=4, block_len=64)
    assert not all(torch.equal(a, b) for a, b in zip(shards, other))
    # i.i.d.: each shard draws blocks from all over the text, not one contiguous range.
    # (A contiguous shard would span exactly 640 tokens.)
    assert all(int(s.max() - s.min()) > tokens.numel() // 4 for s in shards)
    contiguous = make_shards(tokens, 4, seed=3, block_len=64, iid=False)
    assert torch.equal(contiguous[0], tokens[:640])


def test_shards_too_few_blocks_is_a_clear_error():
    with pytest.raises(CorpusError, match="k=8"):
        make_shards(torch.arange(100), 8, block_len=64)


def test_batch_sampler_shapes_targets_and_seed():
    shard = encode(load_stdlib_text(20_000))
    s1 = BatchSampler(shard, 4, 16, seed=7)
    x, y = s1.next()
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    s2 = BatchSampler(shard, 4, 16, seed=7)
    assert torch.equal(s2.next()[0], x)
    assert not torch.equal(BatchSampler(shard, 4, 16, seed=8).next()[0], x)
    # A private generator: the global RNG is neither used nor advanced.
    state = torch.get_rng_state()
    s1.next()
    assert torch.equal(state, torch.get_rng_state())


def test_batch_sampler_shard_too_small():
    with pytest.raises(CorpusError, match="seq_len \\+ 1 = 17"):
        BatchSampler(torch.arange(10), 2, 16, seed=0)


def test_load_text_errors_name_path_and_minimum(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(CorpusError, match="nope.txt.*does not exist"):
        load_text(missing)
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(CorpusError, match=f"empty.txt.*empty.*{MIN_CORPUS_BYTES}"):
        load_text(empty)
    small = tmp_path / "small.txt"
    small.write_text("hello world\n")
    with pytest.raises(CorpusError, match=f"small.txt.*too small: 12 bytes.*{MIN_CORPUS_BYTES}"):
        load_text(small)
    with pytest.raises(CorpusError, match="not a regular file"):
        load_text(tmp_path)


def test_corpus_from_file(tmp_path):
    p = tmp_path / "t.txt"
    p.write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    c = Corpus.from_file(p)
    assert c.num_tokens == p.stat().st_size and c.eval.numel() > 0 and c.source == str(p)


def test_derive_seed_is_stable_and_distinct():
    assert derive_seed(0, "worker", 1) == derive_seed(0, "worker", 1)
    seeds = {derive_seed(s, "worker", i) for s in range(3) for i in range(5)}
    assert len(seeds) == 15
    assert derive_seed(0, "worker", 1) == 921561516274268459  # pinned: no salted hash()
