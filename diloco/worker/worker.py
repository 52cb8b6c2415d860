"""``DilocoWorker``: DiLoCo for any PyTorch training loop, in a few lines.

Embedding it::

    worker = DilocoWorker(model, torch.optim.AdamW(model.parameters()), endpoint,
                          worker_id="w1", sync_every=50)
    worker.join()                      # global params -> model
    for batch in batches:
        opt.zero_grad(); loss_fn(model, batch).backward(); opt.step()
        if not worker.step_done():     # counts the step; at a sync point: submit, wait
            break
    worker.leave()

(``run_training`` in ``diloco.worker.loop`` is exactly this loop.)

What a worker does (DiLoCo, Douillard et al. 2023, Algorithm 1)
----------------------------------------------------------------
It keeps an fp32 copy of the global params next to the model. At a sync
point it submits the pseudo-gradient ``global - local`` (fp32) of one
fragment, waits for that round's ``Result`` and copies the new global params
of the fragment into both the model and its global copy. The inner optimizer
is never reset: each worker keeps its own AdamW state across rounds.

Sync schedule (Streaming DiLoCo staggering)
-------------------------------------------
With H = ``sync_every`` and F fragments (the ``Welcome`` carries the fragment
-> parameter-name map), fragment f's round r closes at schedule step::

    r * H + off_f,      off_f = max(1, (f + 1) * H // F)

so every fragment syncs every H inner steps and the F fragments take turns,
H/F steps apart (with F = 1: rounds close at H, 2H, ...). The schedule step
equals ``inner_step`` for a worker that joined at round 0; a worker joining
later (a replacement, or a re-join) places itself on the schedule from the
Welcome's round ids -- at the last close that already happened -- so every
worker reaches the closes in the same order and no two workers can wait on
each other at different fragments (which would deadlock the barriers). If
several fragments close at the same step they are submitted together.
Async mode uses the same offsets, counted from the worker's own start
(versions count contributions, not rounds, so they cannot place a worker).

Waiting at a sync point
-----------------------
After ``Submit`` the worker is SYNCING: it heartbeats every
``heartbeat_interval_s`` (from the Welcome) and reads ``below_min_workers``
from every ``HeartbeatReply``; while that holds it is PAUSED (SPEC.md R10):
it trains no further, so it never produces a gradient from params that are
not the round's base. Every wait is a ``recv`` with a timeout of at most
``poll_interval_s``, and each turn polls for a stop (a ``Result`` with
outcome ``stop``, a heartbeat command, ``request_stop()`` from another
thread), so a stop always breaks a pause at once. Nothing waits forever
(see "A coordinator outage" below).

A coordinator outage
--------------------
The coordinator is *unreachable* when it has said nothing for
``coordinator_timeout_s`` (default 600 s) since the first message the worker
sent after last hearing from it: a Join without a Welcome, heartbeats
without replies, a Submit without its Result. One rule covers every phase
(joining, training, waiting for a Result, paused below quorum): after
``OUTAGE_NOTICE_S`` of silence the worker reports it through ``on_outage``
(``"waiting"``, seconds waited, what it waits for, the limit), then every
``OUTAGE_REPORT_EVERY_S``; it keeps heartbeating (and re-sends a Join at a
backed-off interval), so a coordinator restarted on the same address within
the limit answers ``rejoin`` / ``unknown_worker`` and the worker joins again
and goes on (``on_outage("back", ...)``). It does not resync (leave and join
again) while the coordinator is silent. At the limit it gives up: it writes
its checkpoint (if it has a ``checkpoint_dir`` and has joined or was restored)
and stops with ``stop_reason == "coordinator_unreachable"`` (``join()``
returns, ``step_done`` returns False; ``on_outage("gave_up", ...)``);
``diloco worker`` exits 3.

A Result lost in transit would leave a worker waiting, unpaused, for ever;
after ``RESYNC_INTERVALS`` heartbeat intervals of that (doubling each time)
the worker leaves and joins again, which is safe (SPEC.md P1: the Welcome
parks it on a contribution still pending, or brings the new params).

Heartbeats while training are sent from ``step_done`` (between inner steps)
once the interval has elapsed, so **one inner step must take well under the
coordinator's heartbeat timeout** (``heartbeat_timeout_s``; the default
interval is a quarter of it), or the coordinator declares the worker dead.
A worker declared dead is told ``rejoin`` and joins again on its own.

Errors
------
``stale_round`` / ``future_round`` / ``unknown_worker`` answers, or a heartbeat
reply with command ``rejoin``: the worker joins again and takes the Welcome's
params and round ids per fragment -- unless the Welcome's params of a fragment
are bit-identical to its own global copy, in which case its local progress is
still valid and kept. It honours ``Welcome.parked`` (SPEC.md P1/P2): a
contribution of its id still pending is waited for before training.
``params_required`` (the run has no params yet; a Join carries only the
spec): the worker sends its Join again with its params, which become the
run's. ``protocol_version``, ``model_mismatch``, ``tensor_mismatch``,
``non_finite``, ``update_too_large`` and the other "your input is wrong"
codes raise ``DilocoWorkerError`` naming the problem.

Save-and-stop and resume
------------------------
A heartbeat reply with command ``save_and_stop`` -- or a stop while the
coordinator is saving (the worker asks with one heartbeat when a ``Result``
says ``stop``) -- makes the worker write ``<checkpoint_dir>/worker-<id>.ckpt``
(``diloco.worker.checkpoint``) and return control: ``step_done`` returns
False. Constructing a worker whose ``checkpoint_dir`` holds that file restores
the model state, the inner optimizer state and the counters; the global params
come from the coordinator's Welcome at ``join()``. A worker that was waiting
at a sync point when it saved resubmits the same pseudo-gradient at ``join()``.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import threading
import time
import warnings
from typing import Callable

import torch

from diloco.tensorfile import CheckpointError
from diloco.transport.base import AuthRefused, TransportError, WorkerEndpoint
from diloco.transport.messages import (
    PROTOCOL_VERSION,
    Accepted,
    Command,
    Error,
    ErrorCode,
    Heartbeat,
    HeartbeatReply,
    Join,
    Leave,
    Message,
    Result,
    Submit,
    TensorSpec,
    Tensors,
    Welcome,
)
from diloco.worker.checkpoint import (
    WorkerCheckpoint,
    checkpoint_path,
    load_worker_checkpoint,
    save_worker_checkpoint,
)
from diloco.worker.lifecycle import Lifecycle, WorkerState

log = logging.getLogger("diloco.worker")

S = WorkerState

#: Error codes answered by joining again (the coordinator forgot us, or we fell behind).
_REJOIN_CODES = frozenset({ErrorCode.STALE_ROUND, ErrorCode.FUTURE_ROUND, ErrorCode.UNKNOWN_WORKER})
#: Error codes that end the run for this worker: the run is over.
_STOP_CODES = frozenset({ErrorCode.STOPPED, ErrorCode.SHUTTING_DOWN})
#: How many sync history entries ``sync_history`` keeps.
HISTORY_LIMIT = 10_000
#: Heartbeat intervals of unpaused waiting before a worker suspects a lost Result (doubles).
RESYNC_INTERVALS = 16
#: Retries of a join answered ``already_member`` (Leave, then Join again).
_ALREADY_MEMBER_RETRIES = 3
#: Default ``coordinator_timeout_s``: how long a silent coordinator is waited for (10 minutes).
DEFAULT_COORDINATOR_TIMEOUT_S = 600.0
#: Seconds of coordinator silence before the first ``on_outage("waiting", ...)`` report.
OUTAGE_NOTICE_S = 5.0
#: Seconds between further reports while the silence lasts.
OUTAGE_REPORT_EVERY_S = 10.0
#: A silent join is re-sent after this long, then after twice as long, ... (at most ``_JOIN_RESEND_MAX_S``).
_JOIN_RESEND_S = 2.5
_JOIN_RESEND_MAX_S = 30.0


class DilocoWorkerError(Exception):
    """The run refused this worker, or the worker cannot continue; ``code`` says why."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


