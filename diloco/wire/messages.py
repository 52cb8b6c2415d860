"""The messages that cross a transport, one frozen dataclass per type.

Tensors travel as ``dict[str, torch.Tensor]`` (ordered by the run's parameter
order); the ZeroMQ codec sends them as raw frames after a msgpack header and
never pickles anything. SPEC.md section 11 documents every type and field.

Why one file of about 420 lines: every message is here, so the wire's whole vocabulary (and the
schemas, ``schemas.py``, that must list the same fields) is read in one place.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from diloco.core.reasons import RejectReason

if TYPE_CHECKING:  # torch only for tensors: an admin command must not pay for importing it
    import torch

#: Bumped on any incompatible change to these messages or their encoding. 3: the run's
#: wire dtype (``Welcome.wire_dtype``; ``Submit`` and ``Result`` carry it, with ``scales``,
#: and a ``Result`` may carry a delta). 4: the collective data plane (``Welcome.data_plane``,
#: ``ReduceOrder``, ``ReduceReport``, ``ReduceAbort``, ``HealOrder``, ``Result.digest``,
#: ``Join.holds_params``, ``Join.held_rounds``, ``Join.held_digests``). 5: heartbeat asides may
#: come between the parts of another message (the ``DLCA`` part tag, ``transport/zmq/framing.py``):
#: a version 4 peer would take one for a new message and drop the one it interrupts. 6: a frame may
#: come in pieces sized to the link, and big messages are acked as they arrive (the ``DLCP`` and
#: ``DLCK`` tags, ``transport/zmq/tags.py``): a version 5 peer would take either for garbage.
#: 7: the collective plane's checks (``Submit.norm``, ``ReduceOrder.norms``/``gather``,
#: ``ReduceReport.blame``/``mean_refused``, the ``evicted`` code; SPEC.md section 7c). 8: heals from
#: several members (``Welcome.more_heal_sources``/``more_heal_prefixes``), the sparse wire
#: (``Welcome.wire_options``, the ``sparse`` wire dtype) and the ``invalid_grace_window`` code.
PROTOCOL_VERSION = 8

#: How tensors of ``Submit`` and ``Result`` travel (``diloco.wire.compression``, SPEC.md
#: section 11, "Wire dtypes"). Plain names here so that decoding a header needs no torch.
WIRE_DTYPE_NAMES = ("fp32", "bf16", "int8", "int4", "sparse")

Tensors = dict[str, "torch.Tensor"]


#: The keys a ``Heartbeat``'s ``metrics`` may hold: key -> (kind, meaning). "int" values are
#: integers >= 0, "float" values finite numbers (``steps_per_s`` also >= 0).
HEARTBEAT_METRICS: dict[str, tuple[str, str]] = {
    "step": ("int", "the worker's inner step"),
    "steps_per_s": ("float", "inner steps per second over the last half minute or so"),
    "loss": ("float", "the last training loss reported"),
    "eval_loss": ("float", "the last evaluation loss reported"),
    "samples": ("int", "samples trained on (batches x batch size when known, else inner steps)"),
    "train_steps_per_s": ("float", "inner steps per second of training time (waits at the barrier, pauses "
                                   "and joins left out): the worker's speed for DyLU; sent in DyLU runs only"),
}

#: Largest H (inner steps per round) a ``Welcome`` or ``HeartbeatReply`` may ask for (DyLU).
MAX_SYNC_EVERY = 1 << 30


#: Codes only the coordinator and the transports use (the rest are the core's reject reasons).
TRANSPORT_ERROR_CODES: dict[str, str] = {
    "BAD_MESSAGE": "undecodable bytes, a missing or mistyped field, an unknown message type",
    "PROTOCOL_VERSION": "the peer speaks another protocol version (the detail names both)",
    "MODEL_MISMATCH": "the joiner's model (tensor names, shapes, dtypes) differs from the run's",
    "TENSOR_MISMATCH": "a submission's tensors do not match the run's parameters of that fragment",
    "TOO_LARGE": "a message larger than the transport's max_message_bytes",
    "STOPPED": "the run has stopped; the coordinator accepts nothing more",
    "BAD_COMMAND": "an admin command the coordinator does not know, or bad arguments to one",
    "PARAMS_REQUIRED": "the run has no params yet: the first worker must join again with its initial params",
    "NON_FINITE": "tensors holding NaN or infinite values (a first join's params, a submission)",
    "UPDATE_TOO_LARGE": "a contribution whose L2 norm exceeds the coordinator's --max-update-norm",
    "FORBIDDEN": "the sender's key has no right to this message (an admin command from a worker key, "
                 "or a worker message from an admin key)",
    "WRONG_KEY": "the worker id is bound to another key: the key that first joined it",
    "BANNED": "the worker id (or, with authentication, its key) was banned with `kick --ban`",
    "KEY_ID_LIMIT": "the key already holds as many live worker ids as it may (one, unless its auth directory "
                    "entry allows more: workers/NAME.max_ids)",
    "START_PARAMS_REQUIRED": "collective plane: no member holds the run's state yet; join again with "
                             "holds_params (your own initial params start the run; they are not sent)",
    "EVICTED": "collective plane: every member of the group found this worker's contribution failing the "
               "run's checks; it leaves the round and joins again with the run's state",
}

#: Codes in ``Error`` replies: every ``RejectReason`` of the core (same names and
#: values, so a reject crosses the wire unchanged) plus ``TRANSPORT_ERROR_CODES``.
#: Built from both so the two lists can never drift apart. SPEC.md section 11.
if TYPE_CHECKING:
    # The same members, spelled out for type checkers (which cannot see the ones built below);
    # tests/test_typed.py fails when the two differ.
    class ErrorCode(str, enum.Enum):
        UNKNOWN_WORKER = "unknown_worker"
        INVALID_WORKER_ID = "invalid_worker_id"
        UNKNOWN_FRAGMENT = "unknown_fragment"
        INVALID_ROUND = "invalid_round"
        STALE_ROUND = "stale_round"
        FUTURE_ROUND = "future_round"
        DUPLICATE = "duplicate"
        SHUTTING_DOWN = "shutting_down"
        TOO_MANY_WORKERS = "too_many_workers"
        HELD_LIMIT = "held_limit"
        INVALID_MIN_WORKERS = "invalid_min_workers"
        INVALID_GRACE_WINDOW = "invalid_grace_window"
        ALREADY_MEMBER = "already_member"
        STALE_ATTEMPT = "stale_attempt"
        INVALID_REPORT = "invalid_report"
        REDUCING = "reducing"
        BAD_MESSAGE = "bad_message"
        PROTOCOL_VERSION = "protocol_version"
        MODEL_MISMATCH = "model_mismatch"
        TENSOR_MISMATCH = "tensor_mismatch"
        TOO_LARGE = "too_large"
        STOPPED = "stopped"
        BAD_COMMAND = "bad_command"
        PARAMS_REQUIRED = "params_required"
        NON_FINITE = "non_finite"
        UPDATE_TOO_LARGE = "update_too_large"
        FORBIDDEN = "forbidden"
        WRONG_KEY = "wrong_key"
        BANNED = "banned"
        KEY_ID_LIMIT = "key_id_limit"
        START_PARAMS_REQUIRED = "start_params_required"
        EVICTED = "evicted"
else:
    ErrorCode = enum.Enum(
        "ErrorCode",
        [(r.name, r.value) for r in RejectReason] + [(name, name.lower()) for name in TRANSPORT_ERROR_CODES],
        type=str,
        module=__name__,
    )


class Command(str, enum.Enum):
    """What a heartbeat reply tells a worker to do."""

    #: Keep going.
    CONTINUE = "continue"
    #: The run stopped (drain finished or abort): stop now.
    STOP = "stop"
    #: The run stopped with save-and-stop: save your own checkpoint, then stop.
    SAVE_AND_STOP = "save_and_stop"
    #: The coordinator does not know you (declared dead, or it restarted): join again.
    REJOIN = "rejoin"


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Name, shape and dtype of one parameter tensor; how a run's model is identified."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        return cls(name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))


def spec_of(tensors: Tensors) -> tuple[TensorSpec, ...]:
    return tuple(TensorSpec.of(name, t) for name, t in tensors.items())


# ---------------------------------------------------------------- worker -> coordinator


@dataclass(frozen=True, slots=True)
class Join:
    """Ask to join. ``params`` are the worker's initial fp32 params: used only if the run has none yet."""

    worker_id: str
    protocol_version: int
    spec: tuple[TensorSpec, ...]
    params: Tensors = field(default_factory=dict)
    #: Collective plane: the worker holds initial params it can start the run from (they are
    #: not sent: the coordinator of a collective run never holds the model, SPEC.md C6).
    holds_params: bool = False
    #: Collective plane, with ``holds_params``: the round ids (one per fragment) of the committed
    #: state the worker holds (its replica, or its checkpoint); () for initial params. Before the
    #: first commit of a (re)started run, the newest such state starts it (SPEC.md C6).
    held_rounds: tuple[int, ...] = ()
    #: With ``held_rounds``: the digest of each fragment's params in that state (as ``Result.digest``),
    #: so the coordinator can tell the state its last commits made from any other (C6).
    held_digests: tuple[str, ...] = ()
    #: Data work units: the unit this worker holds and trains on (a re-join after a coordinator restart
    #: asks to keep it); None: none, or the run has no units (SPEC.md section 12, "Data work units").
    unit: int | None = None
    #: Collective plane: how the member's model is sharded across its ranks (``layout_text``; None:
    #: one rank holds the whole model). Rank r of each member reduces with rank r of the others, so
    #: every member of a collective run has the run's layout (SPEC.md section 15, S8).
    layout: str | None = None


