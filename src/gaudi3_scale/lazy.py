"""Lazily imported package exports: a package's `__init__` names what it offers, and the module holding each name
is imported on first access, so importing the package stays cheap (no torch until a name that needs it is used)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, homes: dict[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for `package` that imports `homes[name]` (a module path) on first access."""

    def __getattr__(name: str) -> Any:
        if name in homes:
            return getattr(importlib.import_module(homes[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