class DilocoWorker:
    """One DiLoCo worker around a model and its inner optimizer. See the module docstring."""

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer,
                 endpoint: WorkerEndpoint, *, worker_id: str, sync_every: int,
                 checkpoint_dir: str | os.PathLike | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 on_state: Callable[[str, str, float], None] | None = None,
                 poll_interval_s: float = 0.05,
                 coordinator_timeout_s: float | None = None,
                 on_outage: Callable[[str, float, str, float], None] | None = None,
                 join_timeout_s: float | None = None) -> None:
        if not isinstance(worker_id, str) or not worker_id:
            raise ValueError(f"worker_id={worker_id!r}: expected a non-empty string")
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every={sync_every!r}: expected an integer >= 1 (inner steps per round)")
        if join_timeout_s is not None:
            warnings.warn("DilocoWorker(join_timeout_s=...) is deprecated: coordinator_timeout_s governs every "
                          "wait for the coordinator, joining included", DeprecationWarning, stacklevel=2)
            if coordinator_timeout_s is None:
                coordinator_timeout_s = join_timeout_s
        if coordinator_timeout_s is None:
            coordinator_timeout_s = DEFAULT_COORDINATOR_TIMEOUT_S
        for name, value in (("poll_interval_s", poll_interval_s), ("coordinator_timeout_s", coordinator_timeout_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{name}={value!r}: expected a finite number of seconds > 0")
        self.model = model
        self.inner_optimizer = inner_optimizer
        self.endpoint = endpoint
        self.worker_id = worker_id
        self.sync_every = sync_every
        self.poll_interval_s = float(poll_interval_s)
        self.coordinator_timeout_s = float(coordinator_timeout_s)
        self._clock = clock
        self._on_state = on_state
        self._on_outage = on_outage
        self._params: dict[str, torch.nn.Parameter] = dict(model.named_parameters())
        if not self._params:
            raise ValueError("the model has no parameters to train")

        # -- public counters
        #: Inner steps this worker has taken (restored from its checkpoint).
        self.inner_step = 0
        #: Rounds (fragment syncs) whose Result this worker applied.
        self.rounds_synced = 0
        #: Why the worker stopped: "stop", "save_and_stop", "drain", "stop_requested", "left", ...
        self.stop_reason: str | None = None
        #: Total seconds spent PAUSED (waiting below quorum).
        self.seconds_paused = 0.0
        #: Tensor payload bytes sent (Join params, pseudo-gradients) and received (Welcome, Results).
        self.bytes_sent = 0
        self.bytes_received = 0
        #: L2 norm of the last pseudo-gradient submitted (one fragment's): what a coordinator's
        #: ``--max-update-norm`` is compared with (NaN before the first submission).
        self.last_update_norm = math.nan
        #: What the last Welcome / heartbeat reply said.
        self.mode: str | None = None
        self.min_workers: int | None = None
        self.below_min_workers = False
        self.heartbeat_interval_s: float | None = None
        #: (inner_step, fragment_id, round_id, outcome) per released contribution, newest last.
        self.sync_history: collections.deque[tuple[int, int, int, str]] = collections.deque(maxlen=HISTORY_LIMIT)
        #: True when this worker was restored from its own checkpoint.
        self.restored = False

        # -- run state
        self._global: Tensors | None = None          # fp32 copy of the global params
        self._fragments: tuple[tuple[str, ...], ...] = ()
        self._round_ids: list[int] = []
        self._next_close: list[int] = []             # schedule step of each fragment's next close
        self._sched_step = 0
        self._waiting: dict[int, int] = {}           # fragment -> round id submitted/parked, awaiting Result
        self._unacked: collections.deque[int] = collections.deque()  # fragments of Submits not yet answered
        self._retry_at: dict[int, float] = {}        # fragment -> time to resubmit (held_limit)
        self._hb_outstanding = 0
        #: Replies still due to heartbeats sent before the current wait began: they say
        #: nothing about the quorum *at* the sync point, so they never pause the worker.
        self._stale_replies = 0
        self._quorum_fresh = False
        self._last_hb_sent = -math.inf
        self._last_heard = clock()
        #: When the first message sent since the coordinator last said anything went out (None: nothing unanswered).
        self._unanswered_since: float | None = None
        self._outage_reports = 0                     # on_outage("waiting") calls in the current silence
        self._rejoin_needed = False
        self._stop_cmd: tuple[str, bool | None] | None = None  # (reason, save?); None save = ask
        self._stop_requested = threading.Event()
        self._save_on_request = False
        self._paused_since: float | None = None
        self._syncing_since: float | None = None    # start of the current unpaused wait
        self._resync_after_s = math.inf
        self._announced = False
        self._left = False
        self._welcomed = False
        self._lifecycle = Lifecycle(self._state_changed)

        self.checkpoint_path = checkpoint_path(checkpoint_dir, worker_id) if checkpoint_dir is not None else None
        if self.checkpoint_path is not None and self.checkpoint_path.exists():
            self._restore()

    # ------------------------------------------------------------------ public

    @property
    def state(self) -> str:
        """The lifecycle state (a ``WorkerState`` value)."""
        return self._lifecycle.state.value

    @property
    def round_ids(self) -> tuple[int, ...]:
        """Per fragment: the round this worker contributes to next (sync) or its base version (async)."""
        return tuple(self._round_ids)

    @property
    def fragments(self) -> tuple[tuple[str, ...], ...]:
        return self._fragments

    @property
    def global_params(self) -> Tensors:
        """The worker's fp32 copy of the global params (read-only view; do not modify)."""
        return dict(self._global or {})

    @property
    def stopped(self) -> bool:
        return self._lifecycle.state in (S.STOPPING, S.STOPPED)

    def request_stop(self, save: bool = False) -> None:
        """Ask the worker to stop at its next poll (thread-safe); breaks a pause at once.

        With ``save=True`` it writes its checkpoint first (needs a ``checkpoint_dir``).
        """
        self._save_on_request = save
        self._stop_requested.set()

    def join(self) -> None:
        """Join the run: send Join (the spec; the params too if the run has none yet), take the Welcome's params.

        Raises ``DilocoWorkerError`` if the run refuses this worker (protocol version,
        model mismatch, ...). If the run has already stopped, or the coordinator stays
        silent for ``coordinator_timeout_s`` (``stop_reason`` "coordinator_unreachable"),
        the worker stops (``step_done`` returns False).
        """
        if self._welcomed and not self.stopped:
            raise DilocoWorkerError(f"worker {self.worker_id!r} has already joined")
        if self.stopped:
            raise DilocoWorkerError(f"worker {self.worker_id!r} is stopped ({self.stop_reason}); make a new one")
        self._announce()
        try:
            if not self._do_join():
                return
            if self._waiting or self._due():
                self._sync_loop()
        except DilocoWorkerError as exc:
            self._fail(exc)
            raise

    def step_done(self) -> bool:
        """Call after each inner ``optimizer.step()``. Returns False when the worker must stop.

        Counts the step; heartbeats if the interval elapsed; at a sync point submits the
        pseudo-gradient and waits for the round (paused while below quorum).
        """
        state = self._lifecycle.state
        if state in (S.STOPPING, S.STOPPED):
            return False
        if state is not S.TRAINING:
            raise DilocoWorkerError(f"step_done() in state {state.value}: call join() first")
        self.inner_step += 1
        self._sched_step += 1
        try:
            self._service_training()
            if not self.stopped and (self._waiting or self._due()):
                self._sync_loop()
        except DilocoWorkerError as exc:
            self._fail(exc)
            raise
        return not self.stopped

    def leave(self) -> None:
        """Send Leave (if joined) and close the endpoint. Idempotent."""
        if self._left:
            return
        self._left = True
        if self._welcomed and self._stop_cmd is None:
            try:
                self.endpoint.send(Leave(self.worker_id))
            except TransportError:
                pass
        try:
            self.endpoint.close()
        except TransportError:
            pass
        if not self.stopped:
            self._finish_stop("left", save=False)

    def save_checkpoint(self) -> None:
        """Write ``<checkpoint_dir>/worker-<id>.ckpt`` now (atomic)."""
        if self.checkpoint_path is None:
            raise DilocoWorkerError("save_checkpoint(): this worker has no checkpoint_dir")
        save_worker_checkpoint(self.checkpoint_path, WorkerCheckpoint(
            worker_id=self.worker_id,
            sync_every=self.sync_every,
            inner_step=self.inner_step,
            sched_step=self._sched_step,
            next_close=list(self._next_close),
            round_ids=list(self._round_ids),
            rounds_synced=self.rounds_synced,
            mode=self.mode,
            fragments=self._fragments,
            model_state=self.model.state_dict(),
            optimizer_state=self.inner_optimizer.state_dict(),
            global_params=self._global or {},
        ))
        log.info("worker %s: checkpoint written to %s (inner step %d)", self.worker_id, self.checkpoint_path,
                 self.inner_step)

    # ------------------------------------------------------------------ joining

    def _do_join(self) -> bool:
        """Join and wait for the Welcome. True when welcomed, False when the run is over."""
        self._lifecycle.go(S.JOINING)
        spec = self._join_spec()
        self._send(Join(self.worker_id, PROTOCOL_VERSION, spec))
        retries = 0
        # A Join can be lost with a connection that died under it: while the coordinator is
        # silent, send it again after 2.5 s, 5 s, 10 s, ... (a duplicate is answered
        # already_member after the Welcome, and ignored).
        resend_after, last_join = _JOIN_RESEND_S, self._clock()
        while True:
            if self._stop_requested.is_set():
                self._finish_stop("stop_requested", save=self._save_on_request)
                return False
            now = self._clock()
            if self._check_silence(now):
                self._give_up()
                return False
            if self._unanswered_since is not None and now - max(last_join, self._unanswered_since) >= resend_after:
                self._send(Join(self.worker_id, PROTOCOL_VERSION, spec))
                last_join, resend_after = now, min(2 * resend_after, _JOIN_RESEND_MAX_S)
            msg = self._recv(self.poll_interval_s)
            if msg is not None and not isinstance(msg, Welcome) and self._unanswered_since is None:
                self._unanswered_since = self._clock()  # heard something else: the Join is still unanswered
            if isinstance(msg, Welcome):
                self._on_welcome(msg)
                return True
            if isinstance(msg, Error) and msg.in_reply_to in ("Join", ""):
                code = _code(msg.code)
                if code in _STOP_CODES:
                    self._stop_cmd = (code.value, False)
                    self._finish_stop(f"run {code.value} before join: {msg.detail}", save=False)
                    return False
                if code is ErrorCode.PARAMS_REQUIRED:
                    # The run has no params yet: the first joiner's become the run's
                    # (SPEC.md section 11). One Join with params per such reply.
                    params = self._join_params()
                    self._send(Join(self.worker_id, PROTOCOL_VERSION, spec, params))
                    self.bytes_sent += _nbytes(params)
                    del params
                    continue
                if code is ErrorCode.ALREADY_MEMBER and retries < _ALREADY_MEMBER_RETRIES:
                    # The coordinator still counts us on this connection (a duplicate join):
                    # leave (our pending contributions stay, P1) and join again.
                    retries += 1
                    self._send(Leave(self.worker_id))
                    self._send(Join(self.worker_id, PROTOCOL_VERSION, spec))
                    continue
                raise DilocoWorkerError(
                    f"worker {self.worker_id!r}: the coordinator refused the join ({_value(msg.code)}): "
                    f"{msg.detail}", _value(msg.code))
            # Anything else is an answer to something sent before this join: superseded by the Welcome.

    def _join_spec(self) -> tuple[TensorSpec, ...]:
        """The model's spec as the run sees it: fp32 (the coordinator keeps fp32 params)."""
        return tuple(TensorSpec(n, tuple(p.shape), "float32") for n, p in self._params.items())

    def _join_params(self) -> Tensors:
        """fp32 copies of the params, for a run that has none yet (answered ``params_required``)."""
        return {n: p.detach().to("cpu", torch.float32).clone() for n, p in self._params.items()}

    def _on_welcome(self, msg: Welcome) -> None:
        fragments = tuple(tuple(f) for f in msg.fragments)
        names = [n for f in fragments for n in f]
        if sorted(names) != sorted(self._params) or len(msg.round_ids) != len(fragments):
            raise DilocoWorkerError(
                f"worker {self.worker_id!r}: the Welcome's fragments do not cover this model's parameters "
                f"exactly ({len(names)} names for {len(self._params)} parameters)", "bad_welcome")
        params = msg.params
        self._check_incoming(params, names, "Welcome")
        self.bytes_received += _nbytes(params)
        same_layout = self._global is not None and fragments == self._fragments
        ids_same = same_layout and list(msg.round_ids) == self._round_ids
        if not same_layout:
            self._global = {}
        kept = []
        for fid, frag in enumerate(fragments):
            keep = same_layout and all(torch.equal(self._global[n], params[n]) for n in frag)
            if keep:
                kept.append(fid)  # same base: the local progress is still valid for this fragment
                continue
            with torch.no_grad():
                for n in frag:
                    self._params[n].copy_(params[n])
                    self._global[n] = params[n].detach().to("cpu", torch.float32).clone()
        self._fragments = fragments
        self._round_ids = list(msg.round_ids)
        self.mode = msg.mode
        self.min_workers = msg.min_workers
        self.below_min_workers = msg.below_min_workers
        self.heartbeat_interval_s = float(msg.heartbeat_interval_s)
        self._place_on_schedule(ids_same, same_layout)
        self._waiting = {int(f): int(r) for f, r in msg.parked}
        self._unacked.clear()
        self._retry_at.clear()
        self._rejoin_needed = False
        now = self._clock()
        self._last_heard = now
        self._last_hb_sent = now
        self._hb_outstanding = 0
        self._stale_replies = 0
        self._quorum_fresh = True
        self._syncing_since = None
        if not self._welcomed:
            self._resync_after_s = RESYNC_INTERVALS * self.heartbeat_interval_s
        self._welcomed = True
        log.info("worker %s joined: mode=%s round_ids=%s parked=%s kept_local=%s", self.worker_id, self.mode,
                 self._round_ids, list(msg.parked), kept)
        self._lifecycle.go(S.SYNCING if self._waiting or self._due() else S.TRAINING)

    def _place_on_schedule(self, ids_same: bool, same_layout: bool) -> None:
        offsets = self._offsets()
        if self.mode == "sync":
            if ids_same and len(self._next_close) == len(offsets):
                return  # our own schedule is consistent with the run's rounds: keep it
            H = self.sync_every
            self._next_close = [r * H + off for r, off in zip(self._round_ids, offsets)]
            # At the last close that already happened: every worker then meets the
            # remaining closes in the same order (see the module docstring).
            self._sched_step = max(0, max(c - H for c in self._next_close))
        elif not (same_layout and len(self._next_close) == len(offsets)):
            self._next_close = [self._sched_step + off for off in offsets]

    def _offsets(self) -> list[int]:
        F, H = len(self._fragments), self.sync_every
        return [max(1, (f + 1) * H // F) for f in range(F)]

    def _check_incoming(self, params: Tensors, names, what: str) -> None:
        for n in names:
            t = params.get(n)
            if t is None:
                raise DilocoWorkerError(f"{what} lacks parameter {n!r}", "bad_message")
            if tuple(t.shape) != tuple(self._params[n].shape):
                raise DilocoWorkerError(
                    f"{what}: parameter {n!r} has shape {list(t.shape)}; this model's has "
                    f"{list(self._params[n].shape)}", "bad_message")

    # ------------------------------------------------------------------ training

    def _due(self) -> list[int]:
        now = None
        due = []
        for f, close in enumerate(self._next_close):
            if f in self._waiting or self._sched_step < close:
                continue
            retry = self._retry_at.get(f)
            if retry is not None:
                now = self._clock() if now is None else now
                if now < retry:
                    continue
            due.append(f)
        return due

    def _service_training(self) -> None:
        """Between inner steps: heartbeat when due, read replies, act on commands."""
        now = self._clock()
        if now - self._last_hb_sent >= self.heartbeat_interval_s:
            self._heartbeat(now)
        if self._hb_outstanding:
            while (msg := self._recv(0.0)) is not None:
                self._dispatch(msg)
        if self._check_silence(self._clock()) and self._stop_cmd is None:
            self._stop_cmd = ("coordinator_unreachable", None)
        self._handle_flags()

    def _sync_loop(self) -> None:
        """Submit every due fragment, then wait until none is pending; stop/rejoin as told."""
        while True:
            if self._handle_flags():
                return
            for f in self._due():
                self._submit(f)
            if not self._waiting and not self._retry_at:
                self._set_paused(False)
                self._lifecycle.go(S.TRAINING)
                return
            self._set_paused(self.below_min_workers and self._quorum_fresh)
            if self._maybe_resync():
                continue
            self._wait_turn()

    def _submit(self, fid: int) -> None:
        assert self._global is not None
        tensors = {}
        for n in self._fragments[fid]:
            tensors[n] = self._global[n] - self._params[n].detach().to("cpu", torch.float32)
        self.last_update_norm = math.sqrt(sum(float(torch.linalg.vector_norm(t)) ** 2 for t in tensors.values()))
        rid = self._round_ids[fid]
        self._retry_at.pop(fid, None)
        if self._lifecycle.state is S.TRAINING:
            self._lifecycle.go(S.SYNCING)
        self._send(Submit(self.worker_id, fid, rid, tensors))
        self.bytes_sent += _nbytes(tensors)
        self._waiting[fid] = rid
        self._unacked.append(fid)
        # Learn the quorum now rather than an interval later (PAUSED is shown promptly);
        # until that reply, what earlier replies said does not pause the worker.
        self._stale_replies = self._hb_outstanding
        self._quorum_fresh = False
        self._heartbeat(self._clock())

    def _wait_turn(self) -> None:
        """One turn of waiting at a sync point: heartbeat if due, receive, dispatch."""
        now = self._clock()
        if now - self._last_hb_sent >= self.heartbeat_interval_s:
            self._heartbeat(now)
        timeout = min(self.poll_interval_s, max(0.0, self._last_hb_sent + self.heartbeat_interval_s - now))
        if self._retry_at:
            timeout = min(timeout, max(0.0, min(self._retry_at.values()) - now))
        msg = self._recv(timeout)
        while msg is not None:
            self._dispatch(msg)
            msg = self._recv(0.0)
        if self._check_silence(self._clock()) and self._stop_cmd is None:
            self._stop_cmd = ("coordinator_unreachable", None)

    def _maybe_resync(self) -> bool:
        """Recover from a lost Result: after a long unpaused wait, leave and join again.

        A transport may drop a message (ZeroMQ drops what a ROUTER sends to a peer that
        is reconnecting), and nothing else would tell a worker whose Result was lost: its
        heartbeats are answered, the run is not paused, it just waits. Leaving and joining
        again is safe in both modes (SPEC.md P1: an accepted contribution stays pending
        and the Welcome parks the worker on it; if it already applied, the Welcome brings
        the new params). Waiting for slow peers is normal, so the first resync comes after
        ``RESYNC_INTERVALS`` heartbeat intervals and the delay doubles each time.
        """
        now = self._clock()
        silent = self._silence(now) > 2 * self.heartbeat_interval_s
        if self._lifecycle.state is not S.SYNCING or not self._waiting or silent:
            # (A silent coordinator is an outage, not a lost Result: joining again would not help.)
            self._syncing_since = None
            return False
        if self._syncing_since is None:
            self._syncing_since = now
            return False
        if now - self._syncing_since < self._resync_after_s:
            return False
        log.warning("worker %s: no Result for %s after %.1f s at the sync point; leaving and joining again",
                    self.worker_id, dict(self._waiting), now - self._syncing_since)
        self._resync_after_s *= 2
        self._syncing_since = None
        self._send(Leave(self.worker_id))
        self._rejoin_needed = True
        return True

    def _set_paused(self, paused: bool) -> None:
        state = self._lifecycle.state
        now = self._clock()
        if paused and state is S.SYNCING:
            self._paused_since = now
            self._lifecycle.go(S.PAUSED)
        elif not paused and state is S.PAUSED:
            self._end_pause(now)
            self._lifecycle.go(S.SYNCING)

    def _end_pause(self, now: float) -> None:
        if self._paused_since is not None:
            self.seconds_paused += now - self._paused_since
            self._paused_since = None

    # ------------------------------------------------------------------ messages

    def _dispatch(self, msg: Message) -> None:
        if isinstance(msg, HeartbeatReply):
            self._hb_outstanding = max(0, self._hb_outstanding - 1)
            if self._stale_replies:
                self._stale_replies -= 1
            else:
                self._quorum_fresh = True
            self.below_min_workers = bool(msg.below_min_workers)
            self.min_workers = msg.min_workers
            command = _command(msg.command)
            if command is Command.REJOIN:
                self._rejoin_needed = True
            elif command is Command.STOP:
                # A reply sent after the stop: the kind is known now (nothing to save).
                reason = self._stop_cmd[0] if self._stop_cmd else "stop"
                if self._stop_cmd is None or self._stop_cmd[1] is None:
                    self._stop_cmd = (reason, False)
            elif command is Command.SAVE_AND_STOP:
                self._stop_cmd = ("save_and_stop", True)
        elif isinstance(msg, Result):
            self._on_result(msg)
        elif isinstance(msg, Accepted):
            if msg.fragment_id in self._unacked:
                self._unacked.remove(msg.fragment_id)
        elif isinstance(msg, Error):
            self._on_error(msg)
        else:
            log.debug("worker %s: ignoring unexpected %s", self.worker_id, type(msg).__name__)

    def _on_result(self, msg: Result) -> None:
        fid = msg.fragment_id
        if self._waiting.get(fid) != msg.round_id:
            log.debug("worker %s: ignoring a stale Result for fragment %s round %s", self.worker_id, fid,
                      msg.round_id)
            return
        outcome = msg.outcome.value if hasattr(msg.outcome, "value") else msg.outcome
        del self._waiting[fid]
        if outcome in ("applied", "applied_final"):
            frag = self._fragments[fid]
            self._check_incoming(msg.params, frag, f"Result for fragment {fid}")
            with torch.no_grad():
                for n in frag:
                    t = msg.params[n]
                    self._params[n].copy_(t)
                    self._global[n] = t.detach().to("cpu", torch.float32).clone()
            self.bytes_received += _nbytes(msg.params)
            self._round_ids[fid] = msg.next_round_id
            if self.mode == "sync":
                self._next_close[fid] = msg.next_round_id * self.sync_every + self._offsets()[fid]
            else:
                self._next_close[fid] += self.sync_every
            self.rounds_synced += 1
            self._syncing_since = None
            self._resync_after_s = RESYNC_INTERVALS * self.heartbeat_interval_s
            self.sync_history.append((self.inner_step, fid, msg.round_id, outcome))
            if outcome == "applied_final":
                self._stop_cmd = ("drain", False)
        elif outcome == "stop":
            self.sync_history.append((self.inner_step, fid, msg.round_id, outcome))
            if self._stop_cmd is None:
                self._stop_cmd = ("stop", None)  # ask: was it save-and-stop?
        else:
            raise DilocoWorkerError(f"Result with unknown outcome {outcome!r}", "bad_message")

    def _on_error(self, msg: Error) -> None:
        code = _code(msg.code)
        if msg.in_reply_to == "Submit":
            fid = self._unacked.popleft() if self._unacked else None
            if code in _REJOIN_CODES:
                log.info("worker %s: submission refused (%s: %s); joining again", self.worker_id, code.value,
                         msg.detail)
                self._rejoin_needed = True
            elif code is ErrorCode.DUPLICATE:
                pass  # it is already pending: its Result will come (P1)
            elif code is ErrorCode.HELD_LIMIT and fid is not None:
                self._waiting.pop(fid, None)
                self._retry_at[fid] = self._clock() + (self.heartbeat_interval_s or self.poll_interval_s)
            elif code in _STOP_CODES:
                if self._stop_cmd is None:
                    self._stop_cmd = (code.value, None)
            else:
                raise DilocoWorkerError(
                    f"worker {self.worker_id!r}: submission refused ({_value(msg.code)}): {msg.detail}",
                    _value(msg.code))
        elif msg.in_reply_to == "Heartbeat":
            if code in _STOP_CODES:
                self._stop_cmd = self._stop_cmd or (code.value, None)
            else:
                log.warning("worker %s: heartbeat refused (%s): %s", self.worker_id, _value(msg.code), msg.detail)
        else:
            log.debug("worker %s: ignoring a stale error (%s in reply to %s)", self.worker_id,
                      _value(msg.code), msg.in_reply_to)

    def _heartbeat(self, now: float) -> None:
        self._send(Heartbeat(self.worker_id))
        self._hb_outstanding += 1
        self._last_hb_sent = now

    def _silence(self, now: float) -> float:
        """Seconds the coordinator has left the worker's messages unanswered (0 when nothing is).

        An endpoint with ``silence_s()`` (ZeroMQ: time since the last *part* arrived) caps it,
        so a large Welcome or Result still arriving does not count as silence.
        """
        if self._unanswered_since is None:
            return 0.0
        silence = max(0.0, now - self._unanswered_since)
        endpoint_silence = getattr(self.endpoint, "silence_s", None)
        if callable(endpoint_silence):
            try:
                silence = min(silence, float(endpoint_silence()))
            except Exception:  # a transport's probe must never break training
                pass
        return silence

    def _waiting_for(self) -> str:
        """What the worker is waiting for from the coordinator, for the outage reports."""
        state = self._lifecycle.state
        if state is S.JOINING:
            return "a Welcome (joining)"
        if self._waiting:
            rounds = ", ".join(f"fragment {f} round {r}" for f, r in sorted(self._waiting.items()))
            paused = " (paused: the run was below quorum)" if state is S.PAUSED else ""
            return f"the Result for {rounds}{paused}"
        return "heartbeat replies"

    @property
    def _outage_log_level(self) -> int:
        # With an on_outage callback the caller shows the outage; the log would say it twice.
        return logging.INFO if self._on_outage is not None else logging.WARNING

    def _report_outage(self, kind: str, waited_s: float, what: str) -> None:
        if self._on_outage is None:
            return
        try:
            self._on_outage(kind, waited_s, what, self.coordinator_timeout_s)
        except Exception:  # an observer must never break training
            log.exception("worker %s: on_outage callback failed", self.worker_id)

    def _check_silence(self, now: float) -> bool:
        """Report a silent coordinator every so often; True once it has been silent for the timeout."""
        silence = self._silence(now)
        if silence >= self.coordinator_timeout_s:
            return True
        if silence < OUTAGE_NOTICE_S:
            return False
        due = OUTAGE_NOTICE_S + self._outage_reports * OUTAGE_REPORT_EVERY_S
        if silence >= due:
            self._outage_reports = int((silence - OUTAGE_NOTICE_S) // OUTAGE_REPORT_EVERY_S) + 1
            log.log(self._outage_log_level, "worker %s: no answer from the coordinator for %.0f s; waiting for %s "
                    "(gives up after %g s)", self.worker_id, silence, self._waiting_for(), self.coordinator_timeout_s)
            self._report_outage("waiting", silence, self._waiting_for())
        return False

    def _give_up(self) -> None:
        """The coordinator stayed silent for ``coordinator_timeout_s``: save (if possible) and stop."""
        silence = self._silence(self._clock())
        what = self._waiting_for()
        save = self.checkpoint_path is not None and (self._welcomed or self.restored)
        log.log(self._outage_log_level, "worker %s: no answer from the coordinator for %.1f s (waiting for %s); "
                "giving up%s", self.worker_id, silence, what, " after writing its checkpoint" if save else "")
        self._report_outage("gave_up", silence, what)
        self._stop_cmd = ("coordinator_unreachable", save)
        self._finish_stop("coordinator_unreachable", save=save)

    def _handle_flags(self) -> bool:
        """Act on a stop or re-join that a message asked for. True when the worker stopped."""
        if self._stop_requested.is_set():
            self._finish_stop("stop_requested", save=self._save_on_request)
            return True
        if self._stop_cmd is not None:
            reason, save = self._stop_cmd
            if reason == "coordinator_unreachable":
                self._give_up()
                return True
            if save is None:
                save = self._ask_if_saving()
                if save:
                    reason = "save_and_stop"
            self._finish_stop(reason, save=save)
            return True
        if self._rejoin_needed:
            self._rejoin_needed = False
            self._end_pause(self._clock())
            if not self._do_join():
                return True
            return self._handle_flags()
        return False

    def _ask_if_saving(self) -> bool:
        """A stop arrived without its kind: one heartbeat asks whether it is save-and-stop."""
        try:
            self._heartbeat(self._clock())
        except DilocoWorkerError:
            return False
        deadline = self._clock() + min(1.0, max(4 * (self.heartbeat_interval_s or 0.0), self.poll_interval_s))
        while (remaining := deadline - self._clock()) > 0:
            msg = self._recv(min(remaining, self.poll_interval_s))
            if isinstance(msg, HeartbeatReply):
                return _command(msg.command) is Command.SAVE_AND_STOP
            if self._stop_requested.is_set():
                return False
        return False

    def _finish_stop(self, reason: str, *, save: bool) -> None:
        self._end_pause(self._clock())
        if self._lifecycle.state is not S.STOPPING:
            self._lifecycle.go(S.STOPPING)
        self.stop_reason = self.stop_reason or reason
        try:
            if save:
                if self.checkpoint_path is None:
                    log.warning("worker %s: asked to save a checkpoint but has no checkpoint_dir", self.worker_id)
                else:
                    self.save_checkpoint()
        finally:
            self._lifecycle.go(S.STOPPED)

    def _fail(self, exc: DilocoWorkerError) -> None:
        if not self.stopped:
            self.stop_reason = f"error: {exc.code or exc}"
            self._finish_stop(self.stop_reason, save=False)

    # ------------------------------------------------------------------ plumbing

    def _send(self, msg: Message) -> None:
        if self._unanswered_since is None:
            self._unanswered_since = self._clock()
        try:
            self.endpoint.send(msg)
        except AuthRefused as exc:
            raise DilocoWorkerError(f"worker {self.worker_id!r}: {exc}", "auth_refused") from exc
        except TransportError as exc:
            raise DilocoWorkerError(f"worker {self.worker_id!r}: cannot send {type(msg).__name__}: {exc}",
                                    "transport") from exc

    def _recv(self, timeout_s: float) -> Message | None:
        try:
            msg = self.endpoint.recv(timeout_s)
        except AuthRefused as exc:
            raise DilocoWorkerError(f"worker {self.worker_id!r}: {exc}", "auth_refused") from exc
        except TransportError as exc:
            raise DilocoWorkerError(f"worker {self.worker_id!r}: cannot receive: {exc}", "transport") from exc
        if msg is not None:
            now = self._clock()
            if self._outage_reports:
                waited = now - self._unanswered_since if self._unanswered_since is not None else 0.0
                log.log(self._outage_log_level, "worker %s: the coordinator answered again after %.0f s",
                        self.worker_id, waited)
                self._report_outage("back", waited, self._waiting_for())
            self._last_heard = now
            self._unanswered_since = None
            self._outage_reports = 0
        return msg

    def _announce(self) -> None:
        if not self._announced:
            self._announced = True
            self._state_changed(self._lifecycle.state)

    def _state_changed(self, state: WorkerState) -> None:
        if self._on_state is None:
            return
        try:
            self._on_state(self.worker_id, state.value, self._clock())
        except Exception:  # an observer must never break training
            log.exception("worker %s: on_state callback failed", self.worker_id)

    def _restore(self) -> None:
        path = self.checkpoint_path
        try:
            ckpt = load_worker_checkpoint(path)
        except CheckpointError as exc:
            raise DilocoWorkerError(str(exc), "bad_checkpoint") from None
        if ckpt.worker_id != self.worker_id:
            raise DilocoWorkerError(f"{path} belongs to worker {ckpt.worker_id!r}, not {self.worker_id!r}",
                                    "bad_checkpoint")
        if ckpt.sync_every != self.sync_every:
            raise DilocoWorkerError(f"{path} was saved with sync_every={ckpt.sync_every}; this worker has "
                                    f"sync_every={self.sync_every}", "bad_checkpoint")
        try:
            self.model.load_state_dict(ckpt.model_state)
        except (RuntimeError, KeyError, ValueError) as exc:
            raise DilocoWorkerError(f"{path}: the model state does not fit this model: {exc}",
                                    "bad_checkpoint") from None
        try:
            self.inner_optimizer.load_state_dict(ckpt.optimizer_state)
        except (RuntimeError, KeyError, ValueError, TypeError) as exc:
            raise DilocoWorkerError(f"{path}: the inner optimizer state does not fit this optimizer: {exc}",
                                    "bad_checkpoint") from None
        for n, t in ckpt.global_params.items():
            p = self._params.get(n)
            if p is None or tuple(p.shape) != tuple(t.shape):
                raise DilocoWorkerError(f"{path}: global copy of {n!r} does not fit this model", "bad_checkpoint")
        self._global = {n: t.to(torch.float32).clone() for n, t in ckpt.global_params.items()} or None
        self._fragments = ckpt.fragments
        self._round_ids = list(ckpt.round_ids)
        self._next_close = list(ckpt.next_close)
        self._sched_step = ckpt.sched_step
        self.inner_step = ckpt.inner_step
        self.rounds_synced = ckpt.rounds_synced
        self.mode = ckpt.mode
        self.restored = True
        log.info("worker %s: restored from %s (inner step %d, round ids %s)", self.worker_id, path,
                 self.inner_step, self._round_ids)


def _nbytes(tensors: Tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _code(code) -> ErrorCode | None:
    try:
        return ErrorCode(code)
    except ValueError:
        return None


def _value(code) -> str:
    return code.value if isinstance(code, ErrorCode) else str(code)


def _command(command) -> Command | None:
    try:
        return Command(command)
    except ValueError:
        return None