#: How a refusal names the layout of a member that is not sharded (``Join.layout`` None).
REPLICATED_LAYOUT = "replicated (one rank holds the whole model)"


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """I am alive. Answered by ``HeartbeatReply``.

    ``metrics`` (optional; omitted from the header when None): the worker's latest
    training figures, keys of ``HEARTBEAT_METRICS`` only (SPEC.md section 11).
    """

    worker_id: str
    metrics: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class Submit:
    """A pseudo-gradient (global - local) for one fragment.

    Sync: ``round_id`` is the round. Async: the fragment version training started from.
    ``tensors`` are encoded in ``wire_dtype`` (the run's, from the Welcome); int8 puts
    one fp32 scale vector per tensor in ``scales`` (``diloco.wire.compression``).
    ``tokens``: how many tokens (or samples, or inner steps: any unit, the same for every
    worker) this pseudo-gradient trained on, for a token-weighted merge; None: not said.
    """

    worker_id: str
    fragment_id: int
    round_id: int
    tensors: Tensors
    wire_dtype: str = "fp32"
    scales: Tensors = field(default_factory=dict)
    tokens: int | None = None
    #: Data work units: the unit this pseudo-gradient trained on (the one the worker was handed); None: none.
    unit: int | None = None
    #: Collective plane: the L2 norm of the pseudo-gradient as the group will decode it (any float:
    #: NaN or inf is refused ``non_finite``); the coordinator's checks of a ready (SPEC.md section 7c).
    norm: float | None = None


