"""The coordinator's share of the collective data plane: who can heal whom, and group prefixes.

Sans-IO like the rest of the coordinator. The core decides *when* a group reduces
and *whether* it commits (SPEC.md C3-C5); this file only keeps what the driver needs
to carry those decisions out without ever holding the model (C6):

* the members that hold the committed state (they were ready for a round: they were in
  the last group or healed since), the heal sources, chosen round robin;
* the store prefix of each group: ``<secret>/<incarnation>/g<epoch>``, a new epoch whenever the group
  changes or an attempt failed, so workers rebuild a group only then (C7); the secret is
  random per run and reaches workers only over the control plane;
* the last commit of each fragment (round, digest): the durable record of the run here.
"""

from __future__ import annotations

import collections
import secrets
from typing import Callable

from diloco.coordinator.params import describe_mismatch, partition
from diloco.wire.messages import REPLICATED_LAYOUT, ErrorCode, Join, TensorSpec


class CollectivePlane:
    def __init__(self, num_fragments: int, secret: str | None = None, heal_sources: int = 1) -> None:
        #: Random per run; workers learn prefixes only from Welcomes and orders (SPEC.md C7).
        self.secret = secret or secrets.token_hex(16)
        #: New in every coordinator process, kept out of checkpoints: a resumed run's counters
        #: start again, and its prefixes must not meet rendezvous keys an earlier incarnation left.
        self.incarnation = secrets.token_hex(4)
        self.spec: tuple[TensorSpec, ...] | None = None
        self.fragments: tuple[tuple[str, ...], ...] = ()
        self.num_fragments = num_fragments
        #: Port of the store the runner hosts (set by ``diloco server``; 0 in the simulator).
        self.store_port = 0
        self._holders: dict[str, None] = {}
        self._next_source = 0
        self._epoch = 0
        self._group: tuple[str, ...] | None = None
        self._heals = 0
        #: At most this many members serve one heal, each a part (``--heal-sources``; one when the
        #: members are sharded: their heals go rank by rank).
        self.heal_sources = heal_sources
        #: joiner -> the (prefix, source) pairs of its heal, retired once it is ready for a round or gone.
        self._healing: dict[str, list[tuple[str, str]]] = {}
        #: (source, joiner) of heals whose joiner left or re-joined elsewhere before it was ready:
        #: the service tells each source to stop serving it (a withdrawn ``HealOrder``, M12).
        self.withdrawn: collections.deque[tuple[str, str]] = collections.deque(maxlen=1024)
        #: The held rounds of the state the run (re)started from, and whether a round has been
        #: committed since: until then a joiner holding a newer state starts the run again (C6).
        self._start_rounds: tuple[int, ...] | None = None
        self._start_current = False
        self._committed_since_start = False
        #: Workers welcomed by this coordinator (incarnation). A state one of them offers on a
        #: later join came from this incarnation's start or a heal (its round ids relabelled to
        #: the run's), or is older: it never starts the run again.
        self._welcomed: set[str] = set()
        #: fragment -> (round_id, digest) of its last commit; (-1, "") before any.
        self.last_commit: list[tuple[int, str]] = [(-1, "")] * num_fragments
        #: (prefix, group size) of groups no longer in use, for the runner to delete from the store.
        self.retired: collections.deque[tuple[str, int]] = collections.deque(maxlen=1024)
        self.stats: collections.Counter = collections.Counter()
        #: How the members holding the run's state shard their model (``Join.layout``; None: not sharded).
        self.layout: str | None = None

    # -- joins and heals

    def check_join(self, join: Join, is_member: Callable[[str], bool]) -> tuple[ErrorCode, str] | None:
        """What to refuse a join with, if anything (the model's layout; who can start the run)."""
        if not join.spec:
            return ErrorCode.BAD_MESSAGE, "the join's spec lists no tensors: a model needs at least one parameter"
        if self.spec is None:
            not_fp32 = [s for s in join.spec if s.dtype != "float32"]
            if not_fp32:
                return ErrorCode.BAD_MESSAGE, (f"initial params must be float32: tensor {not_fp32[0].name!r} is "
                                               f"{not_fp32[0].dtype}")
        elif tuple(join.spec) != self.spec:
            return ErrorCode.MODEL_MISMATCH, describe_mismatch(join.spec, self.spec)
        if join.params:
            return ErrorCode.BAD_MESSAGE, ("this run is on the collective data plane: the coordinator takes no "
                                           "params (join with holds_params; diloco >= protocol 4 does)")
        # S8: rank r of each member reduces with rank r of the others. The members holding the run's
        # state set its layout; once none does, the next member's becomes the run's.
        held = any(is_member(w) for w in self._holders if w != join.worker_id)
        if held and join.layout != self.layout:
            return ErrorCode.MODEL_MISMATCH, (
                f"the worker's model is laid out as {join.layout or REPLICATED_LAYOUT}; this run's members "
                f"hold theirs as {self.layout or REPLICATED_LAYOUT} (on the collective plane every member "
                f"shards its model the same way: the same number of ranks, the same placements)")
        # The joiner's own id does not count: a restarted worker's old incarnation is about to be
        # reported gone (R6), and what it held died with that process.
        if not any(is_member(w) for w in self._holders if w != join.worker_id) and not join.holds_params:
            return ErrorCode.START_PARAMS_REQUIRED, ("no member holds the run's state yet: join with your own "
                                                     "initial params to start it (they stay on your side)")
        if self.spec is None:
            self.spec = tuple(join.spec)
            self.fragments = partition(self.spec, self.num_fragments)
        if not held:
            self.layout = join.layout
        return None

    def reseed_for(self, joiner: str, held_rounds: tuple[int, ...], held_digests: tuple[str, ...]) -> tuple[str, ...]:
        """The members that must drop what they hold and join again before ``joiner`` is welcomed (C6).

        * Nobody holds the state, so the joiner starts the run: members still healing (from a
          source that is gone) join again -- with the state, if their heal completed.
        * Before the first commit since the run (re)started, the joiner's state replaces the one
          it started from: it is the state the last commits made (round and digest match the
          record) and the start's was not; or, offered by a worker this coordinator had not
          welcomed, its rounds are newer. Then every other holder, and whoever heals from them.
        """
        holders = [w for w in self._holders if w != joiner]
        healing = [w for w in self._healing if w != joiner]
        if not holders:
            return tuple(healing)
        if self._committed_since_start or self._start_rounds is None:
            return ()
        current = self.is_current(held_rounds, held_digests)
        newer = joiner not in self._welcomed and self._newer_than_start(held_rounds)
        if not ((current and not self._start_current) or newer):
            return ()
        self.stats["reseeds"] += 1
        return tuple(dict.fromkeys(holders + healing))

    def is_current(self, held_rounds: tuple[int, ...], held_digests: tuple[str, ...]) -> bool:
        """True when a state is the one this run's last commits made: every fragment that has a
        commit is at the round after it, with its digest."""
        n = self.num_fragments
        if len(held_rounds) != n or len(held_digests) != n:
            return False
        committed = [(f, r, d) for f, (r, d) in enumerate(self.last_commit) if r >= 0]
        return bool(committed) and all(held_rounds[f] == r + 1 and held_digests[f] == d for f, r, d in committed)

    def heal_sources_for(self, joiner: str, held_rounds: tuple[int, ...] = (),
                         held_digests: tuple[str, ...] = ()) -> list[tuple[str, str]]:
        """The (source, prefix) pairs a joiner that holds the state of ``held_rounds`` (() for
        initial params or nothing) heals from: up to ``heal_sources`` holders, taken round robin,
        source ``i`` sending part ``i``; [] when nobody holds the state: the joiner starts the run
        from its own (after a reseed, its state is the newer one)."""
        self._welcomed.add(joiner)
        holders = [w for w in self._holders if w != joiner]
        if not holders:
            self._holders[joiner] = None
            self._start_rounds = tuple(held_rounds)
            self._start_current = self.is_current(held_rounds, held_digests)
            self._committed_since_start = False
            return []
        count = min(len(holders), self.heal_sources if self.layout is None else 1)
        sources = [holders[(self._next_source + k) % len(holders)] for k in range(count)]
        self._next_source += 1
        self._heals += 1
        self.stats["heals"] += 1
        pairs = [(source, self._prefix(f"heal{self._heals}" + (f"p{k}" if k else "")))
                 for k, source in enumerate(sources)]
        self._retire_heal(joiner, withdraw=True)
        self._healing[joiner] = [(prefix, source) for source, prefix in pairs]
        return pairs

    def _prefix(self, name: str) -> str:
        """A store prefix of this run and coordinator process (C7)."""
        return f"{self.secret}/{self.incarnation}/{name}"

    def _newer_than_start(self, held_rounds: tuple[int, ...]) -> bool:
        """``held_rounds`` newer than the start's (``reseed_for`` asks only before the first commit)."""
        if self._start_rounds is None or not held_rounds:
            return False
        if not self._start_rounds:
            return True  # the run started from initial params: any committed state is newer
        return len(held_rounds) == len(self._start_rounds) and sum(held_rounds) > sum(self._start_rounds)

    def holds_state(self, worker_id: str) -> None:
        self._holders[worker_id] = None
        self._retire_heal(worker_id, withdraw=False)  # it healed: the serve is over

    def forget(self, worker_id: str) -> None:
        self._holders.pop(worker_id, None)
        self._retire_heal(worker_id, withdraw=True)

    def _retire_heal(self, worker_id: str, withdraw: bool) -> None:
        for prefix, source in self._healing.pop(worker_id, ()):
            self.retired.append((prefix, 2))
            if withdraw and source in self._holders:
                # M12: a source serves one heal at a time, blocking its reduces meanwhile; left to
                # time out, a heal to a joiner that is gone held a member out of every group.
                self.withdrawn.append((source, worker_id))

    # -- groups

    def group_prefix(self, group: tuple[str, ...]) -> str:
        if group != self._group:
            self.retire_group()
            self._group = group
        return self._prefix(f"g{self._epoch}")

    def retire_group(self) -> None:
        if self._group is not None:
            self.retired.append((self._prefix(f"g{self._epoch}"), len(self._group)))
            self.stats["groups"] += 1
        self._group = None
        self._epoch += 1

    def committed(self, fragment_id: int, round_id: int, digest: str) -> None:
        self.last_commit[fragment_id] = (round_id, digest)
        self._committed_since_start = True
        self.stats["commits"] += 1

    # -- status and checkpoints (kilobytes: no tensors, SPEC.md C6)

    def status(self) -> dict:
        return {"holders": list(self._holders), "epoch": self._epoch, "store_port": self.store_port,
                "last_commit": [list(c) for c in self.last_commit], **dict(self.stats)}

    def to_dict(self) -> dict:
        return {"secret": self.secret, "last_commit": [list(c) for c in self.last_commit],
                "spec": [[s.name, list(s.shape), s.dtype] for s in self.spec] if self.spec else None,
                "epoch": self._epoch}

    def restore(self, d: dict) -> None:
        """A resumed run keeps its secret, layout and commit record; holders re-join and are re-learned."""
        self.secret = str(d["secret"])
        commits = [(int(r), str(g)) for r, g in d["last_commit"]]
        if len(commits) != self.num_fragments:
            raise ValueError(f"{len(commits)} fragment commits for {self.num_fragments} fragments")
        self.last_commit = commits
        if d.get("spec"):
            self.spec = tuple(TensorSpec(str(n), tuple(int(x) for x in shape), str(dt)) for n, shape, dt in d["spec"])
            self.fragments = partition(self.spec, self.num_fragments)
        # Old epochs' groups are gone with their workers: start past them.
        self._epoch = int(d.get("epoch", 0)) + 1
