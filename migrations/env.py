"""Alembic environment of the event store: sync or async URLs, or a caller's connection.

The database comes from, in order: a connection handed over in
``config.attributes["connection"]`` (how ``kz_stream.store.upgrade`` and
``SqlEventStore(create_schema=True)`` run it), ``sqlalchemy.url`` set on the config, or the
settings, loaded as the services load them (``kz_stream.config.load_settings``: the
``KZ_*`` environment over the TOML file of ``alembic -x config=FILE`` or
``KZ_CONFIG_FILE``). Async driver URLs (``sqlite+aiosqlite``) run through an async engine.
"""

from __future__ import annotations

import asyncio
from logging.config import fileConfig
from pathlib import Path

from alembic import context
from sqlalchemy import create_engine, pool
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine

from kz_stream.config import load_settings
from kz_stream.database_url import ensure_sqlite_dir, is_async
from kz_stream.store import metadata

config = context.config

# Only the alembic command line configures logging; programmatic callers keep theirs.
if config.cmd_opts is not None and config.config_file_name is not None:
    fileConfig(config.config_file_name, disable_existing_loggers=False)


def _url() -> str:
    url = config.get_main_option("sqlalchemy.url")
    if url:
        return url
    config_file = context.get_x_argument(as_dictionary=True).get("config")
    return load_settings(Path(config_file) if config_file else None).database_url


def _configure(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        # SQLite cannot ALTER most things; batch mode recreates tables instead.
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


async def _run_async(url: str) -> None:
    engine = create_async_engine(url, poolclass=pool.NullPool)
    try:
        async with engine.connect() as connection:
            await connection.run_sync(_configure)
    finally:
        await engine.dispose()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection)
        return
    url = _url()
    ensure_sqlite_dir(url)
    if is_async(url):
        asyncio.run(_run_async(url))
        return
    engine = create_engine(url, poolclass=pool.NullPool)
    try:
        with engine.connect() as conn:
            _configure(conn)
    finally:
        engine.dispose()


def run_offline() -> None:
    context.configure(url=_url(), target_metadata=metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
