"""How every SQLite connection of the event store behaves: the store's engine and
``upgrade()``'s blocking one alike."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, Engine, event

# Seconds a writer waits for SQLite's write lock (the driver's ``timeout``).
WRITE_LOCK_WAIT_S = 60
# The execution option that makes a transaction a writer's: BEGIN IMMEDIATE.
WRITE_OPTION = "kz_write"


def sqlite_hooks(engine: Engine) -> None:
    """Makes ``engine`` (a sync engine, or an async engine's ``sync_engine``) run WAL, and
    begin a transaction with BEGIN IMMEDIATE where its execution options hold
    ``WRITE_OPTION`` (a writer takes the lock up front: a deferred BEGIN that upgrades
    later can fail with SQLITE_BUSY instead of waiting). The driver otherwise runs DDL
    outside any transaction."""

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Let us emit BEGIN ourselves (the driver's implicit BEGIN is always deferred).
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")  # readers never block the writer
        # A power cut may lose the last commits but never corrupts the file (WAL).
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        immediate = conn.get_execution_options().get(WRITE_OPTION, False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")
