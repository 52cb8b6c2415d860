"""The digest a collective member votes with, and the outer step's norm (SPEC.md M11) measured with it.

The digest is SHA-256 over, per tensor, its name, size and the wrapping int64 sums
of its fp32 bit patterns read as 64-bit words, one sum per block of 32,768 words.
Integer sums do not depend on the order a kernel adds in, so every replica that
holds the same bits computes the same digest; one different bit changes its
block's sum. It guards against divergence (a bug, a nondeterministic kernel), not
against a forger: a member that lies can also lie about its pseudo-gradient.

A proposal needs both the digest of the new params and the norm of the step that
made them; each is a pass over the model, so they are taken together: with the
fp32 Nesterov step itself, block by block while the block is in the cache
(``StepWatch``), or in one pass after any other step (``digest_and_step_norm``).
"""

from __future__ import annotations

import hashlib
from typing import Mapping

import torch

from diloco.blocked_step import BLOCK
from diloco.collective.reduce import tensors_norm

Tensors = dict[str, torch.Tensor]

#: 64-bit words per block sum: a 100M-parameter model hashes about 1,500 sums.
_BLOCK_WORDS = 1 << 15


def digest(params: Mapping[str, torch.Tensor]) -> str:
    return _walk(params)[0]


def digest_and_step_norm(after: Mapping[str, torch.Tensor], before: Mapping[str, torch.Tensor],
                         scratch: torch.Tensor) -> tuple[str, float]:
    """``digest(after)`` and the norm of ``after - before`` (``tensors_norm`` of the difference, the
    outer step's norm), in one pass: a chunk of ``after`` is read once for both, its difference
    going through ``scratch`` (fp32, at least ``_DIGEST_CHUNK`` elements) rather than a model-sized
    tensor. Reading the params twice (a digest pass and a step pass) made a round about 5% slower.
    The norm is non-finite when ``after`` is (``before`` being finite)."""
    return _walk(after, before, scratch)


#: A chunk of ``digest_and_step_norm``: whole digest blocks (two fp32 per word) and whole norm blocks.
_DIGEST_CHUNK = 2 * _BLOCK_WORDS


def _walk(after: Mapping[str, torch.Tensor], before: Mapping[str, torch.Tensor] | None = None,
          scratch: torch.Tensor | None = None) -> tuple[str, float]:
    h = hashlib.sha256()
    squares = 0.0
    chunk = 0
    if before is not None:
        if scratch is None or scratch.numel() < _DIGEST_CHUNK:
            raise ValueError(f"the scratch buffer is smaller than one chunk ({_DIGEST_CHUNK} elements)")
        chunk = scratch.numel() - scratch.numel() % _DIGEST_CHUNK
    for name, t in after.items():
        flat = t.detach().to(torch.float32).contiguous().reshape(-1)
        n = flat.numel()
        words, full = _words(flat)
        h.update(_header(name, flat, words, full))
        step = chunk or max(n, 1)
        old = before[name].detach().reshape(-1) if before is not None else None
        for start in range(0, n, step):
            stop = min(start + step, n)
            if start // 2 < full:  # the block sums of this chunk: int64 sums wrap, order-free
                sums = words[start // 2:min(stop // 2, full)].view(-1, _BLOCK_WORDS).sum(dim=1)
                h.update(sums.numpy().tobytes())
            if old is not None:
                part = scratch[:stop - start]
                torch.sub(flat[start:stop], old[start:stop], out=part)
                squares += tensors_norm({"": part}) ** 2
        h.update(b";")
    return h.hexdigest(), squares ** 0.5


def _words(flat: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``flat``'s fp32 bit patterns read as 64-bit words (an odd last element left out), and how many of
    them fill whole digest blocks."""
    n = flat.numel()
    words = flat.view(torch.int32)[:n - n % 2].view(torch.int64)
    return words, words.numel() - words.numel() % _BLOCK_WORDS


def _header(name: str, flat: torch.Tensor, words: torch.Tensor, full: int) -> bytes:
    """What the digest hashes of a tensor before its block sums: its name, size, the sum of the words
    past the last whole block and the bits of an odd last element."""
    n = flat.numel()
    tail = int(words[full:].sum()) if full < words.numel() else 0
    odd = int(flat.view(torch.int32)[-1]) if n % 2 else 0
    return f"{name}:{n}:{tail}:{odd}:".encode()


class StepWatch:
    """The fp32 Nesterov step's companion (``BlockWatch``): while the blocked step has a block of the
    params in the cache, back it up (before), then measure the step's norm (M11) and the digest's
    block sums on it (after). The backup, the step, the check's measure and the vote's digest take
    one pass over the model instead of three."""

    def __init__(self, params: Tensors, backup: Tensors, scratch: torch.Tensor) -> None:
        if BLOCK % (2 * _BLOCK_WORDS) or scratch.numel() < BLOCK:
            raise RuntimeError(f"a step block ({BLOCK} elements) must hold whole digest blocks "
                               f"({2 * _BLOCK_WORDS} elements) and fit the scratch ({scratch.numel()})")
        self._params = {n: p.detach().view(-1) for n, p in params.items()}
        self._backup = {n: backup[n].view(-1) for n in params}
        self._scratch = scratch
        self._words: dict[str, tuple[torch.Tensor, int]] = {}
        self._squares: list[torch.Tensor] = []
        self._sums: list[torch.Tensor] = []
        self._hash = hashlib.sha256()
        self._visited: list[tuple[str, int, int]] = []

    def before(self, name: str, start: int, end: int) -> None:
        self._backup[name][start:end].copy_(self._params[name][start:end])
        self._visited.append((name, start, end))

    def after(self, name: str, start: int, end: int) -> None:
        # The block's step through the scratch (a fresh block-sized temporary would be mapped and
        # faulted in on every call); its squares summed in fp32 by BLAS (~1e-7 of the sum at this
        # length), the blocks in float64 (``result``).
        step = torch.sub(self._params[name][start:end], self._backup[name][start:end],
                         out=self._scratch[:end - start])
        self._squares.append(torch.dot(step, step))
        if name not in self._words:
            self._words[name] = _words(self._params[name])
        words, full = self._words[name]
        first, last = start // 2, min(end // 2, full)
        if first < last:
            self._sums.append(words[first:last].view(-1, _BLOCK_WORDS).sum(dim=1))

    def done(self, name: str) -> None:
        flat = self._params[name]
        words, full = self._words.get(name) or _words(flat)
        self._hash.update(_header(name, flat, words, full))
        if self._sums:
            sums = self._sums[0] if len(self._sums) == 1 else torch.cat(self._sums)
            self._hash.update(sums.numpy().tobytes())
        self._sums = []
        self._hash.update(b";")

    def result(self) -> tuple[str, float]:
        """``digest_and_step_norm``'s answer for the step just taken."""
        squares = float(torch.stack(self._squares).double().sum()) if self._squares else 0.0
        return self._hash.hexdigest(), squares ** 0.5

    def undo(self) -> None:
        """The blocks backed up so far, back (a step that failed part way; the rest was not touched)."""
        with torch.no_grad():
            for name, start, end in self._visited:
                self._params[name][start:end].copy_(self._backup[name][start:end])
