"""The event store port and its SQLAlchemy adapter (SQLite embedded, Postgres real)."""

from kz_stream.store._port import (
    AppendResult,
    ConcurrencyError,
    EventStore,
    RecordedEvent,
    StoreTransaction,
)

__all__ = [
    "AppendResult",
    "ConcurrencyError",
    "EventStore",
    "RecordedEvent",
    "StoreTransaction",
]
