"""The package is typed (PEP 561): its marker ships, and what type checkers read matches the runtime."""

from __future__ import annotations

import ast
from pathlib import Path

import diloco
from diloco.wire import messages

MESSAGES = Path(messages.__file__)


def test_the_package_carries_the_py_typed_marker():
    assert (Path(diloco.__file__).parent / "py.typed").is_file()


def _error_code_for_type_checkers() -> list[tuple[str, str]]:
    """The members of the ``ErrorCode`` class under ``if TYPE_CHECKING:`` in messages.py."""
    for node in ast.walk(ast.parse(MESSAGES.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ClassDef) and node.name == "ErrorCode":
            return [(stmt.targets[0].id, stmt.value.value) for stmt in node.body
                    if isinstance(stmt, ast.Assign)]
    raise AssertionError("messages.py declares no ErrorCode class for type checkers")


def test_error_codes_spelled_out_for_type_checkers_are_the_runtime_ones():
    # ErrorCode is built from RejectReason and TRANSPORT_ERROR_CODES at run time; the class
    # type checkers read lists them by hand, so a new code must be added there too.
    assert _error_code_for_type_checkers() == [(e.name, e.value) for e in messages.ErrorCode]
