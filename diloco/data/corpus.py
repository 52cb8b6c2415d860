"""A character-level corpus made from text already on the machine.

Nothing is downloaded. The default corpus is the Python
standard library's own ``.py`` sources, read in sorted path order, so the same
interpreter always yields the same bytes; any other text file works through
:func:`load_text`.

Vocabulary. Tokens are raw **bytes** (ids 0..255, :data:`VOCAB_SIZE`), so any
file is valid input, the vocabulary is fixed without scanning the text, and a
model trained on one corpus can be evaluated on another. Tokens are stored as
``torch.uint8`` (1 byte per token) and widened to ``int64`` only per batch.

Pipeline::

    corpus = Corpus.from_stdlib()               # or Corpus.from_file(path)
    shards = make_shards(corpus.train, k, seed=0)   # k i.i.d. worker shards
    sampler = BatchSampler(shards[i], batch_size=32, seq_len=128, seed=...)
    x, y = sampler.next()                       # int64 [32, 128] each, y = x shifted by one

Held-out split (:func:`split_train_eval`): the token stream is cut into
fixed-size chunks and every ``eval_every``-th chunk goes to eval. Interleaving
(rather than a tail) keeps the eval set distributed like the train set: the
tail of the sorted standard library is a handful of packages (``xml``,
``zoneinfo`` ...), not representative text.

Shards (:func:`make_shards`): the train stream is cut into blocks, the blocks
are permuted with a seeded generator and dealt round-robin, so the k shards
are i.i.d. samples of the train text and differ only by which blocks they
hold (the calibration in benchmarks/README.md uses i.i.d. shards). ``iid=False``
gives contiguous ranges instead, a crude non-i.i.d. split.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "VOCAB_SIZE",
    "DEFAULT_MAX_BYTES",
    "MIN_CORPUS_BYTES",
    "CorpusError",
    "Corpus",
    "BatchSampler",
    "stdlib_source_files",
    "load_stdlib_text",
    "load_text",
    "encode",
    "decode",
    "split_train_eval",
    "make_shards",
    "derive_seed",
]

#: Byte-level vocabulary: token id = byte value.
VOCAB_SIZE = 256
#: Default cap on the standard-library corpus (bytes); ~4 MB is plenty for a ~100k-param model.
DEFAULT_MAX_BYTES = 4_000_000
#: Smallest text accepted by :func:`load_text` / :class:`Corpus` (bytes).
#: Below this a train/eval split with seq_len 128 windows is meaningless.
MIN_CORPUS_BYTES = 4096

# Directories of the standard library that are not representative source
# text: tests (huge, full of odd literals), third-party packages, bytecode,
# build config, and ``encodings`` (mostly generated code-page tables).
_SKIP_DIRS = frozenset(
    {
        "site-packages",
        "dist-packages",
        "test",
        "tests",
        "idle_test",
        "__pycache__",
        "encodings",
        "lib2to3",
        "ensurepip",
    }
)


class CorpusError(ValueError):
    """A corpus could not be built: names the path or argument, the value and what was expected."""


def derive_seed(seed: int, *tags: object) -> int:
    """A deterministic 63-bit seed derived from ``seed`` and ``tags`` (e.g. ``("worker", 3)``).

    Used so one run seed fans out to independent per-worker streams without
    relying on Python's salted ``hash``.
    """
    h = 1469598103934665603  # FNV-1a 64-bit offset basis
    for part in (seed, *tags):
        for b in repr(part).encode() + b"\x1f":
            h ^= b
            h = (h * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h & 0x7FFFFFFFFFFFFFFF


def stdlib_source_files(root: str | os.PathLike | None = None) -> list[Path]:
    """The standard library's ``.py`` files in sorted relative-path order.

    ``root`` defaults to ``sysconfig.get_paths()["stdlib"]``. Test suites,
    site-packages and generated tables are skipped (see ``_SKIP_DIRS``);
    ``_sysconfigdata*`` (machine-specific build data) is skipped too.
    """
    base = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    if not base.is_dir():
        raise CorpusError(f"standard library directory {str(base)!r} does not exist or is not a directory")
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(base):
        # Prune in place, sorted, so os.walk's order is deterministic too.
        dirnames[:] = sorted(
            d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("config-") and not d.startswith(".")
        )
        for name in sorted(filenames):
            if name.endswith(".py") and not name.startswith("_sysconfigdata"):
                found.append(Path(dirpath) / name)
    found.sort(key=lambda p: p.relative_to(base).as_posix())
    return found


def load_stdlib_text(max_bytes: int = DEFAULT_MAX_BYTES, root: str | os.PathLike | None = None) -> bytes:
    """Concatenate standard-library sources (sorted order) until ``max_bytes``.

    Files that cannot be read are skipped (the result is still deterministic
    for a given installation). The last file is truncated so the result is
    exactly ``max_bytes`` long when the library is big enough.
    """
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < MIN_CORPUS_BYTES:
        raise CorpusError(f"max_bytes={max_bytes!r} is invalid: expected an int >= {MIN_CORPUS_BYTES}")
    parts: list[bytes] = []
    total = 0
    for path in stdlib_source_files(root):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        if not data:
            continue
        data = data + b"\n\n"
        room = max_bytes - total
        parts.append(data[:room])
        total += min(len(data), room)
        if total >= max_bytes:
            break
    text = b"".join(parts)
    if len(text) < MIN_CORPUS_BYTES:
        where = root if root is not None else sysconfig.get_paths()["stdlib"]
        raise CorpusError(
            f"standard library at {str(where)!r} yielded only {len(text)} bytes of .py source; "
            f"need at least {MIN_CORPUS_BYTES} bytes"
        )
    return text


def load_text(path: str | os.PathLike, *, max_bytes: int | None = None, min_bytes: int = MIN_CORPUS_BYTES) -> bytes:
    """Read a text file as bytes (any encoding: the vocabulary is bytes).

    Raises :class:`CorpusError` naming the path when it is missing, not a
    file, unreadable, empty, or shorter than ``min_bytes``.
    """
    p = Path(path)
    if not p.exists():
        raise CorpusError(f"corpus file {str(p)!r} does not exist")
    if not p.is_file():
        raise CorpusError(f"corpus path {str(p)!r} is not a regular file")
    try:
        with p.open("rb") as f:
            data = f.read() if max_bytes is None else f.read(max_bytes)
    except OSError as exc:
        raise CorpusError(f"corpus file {str(p)!r} cannot be read: {exc.strerror or exc}") from exc
    if not data:
        raise CorpusError(f"corpus file {str(p)!r} is empty; need at least {min_bytes} bytes of text")
    if len(data) < min_bytes:
        raise CorpusError(
            f"corpus file {str(p)!r} is too small: {len(data)} bytes; need at least {min_bytes} bytes of text"
        )
    return data


def encode(text: bytes | str) -> torch.Tensor:
    """Bytes (or a str, encoded UTF-8) to a 1-D ``uint8`` token tensor."""
    if isinstance(text, str):
        text = text.encode("utf-8")
    if not isinstance(text, (bytes, bytearray)):
        raise CorpusError(f"encode() expects bytes or str, got {type(text).__name__}")
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).clone()


def decode(tokens: torch.Tensor) -> str:
    """Token ids back to text (invalid UTF-8 is replaced, never raises)."""
    return bytes(tokens.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


def split_train_eval(
    tokens: torch.Tensor, *, eval_every: int = 10, chunk_len: int = 4096
) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic held-out split: every ``eval_every``-th chunk of ``chunk_len`` tokens is eval.

    Chunk ``i`` (0-based) is held out when ``i % eval_every == eval_every - 1``,
    so a corpus of fewer than ``eval_every`` chunks uses smaller chunks to
    still give a non-empty eval set. Returns ``(train, eval)``, both 1-D.
    """
    _check_int("eval_every", eval_every, 2)
    _check_int("chunk_len", chunk_len, 2)
    n = int(tokens.numel())
    if n < MIN_CORPUS_BYTES:
        raise CorpusError(f"split_train_eval: {n} tokens is too few; need at least {MIN_CORPUS_BYTES}")
    # Small corpora: shrink the chunk so there are at least 2*eval_every chunks.
    chunk_len = max(2, min(chunk_len, n // (2 * eval_every)))
    n_chunks = n // chunk_len
    chunks = list(tokens[: n_chunks * chunk_len].view(n_chunks, chunk_len))
    tail = tokens[n_chunks * chunk_len :]
    train_parts = [c for i, c in enumerate(chunks) if i % eval_every != eval_every - 1]
    eval_parts = [c for i, c in enumerate(chunks) if i % eval_every == eval_every - 1]
    train_parts.append(tail)
    return torch.cat(train_parts).clone(), torch.cat(eval_parts).clone()


def make_shards(
    tokens: torch.Tensor, k: int, *, seed: int = 0, block_len: int = 1024, iid: bool = True
) -> list[torch.Tensor]:
    """Split ``tokens`` into ``k`` worker shards of (nearly) equal size.

    ``iid=True``: blocks of ``block_len`` tokens are permuted with a
    ``torch.Generator`` seeded by ``seed`` and dealt round-robin, so every
    shard samples the whole text. ``iid=False``: k contiguous ranges.
    Leftover tokens that do not fill a block (at most ``block_len - 1``) are
    dropped so shards are equal-sized.
    """
    _check_int("k", k, 1)
    _check_int("block_len", block_len, 2)
    n = int(tokens.numel())
    n_blocks = n // block_len
    if n_blocks < k:
        raise CorpusError(
            f"make_shards: {n} tokens make only {n_blocks} blocks of {block_len}; need at least k={k} "
            f"(a smaller block_len or a larger corpus)"
        )
    blocks = tokens[: n_blocks * block_len].view(n_blocks, block_len)
    per_shard = n_blocks // k
    if iid:
        g = torch.Generator().manual_seed(derive_seed(seed, "shards", k))
        order = torch.randperm(n_blocks, generator=g)[: per_shard * k]
        return [blocks[order[i::k]].reshape(-1).clone() for i in range(k)]
    return [blocks[i * per_shard : (i + 1) * per_shard].reshape(-1).clone() for i in range(k)]


class BatchSampler:
    """Seeded random windows from one shard: ``next()`` -> ``(input, target)``, each int64 ``[batch, seq_len]``.

    Window starts are drawn uniformly (with replacement) from a private
    ``torch.Generator``; the same ``(tokens, batch_size, seq_len, seed)``
    always gives the same batch sequence, and no global RNG is touched.
    ``target`` is ``input`` shifted left by one token.
    """

    def __init__(self, tokens: torch.Tensor, batch_size: int, seq_len: int, seed: int) -> None:
        _check_int("batch_size", batch_size, 1)
        _check_int("seq_len", seq_len, 1)
        if tokens.dim() != 1:
            raise CorpusError(f"BatchSampler expects 1-D tokens, got shape {tuple(tokens.shape)}")
        if tokens.numel() < seq_len + 1:
            raise CorpusError(
                f"BatchSampler: shard has {tokens.numel()} tokens; need at least seq_len + 1 = {seq_len + 1}"
            )
        self.tokens = tokens
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self._gen = torch.Generator().manual_seed(seed)
        self._offsets = torch.arange(seq_len + 1)
        self.batches_drawn = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next ``(input, target)`` batch."""
        high = self.tokens.numel() - self.seq_len  # start in [0, high): window of seq_len+1 fits
        starts = torch.randint(0, high, (self.batch_size,), generator=self._gen)
        windows = self.tokens[starts[:, None] + self._offsets].long()
        self.batches_drawn += 1
        return windows[:, :-1], windows[:, 1:]

    __next__ = next

    def __iter__(self) -> "BatchSampler":
        return self


@dataclass(frozen=True)
class Corpus:
    """A tokenised corpus split into train and held-out eval (both 1-D ``uint8`` tensors)."""

    train: torch.Tensor
    eval: torch.Tensor
    #: Where the text came from (a path, or ``"stdlib:<dir>"``), for reports.
    source: str

    @property
    def num_tokens(self) -> int:
        """Train + eval tokens."""
        return int(self.train.numel() + self.eval.numel())

    @classmethod
    def from_bytes(cls, text: bytes, *, source: str = "<bytes>", eval_every: int = 10, chunk_len: int = 4096) -> "Corpus":
        """Tokenise ``text`` and split it (see :func:`split_train_eval`)."""
        if len(text) < MIN_CORPUS_BYTES:
            raise CorpusError(
                f"corpus {source!r} is too small: {len(text)} bytes; need at least {MIN_CORPUS_BYTES} bytes"
            )
        train, ev = split_train_eval(encode(text), eval_every=eval_every, chunk_len=chunk_len)
        return cls(train=train, eval=ev, source=source)

    @classmethod
    def from_stdlib(cls, max_bytes: int = DEFAULT_MAX_BYTES, **split_kw) -> "Corpus":
        """The default corpus: the standard library's own sources, capped at ``max_bytes``."""
        text = load_stdlib_text(max_bytes)
        return cls.from_bytes(text, source=f"stdlib:{sysconfig.get_paths()['stdlib']}", **split_kw)

    @classmethod
    def from_file(cls, path: str | os.PathLike, *, max_bytes: int | None = None, **split_kw) -> "Corpus":
        """Any text file (read as bytes, optionally only the first ``max_bytes``)."""
        text = load_text(path, max_bytes=max_bytes)
        return cls.from_bytes(text, source=str(path), **split_kw)


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise CorpusError(f"{name}={value!r} is invalid: expected an int >= {minimum}")
