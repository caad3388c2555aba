"""Projections: read-model tables rebuilt by replaying the event store.

A projection owns its tables (its own SQLAlchemy ``MetaData``) and applies batches of
recorded events to them. Each batch's writes and the projection's position (tracking name
``projection:<name>``, key ``global_position``) commit in one transaction, so a replay that
stops anywhere resumes with ``catch_up`` with nothing lost and nothing applied twice.

Projections read payloads as stored dicts, upcast to the current schema version
(``kz_stream.events.current_payload``), not as pydantic models: every row was validated on
append, and building a model of an 8 KB ``KernelGenerated`` per event would cost more than
the rest of the replay together.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import orjson
from sqlalchemy import (
    JSON,
    BigInteger,
    Column,
    Connection,
    Float,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    bindparam,
    case,
    cast,
    func,
    literal_column,
    select,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from kz_stream.events import Event, current_payload
from kz_stream.store import AppendResult, EventStore, RecordedEvent, StoreTransaction

__all__ = [
    "TRACKING_KEY",
    "KernelsProjection",
    "Projection",
    "ReplayStats",
    "catch_up",
    "kernels",
    "projection_hash",
    "rebuild",
    "tracking_name",
]

T = TypeVar("T")

TRACKING_KEY = "global_position"
DEFAULT_BATCH_SIZE = 5000


class Projection(ABC):
    """A read model: the tables it owns and how a batch of events changes them."""

    name: ClassVar[str]
    metadata: ClassVar[MetaData]
    # Event types it consumes; None means all. The store filters, so others cost nothing.
    types: ClassVar[tuple[str, ...] | None] = None
    # Payload keys apply() reads (at each type's current schema version); None means all.
    # PostgreSQL then ships only these: reading and parsing whole payloads was most of a
    # replay. Payloads may still arrive whole (older versions, SQLite): ignore extra keys.
    payload_fields: ClassVar[tuple[str, ...] | None] = None

    @abstractmethod
    async def apply(self, tx: StoreTransaction, batch: Sequence[RecordedEvent]) -> None:
        """Writes the effect of ``batch`` (in global-position order) inside ``tx``."""


@dataclass(frozen=True, slots=True)
class ReplayStats:
    events: int  # events applied
    seconds: float
    position: int  # the projection's tracking position afterwards

    @property
    def events_per_s(self) -> float:
        return self.events / self.seconds if self.seconds > 0 else 0.0


def tracking_name(projection: Projection) -> str:
    return f"projection:{projection.name}"


OnBatch = Callable[[int], object]  # called with the position after each committed batch


async def rebuild(
    store: EventStore,
    projection: Projection,
    *,
    batch_size: int = DEFAULT_BATCH_SIZE,
    on_batch: OnBatch | None = None,
) -> ReplayStats:
    """Drops and recreates the projection's tables, then replays every event from 0."""
    return await _replay(store, projection, batch_size, on_batch, fresh=True)


async def catch_up(
    store: EventStore,
    projection: Projection,
    *,
    batch_size: int = DEFAULT_BATCH_SIZE,
    on_batch: OnBatch | None = None,
) -> ReplayStats:
    """Applies the events after the projection's stored position (creating missing tables)."""
    return await _replay(store, projection, batch_size, on_batch, fresh=False)


async def _start(store: EventStore, projection: Projection, *, fresh: bool) -> tuple[str, int]:
    """Creates the projection's tables (dropped first when ``fresh``); returns the dialect
    and the position to replay from."""
    name = tracking_name(projection)
    async with store.transaction() as tx:
        if fresh:
            await tx.run_sync(projection.metadata.drop_all)
        await tx.run_sync(projection.metadata.create_all)
        if fresh:
            await tx.set_tracking(name, {TRACKING_KEY: 0})
            position = 0
        else:
            position = (await tx.get_tracking(name)).get(TRACKING_KEY, 0)
        return tx.dialect, position


