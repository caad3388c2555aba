"""Test services: a throwaway PostgreSQL cluster and the tansu broker, started once per run.

Set KZ_TEST_POSTGRES_URL (a SQLAlchemy URL of a server where we may create databases) or
KZ_TEST_KAFKA_BOOTSTRAP (host:port) to use running services instead.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kz_stream.infra import LocalBroker, LocalPostgres


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def postgres_server_url() -> Iterator[str]:
    """URL of a PostgreSQL server (its maintenance database) that tests may create DBs on."""
    env = os.environ.get("KZ_TEST_POSTGRES_URL")
    if env:
        yield env
        return
    root = Path(tempfile.mkdtemp(prefix="kz-pg-"))
    root.chmod(0o755)
    try:
        pg = LocalPostgres(root / "pg", database="kz").start()
        try:
            yield pg.url
        finally:
            pg.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)  # 62 MB a run, left in /tmp until now


_db_counter = itertools.count()


@pytest.fixture
def postgres_url(postgres_server_url: str) -> Iterator[str]:
    """A fresh, empty database for one test."""
    import psycopg
    from sqlalchemy.engine import make_url

    base = make_url(postgres_server_url)
    name = f"kz_test_{os.getpid()}_{next(_db_counter)}"
    admin = (
        f"host={base.host} port={base.port} user={base.username} dbname={base.database}"
        + (f" password={base.password}" if base.password else "")
    )
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield base.set(database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def kafka_bootstrap() -> Iterator[str]:
    """host:port of a Kafka-protocol broker."""
    env = os.environ.get("KZ_TEST_KAFKA_BOOTSTRAP")
    if env:
        yield env
        return
    broker = LocalBroker().start()
    try:
        yield broker.bootstrap
    finally:
        broker.stop()


@pytest.fixture(
    params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)],
)
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, empty event store: SQLite, then PostgreSQL (the same test on both)."""
    if request.param == "sqlite":
        return f"sqlite+aiosqlite:///{tmp_path / 'events.sqlite3'}"
    return str(request.getfixturevalue("postgres_url"))


@pytest.fixture(autouse=True)
def _fresh_structlog() -> Iterator[None]:
    """Each test starts from structlog's defaults: a command that ran in an earlier test
    (``kz eval run``, ``kz run``) configures logging for the whole process, and its level
    filter hid the INFO events later tests capture."""
    import structlog

    yield
    structlog.reset_defaults()
