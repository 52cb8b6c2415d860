"""The README's "Using it" blocks run as written, its folder map covers every folder, its links resolve.

* "The core in your own orchestrator": the block runs in this process (no torch,
  no I/O) and prints exactly what the README says it prints.
* "The coordinator in your own process": the block runs in a fresh Python
  process; only the port changes (``tcp://127.0.0.1:0``: a free one, read back
  from ``endpoint.address``). Two worker threads train 50 steps each, a round
  every 10: 5 rounds apply.
* "What is here" names every folder of the repository (package, tests, docs,
  scripts, benchmarks, ...), and every ``docs/`` page exists and is linked from
  the README. ("Use it in your own loop" is run against a real server by
  ``tests/zmq/test_readme_own_loop.py``.)
"""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"


def section(title: str) -> str:
    """The text of the README section whose heading is exactly ``title`` (any level), up to the next heading."""
    text = README.read_text(encoding="utf-8")
    m = re.search(rf"^#+ {re.escape(title)}\n", text, re.M)
    assert m, f"README has no section {title!r}"
    rest = text[m.end():]
    # the next heading outside a code block
    out, in_code = [], False
    for line in rest.split("\n"):
        if line.startswith("```"):
            in_code = not in_code
        if not in_code and re.match(r"^#{1,3} ", line):
            break
        out.append(line)
    return "\n".join(out)


def blocks(text: str, lang: str | None = None) -> list[str]:
    """The fenced code blocks of ``text`` in order (``lang``: only those opened with ```lang; "" for a bare fence)."""
    found, current, opened = [], None, ""
    for line in text.split("\n"):
        if current is None and line.startswith("```"):
            current, opened = [], line[3:].strip()
        elif current is not None and line.strip() == "```":
            if lang is None or opened == lang:
                found.append("\n".join(current) + "\n")
            current = None
        elif current is not None:
            current.append(line)
    return found


def test_the_core_in_your_own_orchestrator_runs_and_prints_what_the_readme_says():
    text = section("The core in your own orchestrator")
    [code] = blocks(text, "python")
    printed = [b for b in blocks(text) if b.startswith("phase ")]
    assert len(printed) == 1, "the block's output, as the README shows it"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README:core-orchestrator", "exec"), {"__name__": "__readme__"})
    assert out.getvalue() == printed[0]
    assert "apply fragment 0 round 0 from ('A',)" in out.getvalue()


def test_the_coordinator_in_your_own_process_runs_as_written(tmp_path):
    [code] = blocks(section("The coordinator in your own process"), "python")
    assert 'ZmqCoordinatorEndpoint("tcp://127.0.0.1:5555")' in code and "CoordinatorThread(" in code
    script = tmp_path / "own_coordinator.py"
    script.write_text(code.replace("tcp://127.0.0.1:5555", "tcp://127.0.0.1:0"))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1] == "5 rounds applied", done.stdout + done.stderr


#: Folders that are not the project's: caches, the virtual env, build and tool output.
NOT_OURS = {".git", ".venv", "__pycache__", ".pytest_cache", ".hypothesis", "mutants", ".import_linter_cache",
            ".mypy_cache", ".ruff_cache", "build", "dist"}


def project_folders() -> list[str]:
    """Every folder of the working tree that git tracks a file in, relative, with a trailing slash."""
    listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    folders = set()
    for path in listed.splitlines():
        parts = path.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            if not NOT_OURS.intersection(parts[:i]) and not parts[i - 1].endswith(".egg-info"):
                folders.add("/".join(parts[:i]) + "/")
    return sorted(folders)


def test_what_is_here_names_every_folder():
    [tree] = blocks(section("What is here"))
    named = set(re.findall(r"^(\S+)", tree, re.M))
    missing = []
    for folder in project_folders():
        # a folder is named itself or through what is in it (diloco/core/, .ci/run), or on its parent's line
        # (diloco/transport/ names zmq/ and inproc/)
        parent, leaf = folder.rstrip("/").rsplit("/", 1) if "/" in folder.rstrip("/") else ("", folder)
        if any(n.startswith(folder) for n in named) or (parent + "/" in named and f"{leaf.rstrip('/')}/" in tree):
            continue
        missing.append(folder)
    assert not missing, f'"What is here" does not name: {missing}'


def test_every_docs_page_exists_and_the_readme_links_it():
    text = README.read_text(encoding="utf-8")
    linked = set(re.findall(r"\]\((docs/[^)#]+)", text))
    assert linked, "the README links no docs/ page"
    for page in linked:
        assert (REPO / page).is_file(), f"README links {page}, which does not exist"
    pages = {f"docs/{p.name}" for p in (REPO / "docs").glob("*.md")}
    assert pages <= linked, f"docs/ pages the README does not link: {sorted(pages - linked)}"
    for page in pages:
        body = (REPO / page).read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", body):
            assert (REPO / "docs" / target).exists(), f"{page} links {target}, which does not exist"


def test_the_readmes_labels_are_specs():
    """The rule families the README names are SPEC.md's, with the same ranges, and SPEC.md's opening names them too."""
    spec = (REPO / "SPEC.md").read_text(encoding="utf-8")
    [tree] = blocks(section("What is here"))
    head = " ".join(tree.split("\n")[:2])
    families = re.findall(r"\b([A-Z])(\d+)-[A-Z]?(\d+)\b", head)
    assert {f for f, _, _ in families} == set("RPCMIWG"), head
    opening = spec.split("\n## ", 1)[0].replace("\u2013", "-")
    for family, first, last in families:
        present = {int(n) for n in re.findall(rf"(?:\*\*|^\| ){family}(\d+)\b", spec, re.M)}
        assert present == set(range(int(first), int(last) + 1)), (family, first, last, sorted(present))
        assert f"{family}{first}-{family}{last}" in opening, f"SPEC.md's opening does not name {family}{first}-{last}"
    assert "D1" in head and "**D1 " in spec and "D1" in opening
