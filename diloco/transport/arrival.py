"""What a coordinator-side endpoint's ``recv`` returns: one message and who sent it.

Defined here, below the wire format, so that every transport returns the same
type: ``inproc`` hands over objects and never imports ``diloco.wire``, and
``diloco.wire.zmq`` decodes frames into messages. (Not to be confused with
``diloco.transport.zmq.Arrival``, one peer's *frames* before decoding.)
"""

from __future__ import annotations

from typing import Any, NamedTuple


class Arrival(NamedTuple):
    """One message from ``peer``.

    ``identity`` is the sender's authenticated key (``diloco.transport.zmq.auth.KeyIdentity``)
    when the transport authenticates, else None: the coordinator binds worker ids to it.
    ``measured`` is what the receiver measured of the message's tensors as they arrived
    (``diloco.wire.measure.SubmitSquares``), else None: the coordinator's checks use it.
    """

    peer: str
    message: Any
    identity: Any = None
    measured: Any = None


__all__ = ["Arrival"]
