"""The pure core: the round state machine, its events, effects and rules (SPEC.md).

Nothing in this package performs I/O, reads a clock, draws random numbers,
starts threads or imports torch/zmq; import-linter contracts in
pyproject.toml and a test keep it that way.
"""

from diloco.core.config import DataPlane, FSMConfig, Mode
from diloco.core.effects import (
    EFFECT_TYPES,
    AbortReduce,
    AcceptContribution,
    AcceptJoin,
    ApplyRound,
    DeclareDead,
    DiscardContribution,
    Effect,
    OrderReduce,
    PhaseChanged,
    QuorumChanged,
    Reject,
    ReleaseWorker,
    StopRun,
)
from diloco.core.errors import (
    ClockWentBackwardsError,
    ConfigError,
    DilocoCoreError,
    DriverError,
    InvalidEventError,
    MachineStoppedError,
    SnapshotError,
    UnknownEventError,
)
from diloco.core.events import (
    EVENT_TYPES,
    ContributionSubmitted,
    Event,
    HeartbeatSeen,
    MinWorkersChanged,
    GraceWindowChanged,
    ReduceReported,
    ShutdownRequested,
    Ticked,
    WorkerJoined,
    WorkerLeft,
)
from diloco.core.phases import Phase
from diloco.core.quorum import QuorumDecision, quorum_decision
from diloco.core.reasons import AbortReason, DiscardReason, LeaveCause, RejectReason, ReleaseOutcome, ShutdownKind
from diloco.core.round_fsm import RoundFSM
from diloco.core.status import StatusView

# The names above, not the submodules (``round_fsm``, ``events``, ...) that ``dir()`` would add.
__all__ = [
    "AbortReason",
    "AbortReduce",
    "DataPlane",
    "OrderReduce",
    "ReduceReported",
    "AcceptContribution",
    "AcceptJoin",
    "ApplyRound",
    "ClockWentBackwardsError",
    "ConfigError",
    "ContributionSubmitted",
    "DeclareDead",
    "DilocoCoreError",
    "DiscardContribution",
    "DiscardReason",
    "DriverError",
    "EFFECT_TYPES",
    "EVENT_TYPES",
    "Effect",
    "Event",
    "FSMConfig",
    "HeartbeatSeen",
    "InvalidEventError",
    "LeaveCause",
    "MachineStoppedError",
    "MinWorkersChanged",
    "GraceWindowChanged",
    "Mode",
    "Phase",
    "PhaseChanged",
    "QuorumChanged",
    "QuorumDecision",
    "Reject",
    "RejectReason",
    "ReleaseOutcome",
    "ReleaseWorker",
    "RoundFSM",
    "ShutdownKind",
    "ShutdownRequested",
    "SnapshotError",
    "StatusView",
    "StopRun",
    "Ticked",
    "UnknownEventError",
    "WorkerJoined",
    "WorkerLeft",
    "quorum_decision",
]
