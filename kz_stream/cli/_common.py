"""What the ``kz`` commands share to do their work: the settings (and the option that
names a bad one), the event loop, the event store."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from pydantic import ValidationError

from kz_stream.config import ConfigError, Settings, describe_validation_error, load_settings

if TYPE_CHECKING:
    from kz_stream.store import EventStore

R = TypeVar("R")

ConfigOption = Annotated[
    Path | None, typer.Option("--config", "-c", help="TOML config file (env vars override it).")
]


# Settings fields whose command-line option has another name.
_OPTION_OF_FIELD = {"roles": "--role", "proposer_steps": "--steps-per-turn",
                    "coder_steps": "--steps-per-turn", "max_tokens": "--max-new-tokens"}


def _option(loc: tuple[int | str, ...]) -> str:
    field = str(loc[0]) if loc else "?"
    return _OPTION_OF_FIELD.get(field, "--" + field.replace("_", "-"))


def _bad_option(e: ValidationError, option: str | None = None) -> ConfigError:
    """The first invalid setting, named as its command-line option (``option``, where the
    field's name alone does not tell which option set it)."""
    return ConfigError(describe_validation_error(
        e, lambda _loc: "command line", key=_option if option is None else lambda _loc: option))


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