@dataclass(frozen=True, slots=True)
class ReduceReport:
    """Collective plane: how my reduce of (fragment, round, attempt) ended (SPEC.md C4).

    ``ok`` with ``digest``, the digest of the params I would adopt; or not ok, ``detail`` why.
    """

    worker_id: str
    fragment_id: int
    round_id: int
    attempt: int
    ok: bool
    digest: str = ""
    detail: str = ""
    #: Not ok: the group members whose contribution failed the checks, as this member saw them
    #: (SPEC.md section 7c, "Checks and blame").
    blame: tuple[str, ...] = ()
    #: Not ok: fp32's all-reduced mean failed the checks (whose contribution it was, nobody saw).
    mean_refused: bool = False


@dataclass(frozen=True, slots=True)
class Leave:
    """Goodbye: the worker is stopping on its own."""

    worker_id: str


# ---------------------------------------------------------------- coordinator -> worker


@dataclass(frozen=True, slots=True)
class Welcome:
    """You are a member. Start from ``params`` (all fragments, current global values)."""

    worker_id: str
    #: Per fragment: the round to contribute to next (sync) or the current version (async).
    round_ids: tuple[int, ...]
    #: (fragment_id, round_id) pairs where a contribution of this worker's id is already
    #: pending (from before a crash): wait for their ``Result`` before training (SPEC.md P2).
    parked: tuple[tuple[int, int], ...]
    #: "sync" or "async".
    mode: str
    #: Parameter names of each fragment, in order. Fragment f's round r closes at
    #: inner step r*H + max(1, (f+1)*H//F) (Streaming DiLoCo staggering; diloco.worker).
    fragments: tuple[tuple[str, ...], ...]
    min_workers: int
    below_min_workers: bool
    #: How often to send heartbeats (a fraction of the coordinator's timeout).
    heartbeat_interval_s: float
    #: Always the full fp32 global params.
    params: Tensors
    #: The run's wire dtype: encode every ``Submit`` in it (``WIRE_DTYPE_NAMES``).
    wire_dtype: str = "fp32"
    #: DyLU (SPEC.md section 14, "DyLU"): the inner steps per round this worker should take,
    #: adopted at a round boundary. None (left out of the header): the run does not use DyLU.
    sync_every: int | None = None
    #: "hub" (``params`` are the run's) or "collective" (``params`` empty; SPEC.md C6).
    data_plane: str = "hub"
    #: Collective: the port of the coordinator's rendezvous store (on the coordinator's host).
    store_port: int = 0
    #: Collective: the member to copy the committed state from ("": start from your own params),
    #: and the store prefix of that one-to-one transfer (random per run, SPEC.md C6).
    heal_source: str = ""
    heal_prefix: str = ""
    #: Collective: every worker runs the outer optimizer (``diloco.outer.OuterConfig``
    #: fields) and bounds each collective by ``collective_timeout_s``.
    outer: dict[str, Any] = field(default_factory=dict)
    collective_timeout_s: float = 0.0
    #: Collective: per fragment, the last commit (round_id, digest); (-1, "") before any. A member
    #: whose commit Result a coordinator crash swallowed adopts its proposal if it is this one.
    committed: tuple[tuple[int, str], ...] = ()
    #: Data work units: units per epoch (None: the run has none), and the unit to train on next
    #: (``epoch * data_units + index``; None: none).
    data_units: int | None = None
    unit: int | None = None
    #: Collective: the run's layout (``Join.layout`` of the members holding its state; None: not sharded).
    layout: str | None = None
    #: Collective: the sources after ``heal_source`` and their prefixes (``--heal-sources``): the
    #: joiner asks source i for part i of the state, all at once (SPEC.md C6, "Heals").
    more_heal_sources: tuple[str, ...] = ()
    more_heal_prefixes: tuple[str, ...] = ()
    #: The wire dtype's settings, when it has any: ``sparse`` -- ``chunk``, ``k`` (kept per chunk),
    #: ``beta`` (the accumulator's decay) and ``lr`` (the outer step's; ``diloco.wire.sparse.SparseWire``).
    wire_options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ReduceOrder:
    """Collective plane: reduce (fragment, round) with ``group`` (rank = index), attempt ``attempt``.

    Build (or reuse) the process group under the store prefix ``prefix``, all-reduce your
    pseudo-gradient, compute the outer step on a copy and answer ``ReduceReport`` with the
    digest of the params you would adopt. Adopt nothing before the ``Result`` (SPEC.md C3).
    """

    fragment_id: int
    round_id: int
    attempt: int
    group: tuple[str, ...]
    prefix: str
    #: Each group member's declared contribution norm (``Submit.norm``, as the coordinator checked
    #: it), in group order: what every member holds each contribution against.
    norms: tuple[float, ...] = ()
    #: Gather every member's contribution (even in fp32), so each can be checked: the attempt
    #: after an fp32 mean failed its checks.
    gather: bool = False


