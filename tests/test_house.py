"""The house rules a reader relies on: small files, or a reason at the top of a large one."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "diloco"
#: "About 400 lines" (README, "What is here"): past this a file says at its top why it is one file.
LONG_FILE_LINES = 420


def long_files_without_a_reason(root: Path, limit: int = LONG_FILE_LINES) -> list[str]:
    """Source files longer than ``limit`` lines whose module docstring does not say why (it must speak of its lines)."""
    missing = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if text.count("\n") <= limit:
            continue
        doc = ast.get_docstring(ast.parse(text)) or ""
        if not re.search(r"\b\d{3} lines\b", doc):
            missing.append(f"{path.relative_to(root.parent)}: {text.count(chr(10))} lines")
    return missing


def test_every_long_source_file_says_why_at_its_top():
    assert long_files_without_a_reason(PACKAGE) == []


def test_the_check_finds_a_long_file_without_a_reason(tmp_path):
    (tmp_path / "pkg").mkdir()
    body = "x = 1\n" * 500
    (tmp_path / "pkg" / "quiet.py").write_text('"""Does things."""\n' + body)
    (tmp_path / "pkg" / "explained.py").write_text('"""Does things.\n\nAbout 500 lines: one machine.\n"""\n' + body)
    (tmp_path / "pkg" / "short.py").write_text("x = 1\n")
    assert long_files_without_a_reason(tmp_path / "pkg") == ["pkg/quiet.py: 501 lines"]
