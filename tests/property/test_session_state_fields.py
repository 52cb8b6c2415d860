"""The session's states own their fields, and only the state change resets them (SPEC.md section 14, "States").

``OWNED_FIELDS`` in ``diloco/worker/session.py`` names, per state, the fields that mean
something only in that state and the value each holds outside it; ``_go`` puts them back
as it leaves the state. Three checks keep that true:

* the table names fields of the inventory (``__init__``), which starts them at those values;
* no method but ``_go`` (and its ``_end_pause``) assigns them, save the few listed in
  ``SET_ELSEWHERE``, each with its rule: a value set while in the state, or an event that
  restarts it without a state change. A reset added one field at a time elsewhere fails here;
* Hypothesis drives the session through arbitrary events (the rules of
  ``test_session_stateful.py``, side by side with the reference model) and, after every
  event, each field owned by a state the session is not in holds its value from the table.
"""

from __future__ import annotations

import ast
from pathlib import Path

from hypothesis import settings

from diloco.worker.session import OWNED_FIELDS, WorkerSession
from diloco.worker.states import SESSION_STATES, WorkerState as S
from test_session_stateful import SPEC, SessionMachine

SESSION = Path(__file__).resolve().parents[2] / "diloco" / "worker" / "session.py"
#: The state change: ``_go``, and ``_end_pause``, which it calls as it leaves PAUSED.
HOOK = {"_go", "_end_pause"}
#: Where a state's field is assigned other than by the state change, and why. Anything else
#: (above all a reset) belongs in ``OWNED_FIELDS``.
SET_ELSEWHERE = {
    ("_tick_joining", "_join_resend_s"): "W1: an unanswered Join's resend delay doubles",
    ("_on_message_joining", "_already_member_retries"): "W1: an already_member answer is counted",
    ("_maybe_resync", "_waiting_since"): "W9: the wait's first tick; a restart while still WAITING",
    ("_on_result", "_waiting_since"): "W9: a release restarts the wait's clock, WAITING or not",
    ("_carry_out_stop", "_ask_deadline"): "W12: the ask opens (just entered STOPPING)",
    ("_finish", "_ask_deadline"): "W12: the Stop settles an open ask, though STOPPING goes on",
}


def _owned() -> dict[str, object]:
    return {name: value for fields in OWNED_FIELDS.values() for name, value in fields.items()}


def _methods() -> dict[str, ast.FunctionDef]:
    tree = ast.parse(SESSION.read_text(encoding="utf-8"))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "WorkerSession")
    return {f.name: f for f in cls.body if isinstance(f, ast.FunctionDef)}


def _assigned(node: ast.AST) -> set[str]:
    """The ``self.X`` attributes assigned (=, +=, annotated) anywhere under ``node``."""
    out: set[str] = set()
    for n in ast.walk(node):
        targets = n.targets if isinstance(n, ast.Assign) else \
            [n.target] if isinstance(n, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            out |= {e.attr for e in ast.walk(t)
                    if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self"}
    return out


def test_the_table_names_inventory_fields_and_their_starting_values():
    assert set(OWNED_FIELDS) <= set(SESSION_STATES)
    inventory = _assigned(_methods()["__init__"])
    assert set(_owned()) <= inventory, sorted(set(_owned()) - inventory)
    s = WorkerSession("w", 2, SPEC)
    assert {name: getattr(s, name) for name in _owned()} == _owned()


def test_only_the_state_change_assigns_a_states_fields_but_for_the_rules_listed():
    owned = set(_owned())
    found = {(name, field) for name, f in _methods().items() if name not in HOOK | {"__init__"}
             for field in _assigned(f) & owned}
    assert found == set(SET_ELSEWHERE), (
        f"assigned outside _go, not listed: {sorted(found - set(SET_ELSEWHERE))}; "
        f"listed, no longer assigned: {sorted(set(SET_ELSEWHERE) - found)}")
    # What _go sets as it enters a state (when a pause began, where a stop came from), the state owns.
    assert _assigned(_methods()["_go"]) - {"state"} <= owned
    callers = {name for name, f in _methods().items() for n in ast.walk(f)
               if isinstance(n, ast.Attribute) and n.attr == "_end_pause" and isinstance(n.ctx, ast.Load)}
    assert callers == {"_go"}


class StateFieldsMachine(SessionMachine):
    """The stateful test's world, checking after every event what each state owns."""

    def check(self, what, actions, expected) -> None:
        super().check(what, actions, expected)
        s = self.session
        for state, fields in OWNED_FIELDS.items():
            if state is not s.state:
                held = {name: getattr(s, name) for name in fields}
                assert held == dict(fields), f"{what} at t={self.now}: in {s.state}, {state.value}'s fields {held}"
        assert (s._paused_since is not None) == (s.state is S.PAUSED), what  # W6: the pause's clock runs
        # A re-join asked for is carried out by the same event (W10): none is left for a Welcome to forget.
        assert not s._rejoin_needed or s.state in (S.STOPPING, S.STOPPED), what


TestStateFields = StateFieldsMachine.TestCase
TestStateFields.settings = settings(max_examples=settings().max_examples)
