"""The trace checker's families of invariants, one module each (``diloco.sim.checker`` is the entry).

Each module is a mixin of ``TraceChecker``, reading the state its ``__init__`` sets
up and reporting through its ``_violate``; ``model`` holds what they share. Like
the checker, they judge the trace alone: they import nothing from diloco but
each other (tests/sim/test_trace.py keeps it so).

* ``workers``: messages delivered and dropped, per-connection FIFO (net), the
  worker states, and the workers' rules W5, W6, W8;
* ``rounds``: each coordinator step, membership, quorum and phases, accepted and
  applied contributions (I1, I2, I3, I4, I6, I12; R4, R6, R7, P2, P3);
* ``params``: the outer step recomputed, params installed by workers, snapshots,
  restarts and checkpoints (outer, params, snapshot);
* ``replies``: what the coordinator sends -- Welcome, Result, heartbeat replies,
  errors, admin replies (I5, I6, I11, P2, R6, R8, R12, params);
* ``liveness``: the run's phases and its end (I7 after the heal; I5, every
  worker stopped after a stop; a crash of the simulation);
* ``collective``: the collective data plane, in place of the outer step and params
  checks (I13, I14, C4, C5, C6, and ``fork``: honest members proposing different
  digests).
"""
