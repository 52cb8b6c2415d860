"""Names a package exports but loads on first use (PEP 562), so light importers stay light.

``diloco.sim.command`` and the pure worker modules are imported by ``diloco --help``
and by tools that must not pay for torch; the heavy modules behind a package's
names load only when a name is used.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: str, namespace: dict, where: dict[str, str]) -> tuple[Callable[[str], Any],
                                                                                 Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``: ``where`` maps each name to its submodule."""

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(where))

    return __getattr__, __dir__
