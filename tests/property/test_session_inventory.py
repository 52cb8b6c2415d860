"""The worker session keeps its state inventory whole, and its rule labels right (issue 24).

``WorkerSession.__init__`` is the inventory of the session's state (each field with the
rules it serves): a field first set in any other method would be one a reader cannot
find there. And every rule label (W1, W2, ...) in ``diloco/worker/session.py`` must name a
rule of SPEC.md section 14.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SESSION = ROOT / "diloco" / "worker" / "session.py"


def _self_fields(node: ast.AST) -> set[str]:
    """Names of the ``self.X`` attributes assigned (=, :=, +=, ...) anywhere under ``node``."""
    out: set[str] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Assign):
            targets = n.targets
        elif isinstance(n, (ast.AnnAssign, ast.AugAssign)):
            targets = [n.target]
        else:
            continue
        for t in targets:
            for e in ast.walk(t):
                if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                    out.add(e.attr)
    return out


def test_every_field_of_the_session_is_in_the_inventory():
    tree = ast.parse(SESSION.read_text(encoding="utf-8"))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "WorkerSession")
    methods = [f for f in cls.body if isinstance(f, ast.FunctionDef)]
    inventory = _self_fields(next(f for f in methods if f.name == "__init__"))
    assert len(inventory) > 40
    elsewhere = {f.name: _self_fields(f) - inventory for f in methods if f.name != "__init__"}
    assert {name: fields for name, fields in elsewhere.items() if fields} == {}


def test_every_rule_label_in_the_session_names_a_rule_of_spec_section_14():
    spec = (ROOT / "SPEC.md").read_text(encoding="utf-8")
    section = spec[spec.index("## 14. The worker session"):]
    section = section[:section.index("\n## ", 1)]
    rules = set(re.findall(r"^- \*\*(W\d+) ", section, flags=re.MULTILINE))
    assert {"W1", "W12", "W19"} <= rules
    labels = set(re.findall(r"\bW\d+\b", SESSION.read_text(encoding="utf-8")))
    assert labels and labels <= rules, sorted(labels - rules)
