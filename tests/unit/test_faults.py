"""Outages are told apart from poison: the errors the drivers raise, as they raise them."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import aiokafka.errors as ke
import psycopg
import pytest
import sqlalchemy.exc as sa

from kz_stream.bus import InfrastructureError
from kz_stream.events import EventDecodeError
from kz_stream.faults import Backoff, DependencyUnavailable, dependency_of, wait_out
from kz_stream.store import ConcurrencyError


def wrapped(driver_error: Exception) -> Exception:
    """The error as SQLAlchemy raises it: its own class, the driver's as the cause."""
    try:
        try:
            raise driver_error
        except Exception as e:
            raise sa.OperationalError("SELECT 1", None, e) from e
    except Exception as outer:
        return outer


@pytest.mark.parametrize(("error", "dependency"), [
    (wrapped(psycopg.errors.AdminShutdown("terminating connection")), "store"),
    (psycopg.OperationalError("connection refused"), "store"),
    (ke.KafkaConnectionError("no broker"), "broker"),
    (ke.UnknownTopicOrPartitionError(), "broker"),
    (ke.UnknownError(), "broker"),  # a broker's own failure (tansu's produce race)
    (ConnectionRefusedError(), "network"),
    (DependencyUnavailable("store", "no answer"), "store"),
])
def test_outages_name_their_dependency(error: Exception, dependency: str) -> None:
    assert dependency_of(error) == dependency


@pytest.mark.parametrize("error", [
    sa.IntegrityError("INSERT", None, Exception("duplicate key")),
    ConcurrencyError("stream taken"),
    EventDecodeError("payload.status: bad"),
    InfrastructureError("cannot create topic"),
    ValueError("bad kernel"),
])
def test_poison_is_not_an_outage(error: Exception) -> None:
    assert dependency_of(error) is None


def test_backoff_doubles_up_to_its_cap() -> None:
    b = Backoff(0.2, 1.0)
    assert [b.delay(n) for n in range(5)] == [0.2, 0.4, 0.8, 1.0, 1.0]
    assert b.delay(10_000) == 1.0


async def test_wait_out_retries_outages_and_raises_anything_else() -> None:
    calls: list[int] = []
    retried: list[float] = []

    async def op() -> str:
        calls.append(1)
        if len(calls) < 4:
            raise psycopg.OperationalError("the database system is shutting down")
        return "done"

    result = await wait_out(op, backoff=Backoff(0.001, 0.002),
                            on_retry=lambda _e, _n, delay: retried.append(delay))
    assert result == "done" and retried == [0.001, 0.002, 0.002]

    async def poison() -> None:
        raise ValueError("bad record")

    with pytest.raises(ValueError):
        await wait_out(poison, backoff=Backoff(0.001, 0.002))


async def test_a_wake_ends_the_wait_between_tries_at_once() -> None:
    import asyncio
    import time

    wake = asyncio.Event()
    calls: list[float] = []

    async def op() -> str:
        calls.append(time.monotonic())
        if len(calls) == 1:
            wake.set()  # a stop arrives during the outage
            raise DependencyUnavailable("llm", "refused")
        return "gave up"  # the try after the wake decides (here: returns)

    assert await wait_out(op, backoff=Backoff(60.0, 60.0), wake=wake) == "gave up"
    assert len(calls) == 2 and calls[1] - calls[0] < 5  # not the 60 s wait
    wake.clear()
    with pytest.raises(TimeoutError):  # unset: the backoff's wait stands
        calls.clear()
        await asyncio.wait_for(wait_out(op, backoff=Backoff(60.0, 60.0)), 0.5)


def sqlite_error(db: Path, what: str) -> Exception:
    """The error SQLite raises (as SQLAlchemy wraps it) for a write to a file opened
    read-only, a missing table, or a write lock another connection holds."""
    sqlite3.connect(db).execute("CREATE TABLE IF NOT EXISTS t (x)").connection.commit()
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        conn = (sqlite3.connect(f"file:{db}?mode=ro", uri=True) if what == "readonly"
                else sqlite3.connect(db, timeout=0, isolation_level=None))
        sql = {"readonly": "INSERT INTO t VALUES (1)", "no table": "SELECT * FROM nope",
               "locked": "BEGIN IMMEDIATE"}[what]
        try:
            conn.execute(sql)
        except sqlite3.OperationalError as e:
            return wrapped(e)
        raise AssertionError(f"{sql} did not fail")
    finally:
        holder.rollback()


def test_a_sqlite_store_that_is_locked_is_an_outage_and_one_that_cannot_work_is_not(
    tmp_path: Path,
) -> None:
    assert dependency_of(sqlite_error(tmp_path / "a.db", "locked")) == "store"
    assert dependency_of(sqlite_error(tmp_path / "b.db", "readonly")) is None
    assert dependency_of(sqlite_error(tmp_path / "c.db", "no table")) is None
