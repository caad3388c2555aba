"""The event store port and its SQLAlchemy adapter (SQLite embedded, Postgres real)."""

from kz_stream.store._migrate import upgrade
from kz_stream.store._port import (
    AppendResult,
    ConcurrencyError,
    EventStore,
    RecordedEvent,
    StoreTransaction,
)
from kz_stream.store._sql import SqlEventStore, SqlTransaction, open_store

__all__ = [
    "AppendResult",
    "ConcurrencyError",
    "EventStore",
    "RecordedEvent",
    "SqlEventStore",
    "SqlTransaction",
    "StoreTransaction",
    "open_store",
    "upgrade",
]
