"""What the ``kz`` commands show: the consoles, errors as one line, the progress bars."""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import wraps
from typing import ParamSpec, TypeVar

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

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


def _progress_bars(*, counts: bool = False) -> Progress:
    """Progress bars on stderr: description, bar, [done/total,] a detail field, time."""
    columns = [TextColumn("{task.description}"), BarColumn()]
    if counts:
        columns.append(TextColumn("{task.completed}/{task.total}"))
    columns += [TextColumn("{task.fields[detail]}"), TimeElapsedColumn()]
    return Progress(*columns, console=err_console)
