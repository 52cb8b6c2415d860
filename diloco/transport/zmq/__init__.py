"""ZeroMQ transport: ROUTER (coordinator) / DEALER (workers, admin clients) over TCP.

Frames are ``diloco.transport.codec``'s: a msgpack header and raw tensor
frames, never pickle (SPEC.md section 11).
"""

from diloco.transport.zmq.endpoints import (
    AuthRefused,
    CoordinatorUnreachable,
    ZmqCoordinatorEndpoint,
    ZmqOptions,
    ZmqWorkerEndpoint,
    admin_request,
    make_routing_id,
    peer_name,
)

__all__ = [
    "AuthRefused",
    "CoordinatorUnreachable",
    "ZmqCoordinatorEndpoint",
    "ZmqOptions",
    "ZmqWorkerEndpoint",
    "admin_request",
    "make_routing_id",
    "peer_name",
]
