"""Projections: read-model tables rebuilt by replaying the event store.

A projection owns its tables (its own SQLAlchemy ``MetaData``) and applies batches of
recorded events to them. Each batch's writes and the projection's position (tracking name
``projection:<name>``, key ``global_position``) commit in one transaction, so a replay that
stops anywhere resumes with ``catch_up`` with nothing lost and nothing applied twice.

Projections read payloads as stored dicts, upcast to the current schema version
(``current_payload``), not as pydantic models: every row was validated on append, and
building a model of an 8 KB ``KernelGenerated`` per event would cost more than the rest of
the replay together.
"""

from __future__ import annotations

import hashlib
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import orjson
from sqlalchemy import (
    JSON,
    BigInteger,
    Column,
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

from kz_stream.events import EVENT_TYPES, UPCASTERS, Event, EventDecodeError
from kz_stream.store._port import EventStore, RecordedEvent, StoreTransaction

__all__ = [
    "TRACKING_KEY",
    "KernelsProjection",
    "Projection",
    "ReplayStats",
    "catch_up",
    "current_payload",
    "kernels",
    "projection_hash",
    "rebuild",
    "tracking_name",
]

TRACKING_KEY = "global_position"
DEFAULT_BATCH_SIZE = 5000


class Projection(ABC):
    """A read model: the tables it owns and how a batch of events changes them."""

    name: ClassVar[str]
    metadata: ClassVar[MetaData]
    # Event types it consumes; None means all. The store filters, so others cost nothing.
    types: ClassVar[tuple[str, ...] | None] = None

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


def current_payload(event: Event) -> dict[str, Any]:
    """The stored payload upcast to its type's current schema version, not validated."""
    cls = EVENT_TYPES.get(event.type)
    if cls is None:
        raise EventDecodeError(f"type: unknown event type {event.type!r}")
    data, version = event.payload, event.schema_version
    while version < cls.schema_version:
        upcast = UPCASTERS.get((event.type, version))
        if upcast is None:
            raise EventDecodeError(f"schema_version: no upcaster for {event.type} v{version}")
        data, version = upcast(data), version + 1
    return data


OnBatch = Callable[[int], object]  # called with the position after each committed batch


async def rebuild(
    store: EventStore,
    projection: Projection,
    *,
    batch_size: int = DEFAULT_BATCH_SIZE,
    on_batch: OnBatch | None = None,
) -> ReplayStats:
    """Drops and recreates the projection's tables, then replays every event from 0."""
    async with store.transaction() as tx:
        await tx.run_sync(projection.metadata.drop_all)
        await tx.run_sync(projection.metadata.create_all)
        await tx.set_tracking(tracking_name(projection), {TRACKING_KEY: 0})
    return await _replay(store, projection, 0, batch_size, on_batch)


async def catch_up(
    store: EventStore,
    projection: Projection,
    *,
    batch_size: int = DEFAULT_BATCH_SIZE,
    on_batch: OnBatch | None = None,
) -> ReplayStats:
    """Applies the events after the projection's stored position (creating missing tables)."""
    async with store.transaction() as tx:
        await tx.run_sync(projection.metadata.create_all)
        stored = await tx.get_tracking(tracking_name(projection))
    position = stored.get(TRACKING_KEY, 0)
    return await _replay(store, projection, position, batch_size, on_batch)


async def _replay(
    store: EventStore,
    projection: Projection,
    position: int,
    batch_size: int,
    on_batch: OnBatch | None,
) -> ReplayStats:
    started = time.perf_counter()
    applied = 0
    batches = store.read_all(position, batch_size=batch_size, types=projection.types)
    async for batch in batches:
        async with store.transaction() as tx:
            await projection.apply(tx, batch)
            position = batch[-1].global_position
            await tx.set_tracking(tracking_name(projection), {TRACKING_KEY: position})
        applied += len(batch)
        if on_batch is not None:
            on_batch(position)
    return ReplayStats(applied, time.perf_counter() - started, position)


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
