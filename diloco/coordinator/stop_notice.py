"""Who has heard that the run stopped: the server may exit once every connected worker has.

A stopped run's coordinator stays only to tell its workers (SPEC.md section 12, "Stopping"): each
learns it from a Result that ends its round (``stop``, or a drain's ``applied_final``), a heartbeat
reply that says stop or save-and-stop, or a refusal saying the run stopped. A worker that leaves or
whose connection drops needs no telling. Once none is left to tell, the runner lets go at once
instead of lingering for several heartbeat intervals -- at once when no worker was connected.
"""

from __future__ import annotations

from diloco.wire.messages import Command, Error, ErrorCode, HeartbeatReply, Message, Result

#: Result outcomes that end a worker's run (``diloco.core.ReleaseOutcome`` values).
_FINAL_OUTCOMES = frozenset({"stop", "applied_final"})
_STOP_COMMANDS = frozenset({Command.STOP, Command.SAVE_AND_STOP})


def tells_the_stop(message: Message) -> bool:
    """Whether a worker that receives ``message`` knows the run has stopped (SPEC.md W7, W12)."""
    if isinstance(message, Result):
        return message.outcome in _FINAL_OUTCOMES
    if isinstance(message, HeartbeatReply):
        return message.command in _STOP_COMMANDS
    return isinstance(message, Error) and message.code is ErrorCode.STOPPED


class StopNotice:
    """The workers still to be told of the stop (None until the run stops)."""

    def __init__(self) -> None:
        self._untold: dict[str, str] | None = None  # peer -> worker id

    def stopped(self, peers: dict[str, str]) -> None:
        """The run stopped with these workers connected (worker id -> peer)."""
        if self._untold is None:
            self._untold = {peer: wid for wid, peer in peers.items()}

    def sent(self, out: list[tuple[str, Message]]) -> None:
        """Messages about to go out: a worker that receives one that tells the stop is told."""
        if self._untold:
            for peer, message in out:
                if peer in self._untold and tells_the_stop(message):
                    del self._untold[peer]

    def gone(self, peer: str) -> None:
        """The worker on ``peer`` left or its connection dropped: nobody there to tell."""
        if self._untold:
            self._untold.pop(peer, None)

    @property
    def everyone_told(self) -> bool:
        """The run stopped and no connected worker is left to tell."""
        return self._untold is not None and not self._untold

    @property
    def untold(self) -> list[str]:
        return sorted(self._untold.values()) if self._untold else []
