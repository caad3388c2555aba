"""What every ``kz`` command shares: the settings, the one-line errors, the consoles, the
event loop and the progress bars."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from functools import wraps
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ParamSpec, TypeVar

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from kz_stream.config import ConfigError, Settings, describe_validation_error, load_settings

if TYPE_CHECKING:
    from kz_stream.store import EventStore

console = Console()
err_console = Console(stderr=True)

P = ParamSpec("P")
R = TypeVar("R")

ConfigOption = Annotated[
    Path | None, typer.Option("--config", "-c", help="TOML config file (env vars override it).")
]


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


# Settings fields whose command-line option has another name.
_OPTION_OF_FIELD = {"roles": "--role", "proposer_steps": "--steps-per-turn",
                    "coder_steps": "--steps-per-turn", "max_tokens": "--max-new-tokens"}


def _option(loc: tuple[int | str, ...]) -> str:
    field = str(loc[0]) if loc else "?"
    return _OPTION_OF_FIELD.get(field, "--" + field.replace("_", "-"))


def _bad_option(e: ValidationError) -> ConfigError:
    """The first invalid setting, named as its command-line option."""
    return ConfigError(
        describe_validation_error(e, lambda _loc: "command line", key=_option)
    )


def _settings(config: Path | None, *, quiet: bool = False) -> Settings:
    """The settings (``--config`` over the defaults, under the environment). ``quiet``: a
    command that draws progress bars logs warnings only, unless the user set log_level."""
    settings = load_settings(config)
    if quiet and "log_level" not in settings.model_fields_set:
        settings = settings.model_copy(update={"log_level": "WARNING"})
    return settings


def _run(coro: Coroutine[Any, Any, R]) -> R:
    return asyncio.run(coro)


def _read_store(settings: Settings, read: Callable[[EventStore], Coroutine[Any, Any, R]]) -> R:
    """``read``'s result on the event store, opened as it is (a command that only reads
    migrates nothing)."""
    from kz_stream.store import open_store

    async def go() -> R:
        async with open_store(settings.database_url, create_schema=False) as store:
            return await read(store)

    return _run(go())


def _progress_bars(*, counts: bool = False) -> Progress:
    """Progress bars on stderr: description, bar, [done/total,] a detail field, time."""
    columns = [TextColumn("{task.description}"), BarColumn()]
    if counts:
        columns.append(TextColumn("{task.completed}/{task.total}"))
    columns += [TextColumn("{task.fields[detail]}"), TimeElapsedColumn()]
    return Progress(*columns, console=err_console)
