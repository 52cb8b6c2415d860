"""SPEC.md's phase diagram must be exactly what the code's transition table draws."""

import importlib.util
import pathlib

from diloco.core.phases import TRANSITIONS, render_mermaid

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location("gen_spec_diagram", ROOT / "scripts" / "gen_spec_diagram.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_spec_diagram_matches_transition_table():
    gen = _script()
    assert gen.current_block((ROOT / "SPEC.md").read_text()) == gen.expected_block(), (
        "SPEC.md's phase diagram drifted from diloco/core/phases.py: run python scripts/gen_spec_diagram.py"
    )


def test_drift_is_detected():
    gen = _script()
    text = (ROOT / "SPEC.md").read_text()
    drifted = text.replace("RUNNING --> PAUSED", "RUNNING --> STOPPED", 1)
    assert drifted != text
    assert gen.current_block(drifted) != gen.expected_block()


def test_every_transition_is_drawn():
    diagram = render_mermaid()
    for trigger, sources, dest, _guard, _why in TRANSITIONS:
        for src in sources:
            assert f"{src.name} --> {dest.name}: {trigger}" in diagram
