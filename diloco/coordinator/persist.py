"""When and how the coordinator's loop makes a step durable before announcing it (SPEC.md section 5).

Two ways, chosen by ``full_every`` (``diloco server --full-checkpoint-every``):

- ``1``: every step that changed the run (applied a round, banned or unbanned a
  worker) writes a full checkpoint before its messages go out. Simple, and cheap
  for a small model.
- ``N > 1`` (the journal, ``journal.py``): each outer step's input is appended to
  the journal by a background thread *while the step runs*; after the step a
  small commit chunk is appended and fsync'd, and only then do the messages go
  out. Every ``N`` rounds a full checkpoint is written in the background straight
  from the live tensors, after which a new journal segment starts and the
  segments no kept checkpoint needs are deleted. The next outer step waits for
  that write (it must not change the tensors under it); the workers' training in
  between normally hides it.

``AUTO`` picks ``1`` when a full checkpoint is under ``AUTO_JOURNAL_BYTES`` and
``AUTO_FULL_EVERY`` above: a 10M-parameter model's checkpoint (80 MB with
momentum) costs a few percent of a round, a 100M one's (800 MB) about a third.

All file work runs on one thread, in order, so a step input is always in the
segment its commit follows, and the loop's thread only waits where durability
requires it: before announcing, and before an outer step changes the tensors a
background full checkpoint is still reading.
"""

from __future__ import annotations

import logging
import os
import pathlib
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from diloco.coordinator import journal
from diloco.coordinator.checkpoint import journal_meta, oldest_kept_seq, prepare_save, save_coordinator
from diloco.coordinator.service import Coordinator
from diloco.wire.messages import Submit

log = logging.getLogger("diloco.coordinator")

#: ``--full-checkpoint-every auto``.
AUTO = 0
AUTO_JOURNAL_BYTES = 128 << 20
AUTO_FULL_EVERY = 8


def describe_policy(full_every: int) -> str:
    """``--full-checkpoint-every`` in words (the server's start-up lines)."""
    if full_every == AUTO:
        return (f"a full checkpoint every round below {AUTO_JOURNAL_BYTES >> 20} MB of state, else full checkpoints "
                f"every {AUTO_FULL_EVERY} rounds, a journal in between")
    if full_every == 1:
        return "a full checkpoint every round"
    return f"full checkpoints every {full_every} rounds, a journal in between"


def resume_notes(replayed: int, torn: list) -> list[str]:
    """What a resume did with the journal, one line each (the server prints them)."""
    notes = [f"replayed {replayed} journal step(s) after it"] if replayed else []
    notes += [f"journal {segment} ends at byte {offset}: {why} (an interrupted append: the open round, which no "
              f"worker heard of, is dropped)" for segment, offset, why in torn]
    return notes


def state_bytes(coordinator: Coordinator) -> int:
    """Bytes of the params and the outer optimizers' tensors: the size of a full checkpoint."""
    total = sum(t.numel() * t.element_size() for t in coordinator.store.params.values())
    for state in coordinator.optimizer_states():
        for per_param in state.get("state", {}).values():
            total += sum(t.numel() * t.element_size() for t in per_param.values() if isinstance(t, torch.Tensor))
    # An optimizer's state appears at its first step: count momentum as one more copy until then.
    return max(total, 2 * sum(t.numel() * t.element_size() for t in coordinator.store.params.values()))


