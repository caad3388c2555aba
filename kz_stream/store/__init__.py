"""The event store port and its SQLAlchemy adapter (SQLite embedded, Postgres real).

The modules of this package are private; this is its API (``metadata`` is the schema the
Alembic migrations build).
"""

from kz_stream.store._migrate import upgrade
from kz_stream.store._port import (
    AppendResult,
    ConcurrencyError,
    EventStore,
    RecordedEvent,
    StoreNotFound,
    StoreTransaction,
)
from kz_stream.store._schema import metadata
from kz_stream.store._sql import SqlEventStore, SqlTransaction, open_store

__all__ = [
    "AppendResult",
    "ConcurrencyError",
    "EventStore",
    "RecordedEvent",
    "SqlEventStore",
    "SqlTransaction",
    "StoreNotFound",
    "StoreTransaction",
    "metadata",
    "open_store",
    "upgrade",
]
