"""Loads module source text as a real module, so that ``inspect`` (which Triton's JIT uses)
and tracebacks see the source."""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from types import ModuleType
from typing import Any

from kz_stream.verify._types import sha256


class InterfaceError(ValueError):
    """The source does not define the required names."""


def load_source(source: str, name: str, directory: str | None = None) -> ModuleType:
    """Writes ``source`` to a file and imports it under ``name``; its top level runs now."""
    directory = directory or tempfile.mkdtemp(prefix="kz-src-")
    path = os.path.join(directory, f"{name}_{sha256(source)[:12]}.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def require(module: ModuleType, *names: str) -> list[Any]:
    """Returns the named attributes or raises InterfaceError naming the missing ones."""
    missing = [n for n in names if not hasattr(module, n)]
    if missing:
        raise InterfaceError(f"source does not define {', '.join(missing)}")
    return [getattr(module, n) for n in names]