class Durability:
    """The runner's persistence: full checkpoints every ``full_every`` rounds, the journal in between.

    It is the coordinator's ``StepRecorder`` while journaling: the coordinator tells it of each
    accepted contribution and each outer step as they happen, on the loop's thread; the writes
    run on the journal thread.
    """

    def __init__(self, directory: str | os.PathLike, keep: int, full_every: int = 1) -> None:
        if full_every < 0:
            raise ValueError(f"full_every={full_every}: expected 0 (auto) or a positive number of rounds")
        self.directory = pathlib.Path(directory)
        self.keep = keep
        self.full_every = full_every
        self._coordinator: Coordinator | None = None
        self._io: ThreadPoolExecutor | None = None
        self._segment: journal.Segment | None = None
        #: Writes queued since the last commit (their errors surface at the next commit).
        self._queued: list[Future] = []
        #: The outer steps of the current loop step, as the commit records them.
        self._steps: list[dict] = []
        self._full: Future | None = None
        self._rounds_at_full = 0
        self._has_base = False
        #: True: contributions are journaled as they come (compressed wire dtypes); False: each step's mean.
        self._contributions = False
        #: Contributions journaled but not yet part of a committed step -> their segment's first seq:
        #: such a segment is kept even when every kept full checkpoint is newer (``journal.rotate``).
        self._pinned: dict[tuple[int, int, str], int] = {}
        self._pin_lock = threading.Lock()

    # ------------------------------------------------------------------ setup

    @property
    def journaling(self) -> bool:
        return self._io is not None

    def attach(self, coordinator: Coordinator) -> None:
        """Start serving ``coordinator`` (fresh, or resumed from this directory's checkpoint and journal)."""
        self._coordinator = coordinator
        # A resumed hub coordinator has a base to replay onto; a fresh one gets it at its first persist.
        self._has_base = coordinator.resumed and coordinator.store is not None
        self._rounds_at_full = coordinator.fsm.rounds_applied
        self._maybe_start()

    def _maybe_start(self) -> None:
        """Journal mode, once the params exist (a fresh run's first joiner brings them), unless ``1``
        or ``auto`` finds the model small."""
        c = self._coordinator
        if self._io is not None or self.full_every == 1 or c is None or c.store is None or c.collective is not None:
            return
        if c.config.wire_dtype == "sparse":
            # The journal replays a round through the dense outer step; a sparse run writes a full
            # checkpoint every round instead (its params alone: no outer momentum to save).
            if self.full_every not in (1, AUTO):
                log.warning("--full-checkpoint-every %d: a sparse run writes a full checkpoint every round (the "
                            "journal replays dense outer steps only)", self.full_every)
            self.full_every = 1
            return
        if self.full_every == AUTO:
            size = state_bytes(c)
            if size < AUTO_JOURNAL_BYTES:
                self.full_every = 1
                return
            self.full_every = AUTO_FULL_EVERY
            log.info("journal on: a full checkpoint is %.0f MB, written every %d rounds; in between each round's "
                     "input is journaled (--full-checkpoint-every)", size / 1e6, self.full_every)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._contributions = c.config.wire_dtype != "fp32"
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diloco-journal")
        self._segment = journal.Segment(self.directory, c.journal_seq + 1)
        c.hub.recorder = self

    def close(self) -> None:
        """Wait for any background write (raising its error) and stop the writer thread."""
        if self._io is None:
            return
        try:
            self._wait_full()
        finally:
            self._io.shutdown(wait=True)
            self._io = None
            if self._segment is not None:
                self._segment.close()
            if self._coordinator is not None:
                self._coordinator.hub.recorder = None

    # ------------------------------------------------------------------ StepRecorder (the loop's thread)

    def contribution(self, fragment_id: int, round_id: int, worker_id: str, submit: Submit) -> None:
        if not self._contributions:
            return
        incarnation = self._coordinator.incarnation
        key = (fragment_id, round_id, worker_id)

        def write() -> None:
            with self._pin_lock:
                self._pinned[key] = self._segment.first_seq
            self._segment.append_contribution(incarnation, fragment_id, round_id, worker_id, submit.wire_dtype,
                                              submit.tensors, submit.scales, submit.tokens)

        self._queued.append(self._io.submit(write))

    def step(self, fragment_id: int, inputs: list[tuple[int, str]], grad: dict[str, torch.Tensor]) -> None:
        # The step is about to change the tensors a background full checkpoint may still be reading.
        self._wait_full()
        if self._contributions:
            self._steps.append({"fragment": fragment_id, "inputs": [[r, w] for r, w in inputs]})
            return
        self._steps.append({"fragment": fragment_id, "mean": True})
        self._queued.append(self._io.submit(lambda: self._segment.append_mean(fragment_id, grad)))

    # ------------------------------------------------------------------ the runner's calls

    def after_step(self, changed: bool) -> pathlib.Path | None:
        """Persist a step that ``changed`` the run before its messages go out; the full checkpoint written, if any."""
        c = self._coordinator
        self._maybe_start()
        if not changed or c is None or not c.has_state:
            return None
        if self._io is None or not self._has_base:
            return self.save_now()
        start = time.perf_counter()
        self._wait_queued()
        steps, self._steps = self._steps, []
        c.journal_seq += 1
        meta = journal_meta(c)
        seq = c.journal_seq
        # The segment is looked up when the write runs: a background full checkpoint queued before
        # it (a ban's commit does not wait for one) switches to a new segment first.
        self._io.submit(lambda: self._segment.append_commit(seq, steps, meta)).result()
        self._unpin(steps)
        c.stats.journal_records += 1
        c.stats.journal_wait_s += time.perf_counter() - start
        if c.fsm.rounds_applied - self._rounds_at_full >= self.full_every:
            self._start_full()
        return None

    def save_now(self) -> pathlib.Path:
        """A full checkpoint, written before this returns (the first one, save-and-stop, or every step with ``1``)."""
        c = self._coordinator
        self._wait_full()
        if self._io is not None:
            self._wait_queued()
            steps, self._steps = self._steps, []
            self._unpin(steps)  # the checkpoint holds their result
        c.journal_seq += 1
        start = time.perf_counter()
        path = save_coordinator(c, self.directory, keep=self.keep)
        c.stats.checkpoints_written += 1
        c.stats.checkpoint_write_s += time.perf_counter() - start
        self._has_base = True
        self._rounds_at_full = c.fsm.rounds_applied
        if self._io is not None:
            self._io.submit(self._new_segment, c.journal_seq).result()
        return path

    # ------------------------------------------------------------------ internals

    def _wait_queued(self) -> None:
        """Wait for the writes queued since the last commit, raising the first one's error."""
        queued, self._queued = self._queued, []
        for future in queued:
            future.result()

    def _unpin(self, steps: list[dict]) -> None:
        with self._pin_lock:
            for step in steps:
                for round_id, worker_id in step.get("inputs", ()):
                    self._pinned.pop((step["fragment"], round_id, worker_id), None)

    def _start_full(self) -> None:
        c = self._coordinator
        seq = c.journal_seq
        self._rounds_at_full = c.fsm.rounds_applied
        # The meta is taken now, on this thread; the tensors are read by the writer until it is done,
        # and nothing changes them meanwhile (``step`` waits before the next outer step).
        write_checkpoint = prepare_save(c)

        def write() -> None:
            start = time.perf_counter()
            write_checkpoint(self.directory, self.keep)
            c.stats.checkpoints_written += 1
            c.stats.checkpoint_write_s += time.perf_counter() - start
            self._new_segment(seq)

        self._full = self._io.submit(write)

    def _wait_full(self) -> None:
        full, self._full = self._full, None
        if full is not None:
            full.result()

    def _new_segment(self, seq: int) -> None:
        """After a full checkpoint holding step ``seq``: the next steps go to a new segment; drop old ones."""
        old = self._segment
        self._segment = journal.Segment(self.directory, seq + 1)
        if old is not None:
            old.close()
        with self._pin_lock:
            pinned = set(self._pinned.values())
        journal.rotate(self.directory, oldest_kept_seq(self.directory), pinned)
