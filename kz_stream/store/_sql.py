"""The SQLAlchemy event store adapter: SQLite (embedded default) and PostgreSQL (real store).

How the global position stays trustworthy
-----------------------------------------
A reader that has seen position ``p`` asks for ``global_position > p``. That is only safe if
no transaction can still commit an event with a position below one already visible, i.e.
positions must be assigned in commit order.

- PostgreSQL: identity values are handed out at insert time, not at commit, so two
  concurrent appenders could commit out of order (B takes 11, A takes 10, B commits, a reader
  sees 11, then A commits 10 behind it). Every append therefore first takes one
  transaction-scoped advisory lock (``pg_advisory_xact_lock``); it is released only after
  the commit is visible, so the next appender draws its positions after every earlier one
  is visible. Appends are serialised, which costs little because each is one bulk COPY;
  other work in the transaction (tracking rows, projection writes) runs in parallel until
  the first append. Keep transactions that append short: the lock is held until commit.
  Positions can have holes (rolled-back appends consume identity values); readers never
  rely on positions being dense, only on their order.
- SQLite has one writer at a time: every writing transaction starts with ``BEGIN IMMEDIATE``
  and rowids are assigned under that lock. Writers of one store object first queue on an
  asyncio lock, in order, holding no connection: without it every waiting writer holds a
  pooled connection while SQLite's busy handler sleeps and retries, and beyond the pool's
  size (15) the next ones fail after 30 s (`kz eval` verifying 64 kernels at once did).

Idempotence: under the same lock (or SQLite's write lock) stored event ids are skipped
(counted as duplicates) and the rest inserted; a different event at a taken
(stream_id, stream_version) violates ``uq_events_stream`` and raises ConcurrencyError, which
rolls back the whole batch. On PostgreSQL the batch is first COPYed optimistically inside a
savepoint; only when that meets a unique violation (a redelivery) are its ids looked up.

Tailing: on PostgreSQL each append that wrote rows calls ``pg_notify('kz_events', ...)`` in
its transaction, so listeners are woken exactly at commit; tail() also re-reads every
``poll_interval`` in case a notification is lost (e.g. the listening connection dropped).
SQLite tails by polling.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import orjson
import psycopg
from psycopg import errors as pg_errors
from sqlalchemy import Connection, func, insert, inspect, select, text
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import URL
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from kz_stream.database_url import async_url
from kz_stream.events import EVENT_TYPES, Event
from kz_stream.faults import DependencyUnavailable
from kz_stream.store._migrate import upgrade_connection
from kz_stream.store._port import (
    AppendResult,
    ConcurrencyError,
    RecordedEvent,
    StoreNotFound,
)
from kz_stream.store._schema import EVENT_COLUMNS, events, tracking
from kz_stream.store._sqlite import WRITE_LOCK_WAIT_S, WRITE_OPTION, sqlite_hooks

__all__ = ["NOTIFY_CHANNEL", "SqlEventStore", "open_store"]

T = TypeVar("T")

NOTIFY_CHANNEL = "kz_events"
# One fixed key for the appenders' advisory lock ("kz_event" in ASCII).
_APPEND_LOCK_KEY = 0x6B7A5F6576656E74
_SQLITE_IN_CHUNK = 500  # event ids per IN (...) lookup, far below SQLite's variable limit

_COPY_EVENTS = f"COPY events ({', '.join(EVENT_COLUMNS)}) FROM STDIN (FORMAT BINARY)"
_COPY_TYPES = (
    "uuid", "text", "int4", "text", "int8", "timestamptz", "text", "text", "uuid", "jsonb",
)
# The payload comes as text for orjson: psycopg's jsonb loader cost ~2 us more per 500 B
# payload than casting on the server and parsing here (measured on a page of 5000).
_PAGE_SQL = (
    "SELECT global_position, recorded_at, " + ", ".join(EVENT_COLUMNS[:-1]) + ", "
    "({payload})::text FROM events WHERE global_position > %s {filter} "
    "ORDER BY global_position LIMIT %s"
)
# A payload at its type's current schema version loses the keys nobody asked for; older
# ones come whole, because their upcasters may need any key (v1 ``language`` -> ``backend``).
# Parameters: the current (types, versions) as two arrays, then the keys to drop.
_TRIMMED_PAYLOAD = (
    "CASE WHEN schema_version = (%s::int4[])[array_position(%s::text[], type::text)] "
    "THEN payload - %s::text[] ELSE payload END"
)
_READ_COLUMNS = (events.c.global_position, events.c.recorded_at,
                 *(events.c[name] for name in EVENT_COLUMNS))

# A health probe that waits longer than this calls the database unreachable.
_PING_TIMEOUT_S = 5.0


def _row(event: Event) -> tuple[Any, ...]:
    """The envelope as an events row; a naive occurred_at is taken to be UTC."""
    occurred_at = event.occurred_at
    if occurred_at.tzinfo is None:
        occurred_at = occurred_at.replace(tzinfo=UTC)
    return (
        event.event_id, event.type, event.schema_version, event.stream_id,
        event.stream_version, occurred_at, event.producer, event.correlation_id,
        event.causation_id, event.payload,
    )


_EVENT_FIELDS = frozenset(Event.model_fields)
_new_object = object.__new__
_set_attribute = object.__setattr__


def _trusted_event(values: dict[str, Any]) -> Event:
    """Builds an Event from stored (validated on append) values without validating again.

    What ``Event.model_construct`` does with every field given, minus its per-call
    bookkeeping: reads build millions of these, and conversion was half the replay time
    (measured ~3 us validate or model_construct vs ~0.6 us here). ``_check_trusted_event``
    falls back to model_construct should pydantic's internals ever change.
    """
    ev = _new_object(Event)
    _set_attribute(ev, "__dict__", values)
    _set_attribute(ev, "__pydantic_fields_set__", _EVENT_FIELDS)
    _set_attribute(ev, "__pydantic_extra__", None)
    _set_attribute(ev, "__pydantic_private__", {"_decoded": None})  # not decoded yet
    return ev


def _construct_event(values: dict[str, Any]) -> Event:
    return Event.model_construct(**values)


def _check_trusted_event() -> Callable[[dict[str, Any]], Event]:
    values: dict[str, Any] = {
        "event_id": uuid.UUID(int=1), "type": "T", "schema_version": 1, "stream_id": "s",
        "stream_version": 0, "occurred_at": datetime(2026, 1, 1, tzinfo=UTC), "producer": "",
        "correlation_id": None, "causation_id": None, "payload": {"a": 1},
    }
    try:
        ev = _trusted_event(dict(values))
        if ev == Event(**values) and ev.model_dump() == values:
            return _trusted_event
    except Exception:  # any surprise means: use the public API
        pass
    return _construct_event


_make_event = _check_trusted_event()


def _recorded(row: Sequence[Any], payload: Any) -> RecordedEvent:
    """A stored row (global_position, recorded_at, *EVENT_COLUMNS) as a RecordedEvent, with
    its payload column already parsed."""
    return RecordedEvent(
        global_position=row[0],
        recorded_at=row[1],
        event=_make_event({
            "event_id": row[2], "type": row[3], "schema_version": row[4],
            "stream_id": row[5], "stream_version": row[6], "occurred_at": row[7],
            "producer": row[8], "correlation_id": row[9], "causation_id": row[10],
            "payload": payload,
        }),
    )


async def _psycopg(conn: AsyncConnection) -> psycopg.AsyncConnection[Any]:
    """The psycopg connection under a SQLAlchemy connection of the Postgres engine."""
    pg = (await conn.get_raw_connection()).driver_connection
    if not isinstance(pg, psycopg.AsyncConnection):
        raise TypeError(f"expected a psycopg connection, got {type(pg).__name__}")
    return pg


def _dedupe(batch: Sequence[Event]) -> tuple[list[Event], int]:
    """Drops repeated event ids inside one batch (first wins); returns (unique, repeats)."""
    # UUID.__hash__ is Python code; hashing the int directly is ~3x cheaper per event.
    if len({ev.event_id.int for ev in batch}) == len(batch):
        return list(batch), 0
    seen: set[int] = set()
    unique: list[Event] = []
    for ev in batch:
        if ev.event_id.int not in seen:
            seen.add(ev.event_id.int)
            unique.append(ev)
    return unique, len(batch) - len(unique)


class SqlTransaction:
    """One open database transaction of a SqlEventStore (the StoreTransaction port)."""

    def __init__(self, store: SqlEventStore, conn: AsyncConnection) -> None:
        self._store = store
        self.connection = conn

    @property
    def dialect(self) -> str:
        """``"postgresql"`` or ``"sqlite"``: projections pick dialect-specific upserts by it."""
        return self._store.dialect

    async def append(self, events: Sequence[Event]) -> AppendResult:
        """Appends a batch inside this transaction; a failed batch leaves no trace in it."""
        # A savepoint keeps "the whole batch or nothing" true even when the caller catches
        # the ConcurrencyError and goes on using the transaction.
        async with self.connection.begin_nested():
            return await self._store._append(self.connection, events)

    async def set_tracking(self, name: str, positions: Mapping[str, int]) -> None:
        await self._store._set_tracking(self.connection, name, positions)

    async def get_tracking(self, name: str) -> dict[str, int]:
        return await self._store._get_tracking(self.connection, name)

    async def execute(self, statement: Any, parameters: Any = None) -> Any:
        """Runs a SQLAlchemy statement (or SQL text) in this transaction."""
        if isinstance(statement, str):
            statement = text(statement)
        return await self.connection.execute(statement, parameters)

    async def run_sync(self, fn: Callable[[Connection], T]) -> T:
        """Runs ``fn(sync_connection)`` in this transaction (DDL, ``metadata.create_all``)."""
        return await self.connection.run_sync(fn)


class SqlEventStore:
    """The EventStore port on SQLAlchemy 2 async: ``sqlite+aiosqlite`` or ``postgresql+psycopg``.

    ``create_schema=True`` runs the Alembic migrations on start(). The store is also an async
    context manager (start on enter, close on exit).
    """

    def __init__(self, url: str, *, create_schema: bool = False, pool_size: int = 8) -> None:
        self._url = async_url(url)
        self.url = self._url.render_as_string(hide_password=False)
        self.dialect = self._url.get_backend_name()
        self._create_schema = create_schema
        self._pool_size = pool_size
        self._engine: AsyncEngine | None = None
        self._writer: AsyncEngine | None = None
        self._sqlite_writers: asyncio.Lock | None = None

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        if self._engine is not None:
            return
        if not self._create_schema:
            self._require_sqlite_file()
        if self.dialect == "sqlite":
            engine = self._sqlite_engine()
            # Writers take SQLite's write lock up front (BEGIN IMMEDIATE); a deferred BEGIN
            # that upgrades later can fail with SQLITE_BUSY instead of waiting.
            writer = engine.execution_options(**{WRITE_OPTION: True})
            self._sqlite_writers = asyncio.Lock()
        else:
            engine = self._postgres_engine()
            writer = engine
        self._engine, self._writer = engine, writer
        if self._create_schema:
            try:
                async with writer.begin() as conn:
                    await conn.run_sync(upgrade_connection)
            except BaseException:
                await self.close()  # a next start() migrates again
                raise
        else:
            async with engine.connect() as conn:
                found = await conn.run_sync(lambda c: inspect(c).has_table(events.name))
            if not found:
                await self.close()
                raise StoreNotFound(f"{self._described()} holds no event store (no "
                                    f"{events.name} table: never written by a service or kz "
                                    "run, or another KZ_DATABASE_URL)")

    def _require_sqlite_file(self) -> None:
        """Raises StoreNotFound for a SQLite file that is not there: opening it would leave
        an empty file where the user mistyped a path."""
        database = self._url.database
        if (self.dialect == "sqlite" and database and database != ":memory:"
                and not Path(database).exists()):
            raise StoreNotFound(f"{self._described()}: no such database file (a service or "
                                "kz run creates it; is KZ_DATABASE_URL the one they use?)")

    def _described(self) -> str:
        return self._url.render_as_string(hide_password=True)

    async def close(self) -> None:
        if self._engine is not None:
            await self._engine.dispose()
            self._engine = self._writer = None

    async def __aenter__(self) -> SqlEventStore:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _sqlite_engine(self) -> AsyncEngine:
        engine = create_async_engine(
            self._url,
            json_serializer=lambda obj: orjson.dumps(obj).decode(),
            json_deserializer=orjson.loads,
            connect_args={"timeout": WRITE_LOCK_WAIT_S},
        )
        sqlite_hooks(engine.sync_engine)
        return engine

    def _postgres_engine(self) -> AsyncEngine:
        options = self._url.query.get("options", "")
        if isinstance(options, tuple):
            options = " ".join(options)
        return create_async_engine(
            self._url,
            json_serializer=orjson.dumps,  # psycopg accepts bytes from its json dumper
            json_deserializer=orjson.loads,
            pool_size=self._pool_size,
            max_overflow=2 * self._pool_size,
            # Timestamps come back in UTC whatever the server's zone.
            connect_args={"options": f"{options} -c timezone=UTC".strip()},
        )

    def _engines(self) -> tuple[AsyncEngine, AsyncEngine]:
        if self._engine is None or self._writer is None:
            raise RuntimeError("the event store is not started: call start() first")
        return self._engine, self._writer

    # -- writing -----------------------------------------------------------------------

    async def append(
        self, events: Sequence[Event], *, tracking: Mapping[str, Mapping[str, int]] | None = None
    ) -> AppendResult:
        """Appends a batch atomically, skipping event ids already stored.

        Raises ConcurrencyError (and writes nothing) when a (stream_id, stream_version) of the
        batch holds a different event. ``tracking`` ({name: {key: position}}) commits with it.
        """
        async with self._writing() as conn:
            result = await self._append(conn, events)
            for name, positions in (tracking or {}).items():
                await self._set_tracking(conn, name, positions)
        return result

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[SqlTransaction]:
        """A transaction for appends, tracking and projection writes; commits on clean exit."""
        async with self._writing() as conn:
            yield SqlTransaction(self, conn)

    @asynccontextmanager
    async def _writing(self) -> AsyncIterator[AsyncConnection]:
        """A writing transaction; on SQLite, after this store's earlier writers."""
        _, writer = self._engines()
        async with self._sqlite_writers or contextlib.nullcontext():
            async with writer.begin() as conn:
                yield conn

    async def _append(self, conn: AsyncConnection, batch: Sequence[Event]) -> AppendResult:
        unique, repeats = _dedupe(batch)
        if self.dialect == "postgresql":
            appended, last = await self._append_postgres(conn, unique)
        else:
            appended, last = await self._append_sqlite(conn, unique)
        return AppendResult(
            appended=appended, duplicates=repeats + len(unique) - appended, last_position=last
        )

    async def _append_postgres(self, conn: AsyncConnection, batch: list[Event]) -> tuple[int, int]:
        pg = await _psycopg(conn)
        async with pg.cursor() as cur:
            await cur.execute("SELECT pg_advisory_xact_lock(%s)", (_APPEND_LOCK_KEY,))
            new = batch
            if batch:
                try:
                    # Optimistic: most batches are new, and looking their ids up first cost
                    # ~15% of a 500 B append. A savepoint undoes a batch that meets a stored
                    # id (or slot); the careful path below then sorts it out.
                    async with pg.transaction():
                        await _copy_events(cur, batch)
                except pg_errors.UniqueViolation:
                    new = await _not_stored(cur, batch)
                    try:
                        if new:
                            await _copy_events(cur, new)
                    except pg_errors.UniqueViolation as e:
                        if e.diag.constraint_name == "uq_events_stream":
                            raise ConcurrencyError(_stream_conflict(e.diag.message_detail)) from e
                        raise
            if new:
                await cur.execute(
                    "SELECT m, pg_notify(%s, m::text) FROM "
                    "(SELECT max(global_position) AS m FROM events) s",
                    (NOTIFY_CHANNEL,),
                )
            else:
                await cur.execute("SELECT coalesce(max(global_position), 0) FROM events")
            row = await cur.fetchone()
        return len(new), int(row[0]) if row else 0

    async def _append_sqlite(self, conn: AsyncConnection, batch: list[Event]) -> tuple[int, int]:
        stored: set[uuid.UUID] = set()
        for i in range(0, len(batch), _SQLITE_IN_CHUNK):
            ids = [ev.event_id for ev in batch[i : i + _SQLITE_IN_CHUNK]]
            found = await conn.execute(select(events.c.event_id).where(events.c.event_id.in_(ids)))
            stored.update(found.scalars())
        new = [ev for ev in batch if ev.event_id not in stored]
        if new:
            try:
                await conn.execute(
                    insert(events), [dict(zip(EVENT_COLUMNS, _row(ev), strict=True)) for ev in new]
                )
            except IntegrityError as e:
                if "events.stream_id" in str(e.orig):
                    raise ConcurrencyError(
                        "stream_id, stream_version: a different event is stored there"
                    ) from e
                raise
        last = await conn.scalar(select(func.coalesce(func.max(events.c.global_position), 0)))
        return len(new), int(last or 0)

    async def _set_tracking(
        self, conn: AsyncConnection, name: str, positions: Mapping[str, int]
    ) -> None:
        if not positions:
            return
        ins = pg_insert(tracking) if self.dialect == "postgresql" else sqlite_insert(tracking)
        stmt = ins.on_conflict_do_update(
            index_elements=[tracking.c.name, tracking.c.key],
            set_={"position": ins.excluded.position, "updated_at": func.now()},
        )
        await conn.execute(
            stmt, [{"name": name, "key": k, "position": int(p)} for k, p in positions.items()]
        )

    @staticmethod
    async def _get_tracking(conn: AsyncConnection, name: str) -> dict[str, int]:
        rows = await conn.execute(
            select(tracking.c.key, tracking.c.position).where(tracking.c.name == name)
        )
        return {k: int(p) for k, p in rows}

    # -- reading -----------------------------------------------------------------------

    async def read_stream(self, stream_id: str) -> list[RecordedEvent]:
        """Every event of one stream in stream-version order."""
        engine, _ = self._engines()
        query = (
            select(*_READ_COLUMNS)
            .where(events.c.stream_id == stream_id)
            .order_by(events.c.stream_version)
        )
        async with engine.connect() as conn:
            rows = (await conn.execute(query)).all()
        return [_recorded(r, r[11]) for r in rows]

    async def read_all(
        self,
        from_position: int = 0,
        *,
        batch_size: int = 1000,
        types: Sequence[str] | None = None,
        payload_fields: Sequence[str] | None = None,
        correlation_id: str | None = None,
    ) -> AsyncGenerator[list[RecordedEvent], None]:
        """Batches of events with global_position > from_position, in order, to the current end.

        Each batch is its own short query (keyset on global_position), so a long replay holds
        no transaction open and sees events that commit while it runs. The next page is
        fetched while the caller works on this one: the database produces rows on its core
        while Python builds events on the other.

        ``payload_fields`` (for projections) lets PostgreSQL drop every other key of the
        payloads stored at their type's current schema version before sending them: a
        fraction of the bytes to ship and parse. It is a hint: older payloads, and all of
        them on SQLite, come whole, so a reader must upcast as usual and ignore extra keys.

        ``correlation_id`` keeps one run's events: the index ``ix_events_correlation``
        (correlation_id, global_position) serves it, so a page costs what it returns, not
        what the store holds of other runs.
        """
        engine, _ = self._engines()
        type_list = list(types) if types is not None else None
        postgres = self.dialect == "postgresql"
        if postgres:
            sql, head, tail = _page_query(type_list, payload_fields, correlation_id)

            async def page(after: int) -> Sequence[Sequence[Any]]:
                async with engine.connect() as conn:
                    params = (*head, after, *tail, batch_size)
                    return await self._page_postgres(
                        conn, sql, params, prepare=None if correlation_id is None else False
                    )
        else:

            async def page(after: int) -> Sequence[Sequence[Any]]:
                async with engine.connect() as conn:
                    return await self._page_sqlite(
                        conn, after, batch_size, type_list, correlation_id
                    )

        ahead: asyncio.Task[Sequence[Sequence[Any]]] | None = asyncio.create_task(
            page(from_position)
        )
        try:
            while ahead is not None:
                rows = await ahead
                ahead = None
                if not rows:
                    return
                if len(rows) == batch_size:  # a short page is the end, as of this query
                    ahead = asyncio.create_task(page(rows[-1][0]))
                if postgres:  # payloads come as JSON text (see _PAGE_SQL)
                    loads = orjson.loads
                    yield [_recorded(r, loads(r[11])) for r in rows]
                else:
                    yield [_recorded(r, r[11]) for r in rows]
        finally:
            if ahead is not None:
                ahead.cancel()
                await asyncio.gather(ahead, return_exceptions=True)

    @staticmethod
    async def _page_postgres(
        conn: AsyncConnection, sql: str, params: tuple[Any, ...], *, prepare: bool | None
    ) -> Sequence[Sequence[Any]]:
        """One page. ``prepare=False`` plans it for its parameters each time: once psycopg
        has prepared a statement (its 5th run on a connection), PostgreSQL soon switches to
        a generic plan, which cannot tell a small run's correlation id from a big one's and
        walks the primary key past every other run's events instead of using the index
        (measured: a page 6 -> 15 ms with 30,000 such events before it; more as they grow)."""
        # Straight through psycopg in binary format: SQLAlchemy's row processing cost more
        # than the query itself here (measured: ~45k vs ~120k events/s at 500 B).
        pg = await _psycopg(conn)
        async with pg.cursor(binary=True) as cur:
            await cur.execute(sql, params, prepare=prepare)
            return await cur.fetchall()

    @staticmethod
    async def _page_sqlite(
        conn: AsyncConnection,
        after: int,
        limit: int,
        types: list[str] | None,
        correlation_id: str | None,
    ) -> Sequence[Sequence[Any]]:
        query = select(*_READ_COLUMNS).where(events.c.global_position > after)
        if types is not None:
            query = query.where(events.c.type.in_(types))
        if correlation_id is not None:
            query = query.where(events.c.correlation_id == correlation_id)
        query = query.order_by(events.c.global_position).limit(limit)
        return (await conn.execute(query)).all()

    async def tail(
        self,
        from_position: int = 0,
        *,
        batch_size: int = 1000,
        poll_interval: float = 0.5,
        types: Sequence[str] | None = None,
    ) -> AsyncGenerator[list[RecordedEvent], None]:
        """read_all from ``from_position``, then waits for commits and yields them, forever."""
        self._engines()
        position = from_position
        async with self._waiter() as wait:
            while True:
                async with contextlib.aclosing(
                    self.read_all(position, batch_size=batch_size, types=types)
                ) as batches:
                    async for batch in batches:
                        position = batch[-1].global_position
                        yield batch
                await wait(poll_interval)

    @asynccontextmanager
    async def _waiter(self) -> AsyncIterator[Callable[[float], Awaitable[None]]]:
        """A function that returns after a new commit is announced or ``timeout`` passes."""
        if self.dialect != "postgresql":
            yield asyncio.sleep
            return
        listener = _Listener(self._url.set(drivername="postgresql"))
        try:
            await listener.connect()
            yield listener.wait
        finally:
            await listener.close()

    async def ping(self) -> None:
        engine, _ = self._engines()
        try:
            async with asyncio.timeout(_PING_TIMEOUT_S), engine.connect() as conn:
                await conn.execute(text("SELECT 1"))
        except Exception as e:
            where = self._url.render_as_string(hide_password=True)
            raise DependencyUnavailable(
                "store", f"{where} does not answer: {type(e).__name__}: {e}"
            ) from e

    async def last_position(self) -> int:
        engine, _ = self._engines()
        async with engine.connect() as conn:
            last = await conn.scalar(select(func.coalesce(func.max(events.c.global_position), 0)))
        return int(last or 0)

    async def get_tracking(self, name: str) -> dict[str, int]:
        engine, _ = self._engines()
        async with engine.connect() as conn:
            return await self._get_tracking(conn, name)


