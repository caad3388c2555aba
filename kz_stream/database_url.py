"""Event-store database URLs: parsing, the async and blocking driver forms, redaction, and
the folder of a SQLite file. Every other module goes through these functions."""

from __future__ import annotations

import os

from sqlalchemy.engine import URL, make_url

__all__ = ["async_url", "ensure_sqlite_dir", "is_async", "parse", "redact", "sync_url"]

# Async drivers and the blocking driver of the same database (Alembic's upgrade()).
_SYNC_DRIVERS = {"aiosqlite": "pysqlite", "asyncpg": "psycopg", "psycopg_async": "psycopg"}


def parse(url: str | URL) -> URL:
    """The URL parsed (SQLAlchemy's ``make_url``; a malformed one raises)."""
    return make_url(url)


def async_url(url: str | URL) -> URL:
    """The event store's async form: the async driver for plain ``sqlite://`` and
    ``postgresql://`` URLs. Raises ValueError for another database or an in-memory SQLite."""
    u = parse(url)
    backend, driver = u.get_backend_name(), u.get_driver_name()
    if backend not in ("sqlite", "postgresql"):
        raise ValueError(f"unsupported event store URL {u!r}: use sqlite or postgresql")
    if backend == "sqlite" and (u.database in (None, "", ":memory:")
                                or u.query.get("mode") == "memory"):
        # Checked for every driver (a plain sqlite:// got past it): each pooled connection
        # would see its own empty database, or all share one, and the events go with the
        # process.
        raise ValueError("the SQLite event store needs a file path, not an in-memory database")
    if backend == "sqlite" and driver != "aiosqlite":
        return u.set(drivername="sqlite+aiosqlite")
    if backend == "postgresql" and driver not in ("psycopg", "psycopg_async"):
        return u.set(drivername="postgresql+psycopg")
    return u


def sync_url(url: str | URL) -> str:
    """The same database through a blocking driver (``sqlite+aiosqlite`` -> ``sqlite``),
    password included (it is for connecting, not for showing)."""
    u = parse(url)
    driver = _SYNC_DRIVERS.get(u.get_driver_name())
    if driver is not None:
        u = u.set(drivername=f"{u.get_backend_name()}+{driver}")
    return u.render_as_string(hide_password=False)


def is_async(url: str | URL) -> bool:
    """Whether the URL's driver needs an async engine."""
    return bool(parse(url).get_dialect().is_async)


def redact(url: str | URL) -> str:
    """The URL with its password hidden, for messages."""
    return parse(url).render_as_string(hide_password=True)


def ensure_sqlite_dir(url: str | URL) -> None:
    """Creates the folder of a SQLite database file, so a fresh checkout just runs."""
    u = parse(url)
    if u.get_backend_name() == "sqlite" and u.database and u.database != ":memory:":
        os.makedirs(os.path.dirname(os.path.abspath(u.database)), exist_ok=True)
