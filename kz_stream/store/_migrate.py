"""Runs the Alembic migrations in ``migrations/`` against a database URL or a connection."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import create_engine, pool
from sqlalchemy.engine import Connection

from kz_stream.database_url import parse, sync_url
from kz_stream.store._sqlite import WRITE_LOCK_WAIT_S, WRITE_OPTION, sqlite_hooks

__all__ = ["alembic_config", "upgrade", "upgrade_connection"]


def alembic_config(url: str | None = None) -> Config:
    """The Alembic config of the installed ``migrations`` package."""
    import kz_stream.migrations  # the migrations/ folder, installed under kz_stream

    cfg = Config(str(Path(kz_stream.migrations.__file__).with_name("alembic.ini")))
    if url is not None:
        # ConfigParser interpolates '%': a password may hold one.
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


# One fixed key for the migrating processes' advisory lock ("kz_migr" in ASCII; the
# appenders' is "kz_event").
_MIGRATION_LOCK_KEY = int.from_bytes(b"kz_migr", "big")


def upgrade_connection(connection: Connection, revision: str = "head") -> None:
    """Upgrades the database behind an open connection (commits nothing itself). On
    PostgreSQL it first takes a lock held to the commit: services starting together on a
    fresh database each found no ``alembic_version`` and created the tables, and all but
    one died on a unique violation; after the wait, Alembic finds the schema at head."""
    if connection.dialect.name == "postgresql":
        connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_MIGRATION_LOCK_KEY})")
    cfg = alembic_config()
    cfg.attributes["connection"] = connection
    command.upgrade(cfg, revision)


def upgrade(url: str, revision: str = "head") -> None:
    """Upgrades the database at ``url`` to ``revision`` in one transaction; blocking, safe
    inside an event loop."""
    if parse(url).get_backend_name() == "sqlite":
        # The store's connections (``sqlite_hooks``): one BEGIN IMMEDIATE transaction.
        # The driver ran the DDL outside any until 2026-12-08: an upgrade cut between
        # ``CREATE TABLE events`` and its version row left a database no later upgrade
        # could mend, and one racing a starting service failed on "table alembic_version
        # already exists".
        engine = create_engine(sync_url(url), poolclass=pool.NullPool,
                               connect_args={"timeout": WRITE_LOCK_WAIT_S},
                               execution_options={WRITE_OPTION: True})
        sqlite_hooks(engine)
    else:
        engine = create_engine(sync_url(url), poolclass=pool.NullPool)
    try:
        with engine.begin() as conn:
            upgrade_connection(conn, revision)
    finally:
        engine.dispose()
