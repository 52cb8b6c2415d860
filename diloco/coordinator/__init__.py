"""The coordinator: drives the round state machine from a transport.

``service.Coordinator`` is sans-IO (messages and a clock reading in, messages
out), so the same code runs under the in-process transport, ZeroMQ and the
simulator. ``runner`` is the thin loop that gives it a real clock and a
real transport.
"""

from diloco.coordinator.config import CoordinatorConfig
from diloco.outer import OuterConfig
from diloco.coordinator.service import Coordinator

__all__ = ["Coordinator", "CoordinatorConfig", "OuterConfig"]
