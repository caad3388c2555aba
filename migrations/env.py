"""Alembic environment of the event store: sync or async URLs, or a caller's connection.

The URL comes from, in order: a connection handed over in ``config.attributes["connection"]``
(how ``kz_stream.store._migrate`` and ``SqlEventStore(create_schema=True)`` run it),
``sqlalchemy.url`` set on the config, or the ``KZ_DATABASE_URL`` environment variable.
Async driver URLs (``sqlite+aiosqlite``) run through an async engine.
"""

from __future__ import annotations

import asyncio
import os
from logging.config import fileConfig

from alembic import context
from sqlalchemy import create_engine, pool
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.ext.asyncio import create_async_engine

from kz_stream.store._schema import metadata

config = context.config

# Only the alembic command line configures logging; programmatic callers keep theirs.
if config.cmd_opts is not None and config.config_file_name is not None:
    fileConfig(config.config_file_name, disable_existing_loggers=False)


def _url() -> str:
    url = config.get_main_option("sqlalchemy.url") or os.environ.get("KZ_DATABASE_URL")
    if not url:
        raise RuntimeError("no database URL: set KZ_DATABASE_URL or pass one to upgrade()")
    return url


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
    if make_url(url).get_dialect().is_async:
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
