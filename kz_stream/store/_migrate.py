"""Runs the Alembic migrations in ``migrations/`` against a database URL or a connection."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import create_engine, pool
from sqlalchemy.engine import Connection

from kz_stream.database_url import sync_url

__all__ = ["alembic_config", "upgrade", "upgrade_connection"]


def alembic_config(url: str | None = None) -> Config:
    """The Alembic config of the installed ``migrations`` package."""
    import kz_stream.migrations  # the migrations/ folder, installed under kz_stream

    cfg = Config(str(Path(kz_stream.migrations.__file__).with_name("alembic.ini")))
    if url is not None:
        # ConfigParser interpolates '%': a password may hold one.
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade_connection(connection: Connection, revision: str = "head") -> None:
    """Upgrades the database behind an open connection (commits nothing itself)."""
    cfg = alembic_config()
    cfg.attributes["connection"] = connection
    command.upgrade(cfg, revision)


def upgrade(url: str, revision: str = "head") -> None:
    """Upgrades the database at ``url`` to ``revision``; blocking, safe inside an event loop."""
    engine = create_engine(sync_url(url), poolclass=pool.NullPool)
    try:
        with engine.begin() as conn:
            upgrade_connection(conn, revision)
    finally:
        engine.dispose()
