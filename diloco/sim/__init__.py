"""Deterministic simulation of whole diloco runs (in the manner of TigerBeetle's VOPR and FoundationDB's simulation).

One seed derives every knob (``config.derive_config``); simulated time only;
the real ``RoundFSM``, ``Coordinator`` and ``WorkerSession`` run unchanged
while time, the network, the worker processes and the faults are simulated:
``simulation`` builds one run from separate pieces (``scheduler``, ``network``,
``coord_process``, ``faults``, ``worker``, ``collective``) that talk through the
Protocols of ``world``; the checker judges SPEC.md's invariants from the trace
alone (``checker``); any failure replays from its seed, and ``--replay`` proves
a trace reproduces byte for byte.

    diloco sim --seed 7 --trace run.jsonl --plot run.png
    diloco sim --replay run.jsonl
    diloco sim --swarm 200
    diloco sim --swarm 50 --data-plane collective
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from diloco.lazy import lazy_exports

if TYPE_CHECKING:
    from diloco.sim.checker import TraceChecker, Violation, check_records
    from diloco.sim.config import SimConfig, SimConfigError, derive_config
    from diloco.sim.run import RunResult, replay_trace, run_config, run_seed

#: Where each name of ``__all__`` lives. Loaded on first use (PEP 562), so that
#: ``diloco.sim.command`` (imported to build ``diloco --help``) does not load the
#: simulation and torch with it.
_LAZY = {
    "TraceChecker": "checker", "Violation": "checker", "check_records": "checker",
    "SimConfig": "config", "SimConfigError": "config", "derive_config": "config",
    "RunResult": "run", "replay_trace": "run", "run_config": "run", "run_seed": "run",
}


__getattr__, __dir__ = lazy_exports(__name__, globals(), _LAZY)


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
