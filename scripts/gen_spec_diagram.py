#!/usr/bin/env python3
"""Write the phase diagram generated from diloco/core/phases.py into SPEC.md.

Usage: python scripts/gen_spec_diagram.py [--check]
With --check it changes nothing and exits 1 if SPEC.md's copy has drifted.
"""

from __future__ import annotations

import pathlib
import re
import sys

from diloco.core.phases import render_mermaid

SPEC = pathlib.Path(__file__).resolve().parent.parent / "SPEC.md"
BLOCK = re.compile(r"(<!-- phase-diagram:begin -->\n)(.*?)(<!-- phase-diagram:end -->)", re.S)


def expected_block() -> str:
    return "```mermaid\n" + render_mermaid() + "```\n"


def current_block(text: str) -> str:
    m = BLOCK.search(text)
    if m is None:
        raise SystemExit("SPEC.md has no <!-- phase-diagram:begin/end --> markers")
    return m.group(2)


def main(argv: list[str]) -> int:
    text = SPEC.read_text()
    if current_block(text) == expected_block():
        print("SPEC.md phase diagram is up to date")
        return 0
    if "--check" in argv:
        print("SPEC.md phase diagram has drifted from diloco/core/phases.py; run scripts/gen_spec_diagram.py")
        return 1
    SPEC.write_text(BLOCK.sub(lambda m: m.group(1) + expected_block() + m.group(3), text))
    print("SPEC.md phase diagram updated")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
