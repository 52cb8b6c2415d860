"""``DilocoWorker``: DiLoCo for any PyTorch training loop; the thin driver of a ``WorkerSession``.

(About 690 lines, of which about 460 are code: its documentation, the ``_run``
dispatch with a dozen short methods, and the two threads' hand-over. What the
worker keeps per parameter and does to it is ``diloco.worker.keeper`` (one
keeper for a whole model, one for a model sharded across the worker's ranks);
the read-only view of the session users read is ``diloco.worker.view``.)

Embedding it::

    worker = DilocoWorker(model, torch.optim.AdamW(model.parameters()), endpoint,
                          worker_id="w1", sync_every=50)
    worker.join()                      # global params -> model
    for batch in batches:
        opt.zero_grad(); loss_fn(model, batch).backward(); opt.step()
        if not worker.step_done():     # counts the step; at a sync point: submit, wait
            break
    worker.leave()

(``diloco.Worker`` wraps exactly this in a context manager; ``run_training`` in
``diloco.worker.loop`` is this loop.)

What lives where
----------------
The protocol -- joining, heartbeats, the sync schedule, pausing below quorum,
held-limit retries, resync after a lost Result, re-joins, outages, stops --
is ``diloco.worker.session.WorkerSession``, pure and specified in SPEC.md
section 14 (rules W1-W20). This driver only carries out what the session
asks: tensor copies (``InstallParams``), overlap merges (``MergeParams``),
pseudo-gradients (``SubmitFragment``:
``global - local``, fp32, of one fragment), the worker's checkpoint (``Stop``
with ``save``), the endpoint, the clock and the callbacks. The inner optimizer
is never reset: each worker keeps its own state across rounds (DiLoCo,
Douillard et al. 2023, Algorithm 1).

Overlap
-------
With ``overlap_steps=T`` (1 <= T < ``sync_every``; Streaming DiLoCo's tau) a
worker submits a fragment's pseudo-gradient and keeps training; T inner steps
later it merges the round's new params into that fragment:
``local <- overlap_alpha * local + (1 - overlap_alpha) * global`` (in place,
no_grad), and its global copy becomes the new params, the base of the
fragment's next pseudo-gradient. If the Result has not come by then it waits
(and pauses below quorum) as without overlap. ``overlap_alpha`` defaults to
0.5, Streaming DiLoCo's (Douillard et al. 2025). SPEC.md W15-W18.

The communication thread
------------------------
By default a communication thread owns the endpoint: it receives, feeds the
session, sends heartbeats on time and answers the coordinator while the
training thread runs an inner step, an evaluation or a checkpoint write of
any length -- so a slow step never gets a healthy worker declared dead. What
touches the model runs on the training thread (the one that called ``join``),
at ``step_done`` or while it waits at a sync point; what it sends goes out
through the communication thread, which owns the socket. With an injected
``clock`` (tests with a fake clock) or ``comm_thread=False``, the training
thread pumps the endpoint itself between steps and while it waits; then one
inner step must take well under the coordinator's heartbeat timeout.
``on_state`` may be called from either thread, never two calls at once, and
always in the order the session moved: its last call is the worker's state.
The communication thread ticks the session every turn, so a gap of more than
``STALL_S`` between two of its ticks means the process did not run (stopped by
SIGSTOP or a debugger, a paused VM, starved): such stretches do not count as
the coordinator's silence (W11; SPEC.md section 13, "Freezes"), and a worker
that thaws does not give up on a coordinator whose answer was waiting for it.

Stopping
--------
``request_stop(save=...)`` (thread- and signal-safe) stops the worker at its
next turn, breaking a pause at once. A heartbeat reply with ``save_and_stop``
(or a stop while the coordinator saves) writes
``<checkpoint_dir>/worker-<id>.ckpt`` (``diloco.worker.checkpoint``) before
control returns: ``step_done`` returns False. A worker constructed with that
file restores its model, inner optimizer and schedule; the global params come
from the Welcome. ``stop_reason`` says why it stopped; ``coordinator_unreachable``
means the coordinator stayed silent for ``coordinator_timeout_s`` (W11).
Errors the run answers with (``model_mismatch``, ``non_finite``, ...) raise
``DilocoWorkerError`` naming the code.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import threading
import time
from typing import Callable, Mapping

import torch

from diloco.collective.sharded_endpoint import MemberBroken

from diloco.wire import compression
from diloco.wire.endpoints import WorkerEndpoint
from diloco.wire.messages import PROTOCOL_VERSION, Join, Result, Submit, TensorSpec, Tensors, Welcome
from diloco.wire.sparse import SparseWire
from diloco.worker.actions import (
    MODEL_ACTIONS,
    Action,
    Fail,
    InstallParams,
    MergeParams,
    Note,
    OutageReport,
    Send,
    SendJoinWithParams,
    StateChanged,
    Stop,
    SubmitFragment,
)
from diloco.worker.errors import DilocoWorkerError
from diloco.worker.link import Link
from diloco.worker.metrics import TrainingMetrics
from diloco.worker.keeper import keeper_and_plane, sparse_wire_of
from diloco.worker.view import SessionView
from diloco.worker.session import DEFAULT_COORDINATOR_TIMEOUT_S, DEFAULT_OVERLAP_ALPHA, WorkerSession
from diloco.worker.states import WorkerState

log = logging.getLogger("diloco.worker")

S = WorkerState

_LOG_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}

__all__ = ["DEFAULT_COORDINATOR_TIMEOUT_S", "DilocoWorker", "DilocoWorkerError"]

#: A gap this long between two ticks of the communication thread means the process did not run.
#: A turn is a poll (``COMM_POLL_S``), what arrived, and sends (each at most the transport's
#: 0.5 s send timeout): well under a second.
STALL_S = 2.0


class DilocoWorker(SessionView):
    """One DiLoCo worker around a model and its inner optimizer. See the module docstring."""

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer,
                 endpoint: WorkerEndpoint, *, worker_id: str, sync_every: int,
                 checkpoint_dir: str | os.PathLike | None = None,
                 clock: Callable[[], float] | None = None,
                 on_state: Callable[[str, str, float], None] | None = None,
                 poll_interval_s: float = 0.05,
                 coordinator_timeout_s: float | None = None,
                 on_outage: Callable[[str, float, str, float], None] | None = None,
                 comm_thread: bool | None = None,
                 overlap_steps: int = 0,
                 overlap_alpha: float = DEFAULT_OVERLAP_ALPHA,
                 checkpoint_every: int | None = None,
                 error_feedback: bool | None = None) -> None:
        if coordinator_timeout_s is None:
            coordinator_timeout_s = DEFAULT_COORDINATOR_TIMEOUT_S
        if isinstance(poll_interval_s, bool) or not isinstance(poll_interval_s, (int, float)) \
                or not 0 < poll_interval_s < math.inf:
            raise ValueError(f"poll_interval_s={poll_interval_s!r}: expected a finite number of seconds > 0")
        if error_feedback is not None and not isinstance(error_feedback, bool):
            raise ValueError(f"error_feedback={error_feedback!r}: expected True, False or None (on for int8)")
        #: Error feedback (SPEC.md section 14, "Error feedback"): None follows the run's wire dtype.
        self.error_feedback = error_feedback
        #: Tokens trained since the start (``step_done``), and where each fragment's last Submit left it.
        self._tokens_since = 0
        self._tokens_at_submit: dict[int, int] = {}
        self._params: dict[str, torch.nn.Parameter] = dict(model.named_parameters())
        spec = tuple(TensorSpec(n, tuple(p.shape), "float32") for n, p in self._params.items())
        self.session = WorkerSession(worker_id, sync_every, spec, coordinator_timeout_s=coordinator_timeout_s,
                                     overlap_steps=overlap_steps, overlap_alpha=overlap_alpha)
        self.model = model
        self.inner_optimizer = inner_optimizer
        self.endpoint = endpoint
        #: The global copy and residual beside the model, and the operations on them (``keeper``): per
        #: shard on every rank for a model FSDP2 shards across this worker's ranks. The data plane is
        #: transparent on a hub run; on a collective one it turns the plane's messages into the hub's,
        #: so the session is the same on both (``diloco.collective.endpoint``).
        self._keeper, self.data_plane = keeper_and_plane(model, inner_optimizer, worker_id, endpoint)
        self.link = Link(self.data_plane, worker_id, threaded=(clock is None) if comm_thread is None else bool(comm_thread))
        self.worker_id = worker_id
        self.sync_every = sync_every
        self.poll_interval_s = float(poll_interval_s)
        self._clock = clock or time.monotonic
        self._on_state = on_state
        self._on_outage = on_outage
        #: The training figures every heartbeat carries (``report``; SPEC.md section 11).
        self.metrics = TrainingMetrics(self._clock)
        self.link.heartbeat_metrics = lambda: self.metrics.snapshot(
            self.session.inner_step, train_rate=self.session.target_sync_every is not None)
        #: When the worker last became free to train (DyLU's speed: a step's time from then).
        self._trainable_since: float | None = None

        #: Tensor payload bytes sent (Join params, pseudo-gradients) and received (Welcome, Results).
        self.bytes_sent = 0
        self.bytes_received = 0
        #: L2 norm of the last pseudo-gradient submitted (one fragment's): what a coordinator's
        #: ``--max-update-norm`` is compared with (NaN before the first submission).
        self.last_update_norm = math.nan
        #: Times the driver wrote global params into the model (a Welcome, a Result, a restore):
        #: a multi-rank worker's leader broadcasts the model to its other ranks when this moves.
        self.params_written = 0
        #: The run's wire dtype, from the Welcome the session took last (SPEC.md section 11), and the
        #: sparse wire's settings when it is ``sparse``.
        self.wire_dtype = "fp32"
        self.sparse_wire: SparseWire | None = None
        #: Residual entries (parameters) dropped at a Welcome because the run had moved on since.
        self.residuals_dropped = 0
        self.residual_restored = 0

        self._lock = threading.RLock()                # guards the session and the model queue
        self._wake = threading.Condition(self._lock)
        #: What the communication thread's events ask of the model, for the training thread.
        self._model_queue: collections.deque[Action] = collections.deque()
        #: The session's moves not yet reported to ``on_state``, in the session's order (``_report_states``).
        self._states_pending: collections.deque[WorkerState] = collections.deque()
        self._states_lock = threading.Lock()
        self._reporting_states = False
        self._error: DilocoWorkerError | None = None
        self._stop_request: bool | None = None        # save? (set by request_stop, any thread or a signal)
        self._training_thread: int | None = None
        self._left = False
        #: Stretches in which the communication thread did not tick (the process was stopped or
        #: starved), as (end, seconds), newest last; and when it last ticked.
        self._stalls: collections.deque[tuple[float, float]] = collections.deque(maxlen=64)
        self._last_tick: float | None = None

        if checkpoint_every is not None and (isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int)
                                             or checkpoint_every < 1 or checkpoint_dir is None):
            raise ValueError(f"checkpoint_every={checkpoint_every!r}: expected an integer >= 1, with a checkpoint_dir")
        #: Write the checkpoint after every this many synced rounds (at a commit boundary), or never.
        self.checkpoint_every = checkpoint_every
        self._saved_at_rounds = 0
        self.checkpoint_path = None if checkpoint_dir is None else self._keeper.checkpoint_path(checkpoint_dir,
                                                                                                   worker_id)
        if self.checkpoint_path is not None:
            labels = self._keeper.restore(self.checkpoint_path, worker_id, sync_every, model, inner_optimizer,
                                          self.data_plane)
            if labels is not None:
                self.session.restore(**labels)
                #: Params whose error-feedback residual (the sparse wire's accumulator) came back with it.
                self.residual_restored = len(getattr(self._keeper, "residual", ()))
                log.info("worker %s: restored from %s (inner step %d, round ids %s)", worker_id,
                         self.checkpoint_path, labels["inner_step"], labels["round_ids"])

    # ------------------------------------------------------------------ what the session knows

    @property
    def global_params(self) -> Tensors:
        """The worker's fp32 copy of the global params (read-only view; do not modify)."""
        return dict(self._keeper.global_)

    @property
    def sharded(self) -> bool:
        """True when the model is sharded across this worker's ranks (FSDP2): see ``diloco.worker.shards``."""
        return self._keeper.sharded

    @property
    def uses_comm_thread(self) -> bool:
        """True when a communication thread owns the endpoint (the default with the real clock)."""
        return self.link.threaded

    # ------------------------------------------------------------------ public

    def request_stop(self, save: bool = False) -> None:
        """Ask the worker to stop at its next turn (thread- and signal-safe); breaks a pause at once.

        With ``save=True`` it writes its checkpoint first (needs a ``checkpoint_dir``).
        """
        self._stop_request = bool(save)

    def report(self, *, loss: float | None = None, eval_loss: float | None = None,
               samples: int | None = None) -> None:
        """Tell the coordinator (on the next heartbeats) the latest training or evaluation loss,
        and/or ``samples`` more samples trained on; it shows them in ``status`` and the dashboard."""
        self.metrics.report(loss=loss, eval_loss=eval_loss, samples=samples)

    def join(self) -> None:
        """Join the run: Join (with the params if the run has none yet), take the Welcome's params.

        Returns once the worker may train (or has stopped: the run is over, or the
        coordinator stayed silent for ``coordinator_timeout_s``). Raises
        ``DilocoWorkerError`` if the run refuses this worker.
        """
        if self.session.state is not None:
            if self.stopped:
                raise DilocoWorkerError(f"worker {self.worker_id!r} is stopped ({self.stop_reason}); make a new one")
            raise DilocoWorkerError(f"worker {self.worker_id!r} has already joined")
        self._training_thread = threading.get_ident()
        # A fake clock cannot pace a real thread's waits: with one, the training thread pumps.
        self.link.start(self._pump, lambda: self.session.state is S.STOPPED, self._comm_failed)
        try:
            with self._lock:
                actions = self._took(self.session.start(self._clock()))
            self._run(actions)
            self._wait_until_trainable()
        except DilocoWorkerError as exc:
            self._fail(exc)
            raise

    def step_done(self, tokens: int | None = None) -> bool:
        """Call after each inner ``optimizer.step()``. Returns False when the worker must stop.

        Counts the step; at a sync point submits the pseudo-gradient and waits for the
        round (paused while the run is below quorum). ``tokens``: what this step trained on
        (tokens, samples: one unit for every worker of the run), summed per fragment into its
        next ``Submit`` for a token-weighted merge; None counts the step as 1 (inner steps).
        """
        if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1):
            raise DilocoWorkerError(f"step_done(tokens={tokens!r}): expected an integer >= 1, or None for one step")
        state = self.session.state
        if state is None:
            raise DilocoWorkerError("step_done() before join(): call join() first")
        if state is S.STOPPED:
            return False
        self._tokens_since += tokens or 1
        try:
            now = self._clock()
            if self._trainable_since is not None:
                self.metrics.step_took(now - self._trainable_since)  # this step's training time
                self._trainable_since = None
            with self._lock:
                actions = self._took(self.session.step_done(now))
            self._run_model_queue()  # what earlier events asked (a Welcome's params) comes first
            self._run(actions)
            if not self.uses_comm_thread:
                self._pump(0.0, only_if_expected=True)
            trainable = self._wait_until_trainable()
            every = self.checkpoint_every
            if trainable and every is not None and self.session.rounds_synced - self._saved_at_rounds >= every:
                # Here the model holds every Result taken so far: a commit boundary.
                self._saved_at_rounds = self.session.rounds_synced
                self.save_checkpoint()
            return trainable
        except DilocoWorkerError as exc:
            self._fail(exc)
            raise

    def leave(self) -> None:
        """Send Leave (unless the run ended) and close the endpoint. Idempotent."""
        if self._left:
            return
        self._left = True
        self.link.stop()
        with self._lock:
            actions = self._took(self.session.leave(self._clock()))
        for a in actions:
            if isinstance(a, MergeParams):
                self._merge(a)  # W17: the model the caller keeps holds every Result received
        self.link.close([a.message for a in actions if isinstance(a, Send)])
        for a in actions:
            if isinstance(a, StateChanged):
                self._report_states()

    def save_checkpoint(self) -> None:
        """Write ``<checkpoint_dir>/worker-<id>.safetensors`` now (atomic); a sharded member, with all
        its ranks, ``worker-<id>.dcp/`` (``diloco.worker.sharded_checkpoint``)."""
        if self.checkpoint_path is None:
            raise DilocoWorkerError("save_checkpoint(): this worker has no checkpoint_dir")
        s = self.session
        while True:
            self._run_model_queue()  # the params of every Result the session took, installed
            with self._lock:
                if self._model_queue:
                    continue
                why_not = self._unlabelled_state()
                if why_not is not None:
                    log.info("worker %s: checkpoint not written now: %s", self.worker_id, why_not)
                    return
                # Taken together under the lock: the labels and the params they name (installs run
                # on this thread, and the queue is empty).
                taken = self._keeper.snapshot(s, self.worker_id, self.sync_every, self.model, self.inner_optimizer,
                                              self.data_plane)
            break
        self._keeper.write(self.checkpoint_path, taken)
        log.info("worker %s: checkpoint written to %s (inner step %d)", self.worker_id, self.checkpoint_path,
                 s.inner_step)

    def _unlabelled_state(self) -> str | None:
        """Why the global copy is not, right now, the state its round labels name (None: it is). A
        checkpoint must never offer one state under another's round (SPEC.md section 14, W18)."""
        if self.session.held:
            return "a Result is held for its overlap window; its round is the label, not yet the params"
        if not self.data_plane.state_confirmed:
            return ("the collective state this worker started the run from carries the run's round ids but no "
                    "commit has confirmed it yet")
        return None

    # ------------------------------------------------------------------ the training thread

    def _wait_until_trainable(self) -> bool:
        """Run what the session asks of the model until it may train (True) or has stopped (False)."""
        while True:
            self._take_stop_request()
            self._run_model_queue()
            with self._lock:
                if self._error is not None:
                    raise self._error
                if self._model_queue or self._stop_request is not None:
                    continue
                state = self.session.state
                if state is S.STOPPED:
                    return False
                if state is S.TRAINING:
                    self._trainable_since = self._clock()
                    return True
                if self.uses_comm_thread:
                    self._wake.wait(self.poll_interval_s)
                    continue
            self._pump(self.poll_interval_s)

    def _run_model_queue(self) -> None:
        while True:
            with self._lock:
                if self._error is not None:
                    raise self._error
                if not self._model_queue:
                    return
                action = self._model_queue.popleft()
            self._run([action])

    def _take_stop_request(self) -> None:
        save, self._stop_request = self._stop_request, None
        if save is not None:
            with self._lock:
                actions = self._took(self.session.request_stop(self._clock(), save=save))
            self._run(actions)

    # ------------------------------------------------------------------ the endpoint

    def _recv(self, timeout_s: float):
        try:
            return self.link.recv(timeout_s)
        except MemberBroken as exc:  # a sharded member lost a rank: it goes as a whole (S10)
            raise DilocoWorkerError(str(exc), "group_failed") from None

    def _pump(self, timeout_s: float, only_if_expected: bool = False) -> None:
        """Receive what arrived (waiting up to ``timeout_s``) and tick the session.

        The communication thread's turn; without that thread, the training thread's.
        """
        if self.link.on_comm_thread and self._stop_request is not None:
            with self._lock:
                self._wake.notify_all()  # the training thread takes the stop
        if not only_if_expected or self.session.awaiting_replies:
            msg = self._recv(timeout_s)
            while msg is not None:
                # A delta Result is decoded at install, in order.
                msg = compression.mark_delta(msg, self.sparse_wire)
                with self._lock:
                    actions = self._took(self.session.on_message(msg, self._clock()))
                    if isinstance(msg, Welcome) and any(isinstance(a, InstallParams) for a in actions):
                        self._adopt_wire(msg)  # with the Welcome the session took
                    actions = self._queue_model_actions(actions)
                self._run(actions)
                msg = self._recv(0.0)
        sending, receiving = self.link.transport_activity()
        silence = self.link.transport_silence()
        with self._lock:
            now = self._clock()
            if self.link.on_comm_thread:
                silence = self._without_stalls(now, silence)
            actions = self._took(self.session.tick(now, silence, sending=sending, receiving=receiving))
        self._run(actions)

    def _without_stalls(self, now: float, transport_silence: float | None) -> float | None:
        """The silence cap for the session's tick: time the process did not run is no silence (W11).

        Called by the communication thread, holding the lock, at every tick.
        """
        last, self._last_tick = self._last_tick, now
        if last is not None and now - last > STALL_S:
            self._stalls.append((now, now - last))
            log.warning("worker %s: this process did not run for %.1f s (stopped or starved); that time is not "
                        "the coordinator's silence", self.worker_id, now - last)
        if not self._stalls:
            return transport_silence
        silence = self.session.silence(now)
        began = now - silence
        lost = sum(gap for end, gap in self._stalls if end - gap >= began)
        if not lost:
            return transport_silence
        own = max(0.0, silence - lost)
        return own if transport_silence is None else min(own, transport_silence)

    def _comm_failed(self, exc: BaseException) -> None:
        if not isinstance(exc, DilocoWorkerError):
            log.error("worker %s: communication thread failed", self.worker_id, exc_info=exc)
            exc = DilocoWorkerError(f"communication thread failed: {exc!r}", "internal")
        with self._lock:
            self._error = self._error or exc
            self._wake.notify_all()

    # ------------------------------------------------------------------ actions

    def _queue_model_actions(self, actions: list[Action]) -> list[Action]:
        """Off the training thread, under ``_lock``: queue the first model action and all after it for
        the training thread in the same critical section that changed the session, and return the
        rest. So the session's round ids never run ahead of a queue that lacks their params: a
        checkpoint taken under the lock with the queue drained holds the params of its labels."""
        if threading.get_ident() == self._training_thread:
            return actions
        first = next((i for i, a in enumerate(actions) if isinstance(a, MODEL_ACTIONS)), None)
        if first is None:
            return actions
        self._model_queue.extend(actions[first:])
        self._wake.notify_all()
        return actions[:first]

    def _run(self, actions: list[Action]) -> None:
        """Carry out the session's actions in order; model actions only on the training thread."""
        on_training_thread = threading.get_ident() == self._training_thread
        deferred = False
        for i, action in enumerate(actions):
            if not on_training_thread and (deferred or isinstance(action, MODEL_ACTIONS)):
                # Keep the order: everything after a model action waits for the training thread.
                with self._lock:
                    self._model_queue.append(action)
                    self._wake.notify_all()
                deferred = True
                continue
            if isinstance(action, Send):
                message = action.message
                if on_training_thread:
                    self.link.post(message)
                else:
                    self.link.send(message)
            elif isinstance(action, StateChanged):
                self._report_states()
            elif isinstance(action, InstallParams):
                self._install(action)
            elif isinstance(action, MergeParams):
                self._merge(action)
            elif isinstance(action, SubmitFragment):
                self._submit(action)
            elif isinstance(action, SendJoinWithParams):
                params = self._keeper.join_params(self.data_plane.machine.wants_start_params)
                self.link.post(Join(self.worker_id, PROTOCOL_VERSION, self.session.spec, params,
                                    unit=self.session.unit))
                self.bytes_sent += compression.tensor_nbytes(params)
            elif isinstance(action, Stop):
                self._stop(action)
            elif isinstance(action, OutageReport):
                self._report_outage(action)
            elif isinstance(action, Fail):
                error = DilocoWorkerError(action.detail, action.code)
                if on_training_thread:
                    raise error
                with self._lock:
                    self._error = self._error or error
                    self._wake.notify_all()
            elif isinstance(action, Note):
                log.log(_LOG_LEVELS.get(action.level, logging.INFO), "worker %s: %s", self.worker_id, action.text)

    def _check_params(self, action: InstallParams | MergeParams, source: str) -> Mapping[str, torch.Tensor] | None:
        """The action's params checked against the model; a delta (SPEC.md section 11) resolved first.
        None for a sharded member on the collective plane: each rank's data plane holds its shards.

        A delta Result carries new = global + delta: it is resolved against this worker's
        global copy, which is the round's base (with overlap too: the copy changes only when
        a fragment's params are installed or merged).
        """
        if self._keeper.sharded and self.data_plane.collective:
            return None
        params = action.params
        received = None
        if isinstance(params, compression.DeltaParams):
            received = params.nbytes
            try:
                params = self._keeper.resolve_delta(params, action.names, f"{source} for fragment {action.fragment_id}")
            except compression.EncodingError as exc:
                raise DilocoWorkerError(str(exc), "bad_message") from None
        for n in action.names:
            t = params.get(n)
            if t is None:
                raise DilocoWorkerError(f"{source} for fragment {action.fragment_id} lacks parameter {n!r}",
                                        "bad_message")
            if tuple(t.shape) != tuple(self._params[n].shape):
                raise DilocoWorkerError(
                    f"{source}: parameter {n!r} has shape {list(t.shape)}; this model's has "
                    f"{list(self._params[n].shape)}", "bad_message")
        self.bytes_received += (received if received is not None
                                else compression.tensor_nbytes({n: params[n] for n in action.names}))
        return params

    def _merge(self, action: MergeParams) -> None:
        """Overlap (W16): local <- alpha * local + (1 - alpha) * global; the global copy becomes the Result's."""
        params = self._check_params(action, "Result")
        delta = isinstance(action.params, compression.DeltaParams)
        self._written(self._keeper.merge(action.names, params, delta, action.alpha, self.data_plane.collective),
                      action)

    def _install(self, action: InstallParams) -> None:
        params = self._check_params(action, action.source)
        delta = isinstance(action.params, compression.DeltaParams)
        self._written(self._keeper.install(action.names, params, delta, action.keep_if_same,
                                           self.data_plane.collective), action)

    def _written(self, outcome: str, action: InstallParams | MergeParams) -> None:
        if outcome == "non_finite":
            raise DilocoWorkerError(f"the delta for fragment {action.fragment_id} makes a parameter non-finite",
                                    "bad_message")
        if outcome == "installed":
            self.params_written += 1

    def _submit(self, action: SubmitFragment) -> None:
        fid = action.fragment_id
        enc, declared, self.last_update_norm = self._keeper.pseudo_gradient(
            fid, action.round_id, self.session.fragments[fid], self.wire_dtype, self.error_feedback_on,
            self.data_plane.collective, self.sparse_wire)
        tokens = self._tokens_since - self._tokens_at_submit.get(fid, 0)
        self._tokens_at_submit[fid] = self._tokens_since
        self.link.post(Submit(self.worker_id, fid, action.round_id, enc.values, self.wire_dtype, enc.scales,
                              tokens if tokens > 0 else None, unit=self.session.unit, norm=declared))
        self.bytes_sent += enc.nbytes

    def _adopt_wire(self, welcome: Welcome) -> None:
        """The Welcome's wire dtype and settings; the residuals the run has moved past dropped."""
        self.wire_dtype, self.sparse_wire = welcome.wire_dtype, sparse_wire_of(welcome, self._keeper.sharded)
        dropped = self._keeper.settle_residual(welcome.round_ids, welcome.fragments, self.worker_id, welcome.parked)
        self.residuals_dropped += len(dropped)

    @property
    def error_feedback_on(self) -> bool:
        """Whether this worker's Submits carry error feedback: as set, or by default for lossy int8."""
        return self.wire_dtype in compression.LOSSY if self.error_feedback is None else self.error_feedback

    def _stop(self, action: Stop) -> None:
        try:
            if action.save:
                if self.checkpoint_path is not None:
                    self.save_checkpoint()
                elif action.reason != "coordinator_unreachable":
                    log.warning("worker %s: asked to save a checkpoint but has no checkpoint_dir", self.worker_id)
        finally:
            with self._lock:
                actions = self._took(self.session.stopped_done(self._clock()))
            self._run(actions)

    def _fail(self, exc: DilocoWorkerError) -> None:
        with self._lock:
            actions = self._took(self.session.fail(exc.code or "error", str(exc), self._clock()))
        for a in actions:
            if isinstance(a, StateChanged):
                self._report_states()

    # ------------------------------------------------------------------ callbacks

    def _took(self, actions: list[Action]) -> list[Action]:
        """Note the session's moves in ``actions`` (called holding ``_lock``, so in the session's order)."""
        for a in actions:
            if isinstance(a, StateChanged):
                self._states_pending.append(a.state)
        return actions

    def _report_states(self) -> None:
        """Report every move not reported yet, in the session's order (a ``StateChanged`` action).

        Both threads carry out the session's actions, each after releasing ``_lock``, so a
        thread's ``StateChanged`` can come late: the training thread's WAITING after the
        communication thread's PAUSED, and an observer would be left believing the worker is
        WAITING. So the moves are queued in the order the session made them (``_took``) and
        reported one at a time by whichever thread gets here first; a thread that finds
        another one reporting leaves its moves to it (no thread waits for a slow callback).
        """
        with self._states_lock:
            if self._reporting_states:
                return
            self._reporting_states = True
        try:
            while True:
                with self._states_lock:
                    if not self._states_pending:
                        self._reporting_states = False
                        return
                    state = self._states_pending.popleft()
                self._state_changed(state)
        except BaseException:
            with self._states_lock:
                self._reporting_states = False
            raise

    def _state_changed(self, state: WorkerState) -> None:
        if self._on_state is None:
            return
        try:
            self._on_state(self.worker_id, state.value, self._clock())
        except Exception:  # an observer must never break training
            log.exception("worker %s: on_state callback failed", self.worker_id)

    def _report_outage(self, report: OutageReport) -> None:
        # With an on_outage callback the caller shows the outage; the log would say it twice.
        level = logging.INFO if self._on_outage is not None else logging.WARNING
        if report.kind == "waiting":
            log.log(level, "worker %s: no answer from the coordinator for %.0f s; waiting for %s (gives up after "
                    "%g s)", self.worker_id, report.waited_s, report.waiting_for, report.limit_s)
        elif report.kind == "back":
            log.log(level, "worker %s: the coordinator answered again after %.0f s", self.worker_id,
                    report.waited_s)
        else:
            log.log(level, "worker %s: no answer from the coordinator for %.1f s (waiting for %s); giving up",
                    self.worker_id, report.waited_s, report.waiting_for)
        if self._on_outage is None:
            return
        try:
            self._on_outage(report.kind, report.waited_s, report.waiting_for, report.limit_s)
        except Exception:  # an observer must never break training
            log.exception("worker %s: on_outage callback failed", self.worker_id)