async def _replay(
    store: EventStore,
    projection: Projection,
    batch_size: int,
    on_batch: OnBatch | None,
    *,
    fresh: bool,
) -> ReplayStats:
    """Prepares the tables (``_start``), then applies batches in order, one transaction
    each, with the next batch's Python work (building its events, ``apply``'s fold)
    overlapping the database work of the one before: that upsert was most of a replay's
    wall time, the CPU mostly idle during it (measured ~15% faster). A batch opens its
    transaction only once the previous one has committed (``_AfterCommit``), so batches
    still take effect one at a time, in order."""
    dialect, position = await _start(store, projection, fresh=fresh)
    started = time.perf_counter()
    applied = 0
    name = tracking_name(projection)

    async def commit(batch: list[RecordedEvent], previous: asyncio.Task[int] | None) -> int:
        async with contextlib.AsyncExitStack() as stack:
            tx = _AfterCommit(store, dialect, previous, stack)
            await projection.apply(tx, batch)
            last = batch[-1].global_position
            await tx.set_tracking(name, {TRACKING_KEY: last})
        return last

    in_flight: list[tuple[asyncio.Task[int], int]] = []  # (commit, events), oldest first

    async def settle_oldest() -> None:
        nonlocal position, applied
        task, count = in_flight[0]
        position = await task
        in_flight.pop(0)
        applied += count
        if on_batch is not None:
            on_batch(position)

    with _fewer_collections():
        try:
            async for batch in store.read_all(position, batch_size=batch_size,
                                              types=projection.types,
                                              payload_fields=projection.payload_fields):
                previous = in_flight[-1][0] if in_flight else None
                in_flight.append((asyncio.create_task(commit(batch, previous)), len(batch)))
                if len(in_flight) > 1:  # one batch in the database, the next one waiting
                    await settle_oldest()
            while in_flight:
                await settle_oldest()
        except asyncio.CancelledError:
            for task, _ in in_flight:
                task.cancel()
            raise
        finally:
            # On any other error a batch already in the database still commits (or fails on
            # its own): each one is atomic with its position, so catch_up resumes after it.
            await asyncio.gather(*(task for task, _ in in_flight), return_exceptions=True)
    return ReplayStats(applied, time.perf_counter() - started, position)


class _AfterCommit:
    """A StoreTransaction that begins (in ``stack``) at its first database call, once the
    previous batch has committed; a failed previous batch fails this one too.

    Beginning late matters: a SQLite writer takes the database lock at BEGIN, and a batch
    holding it while waiting for the one before would deadlock with it.
    """

    def __init__(
        self,
        store: EventStore,
        dialect: str,
        previous: asyncio.Task[int] | None,
        stack: contextlib.AsyncExitStack,
    ) -> None:
        self._store = store
        self._dialect = dialect
        self._previous = previous
        self._stack = stack
        self._tx: StoreTransaction | None = None

    @property
    def dialect(self) -> str:
        return self._dialect

    async def _begin(self) -> StoreTransaction:
        if self._tx is None:
            if self._previous is not None:
                await asyncio.shield(self._previous)  # raises the previous batch's error
            self._tx = await self._stack.enter_async_context(self._store.transaction())
        return self._tx

    async def append(self, events: Sequence[Event]) -> AppendResult:
        return await (await self._begin()).append(events)

    async def set_tracking(self, name: str, positions: Mapping[str, int]) -> None:
        await (await self._begin()).set_tracking(name, positions)

    async def get_tracking(self, name: str) -> dict[str, int]:
        return await (await self._begin()).get_tracking(name)

    async def execute(self, statement: Any, parameters: Any = None) -> Any:
        return await (await self._begin()).execute(statement, parameters)

    async def run_sync(self, fn: Callable[[Connection], T]) -> T:
        return await (await self._begin()).run_sync(fn)


# The cyclic collector's first threshold while many events are live: replays here, and
# high-rate services (kz_stream.runtime). CPython's is 700.
GC_GEN0_THRESHOLD = 100_000
_replays_running = 0
_saved_threshold: tuple[int, int, int] = (0, 0, 0)


@contextlib.contextmanager
def _fewer_collections() -> Iterator[None]:
    """Raises the cyclic collector's first threshold while replays run, then restores it.

    A batch is thousands of live events; at the default threshold the collector ran every
    700 of their containers and rescanned everything older: half a replay's CPU (measured
    ~12 vs ~6.5 us per event). Reference counting still frees them; only the rare cycle
    waits longer. Nested or concurrent replays restore the threshold when the last ends.
    """
    global _replays_running, _saved_threshold
    if _replays_running == 0:
        _saved_threshold = gc.get_threshold()
        gen0, gen1, gen2 = _saved_threshold
        gc.set_threshold(max(gen0, GC_GEN0_THRESHOLD), gen1, gen2)
    _replays_running += 1
    try:
        yield
    finally:
        _replays_running -= 1
        if _replays_running == 0:
            gc.set_threshold(*_saved_threshold)


