"""Moving bytes between the coordinator and workers. Knows nothing about rounds or messages.

``base`` holds the errors every transport raises, ``limits`` how big a
message and a frame may be. ``zmq`` moves frames between processes and
machines (a ROUTER for the coordinator, DEALERs for workers, with parts,
limits, reconnects and CURVE keys); ``inproc`` hands objects between threads
of one process. ``diloco.wire`` decides what the frames mean. ``Arrival`` is
what a coordinator-side endpoint of either kind receives: a peer, its message
and (with keys) its identity.
"""

from diloco.transport.arrival import Arrival

__all__ = ["Arrival"]
