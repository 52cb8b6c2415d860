"""ZeroMQ transport: a ROUTER (coordinator) and DEALERs (workers, admin clients) over TCP, moving frames.

``diloco.wire.zmq`` puts messages on top: its endpoints are what the
coordinator and a worker hold.
"""

from diloco.transport.base import AuthRefused
from diloco.transport.zmq.dealer import FrameDealer
from diloco.transport.zmq.options import ZmqOptions, make_routing_id, peer_name, routing_id_of
from diloco.transport.zmq.router import Arrival, FrameRouter

__all__ = [
    "Arrival",
    "AuthRefused",
    "FrameDealer",
    "FrameRouter",
    "ZmqOptions",
    "make_routing_id",
    "peer_name",
    "routing_id_of",
]
