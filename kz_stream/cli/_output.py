"""What the ``kz`` commands show: the consoles, errors as one line, the progress bars."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from functools import wraps
from typing import Any, ParamSpec, TypeVar

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from kz_stream.config import ConfigError

console = Console()
err_console = Console(stderr=True)

P = ParamSpec("P")
R = TypeVar("R")


def _one_line_errors(fn: Callable[P, R]) -> Callable[P, R]:
    """Turns any exception into one red line on stderr and exit code 1."""

    @wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort, KeyboardInterrupt):
            raise
        except Exception as e:  # the CLI's edge: report, never dump a traceback
            if os.environ.get("KZ_DEBUG"):
                raise
            if isinstance(e, ConfigError):
                # Already names the key, value, expectation and source (two lines at most).
                lines = str(e).splitlines()[:2]
                err_console.print(f"[red]error:[/red] config: {lines[0]}", highlight=False)
                for line in lines[1:]:
                    err_console.print(f"       {line}", highlight=False)
                raise typer.Exit(1) from None
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            err_console.print(f"[red]error:[/red] {type(e).__name__}: {msg}", highlight=False)
            raise typer.Exit(1) from None

    return wrapper


class _ProgressLines(Progress):
    """Progress for a stderr that is not a terminal (a log file, CI, ``nohup``): rich draws
    the bars there only once, when they stop, so a run of many minutes would show nothing
    until its end. This one also prints one plain line of every task's state, at most
    every ``every_s`` seconds while they move."""

    def __init__(self, *columns: Any, every_s: float, **kwargs: Any) -> None:
        super().__init__(*columns, **kwargs)
        self._every_s = every_s
        self._last = time.monotonic()

    def update(self, task_id: TaskID, **kwargs: Any) -> None:
        super().update(task_id, **kwargs)
        now = time.monotonic()
        if now - self._last >= self._every_s:
            self._last = now
            self.console.print(self.line(), highlight=False, markup=False)

    def line(self) -> str:
        parts = []
        for task in self.tasks:
            done = f"{task.completed:.0f}" + (f"/{task.total:.0f}" if task.total else "")
            detail = str(task.fields.get("detail", ""))
            parts.append(f"{task.description} {done}" + (f" ({detail})" if detail else ""))
        return f"[{time.strftime('%H:%M:%S')}] " + "; ".join(parts)


def _progress_bars(*, counts: bool = False) -> Progress:
    """Progress bars on stderr: description, bar, [done/total,] a detail field, time. Where
    stderr is not a terminal, also a plain line every ``KZ_PROGRESS_EVERY_S`` seconds
    (default 30) while they move."""
    columns = [TextColumn("{task.description}"), BarColumn()]
    if counts:
        columns.append(TextColumn("{task.completed}/{task.total}"))
    columns += [TextColumn("{task.fields[detail]}"), TimeElapsedColumn()]
    if err_console.is_terminal:
        return Progress(*columns, console=err_console)
    every_s = float(os.environ.get("KZ_PROGRESS_EVERY_S", "30"))
    return _ProgressLines(*columns, console=err_console, every_s=every_s)
