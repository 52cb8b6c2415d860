"""The phase machine (SPEC.md section 6): guards are pure predicates on the quorum, and a
move that is not in the graph raises (``auto_transitions=False``) instead of happening.

``RoundFSM`` only fires a trigger it has checked itself, so these refusals can never be
seen through ``step``; they are the phase machine's own safety net, tested here directly.
"""

from __future__ import annotations

import pytest
from transitions import MachineError

from diloco.core import Phase
from diloco.core.phases import PhaseModel

TRIGGERS = ("quorum_reached", "quorum_lost", "drain_requested", "stopped")

#: SPEC.md section 6, written out by hand: (source, trigger) -> (destination, quorum it needs).
#: ``True``: only with quorum; ``False``: only without; ``None``: either.
GRAPH: dict[tuple[Phase, str], tuple[Phase, bool | None]] = {
    (Phase.FORMING, "quorum_reached"): (Phase.RUNNING, True),
    (Phase.PAUSED, "quorum_reached"): (Phase.RUNNING, True),
    (Phase.RUNNING, "quorum_lost"): (Phase.PAUSED, False),
    (Phase.RUNNING, "drain_requested"): (Phase.DRAINING, True),
    (Phase.FORMING, "stopped"): (Phase.STOPPED, None),
    (Phase.RUNNING, "stopped"): (Phase.STOPPED, None),
    (Phase.PAUSED, "stopped"): (Phase.STOPPED, None),
    (Phase.DRAINING, "stopped"): (Phase.STOPPED, None),
}


def model(phase: Phase, has_quorum: bool) -> PhaseModel:
    m = PhaseModel(phase)
    m.below_min_workers = not has_quorum
    return m


@pytest.mark.parametrize("has_quorum", [True, False], ids=["quorum", "below"])
@pytest.mark.parametrize("trigger", TRIGGERS)
@pytest.mark.parametrize("phase", list(Phase), ids=lambda p: p.value)
def test_every_phase_and_trigger_moves_exactly_as_the_graph_says_or_raises(phase, trigger, has_quorum):
    m = model(phase, has_quorum)
    assert m.state is phase
    move = GRAPH.get((phase, trigger))
    if move is not None and move[1] in (None, has_quorum):
        m.fire(trigger)
        assert m.state is move[0]
        return
    with pytest.raises(MachineError):
        m.fire(trigger)
    assert m.state is phase, "a refused move must leave the phase as it was"


def test_a_guard_refusing_names_the_trigger_and_the_phase():
    m = model(Phase.FORMING, has_quorum=False)
    with pytest.raises(MachineError, match=r"guard refused 'quorum_reached' in phase forming"):
        m.fire("quorum_reached")
    m = model(Phase.RUNNING, has_quorum=True)
    with pytest.raises(MachineError, match=r"guard refused 'quorum_lost' in phase running"):
        m.fire("quorum_lost")
    m = model(Phase.RUNNING, has_quorum=False)
    with pytest.raises(MachineError, match=r"guard refused 'drain_requested' in phase running"):
        m.fire("drain_requested")


def test_a_new_phase_model_assumes_no_quorum_until_told():
    """The machine starts FORMING with 0 members: below any min_workers >= 1."""
    m = PhaseModel(Phase.FORMING)
    assert m.below_min_workers is True
    assert m.lacks_quorum() and not m.has_quorum()
    with pytest.raises(MachineError):
        m.fire("quorum_reached")


def test_there_are_no_automatic_to_phase_moves():
    m = PhaseModel(Phase.RUNNING)
    assert not hasattr(m, "to_STOPPED") and not hasattr(m, "to_stopped")
    with pytest.raises(AttributeError):
        m.trigger("to_stopped")


def test_a_move_not_in_the_graph_is_reported_as_such_not_as_a_refusing_guard():
    """Two different bugs, two different messages: no edge for the trigger here, or an edge
    whose quorum guard said no."""
    for phase, trigger in [(Phase.FORMING, "quorum_lost"), (Phase.STOPPED, "stopped"),
                           (Phase.PAUSED, "drain_requested")]:
        m = model(phase, has_quorum=True)
        with pytest.raises(MachineError) as info:
            m.fire(trigger)
        assert "guard refused" not in str(info.value)
        assert trigger in str(info.value) and phase.name in str(info.value)


def test_an_unknown_trigger_raises():
    m = model(Phase.RUNNING, has_quorum=True)
    with pytest.raises((MachineError, AttributeError)):
        m.fire("dance")
    assert m.state is Phase.RUNNING
