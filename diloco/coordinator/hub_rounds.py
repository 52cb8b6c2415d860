"""The hub plane's half of the coordinator: pseudo-gradients in, outer steps, params out.

Submits carry each worker's pseudo-gradient. This half checks them (wire dtype, shapes,
finiteness, ``--max-update-norm``, the outlier bound), sums a sync round's contributions as they
come (``ParamStore``), holds async ones until they apply, steps one outer ``torch.optim``
optimizer per fragment, and puts the new params (or a bf16/int8 run's encoded delta) in the
Results. The core decides *when*; this file does the arithmetic (SPEC.md sections 5, 11, 12).

Why one file of about 520 lines: the submission's checks, the running sum, the outer step and the
Results it releases share the per-fragment maps below (what was summed, what was handed out,
what was prepared ahead), and each step reads what the last one left.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from dataclasses import dataclass
from typing import Protocol

import torch

from diloco.blocked_step import GradBlocks, Magnitudes, blocked_step_applies, step_in_blocks
from diloco.coordinator.params import (
    NonFinite,
    ParamMismatch,
    ParamStore,
    all_finite,
    check_tensors,
    describe_mismatch,
    first_non_finite,
    l2_norm,
)
from diloco.coordinator.plane import Outgoing, RoundsHost, WelcomeParts
from diloco.coordinator.units import NO_UNIT
from diloco.core import (
    AbortReduce,
    AcceptContribution,
    ApplyRound,
    ContributionSubmitted,
    DiscardContribution,
    GraceWindowChanged,
    Mode,
    OrderReduce,
    Phase,
    ReleaseOutcome,
    ReleaseWorker,
)
from diloco.outer import OptimizerBackup, build_outer_optimizer
from diloco.coordinator.grace_auto import AutoGraceWindow
from diloco.coordinator.sparse_rounds import SparseRounds
from diloco.wire import compression
from diloco.wire.messages import ErrorCode, Join, ReduceReport, Result, Submit, Tensors


class StepRecorder(Protocol):
    """What a write-ahead journal hears from the hub coordinator (``persist.py``)."""

    def contribution(self, fragment_id: int, round_id: int, worker_id: str, submit: Submit) -> None:
        """An accepted contribution, as it came (encoded in the run's wire dtype)."""

    def step(self, fragment_id: int, inputs: list[tuple[int, str]], grad: Tensors) -> None:
        """An outer step is about to run on ``grad``, made of ``inputs`` ((round, worker) in the order
        they were summed; async: the one held contribution). ``grad`` is not changed by the step."""


def receive_buffers(tensors: Tensors, measured) -> bool:
    """Whether every tensor is memory the receiver measured as it arrived (``diloco.wire.measure``): the
    Submit's own receive buffers, fp32 and contiguous, which only this Submit holds."""
    return measured is not None and all(not t.numel() or measured.square(t) is not None for t in tensors.values())


def held_tensors(tensors: Tensors) -> Tensors:
    """An async contribution as it is held until it applies: fp32 copies (a replay makes the same)."""
    return {n: t.detach().to(torch.float32).clone() for n, t in tensors.items()}


@dataclass
class _Held:
    """An async contribution's tensors, kept until it applies or is discarded."""

    tensors: Tensors
    base: int
    #: What the Submit said it trained on (the token budget; a token-weighted merged step weighs it).
    tokens: int | None = None


class HubRounds:
    """The hub plane's ``DataPlaneRounds`` (``plane.py``)."""

    collective = None

    def __init__(self, host: RoundsHost) -> None:
        self.host = host
        self.config = host.config
        self._sync = self.config.fsm.mode is Mode.SYNC
        #: The global fp32 params and their fragments: from the first joiner, or a checkpoint.
        self.store: ParamStore | None = None
        self._optimizers: list[torch.optim.Optimizer] = []
        #: Per fragment: where ``outer_step`` backs its optimizer's state up (buffers kept from step to step).
        self._optimizer_backups: list[OptimizerBackup] = []
        self._held: dict[tuple[int, str], _Held] = {}
        #: fragment -> (next round id / version, what its Results carry right after its last
        #: ApplyRound in this step: params or an encoded delta). Results carry these copies,
        #: never the live tensors (see ``release``).
        self._released: dict[int, tuple[int, compression.Encoded]] = {}
        #: fragment -> weak references to the views of its params its last Results carry: while one is
        #: alive (a transport still sending, a driver holding the message), the params' memory must keep
        #: its values, and the next outer step writes fresh memory (``outer.step_in_blocks``).
        self._handed_out: dict[int, list[weakref.ref]] = {}
        #: fragment -> bounds on its params and momentum after its last blocked step (``outer.Magnitudes``).
        self._magnitudes: dict[int, Magnitudes | None] = {}
        #: Hears each accepted contribution and each outer step's input, so that a write-ahead journal
        #: can write them while the round goes on (``persist.py``).
        self.recorder: StepRecorder | None = None
        #: Sync rounds: the contributions in each fragment's running sum, in the order they were
        #: added (a replay adds them in the same order: the same bits).
        self._summed: dict[int, list[tuple[int, str]]] = {}
        #: Sync rounds: the tokens the contributions in each fragment's running sum trained on.
        self._round_tokens: dict[int, int] = {}
        #: Per fragment: its next outer step's preparation, made while the loop was idle
        #: (``idle``): the params moved to fresh memory (``begin_step``'s undo values) with the
        #: optimizer's state backed up, and what proves both still current.
        self._prepared: dict[int, tuple[Tensors, tuple]] = {}
        #: ``--wire-dtype sparse``: its sums, steps and Results (``sparse_rounds.py``); None for another.
        wire = self.config.sparse_wire
        self._sparse = SparseRounds(wire) if wire is not None else None
        #: ``--grace-window auto`` (async): the windows' length from the arrivals, and a change of it
        #: the core is told of at the end of the step (``end_step``).
        self.grace_auto = (AutoGraceWindow(self.config.fsm.grace_window_s, host.fsm.grace_window_s)
                           if self.config.grace_auto else None)
        self._next_window: float | None = None

    # ------------------------------------------------------------------ state

    @property
    def delta_results(self) -> bool:
        """Sync rounds of a bf16 or int8 run: Results carry the encoded delta, and the params
        become old + decode(delta) (SPEC.md section 11, "Wire dtypes"). Async: full fp32."""
        return self._sync and self.config.wire_dtype != "fp32"

    @property
    def has_state(self) -> bool:
        return self.store is not None

    def num_params(self) -> int:
        return sum(t.numel() for t in self.store.params.values()) if self.store is not None else 0

    def status(self) -> None:
        return None

    def install_params(self, params: Tensors, optimizer_states: list[dict] | None = None) -> None:
        """Set the global params (first joiner, or a checkpoint) and build the outer optimizers."""
        num_fragments = self.config.fsm.num_fragments
        self.store = ParamStore(params, num_fragments)
        self._prepared = {}
        self._optimizers = []
        self._optimizer_backups = [OptimizerBackup() for _ in range(num_fragments)]
        for fid in range(num_fragments):
            tensors = list(self.store.fragment_params(fid).values())
            self._optimizers.append(build_outer_optimizer(tensors, self.config.outer, self.host.fsm.min_workers))
        if optimizer_states is not None:
            for opt, state in zip(self._optimizers, optimizer_states):
                opt.load_state_dict(state)

    def optimizer_states(self) -> list[dict]:
        return [opt.state_dict() for opt in self._optimizers]

    # ------------------------------------------------------------------ joins

    def check_join(self, peer: str, msg: Join, out: Outgoing) -> Join | None:
        refuse = self.host.refuse
        if self.store is not None:
            if msg.params:
                # Only the first join's params are used: drop these at once, keep no reference.
                msg = dataclasses.replace(msg, params={})
            if tuple(msg.spec) != self.store.spec:
                refuse(peer, out, ErrorCode.MODEL_MISMATCH, describe_mismatch(msg.spec, self.store.spec), msg)
                return None
            return msg
        if not msg.spec:
            refuse(peer, out, ErrorCode.BAD_MESSAGE, "the join's spec lists no tensors: a model "
                   "needs at least one parameter", msg)
            return None
        # The run keeps fp32 params and every later join is compared with their spec:
        # a first join in another dtype would be welcomed and then lock out every
        # later worker with the very same model (Join: "initial fp32 params").
        not_fp32 = [s for s in msg.spec if s.dtype != "float32"]
        if not_fp32:
            refuse(peer, out, ErrorCode.BAD_MESSAGE,
                   f"initial params must be float32: tensor {not_fp32[0].name!r} is "
                   f"{not_fp32[0].dtype} (send fp32 copies; workers may train in any dtype)", msg)
            return None
        if not msg.params:
            # Joins carry only the spec; the first one is asked for the params (SPEC.md section 11).
            refuse(peer, out, ErrorCode.PARAMS_REQUIRED,
                   "the run has no params yet: join again with your initial fp32 params", msg)
            return None
        try:
            check_tensors(msg.params, msg.spec, "initial params of the first worker")
        except ParamMismatch as exc:
            refuse(peer, out, ErrorCode.BAD_MESSAGE, str(exc), msg)
            return None
        bad = first_non_finite(msg.params)
        if bad is not None:
            refuse(peer, out, ErrorCode.NON_FINITE,
                   f"initial params of the first worker: tensor {bad!r} has non-finite values "
                   f"(NaN or infinity); the run cannot start from them", msg)
            return None
        return msg

    def reseed(self, join: Join, out: Outgoing) -> None:
        pass  # the hub's params are the run's: a joiner never brings a newer state

    def welcome(self, worker_id: str, join: Join, out: Outgoing) -> WelcomeParts:
        if self.store is None:
            self.install_params(join.params)
        store = self.store
        assert store is not None
        units = self.host.units
        return WelcomeParts(dict(
            fragments=store.fragments,
            # A copy: the message must keep the values of *now* however long the driver
            # holds it (the store's tensors change in place at every outer step). Always fp32.
            params={n: t.clone() for n, t in store.params.items()},
            data_units=units.units or None,
            unit=self.host.hand_out(worker_id, join.unit),
        ), nbytes=compression.tensor_nbytes(store.params))

    # ------------------------------------------------------------ submissions

    def on_submit(self, peer: str, msg: Submit, out: Outgoing, measured) -> None:
        host, fid = self.host, msg.fragment_id
        if self.store is None or type(fid) is not int or not 0 <= fid < self.config.fsm.num_fragments:
            # The core refuses it (no such fragment, or no round open yet) with the reason.
            host.step(ContributionSubmitted(msg.worker_id, fid, msg.round_id), out, peer=peer, submit=msg,
                      tensors=None)
            return
        if self._sparse is not None:
            # Checked and decoded to entries, never to a dense tensor; the bounds on the entries' norm.
            payloads = self._decode_submission(peer, msg, out)
            if payloads is not None:
                norm = self._sparse.norm(payloads)
                self._bounded_step(peer, msg, out, payloads, norm, norm, owned=False)
            return
        # Decoded to fp32 first (SPEC.md section 11, "Wire dtypes"); then the checks of any submission.
        tensors = self._decode_submission(peer, msg, out)
        if tensors is None:
            return
        try:
            # The outlier bound needs the norm: the same pass proves the tensors finite.
            checked_norm = self.store.check_submission(fid, tensors, norm=host.outliers.factor > 0,
                                                       measured=measured)
        except NonFinite as exc:
            host.refuse(peer, out, ErrorCode.NON_FINITE, str(exc), msg)
            return
        except ParamMismatch as exc:
            host.refuse(peer, out, ErrorCode.TENSOR_MISMATCH, str(exc), msg)
            return
        # ``--max-update-norm`` is held to the exact norm; the outlier bound alone takes the checks' measure.
        norm = l2_norm(tensors) if self.config.max_update_norm is not None else checked_norm
        self._bounded_step(peer, msg, out, tensors, norm, checked_norm if checked_norm is not None else norm,
                           receive_buffers(tensors, measured))

    def _bounded_step(self, peer: str, msg: Submit, out: Outgoing, tensors, norm: float | None,
                      step_norm: float | None, owned: bool) -> None:
        """The bounds every submission is held to on ``norm`` (``--max-update-norm``, the outlier bound;
        SPEC.md section 12), then the core; an accepted contribution's norm joins the outlier history."""
        host, fid = self.host, msg.fragment_id
        limit = self.config.max_update_norm
        if limit is not None and norm is not None and norm > limit:
            host.refuse(peer, out, ErrorCode.UPDATE_TOO_LARGE,
                        f"fragment {fid} submission: L2 norm {norm:.6g} exceeds the coordinator's "
                        f"--max-update-norm {limit:g}", msg)
            return
        if host.outliers.factor > 0:
            assert norm is not None  # measured by the checks whenever the bound is on
            why = host.outliers.check(fid, norm, self.store.fragment_params(fid))
            if why is not None:
                host.refuse(peer, out, ErrorCode.UPDATE_TOO_LARGE, f"fragment {fid} submission: {why}", msg)
                host.notify("outlier", host.fsm.now_s, worker_id=msg.worker_id, fragment_id=fid,
                            norm=norm if math.isfinite(norm) else str(norm), detail=why)
                return
        effects = host.step(ContributionSubmitted(msg.worker_id, fid, msg.round_id), out, peer=peer, submit=msg,
                            tensors=tensors, norm=step_norm, owned=owned)
        if norm is not None and any(type(e) is AcceptContribution for e in effects):
            host.outliers.accepted(fid, norm)

    def _decode_submission(self, peer: str, msg: Submit, out: Outgoing):
        """The submission's tensors as fp32 (a sparse run: its payloads' entries, ``sparse.Payload``), or
        None after refusing it (bad_message, tensor_mismatch, non_finite)."""
        host, fid, wire_dtype = self.host, msg.fragment_id, self.config.wire_dtype
        what = f"fragment {fid} submission"
        if msg.wire_dtype != wire_dtype:
            host.refuse(peer, out, ErrorCode.BAD_MESSAGE,
                        f"{what} is encoded as {msg.wire_dtype}; this run's wire dtype is {wire_dtype} (the "
                        f"Welcome says so: join again)", msg)
            return None
        if msg.tokens is None and self.config.token_weighted:
            host.refuse(peer, out, ErrorCode.BAD_MESSAGE,
                        f"{what} does not say how many tokens it trained on; this run merges contributions "
                        f"weighted by their tokens (--merge {self.config.merge})", msg)
            return None
        assert self.store is not None
        spec = [(s.name, s.shape) for s in self.store.fragment_spec(fid)]
        try:
            if self._sparse is not None:
                return self._sparse.decode(msg, spec, what)
            return compression.decode(msg.tensors, msg.scales, wire_dtype, spec, what)
        except compression.EncodedMismatch as exc:
            host.refuse(peer, out, ErrorCode.TENSOR_MISMATCH, str(exc), msg)
        except compression.NonFiniteScale as exc:  # the pseudo-gradient was not finite before encoding
            host.refuse(peer, out, ErrorCode.NON_FINITE, str(exc), msg)
            host.notify("outlier", host.fsm.now_s, worker_id=msg.worker_id, fragment_id=fid, norm="nan",
                        detail=str(exc))
        except compression.EncodingError as exc:
            host.refuse(peer, out, ErrorCode.BAD_MESSAGE, str(exc), msg)
        return None

    def on_report(self, peer: str, msg: ReduceReport, out: Outgoing) -> None:
        self.host.refuse(peer, out, ErrorCode.BAD_MESSAGE,
                         "a coordinator does not accept ReduceReport messages", msg)

    # --------------------------------------------------------------- effects

    def accept(self, effect: AcceptContribution, submit: Submit, tensors: Tensors, peer: str, out: Outgoing,
               norm: float | None, closes: bool, owned: bool) -> None:
        host, store = self.host, self.store
        assert store is not None
        nbytes = compression.tensor_nbytes
        host.stats.bytes_received += nbytes(submit.tensors) + nbytes(submit.scales)
        fid = effect.fragment_id
        if self._sparse is not None:
            self._sparse.add(fid, store.fragment_params(fid), tensors, submit)  # type: ignore[arg-type]
            self._summed.setdefault(fid, []).append((effect.round_id, effect.worker_id))
            self._round_tokens[fid] = self._round_tokens.get(fid, 0) + (submit.tokens or 0)
        elif self._sync:
            # ``closes``: this round's outer step follows, whose mean makes the addition in its own pass.
            # ``owned``: the tensors are the receiver's buffers, which nothing else reads (a journal
            # writes the Submit as it came: then they are not), so the round's sum may start in them.
            store.accumulate(fid, tensors, submit.tokens if self.config.token_weighted else None, norm,
                             last=closes, owned=owned and self.recorder is None)
            self._summed.setdefault(fid, []).append((effect.round_id, effect.worker_id))
            self._round_tokens[fid] = self._round_tokens.get(fid, 0) + (submit.tokens or 0)
        else:
            self._held[(fid, effect.worker_id)] = _Held(held_tensors(tensors), effect.round_id, submit.tokens)
            if self.grace_auto is not None:
                self.grace_auto.accepted(fid, host.fsm.now_s)
        if host.units.enabled:
            why = host.units.submitted(effect.worker_id, fid, NO_UNIT if submit.unit is None else submit.unit)
            if why is not None:  # the contribution counts; its data is not marked trained
                host.notify("unit_mismatch", host.fsm.now_s, worker_id=effect.worker_id, fragment_id=fid,
                            round_id=effect.round_id, detail=why)
        if self.recorder is not None:
            self.recorder.contribution(effect.fragment_id, effect.round_id, effect.worker_id, submit)

    def apply(self, effect: ApplyRound, now: float) -> dict:
        host, store = self.host, self.store
        assert store is not None
        fid = effect.fragment_id
        grad_bound = None
        mean = None
        if self._sparse is not None:
            inputs = self._summed.pop(fid, [])
            bad, released = self._sparse.step(fid, store.fragment_params(fid), len(inputs))
            self._stepped(effect, bad, self._round_tokens.pop(fid, 0), now)
            self._released[fid] = (effect.round_id + 1, released)
            return {}
        if self._sync:
            # The mean is made in the outer step's own pass when it can be (``outer.step_in_blocks``).
            mean = store.open_mean(fid, len(effect.contributors))
            grad = mean.tensors
            grad_bound = store.mean_bound(fid)
            inputs = self._summed.pop(fid, [])
            tokens = self._round_tokens.pop(fid, 0)
        elif len(effect.contributors) == 1:
            (wid,) = effect.contributors
            held = self._held.pop((fid, wid))
            grad, inputs, tokens = held.tensors, [(held.base, wid)], held.tokens or 0
        else:
            # A grace window's merged step (SPEC.md P5): the mean of its contributions, summed in
            # the order the core lists them through the sync rounds' running sum (the same bits).
            inputs, tokens = [], 0
            for wid in effect.contributors:
                held = self._held.pop((fid, wid))
                store.accumulate(fid, held.tensors, held.tokens if self.config.token_weighted else None)
                inputs.append((held.base, wid))
                tokens += held.tokens or 0
            grad = store.take_mean(fid, len(inputs))
        if self.recorder is not None:
            if mean is not None:
                mean.finish()  # the journal writes the mean while the step runs
            self.recorder.step(fid, inputs, grad)
            mean = None
        bad, delta = self.outer_step(fid, grad, grad_bound, mean)
        self._stepped(effect, bad, tokens, now)
        if self.grace_auto is not None:
            everyone = len(effect.contributors) >= host.fsm.live_workers
            self._next_window = self.grace_auto.closed(fid, everyone) or self._next_window
        # What the Results of this apply carry (SPEC.md section 5, rule 1: they follow it),
        # shared by all its contributors: views of the params, which no later step writes
        # (each moves them to fresh memory first, ``ParamStore.begin_step``), so a Result still
        # queued or held keeps these values; a later apply of the same fragment in the same
        # step (async, held contributions) releases its own.
        if not self.delta_results:
            released = compression.Encoded(store.released(fid), {})
            self._handed_out[fid] = [weakref.ref(t) for t in released.values.values()]
        elif bad is not None or delta is None:  # params unchanged: a zero delta
            released = compression.encode({n: torch.zeros_like(t) for n, t in store.fragment_params(fid).items()},
                                          self.config.wire_dtype)
        else:
            released = delta
        self._released[fid] = (effect.round_id + 1, released)
        return {}

    def _stepped(self, effect: ApplyRound, bad: str | None, tokens: int, now: float) -> None:
        """What follows an outer step, whatever made it: a refused one is told; an applied one counts its
        tokens; units finish or go back."""
        host, fid = self.host, effect.fragment_id
        if bad is not None:
            host.stats.steps_refused += 1
            host.notify("step_refused", now, fragment_id=fid, round_id=effect.round_id,
                        contributors=list(effect.contributors), tensor=bad)
        else:
            host.budget.add(tokens, now)
        if host.units.enabled:
            self._units_of_step(fid, effect.round_id, effect.contributors, bad is None, now)

    def _units_of_step(self, fid: int, round_id: int, contributors, applied: bool, now: float) -> None:
        """An outer step's contributions: their units finish when it applied; else they go back."""
        units = self.host.units
        if applied:
            done = units.applied(fid, contributors)
            if done:
                self.host.notify("units_finished", now, fragment_id=fid, round_id=round_id, units=done)
        else:
            for wid in contributors:
                units.not_applied(fid, wid)

    def idle(self) -> None:
        """Make the part of one fragment's next outer step that does not depend on its input, ahead,
        when that step goes to ``opt.step()`` or needs the params' old values (a bf16/int8 run's delta;
        otherwise ``step_in_blocks`` needs nothing made ahead): move its
        params to fresh memory holding the same values (``begin_step``) and back its optimizer's state
        up. Two model-sized copies that ``outer_step`` would otherwise make after the round's last
        contribution, on the round's critical path. Values and bits are unchanged: the params keep
        their values, and ``outer_step`` uses the preparation only while nothing has changed the
        params or the optimizer's state since (``_step_key``); else it makes them itself, as a journal
        replay does. One fragment per call, so that an idle tick stays short."""
        store = self.store
        if store is None or self._sparse is not None:
            return  # a sparse step has no optimizer state and writes fresh memory anyway
        for fid in range(len(self._optimizers)):
            if fid in self._prepared or (blocked_step_applies(self._optimizers[fid]) and not self.delta_results):
                continue  # a blocked step into fresh memory or in place needs nothing made ahead
            before = store.begin_step(fid)
            self._optimizer_backups[fid].take(self._optimizers[fid])
            self._prepared[fid] = (before, self._step_key(fid))
            return

    def _step_key(self, fid: int) -> tuple:
        """What identifies fragment ``fid``'s params and optimizer state as they are now: each tensor's
        memory and version counter (an in-place change bumps it)."""
        assert self.store is not None
        opt = self._optimizers[fid]
        params = [(p.data_ptr(), p._version) for p in self.store.fragment_params(fid).values()]
        state = [(k, v.data_ptr(), v._version) if isinstance(v, torch.Tensor) else (k, repr(v))
                 for st in opt.state.values() for k, v in st.items()]
        groups = [repr(sorted((k, v) for k, v in g.items() if k != "params")) for g in opt.param_groups]
        return tuple(params), tuple(state), tuple(groups)

    def outer_step(self, fid: int, grad: Tensors, grad_bound: float | None = None,
                   grad_blocks: GradBlocks | None = None) -> tuple[str | None, compression.Encoded | None]:
        """Step fragment ``fid``'s outer optimizer on ``grad``: (the first non-finite tensor or None, the
        encoded delta the Results carry on a bf16/int8 run, else None). ``grad_bound``: at least every
        element's magnitude, when known (``ParamStore.mean_bound``), for a step made in place.
        ``grad_blocks``: ``grad`` is still to be made (``ParamStore.open_mean``); made by the step.

        Deterministic: the same params, optimizer state and ``grad`` give the same bits, which
        is what lets a write-ahead log replay a round (``journal.py``).
        """
        store = self.store
        assert store is not None
        params = store.fragment_params(fid)
        opt = self._optimizers[fid]
        # Finite contributions can still step to an infinity (a huge mean times lr and momentum):
        # the step must be undone exactly, and the params' memory, which the last Results may still
        # be sent from, must keep its values. A plain Nesterov step is made block by block
        # (``outer.step_in_blocks``, the same bits): in place when no Result holds the params' memory
        # any more and bounds prove it finite, else into fresh memory, leaving the old as the undo.
        # Any other step changes a fresh copy of the params (``begin_step``) with the optimizer's
        # state backed up.
        opt_before = self._optimizer_backups[fid]
        prepared = self._prepared.pop(fid, None)
        # Made while idle (``idle``) and still current: the same values, bit for bit.
        kept = prepared[0] if prepared is not None and prepared[1] == self._step_key(fid) else None
        overwrite = not self.delta_results and all(ref() is None for ref in self._handed_out.get(fid, ()))
        blocked = step_in_blocks(opt, params, grad, grad_bound=None if self.delta_results else grad_bound,
                                 magnitudes=self._magnitudes.get(fid), overwrite=overwrite,
                                 undo_kept=kept is not None, grad_blocks=grad_blocks)
        self._magnitudes[fid] = None if blocked is None else blocked.magnitudes
        if blocked is not None and kept is None:
            before, bad, undo = blocked.before, blocked.bad, blocked.undo
        else:
            if kept is not None:
                before = kept
            else:
                before = store.begin_step(fid)
                opt_before.take(opt)
            if blocked is not None:
                bad = blocked.bad
            else:
                for name, p in params.items():
                    p.grad = grad[name]
                opt.step()
                for p in params.values():
                    p.grad = None
                bad = next((n for n, p in params.items() if not all_finite(p)), None)

            def undo() -> None:
                store.undo_step(fid, before)
                opt_before.restore(opt)
        delta = None
        if self.delta_results and bad is None:
            # The params every worker will hold: old + decode(encode(delta)), bit for bit.
            delta, new = compression.quantized_update(before, params, self.config.wire_dtype)
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(new[n])
            bad = next((n for n, p in params.items() if not all_finite(p)), None)
        if bad is not None:
            # SPEC.md section 12, "Non-finite steps": undo the step exactly; the round still
            # counts as applied (the core emitted ApplyRound) and its contributions are
            # discarded; the Results carry the unchanged params.
            undo()
        return bad, delta

    def release(self, effect: ReleaseWorker, peer: str, out: Outgoing) -> None:
        # The values right after the ApplyRound that released this worker, not the live
        # tensors: a driver may hold the message while later steps apply more rounds
        # (the simulator delays delivery), and in async mode several held contributions
        # apply in one step, each releasing its worker at its own version.
        host = self.host
        next_round, released = self._released[effect.fragment_id]
        host.stats.bytes_sent += released.nbytes
        delta = self.delta_results
        unit = (host.hand_out(effect.worker_id)
                if host.units.enabled and effect.outcome is ReleaseOutcome.APPLIED else None)
        out.append((peer, Result(effect.fragment_id, effect.round_id, effect.outcome.value, next_round,
                                 released.values, delta, self.config.wire_dtype if delta else "fp32",
                                 released.scales, unit=unit)))

    def discard(self, effect: DiscardContribution) -> None:
        self.host.units.not_applied(effect.fragment_id, effect.worker_id)
        if self._sparse is not None:
            self._sparse.discard(effect.fragment_id)
        if self._sync:
            # Discards happen only at a stop (P1), which discards the whole round.
            if self.store is not None:
                self.store.reset_sum(effect.fragment_id)
            self._summed.pop(effect.fragment_id, None)
            self._round_tokens.pop(effect.fragment_id, None)
        else:
            self._held.pop((effect.fragment_id, effect.worker_id), None)

    def order(self, effect: OrderReduce, out: Outgoing, now: float) -> None:
        raise AssertionError("the core orders no reduce on the hub data plane")

    def abort(self, effect: AbortReduce, out: Outgoing, now: float) -> None:
        raise AssertionError("the core aborts no reduce on the hub data plane")

    def forget(self, worker_id: str, out: Outgoing) -> None:
        pass  # a worker's contributions stay or go by the core's effects, not by its connection

    def end_step(self) -> None:
        self._released.clear()
        if self._next_window is not None:
            # P5: the windows opened from now on last as long as the arrivals say (``grace_auto.py``);
            # none opens once the run stopped (a drain's last window may close in the stopping step).
            window, self._next_window = self._next_window, None
            if self.host.fsm.phase is Phase.STOPPED:
                return None
            self.host.step(GraceWindowChanged(window), [])
            self.host.notify("grace_window", self.host.fsm.now_s, seconds=window)
        return None
