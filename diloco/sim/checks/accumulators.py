"""The sparse wire (SPEC.md section 11), judged from the trace alone: every worker's payload is
a top-k, 2-bit encoding of its own error-feedback accumulator, and no accumulator carries mass
into a round it was not made for (**sparse**).

The checker keeps its own copy of each worker's accumulator, in double precision, rebuilt from
the seeded pseudo-gradients the simulated workers submit (``seeded_update``, recomputed here):
before a Submit of fragment f for round r the accumulator is ``beta * e + delta`` when ``e``
was left by the worker's Submit of round r - 1 (or restored from a checkpoint with it), else
just ``delta`` -- a Welcome that opens neither that round (with no Submit of it parked: a dead
incarnation's) nor, with the Submit that made it parked or kept to send again, the round
before drops it; after the Submit it is that minus
what the payload carries. A Submit of a round already sent must carry the same payload again
and leave the accumulator as it was. A payload must hold exactly ``min(k, chunk length)`` entries
of every chunk at strictly increasing places, entries no smaller than any left out, a scale
equal to the largest kept magnitude and each code the level nearest its entry (all within
the tolerances, as the worker computes in float32).

Each incarnation of a sparse worker starts with an ``acc`` record (``resume``: it restored
the checkpoint it last wrote, whose ``ckpt`` record the checker saw, residuals and the rounds
they are for, but no payload to send again). Accepted sparse
contributions are decoded here for the outer step (plain SGD on their mean, ``params``).
"""

from __future__ import annotations

import hashlib
import struct

from diloco.sim.checks.model import RTOL

#: A code ``c`` stands for ``(2c - 3) / 3`` of its chunk's scale.
_LEVELS = (-1.0, -1 / 3, 1 / 3, 1.0)


def _f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def seeded_delta(seed: int, wid: str, f: int, r: int, sizes: dict[str, int]) -> dict[str, list[float]]:
    """The pseudo-gradient a simulated worker submits: blake2b words mapped to [-0.1, 0.1), float32."""
    total = sum(sizes.values())
    digest = hashlib.blake2b(f"{seed}:{wid}:{f}:{r}".encode(), digest_size=max(4 * total, 4)).digest()
    words = struct.unpack(f"<{total}I", digest[:4 * total])
    out, i = {}, 0
    for n, k in sizes.items():
        out[n] = [_f32((w / 4294967296.0 - 0.5) * 0.2) for w in words[i:i + k]]
        i += k
    return out


