"""Table definitions of the event store, shared by the store's queries and the schema test.

Alembic owns the schema (``migrations/versions``); the migrations are frozen history, so
they spell their tables out, and ``tests/contract`` checks that the migrated database
matches this metadata exactly.

Envelope metadata lives in typed columns rather than a ``metadata`` JSON blob: producer,
correlation and causation ids and occurred-at are fixed by the envelope, and as columns
they are cheap to filter on, to index (one run's events by correlation id) and to COPY.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Column,
    DateTime,
    Dialect,
    Identity,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    TypeDecorator,
    UniqueConstraint,
    Uuid,
    func,
)
from sqlalchemy.dialects.postgresql import JSONB

__all__ = ["EVENT_COLUMNS", "PAYLOAD", "TIMESTAMP", "events", "metadata", "tracking"]


class _UtcDateTime(TypeDecorator[datetime]):
    """SQLite keeps no zone: store UTC wall time, read it back as aware UTC."""

    impl = DateTime
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is not None and value.tzinfo is not None:
            value = value.astimezone(UTC).replace(tzinfo=None)
        return value

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        assert isinstance(value, datetime)
        return value.replace(tzinfo=UTC)


# Postgres: timestamptz and jsonb; SQLite: UTC text and JSON text.
TIMESTAMP = DateTime(timezone=True).with_variant(_UtcDateTime(), "sqlite")
PAYLOAD = JSON().with_variant(JSONB(), "postgresql")
# SQLite only makes INTEGER PRIMARY KEY the autoincrementing rowid.
POSITION = BigInteger().with_variant(Integer(), "sqlite")

metadata = MetaData()

events = Table(
    "events",
    metadata,
    Column("global_position", POSITION, Identity(), nullable=False),
    Column("event_id", Uuid(), nullable=False),
    Column("stream_id", String(200), nullable=False),
    Column("stream_version", BigInteger(), nullable=False),
    Column("type", String(100), nullable=False),
    Column("schema_version", Integer(), nullable=False),
    Column("occurred_at", TIMESTAMP, nullable=False),
    Column("producer", String(200), nullable=False),
    Column("correlation_id", String(200), nullable=True),
    Column("causation_id", Uuid(), nullable=True),
    Column("payload", PAYLOAD, nullable=False),
    Column("recorded_at", TIMESTAMP, nullable=False, server_default=func.now()),
    PrimaryKeyConstraint("global_position", name="pk_events"),
    UniqueConstraint("event_id", name="uq_events_event_id"),
    UniqueConstraint("stream_id", "stream_version", name="uq_events_stream"),
    # One run's events in position order (read_all(correlation_id=...)): a report of one
    # run reads its own rows, not every run's in the store (revision 0002).
    Index("ix_events_correlation", "correlation_id", "global_position"),
    # AUTOINCREMENT: SQLite never reuses a position, even one whose row is gone.
    sqlite_autoincrement=True,
)

tracking = Table(
    "tracking",
    metadata,
    Column("name", String(200), nullable=False),
    Column("key", String(200), nullable=False),
    Column("position", BigInteger(), nullable=False),
    Column("updated_at", TIMESTAMP, nullable=False, server_default=func.now()),
    PrimaryKeyConstraint("name", "key", name="pk_tracking"),
)

# The envelope columns in Event field order: what append writes and reads return.
EVENT_COLUMNS = (
    "event_id",
    "type",
    "schema_version",
    "stream_id",
    "stream_version",
    "occurred_at",
    "producer",
    "correlation_id",
    "causation_id",
    "payload",
)
