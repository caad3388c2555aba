"""Event-store URLs: every form of an in-memory SQLite database is refused (its events
would go with the process), and plain driver names get the store's async drivers."""

from __future__ import annotations

import pytest

from kz_stream.database_url import async_url


@pytest.mark.parametrize("url", [
    "sqlite://", "sqlite:///:memory:", "sqlite+aiosqlite:///:memory:",
    "sqlite+pysqlite:///file:kz?mode=memory&uri=true",
])
def test_an_in_memory_sqlite_store_is_refused_whatever_its_driver(url: str) -> None:
    with pytest.raises(ValueError, match="needs a file path"):
        async_url(url)


@pytest.mark.parametrize(("url", "driver"), [
    ("sqlite:///kz.sqlite3", "aiosqlite"),
    ("sqlite+aiosqlite:///kz.sqlite3", "aiosqlite"),
    ("postgresql://kz@localhost/kz", "psycopg"),
    ("postgresql+psycopg2://kz@localhost/kz", "psycopg"),
])
def test_a_file_or_server_store_gets_its_async_driver(url: str, driver: str) -> None:
    assert async_url(url).get_driver_name() == driver


def test_another_database_is_refused() -> None:
    with pytest.raises(ValueError, match="use sqlite or postgresql"):
        async_url("mysql://kz@localhost/kz")
