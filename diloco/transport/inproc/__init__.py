"""In-memory transport for threads of one process (tests, ``diloco demo``)."""

from diloco.transport.inproc.network import InprocCoordinatorEndpoint, InprocNetwork, InprocWorkerEndpoint

__all__ = ["InprocNetwork", "InprocCoordinatorEndpoint", "InprocWorkerEndpoint"]
