"""Deterministic simulation of whole diloco runs (DESIGN.md section 4: TigerBeetle VOPR, FoundationDB).

One seed derives every knob (``config.derive_config``); simulated time only;
the real ``RoundFSM`` and ``Coordinator`` run unchanged while the network,
the light workers and the faults are simulated (``simulation``); the checker
judges SPEC.md's invariants from the trace alone (``checker``); any failure
replays from its seed, and ``--replay`` proves a trace reproduces byte for byte.

    diloco sim --seed 7 --trace run.jsonl --plot run.png
    diloco sim --replay run.jsonl
    diloco sim --swarm 200
"""

from diloco.sim.checker import TraceChecker, Violation, check_records
from diloco.sim.config import SimConfig, SimConfigError, derive_config
from diloco.sim.run import RunResult, replay_trace, run_config, run_seed

__all__ = [
    "RunResult",
    "SimConfig",
    "SimConfigError",
    "TraceChecker",
    "Violation",
    "check_records",
    "derive_config",
    "replay_trace",
    "run_config",
    "run_seed",
]