async def projection_hash(store: EventStore, projection: Projection) -> str:
    """SHA-256 of the projection's tables, rows in primary-key order: equal iff equal content."""
    digest = hashlib.sha256()
    async with store.transaction() as tx:
        for table in projection.metadata.sorted_tables:
            digest.update(orjson.dumps([table.name, [c.name for c in table.columns]]))
            result = await tx.execute(select(table).order_by(*table.primary_key.columns))
            for row in result:
                digest.update(orjson.dumps(list(row), default=str))
    return digest.hexdigest()


_kernels_metadata = MetaData()

kernels = Table(
    "kernels",
    _kernels_metadata,
    Column("kernel_id", String(200), primary_key=True),
    Column("module_id", String(200), nullable=True),
    Column("group_id", String(200), nullable=True),
    Column("backend", String(20), nullable=True),
    Column("policy_version", Integer(), nullable=True),  # the policy that generated it
    Column("status", String(40), nullable=True),  # of the latest verdict
    Column("speedup", Float(), nullable=True),  # of the latest verdict
    Column("verdict_count", Integer(), nullable=False),
    Column("last_position", BigInteger(), nullable=False),
)


class KernelsProjection(Projection):
    """One row per kernel: where it came from and what its latest verdict says.

    Built from KernelGenerated (module, group, backend, policy version) and KernelVerified
    (status, speedup, count). A verdict recorded before its generation still lands: each
    column is filled by whichever event carries it.
    """

    name = "kernels"
    metadata = _kernels_metadata
    types = ("KernelGenerated", "KernelVerified")
    payload_fields = (
        "kernel_id", "module_id", "group_id", "backend", "policy_version", "status", "speedup",
    )
    table = kernels

    async def apply(self, tx: StoreTransaction, batch: Sequence[RecordedEvent]) -> None:
        rows: dict[str, dict[str, Any]] = {}
        for rec in batch:  # fold the batch first: one upsert per kernel, not per event
            ev = rec.event
            p = current_payload(ev)
            row = rows.get(p["kernel_id"])
            if row is None:
                row = rows[p["kernel_id"]] = {
                    "kernel_id": p["kernel_id"], "module_id": None, "group_id": None,
                    "backend": None, "policy_version": None, "status": None, "speedup": None,
                    "verdict_count": 0, "last_position": 0,
                }
            row["module_id"] = p["module_id"]
            row["group_id"] = p["group_id"]
            row["last_position"] = rec.global_position
            if ev.type == "KernelGenerated":
                row["backend"] = p["backend"]
                row["policy_version"] = p.get("policy_version", 0)
            else:
                row["status"] = p["status"]
                row["speedup"] = p.get("speedup")
                row["verdict_count"] += 1
        if rows:
            await tx.execute(*self._upsert(tx.dialect, list(rows.values())))

    @staticmethod
    def _upsert(dialect: str, rows: list[dict[str, Any]]) -> tuple[Any, Any]:
        """The upsert of folded rows: on Postgres one statement over the batch as one JSON
        document (psycopg would otherwise send a statement per row, or quote every array
        element in Python); on SQLite executemany, a C loop there."""
        names = [c.name for c in kernels.columns]
        if dialect == "postgresql":
            pg = pg_insert(kernels)
            stmt = pg.from_select(names, select(_BATCH_ROWS)).on_conflict_do_update(
                index_elements=[kernels.c.kernel_id], set_=_merge(pg.excluded)
            )
            return stmt, {"rows": orjson.dumps(rows).decode()}
        lite = sqlite_insert(kernels)
        return lite.on_conflict_do_update(
            index_elements=[kernels.c.kernel_id], set_=_merge(lite.excluded)
        ), rows


def _merge(new: Any) -> dict[str, Any]:
    """How a folded batch row (``excluded``) updates a stored kernel row."""
    old = kernels.c
    verdict = new.verdict_count > 0
    return {
        "module_id": new.module_id,
        "group_id": new.group_id,
        "backend": func.coalesce(new.backend, old.backend),
        "policy_version": func.coalesce(new.policy_version, old.policy_version),
        "status": case((verdict, new.status), else_=old.status),
        "speedup": case((verdict, new.speedup), else_=old.speedup),
        "verdict_count": old.verdict_count + new.verdict_count,
        "last_position": new.last_position,
    }


# json_populate_recordset(NULL::kernels, :rows): a JSON array of objects as kernels rows.
_BATCH_ROWS = func.json_populate_recordset(
    literal_column(f"NULL::{kernels.name}"), cast(bindparam("rows", type_=Text()), JSON())
).table_valued(*(c.name for c in kernels.columns), name="batch")
