"""The house rules a reader relies on: small files, or a reason at the top of a large one."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "diloco"
#: Where long files must say why they are long: the package, and the scripts and benchmarks beside it.
CHECKED = (PACKAGE, REPO / "scripts", REPO / "benchmarks")
#: "About 400 lines" (README, "What is here"): past this a file says at its top why it is one file.
LONG_FILE_LINES = 420
#: How far a stated size may be from the file's: a size that drifted further no longer tells the truth.
SIZE_SLACK = 0.20
_SIZE_RX = re.compile(r"\b(\d{1,3}(?:,\d{3})+|\d{3,})\s+lines\b")


def stated_sizes(doc: str) -> list[int]:
    """The sizes a docstring states ("about 1,100 lines", "690 lines")."""
    return [int(m.group(1).replace(",", "")) for m in _SIZE_RX.finditer(doc)]


def long_files_without_a_true_size(root: Path, limit: int = LONG_FILE_LINES) -> list[str]:
    """Source files longer than ``limit`` lines whose module docstring does not say why, with a size
    within ``SIZE_SLACK`` of the file's own (it must speak of its lines, and truly)."""
    problems = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        lines = text.count("\n")
        if lines <= limit:
            continue
        sizes = stated_sizes(ast.get_docstring(ast.parse(text)) or "")
        where = f"{path.relative_to(root.parent)}: {lines} lines"
        if not sizes:
            problems.append(f"{where}, no reason stated")
        elif not any(abs(size - lines) <= SIZE_SLACK * lines for size in sizes):
            problems.append(f"{where}, says {', '.join(map(str, sizes))}")
    return problems


def test_every_long_file_says_why_at_its_top_and_how_long_it_truly_is():
    assert [p for root in CHECKED for p in long_files_without_a_true_size(root)] == []


def test_the_check_finds_a_long_file_without_a_reason_or_with_a_stale_size(tmp_path):
    (tmp_path / "pkg").mkdir()
    body = "x = 1\n" * 500
    (tmp_path / "pkg" / "quiet.py").write_text('"""Does things."""\n' + body)
    (tmp_path / "pkg" / "explained.py").write_text('"""Does things.\n\nAbout 500 lines: one machine.\n"""\n' + body)
    (tmp_path / "pkg" / "stale.py").write_text('"""Does things.\n\nAbout 300 lines: one machine.\n"""\n' + body)
    (tmp_path / "pkg" / "grown.py").write_text('"""Over 400 lines, now about 1,200 lines.\n"""\n' + body * 2)
    (tmp_path / "pkg" / "short.py").write_text("x = 1\n")
    assert long_files_without_a_true_size(tmp_path / "pkg") == ["pkg/quiet.py: 501 lines, no reason stated",
                                                                "pkg/stale.py: 504 lines, says 300"]


def _module_imports(root: Path, type_only: bool = False) -> dict[str, set[str]]:
    """Module -> the package's modules it imports when it is imported: ``import`` and ``from ... import``
    at module level or in a class body, not inside a function (it runs later, and cannot make an
    import circle), and under ``if TYPE_CHECKING`` only with ``type_only`` (a circle of names
    that only type each other is still two modules that cannot be read apart)."""
    modules = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    graph: dict[str, set[str]] = {m: set() for m in modules}

    def scan(module: str, node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test) and not type_only:
                continue
            if isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    package = module.split(".") if modules[module].name == "__init__.py" else module.split(".")[:-1]
                    package = package[:len(package) - (child.level - 1)]
                    base = ".".join(package + ([base] if base else []))
                for alias in child.names:
                    target = f"{base}.{alias.name}"
                    if target in modules:
                        graph[module].add(target)
                    elif base in modules:
                        graph[module].add(base)
            elif isinstance(child, ast.Import):
                graph[module].update(a.name for a in child.names if a.name in modules)
            scan(module, child)

    for module, path in modules.items():
        scan(module, ast.parse(path.read_text(encoding="utf-8")))
    return graph


def import_circles(root: Path, type_only: bool = False) -> list[list[str]]:
    """Every set of the package's modules that import each other in a circle (strongly connected, > 1)."""
    graph = _module_imports(root, type_only)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_no_module_imports_itself_through_others():
    assert import_circles(PACKAGE) == []


def test_no_import_circle_even_through_type_only_imports():
    # The simulator's pieces, for one, meet through the Protocols of ``diloco.sim.world`` and the
    # stats of ``diloco.sim.stats``, not through each other's classes.
    assert import_circles(PACKAGE, type_only=True) == []


def test_the_check_finds_an_import_circle(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("from ..c import C\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import d\n"
                              "import pkg.a\nclass C: ...\n")
    (pkg / "d.py").write_text("def later():\n    from pkg import c\n")  # lazy: no circle
    assert import_circles(pkg) == [["pkg.a", "pkg.c", "pkg.sub.b"]]
    (pkg / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import c\n")
    assert import_circles(pkg) == [["pkg.a", "pkg.c", "pkg.sub.b"]]
    assert import_circles(pkg, type_only=True) == [["pkg.a", "pkg.c", "pkg.d", "pkg.sub.b"]]


def code_lines(path: Path) -> int:
    """Lines of a module that are neither blank, comments nor docstrings."""
    text = path.read_text(encoding="utf-8")
    docs: set[int] = set()
    for node in ast.walk(ast.parse(text)):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body \
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            docs.update(range(body[0].lineno, body[0].end_lineno + 1))
    return sum(1 for i, line in enumerate(text.splitlines(), 1)
               if line.strip() and not line.strip().startswith("#") and i not in docs)


def test_the_worker_driver_stays_thin():
    # It drives the session; what it keeps per parameter is the keeper's, what it shows is the view's.
    assert code_lines(PACKAGE / "worker" / "worker.py") <= 480


def test_code_lines_leave_out_docstrings_comments_and_blank_lines(tmp_path):
    path = tmp_path / "m.py"
    path.write_text('"""Doc.\n\nMore."""\n\n# a comment\nx = 1\n\n\ndef f():\n    """Doc."""\n    return x  # why\n')
    assert code_lines(path) == 3