@dataclass(frozen=True, slots=True)
class ReduceAbort:
    """Collective plane: that attempt will not commit; drop its result, keep your pseudo-gradient."""

    fragment_id: int
    round_id: int
    attempt: int
    reason: str


@dataclass(frozen=True, slots=True)
class HealOrder:
    """Collective plane: send your committed state to ``joiner`` over a two-rank group at ``prefix``.

    An empty ``prefix`` withdraws the order: the joiner left or heals from another source (M12)."""

    joiner: str
    prefix: str


@dataclass(frozen=True, slots=True)
class HeartbeatReply:
    below_min_workers: bool
    min_workers: int
    #: The run's phase (diloco.core.Phase value).
    phase: str
    command: Command = Command.CONTINUE
    #: DyLU: this worker's H_w now (as ``Welcome.sync_every``); None: the run does not use DyLU.
    sync_every: int | None = None


@dataclass(frozen=True, slots=True)
class Accepted:
    """Your submission is kept; wait for its ``Result``."""

    fragment_id: int
    round_id: int


@dataclass(frozen=True, slots=True)
class Result:
    """Your contribution to (fragment, round) was released.

    ``outcome`` is a ``diloco.core.ReleaseOutcome`` value: "applied" (continue from
    ``params``), "applied_final" (take ``params``, then stop), "stop" (stop now;
    ``params`` empty). ``next_round_id`` is the fragment's next round (sync) or its
    new version (async).

    ``delta`` false: ``params`` are the fragment's new fp32 params (``wire_dtype`` "fp32").
    ``delta`` true (sync rounds of a bf16 or int8 run): ``params`` (and int8 ``scales``)
    encode, in ``wire_dtype``, new params minus the fragment's params at ``round_id``,
    which every contributor holds; new = old + decoded delta, bit for bit the
    coordinator's (``diloco.wire.compression.apply_delta``).
    """

    fragment_id: int
    round_id: int
    outcome: str
    next_round_id: int
    params: Tensors = field(default_factory=dict)
    delta: bool = False
    wire_dtype: str = "fp32"
    scales: Tensors = field(default_factory=dict)
    #: Collective plane: the committed digest; ``params`` are empty and each member adopts the
    #: params it computed for this round, whose digest this is (SPEC.md C4).
    digest: str = ""
    #: Data work units: the unit to train on next (outcome "applied"); None: none, or no units.
    unit: int | None = None


@dataclass(frozen=True, slots=True)
class Error:
    """Your message was refused; nothing it carried was kept."""

    code: ErrorCode
    detail: str
    #: The type name of the message this answers (e.g. "Submit").
    in_reply_to: str = ""


# ---------------------------------------------------------------- admin


@dataclass(frozen=True, slots=True)
class AdminRequest:
    """An operator command: status | shutdown | set_min_workers | kick."""

    command: str
    args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class AdminReply:
    ok: bool
    data: dict[str, Any] = field(default_factory=dict)
    error: str = ""


Message = (
    Join | Heartbeat | Submit | Leave | Welcome | HeartbeatReply | Accepted | Result | Error
    | AdminRequest | AdminReply | ReduceOrder | ReduceReport | ReduceAbort | HealOrder
)

MESSAGE_TYPES: tuple[type, ...] = (
    Join, Heartbeat, Submit, Leave, Welcome, HeartbeatReply, Accepted, Result, Error,
    AdminRequest, AdminReply, ReduceOrder, ReduceReport, ReduceAbort, HealOrder,
)
