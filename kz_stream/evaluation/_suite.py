"""Evaluation suites: folders of KernelBench-format problem files.

A problem file (``N_Name.py``) defines ``class Model``, ``get_inputs`` and
``get_init_inputs`` at module level, as KernelBench's ``KernelBench/level1/*.py`` do. A
suite is one such folder (its level read from a name like ``level1``, or given), or a
folder of ``levelN`` folders (KernelBench's ``KernelBench/``). The project ships no
KernelBench problems; users point at their own checkout.
"""

from __future__ import annotations

import ast
import fnmatch
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Suite", "SuiteProblem", "load_suite", "problem_interface_error"]

_LEVEL = re.compile(r"level[_-]?(\d+)$", re.IGNORECASE)
_NUMBER = re.compile(r"^(\d+)_")
_REQUIRED = ("Model", "get_inputs", "get_init_inputs")


@dataclass(frozen=True)
class SuiteProblem:
    """One problem: ``problem_id`` is ``level<N>/<file stem>`` (the stem without a level)."""

    problem_id: str
    name: str
    level: int | None
    path: Path
    source: str


@dataclass(frozen=True)
class Suite:
    root: Path
    problems: tuple[SuiteProblem, ...]
    skipped: tuple[tuple[Path, str], ...]  # files that are not problems, and why


def problem_interface_error(source: str) -> str | None:
    """Why ``source`` is not a KernelBench-format problem, or None when it is one."""
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        return f"syntax error: {e.msg} (line {e.lineno})"
    defined = {
        node.name
        for node in tree.body
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
    }
    missing = [name for name in _REQUIRED if name not in defined]
    return f"defines no {', '.join(missing)}" if missing else None


def _sort_key(path: Path) -> tuple[int, str]:
    m = _NUMBER.match(path.name)
    return (int(m.group(1)) if m else 1 << 30, path.name)


def _folder_level(folder: Path) -> int | None:
    m = _LEVEL.search(folder.name)
    return int(m.group(1)) if m else None


def _load_folder(
    folder: Path, level: int | None, match: str | None
) -> tuple[list[SuiteProblem], list[tuple[Path, str]]]:
    problems, skipped = [], []
    for path in sorted(folder.glob("*.py"), key=_sort_key):
        if path.name.startswith("_") or (match and not fnmatch.fnmatch(path.stem, match)):
            continue
        source = path.read_text()
        error = problem_interface_error(source)
        if error:
            skipped.append((path, error))
            continue
        pid = f"level{level}/{path.stem}" if level is not None else path.stem
        problems.append(SuiteProblem(pid, path.stem, level, path, source))
    return problems, skipped


def load_suite(
    root: str | Path, *, level: int | None = None, match: str | None = None,
    limit: int | None = None,
) -> Suite:
    """Loads the problems under ``root``, in KernelBench's order (by leading number).

    ``level`` overrides the level read from the folder name; ``match`` keeps files whose
    stem matches a glob (``"1*_*"``); ``limit`` keeps the first problems of each level.
    Raises ``FileNotFoundError`` for a missing folder and ``ValueError`` for one without
    problems.
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"suite folder {root} does not exist")
    folders = [(root, level if level is not None else _folder_level(root))]
    if not any(p.suffix == ".py" for p in root.iterdir()):
        # KernelBench's root: one folder per level.
        folders = sorted(
            ((d, _folder_level(d)) for d in root.iterdir() if d.is_dir() and _folder_level(d)),
            key=lambda fl: fl[1] or 0,
        )
    problems: list[SuiteProblem] = []
    skipped: list[tuple[Path, str]] = []
    for folder, lvl in folders:
        found, bad = _load_folder(folder, lvl, match)
        problems += found[:limit] if limit is not None else found
        skipped += bad
    if not problems:
        why = f" ({len(skipped)} files are not problems: {skipped[0][1]})" if skipped else ""
        raise ValueError(f"no KernelBench-format problems in {root}{why}")
    # Kernel ids derive from problem ids: two problems of one id would share kernels.
    twice = sorted(pid for pid, n in Counter(p.problem_id for p in problems).items() if n > 1)
    if twice:
        raise ValueError(f"{len(twice)} problem ids stand twice in {root} ({twice[0]}, ...): "
                         "two folders of one level? name the one to evaluate")
    return Suite(root, tuple(problems), tuple(skipped))
