"""The run's phase graph, declared once as plain data and driven by ``transitions``.

The table below is the single source of truth: ``RoundFSM`` builds its
``transitions.Machine`` from it, and ``render_mermaid`` draws the diagram that
SPEC.md section 6 carries (``scripts/gen_spec_diagram.py`` writes it; a test
fails when the copy in SPEC.md drifts).

Phases change a few times per run, never per heartbeat, so the machine is
fired only on a change and the per-event path stays plain Python (SPEC.md R13).
"""

from __future__ import annotations

import enum

from typing import TYPE_CHECKING

from transitions import Machine, MachineError

if TYPE_CHECKING:
    from collections.abc import Callable


class Phase(str, enum.Enum):
    """Where the run is in its life."""

    #: Quorum has never been reached yet; members gather, contributions park.
    FORMING = "forming"
    #: live members >= min_workers: rounds apply.
    RUNNING = "running"
    #: Quorum was lost: nothing applies until a replacement joins or min_workers drops.
    PAUSED = "paused"
    #: A drain was requested: the round in flight applies, then the run stops.
    DRAINING = "draining"
    #: Terminal. The machine accepts no more events.
    STOPPED = "stopped"


#: (trigger, sources, destination, guard, why). Guards are pure predicates on the model.
TRANSITIONS: tuple[tuple[str, tuple[Phase, ...], Phase, str | None, str], ...] = (
    ("quorum_reached", (Phase.FORMING, Phase.PAUSED), Phase.RUNNING, "has_quorum",
     "live members >= min_workers (a join, or min_workers lowered)"),
    ("quorum_lost", (Phase.RUNNING,), Phase.PAUSED, "lacks_quorum",
     "a death, leave or raised min_workers left live members < min_workers"),
    ("drain_requested", (Phase.RUNNING,), Phase.DRAINING, "has_quorum",
     "ShutdownRequested(DRAIN) while the round in flight can still apply"),
    ("stopped", (Phase.FORMING, Phase.RUNNING, Phase.PAUSED, Phase.DRAINING), Phase.STOPPED, None,
     "save-and-stop, abort, a drain that finished, or a drain that lost quorum"),
)


class PhaseModel:
    """The object the ``transitions`` machine drives; guards read ``below_min_workers``."""

    state: Phase
    #: Installed by the machine: fires a trigger by name; False when its guard refuses.
    trigger: Callable[[str], bool]

    def __init__(self, initial: Phase) -> None:
        self.below_min_workers = True
        self._machine = Machine(
            model=self,
            states=list(Phase),
            transitions=[
                {"trigger": trig, "source": list(src), "dest": dst,
                 **({"conditions": guard} if guard else {})}
                for trig, src, dst, guard, _why in TRANSITIONS
            ],
            initial=initial,
            auto_transitions=False,
            ignore_invalid_triggers=False,
        )

    def has_quorum(self) -> bool:
        return not self.below_min_workers

    def lacks_quorum(self) -> bool:
        return self.below_min_workers

    def fire(self, trigger: str) -> None:
        """Fire ``trigger``; an illegal move is a bug in the core, so it raises loudly."""
        if not self.trigger(trigger):
            raise MachineError(f"guard refused {trigger!r} in phase {self.state.value}")


def render_mermaid() -> str:
    """The phase diagram, as SPEC.md carries it (generated, never edited by hand)."""
    lines = ["stateDiagram-v2", f"    [*] --> {Phase.FORMING.name}"]
    for trig, sources, dest, guard, _why in TRANSITIONS:
        label = trig + (f" [{guard}]" if guard else "")
        for src in sources:
            lines.append(f"    {src.name} --> {dest.name}: {label}")
    lines.append(f"    {Phase.STOPPED.name} --> [*]")
    return "\n".join(lines) + "\n"