class _Listener:
    """LISTENs on the append channel; falls back to plain polling while disconnected."""

    def __init__(self, url: URL) -> None:
        self._conninfo = url.render_as_string(hide_password=False)
        self._conn: psycopg.AsyncConnection[Any] | None = None

    async def connect(self) -> None:
        with contextlib.suppress(psycopg.OperationalError):
            conn = await psycopg.AsyncConnection.connect(self._conninfo, autocommit=True)
            await conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
            self._conn = conn

    async def wait(self, seconds: float) -> None:
        if self._conn is None:
            await asyncio.sleep(seconds)
            await self.connect()  # the caller re-reads first, so nothing announced is lost
            return
        try:
            async for _ in self._conn.notifies(timeout=seconds, stop_after=1):
                pass
            # Several commits may have been announced meanwhile: one re-read covers them all.
            async for _ in self._conn.notifies(timeout=0.0):
                pass
        except psycopg.OperationalError:
            await self.close()

    async def close(self) -> None:
        if self._conn is not None:
            conn, self._conn = self._conn, None
            with contextlib.suppress(psycopg.Error):
                await conn.close()


def _page_query(
    types: list[str] | None, payload_fields: Sequence[str] | None, correlation_id: str | None
) -> tuple[str, tuple[Any, ...], tuple[Any, ...]]:
    """A read_all page's SQL, and its parameters before ``after`` and between it and the
    page size."""
    before: tuple[Any, ...] = ()
    payload = "payload"
    if payload_fields is not None:
        classes = [EVENT_TYPES[t] for t in (types or EVENT_TYPES) if t in EVENT_TYPES]
        # Keys a current payload of these types can hold, less the wanted ones.
        unwanted = sorted({k for cls in classes for k in cls.model_fields} - set(payload_fields))
        if unwanted:
            payload = _TRIMMED_PAYLOAD
            before = (
                [cls.schema_version for cls in classes],
                [cls.event_type for cls in classes],
                unwanted,
            )
    filters: list[str] = []
    between: list[Any] = []
    if types is not None:
        filters.append("AND type = ANY(%s)")
        between.append(types)
    if correlation_id is not None:
        filters.append("AND correlation_id = %s")
        between.append(correlation_id)
    return _PAGE_SQL.format(payload=payload, filter=" ".join(filters)), before, tuple(between)


async def _copy_events(cur: psycopg.AsyncCursor[Any], batch: Sequence[Event]) -> None:
    async with cur.copy(_COPY_EVENTS) as copy:
        copy.set_types(list(_COPY_TYPES))
        for ev in batch:
            await copy.write_row(_row(ev))


async def _not_stored(cur: psycopg.AsyncCursor[Any], batch: Sequence[Event]) -> list[Event]:
    await cur.execute(
        "SELECT event_id FROM events WHERE event_id = ANY(%s)", ([ev.event_id for ev in batch],)
    )
    stored = {r[0] for r in await cur.fetchall()}
    return [ev for ev in batch if ev.event_id not in stored]


def _stream_conflict(detail: str | None) -> str:
    return f"stream_id, stream_version: a different event is stored there ({detail or ''})"


@asynccontextmanager
async def open_store(url: str, *, create_schema: bool = True) -> AsyncIterator[SqlEventStore]:
    """A started SqlEventStore (schema migrated by default), closed on exit."""
    store = SqlEventStore(url, create_schema=create_schema)
    await store.start()
    try:
        yield store
    finally:
        await store.close()

