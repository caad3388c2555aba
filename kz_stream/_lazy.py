"""Package attributes imported on first use (PEP 562): importing a package does not import
its heavy modules (torch, vLLM, httpx, the services) until one of their names is asked for."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, origins: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that imports ``name`` from the module
    ``origins[name]`` (relative to the package, e.g. ``"._run"``) when it is asked for."""

    def __getattr__(name: str) -> Any:
        module = origins.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module, package), name)

    return __getattr__
