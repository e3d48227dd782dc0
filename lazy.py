"""Lazy package exports (PEP 562): a package names its public objects and the modules that
define them; an object's module is imported on first access, so importing the package (or one
of its submodules) stays cheap and does not pull in jax."""

from __future__ import annotations

import importlib
from typing import Callable, Mapping


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], object]:
    """The module-level ``__getattr__`` of ``package``: ``name`` -> ``exports[name]``'s object."""

    def __getattr__(name: str):
        if name in exports:
            return getattr(importlib.import_module(exports[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