def decode(entries: list, scales: list, numel: int, chunk: int, k: int) -> list[tuple[int, list[tuple[int, int]]]]:
    """A payload as (scale, [(place, code)]) per chunk; ValueError if its layout is not the format's."""
    chunks = -(-numel // chunk)
    if len(scales) != chunks:
        raise ValueError(f"{len(scales)} scales for {chunks} chunks")
    out, i = [], 0
    for c in range(chunks):
        kept = min(k, min(chunk, numel - c * chunk))
        part = [(int(e) >> 2, int(e) & 3) for e in entries[i:i + kept]]
        i += kept
        if len(part) != kept:
            raise ValueError(f"chunk {c} has {len(part)} entries, not {kept}")
        out.append((scales[c], part))
    if i != len(entries):
        raise ValueError(f"{len(entries)} entries; the format has {i}")
    return out


def densify(entries: list, scales: list, numel: int, chunk: int, k: int) -> list[float]:
    dense = [0.0] * numel
    for c, (scale, part) in enumerate(decode(entries, scales, numel, chunk, k)):
        for place, code in part:
            dense[c * chunk + place] = _f32(_f32(_LEVELS[code]) * scale)
    return dense


class AccumulatorChecks:
    """A mixin of ``TraceChecker``: each sparse worker's accumulator and payloads."""

    def _init_accumulators(self) -> None:
        #: worker process (its peer, "worker-3/2": an incarnation) -> fragment -> (the round its
        #: residual is for, the residual per param). Keyed by process, as a dead one's last Submit
        #: may arrive after its restart began.
        self.acc: dict[str, dict[int, tuple[int, dict[str, list[float]]]]] = {}
        #: worker process -> fragment -> (round, entries, scales) of its last payload (sent again, as it
        #: was, when that round is submitted again).
        self.acc_last: dict[str, dict[int, tuple]] = {}
        #: worker id -> its residuals with their rounds when it last wrote a checkpoint (a resume restores it).
        self.acc_saved: dict[str, dict[int, tuple[int, dict[str, list[float]]]]] = {}

    @property
    def sparse(self) -> bool:
        return self.cfg is not None and self.cfg.get("wire_dtype") == "sparse"

    def _on_acc(self, rec: dict) -> None:
        """A sparse worker's incarnation starts: with the residual of its last checkpoint, or none."""
        saved = self.acc_saved.get(rec["w"]) if rec["resume"] else None
        self.acc_last[rec["p"]] = {}
        if saved is None:
            self.acc[rec["p"]] = {}
            return
        self.acc[rec["p"]] = {f: (label, {n: list(v) for n, v in e.items()}) for f, (label, e) in saved.items()}

    def _accumulator_saved(self, rec: dict) -> None:
        """A ``ckpt`` record: the worker's residuals go into it, with the rounds they are for."""
        if self.sparse:
            self.acc_saved[rec["w"]] = {f: (label, {n: list(v) for n, v in e.items()})
                                        for f, (label, e) in self.acc.get(rec["p"], {}).items()}

    def _welcome_taken(self, welcome: dict) -> None:
        """A worker installed a Welcome: a fragment's residual stays only if the Welcome opens the round
        it was made for, or the round of the Submit that made it, parked or to be sent again as it was."""
        peer = welcome["dst"]
        acc, last = self.acc.setdefault(peer, {}), self.acc_last.setdefault(peer, {})
        parked = {(p[0], p[1]) for p in welcome["parked"]}
        for f, (label, _) in list(acc.items()):
            w = welcome["round_ids"][f]
            keep = (f, w) not in parked if w == label else \
                w == label - 1 and ((f, w) in parked or last.get(f, (None,))[0] == w)
            if not keep:
                del acc[f]
                last.pop(f, None)

    def _dense_contribution(self, msg: dict, f: int) -> dict[str, list[float]]:
        """An accepted contribution as the outer step sums it (a sparse one decoded here)."""
        if "sc" not in msg:
            return msg["v"]
        cfg, params = self.cfg, self.model.params[f]
        return {n: densify(e, msg["sc"][n], len(params[n]), cfg["sparse_chunk"], cfg["sparse_k"])
                for n, e in msg["v"].items()}

    def _payload_sent(self, rec: dict) -> None:
        """A worker's sparse Submit: its payload against the checker's copy of its accumulator."""
        m = self.model
        wid, peer, f, r = rec["worker_id"], rec["src"], rec["fragment_id"], rec["round_id"]
        if m is None or "sc" not in rec:
            self._violate("sparse", f"{wid} sent {'an fp32' if 'sc' not in rec else 'a sparse'} Submit of "
                                    f"fragment {f} round {r} {'on the sparse wire' if m else 'before the run had params'}")
            return
        cfg = self.cfg
        chunk, k, beta = cfg["sparse_chunk"], cfg["sparse_k"], cfg["sparse_beta"]
        names = m.fragments[f]
        sizes = {n: len(m.params[f][n]) for n in names}
        delta = seeded_delta(cfg["seed"], wid, f, r, sizes)
        label, e = self.acc.setdefault(peer, {}).get(f, (None, None))
        last = self.acc_last.setdefault(peer, {}).get(f)
        if label == r + 1 and last is not None and last[0] == r:
            if (last[1], last[2]) != (rec["v"], rec["sc"]):
                self._violate("sparse", f"{wid} submitted fragment {f} round {r} again with another payload: "
                                        f"its first one's entries left its accumulator already")
            self.counts["payloads_checked"] += 1
            return
        if label == r:
            t = {n: [d + beta * x for d, x in zip(delta[n], e[n])] for n in names}
        else:
            t = delta  # no residual, or one the run moved past: none of it may travel
        residual: dict[str, list[float]] = {}
        for n in names:
            try:
                chunks = decode(rec["v"][n], rec["sc"][n], sizes[n], chunk, k)
            except (KeyError, ValueError) as exc:
                self._violate("sparse", f"{wid}'s payload of fragment {f} round {r}, tensor {n!r}: {exc}")
                return
            problem = _payload_problem(t[n], chunks, chunk)
            if problem:
                stale = " (it carries a residual the run moved past)" if label not in (None, r) else ""
                self._violate("sparse", f"{wid}'s payload of fragment {f} round {r}, tensor {n!r}: {problem}, "
                                        f"against the accumulator the checker rebuilt{stale}")
                return
            sent = densify(rec["v"][n], rec["sc"][n], sizes[n], chunk, k)
            residual[n] = [x - s for x, s in zip(t[n], sent)]
        self.acc[peer][f] = (r + 1, residual)
        self.acc_last[peer][f] = (r, rec["v"], rec["sc"])
        self.counts["payloads_checked"] += 1


def _payload_problem(t: list[float], chunks: list, chunk: int) -> str:
    """Why a payload is not the chunk-wise top-k, 2-bit encoding of ``t`` ("" if it is)."""
    for c, (scale, part) in enumerate(chunks):
        values = t[c * chunk:(c + 1) * chunk]
        places = [p for p, _ in part]
        if any(b <= a for a, b in zip(places, places[1:])) or any(p >= len(values) for p in places):
            return f"chunk {c}'s places {places} are not strictly increasing within it"
        kept = {abs(values[p]) for p in places}
        left = [abs(v) for i, v in enumerate(values) if i not in set(places)]
        top = max(kept, default=0.0)
        tol = RTOL * max(top, 1e-12)
        if left and max(left) > min(kept) + tol:
            return f"chunk {c} leaves out an entry of magnitude {max(left):g} and keeps one of {min(kept):g}"
        if abs(scale - top) > tol:
            return f"chunk {c}'s scale is {scale:g}, its largest kept magnitude {top:g}"
        for p, code in part:
            if abs(values[p] / (scale or 1.0) - _LEVELS[code]) > 1 / 3 + RTOL:
                return f"chunk {c} place {p}: code {code} for {values[p]:g} (scale {scale:g}) is not its nearest level"
    return ""
