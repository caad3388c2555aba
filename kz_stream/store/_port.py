"""What every event store adapter provides. Contract tests in tests/contract pin it."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol, TypeVar

from sqlalchemy import Connection

from kz_stream.events import Event

T = TypeVar("T")


class ConcurrencyError(Exception):
    """(stream_id, stream_version) is already taken by a different event."""


class StoreNotFound(LookupError):
    """A store opened to be read, without creating its schema, that holds none (the
    database never written, or another ``KZ_DATABASE_URL``)."""


@dataclass(frozen=True, slots=True)
class RecordedEvent:
    """An event as stored: the envelope plus its commit-ordered global position."""

    global_position: int
    recorded_at: datetime
    event: Event


@dataclass(frozen=True, slots=True)
class AppendResult:
    appended: int  # new rows written
    duplicates: int  # events whose event_id was already stored (idempotent no-ops)
    last_position: int  # highest global position after the append


class StoreTransaction(Protocol):
    """One database transaction: appends, tracking positions and projection writes commit
    together or not at all."""

    @property
    def dialect(self) -> str:
        """The SQL dialect name (``"postgresql"``, ``"sqlite"``) for dialect-specific writes."""
        ...

    async def append(self, events: Sequence[Event]) -> AppendResult:
        """Appends a batch; a ConcurrencyError undoes that batch only (a savepoint)."""
        ...

    async def set_tracking(self, name: str, positions: Mapping[str, int]) -> None: ...

    async def get_tracking(self, name: str) -> dict[str, int]: ...

    async def execute(self, statement: Any, parameters: Any = None) -> Any:
        """Runs a SQLAlchemy statement (projection writes) in this transaction."""
        ...

    async def run_sync(self, fn: Callable[[Connection], T]) -> T:
        """Runs ``fn`` with the transaction's sync SQLAlchemy connection (DDL, create_all)."""
        ...


class EventStore(Protocol):
    url: str

    async def start(self) -> None:
        """Connects; creates the schema when ``create_schema`` was asked for."""

    async def close(self) -> None: ...

    async def append(
        self, events: Sequence[Event], *, tracking: Mapping[str, Mapping[str, int]] | None = None
    ) -> AppendResult:
        """Appends a batch atomically, skipping events whose event_id is stored already.

        Raises ConcurrencyError when (stream_id, stream_version) holds another event.
        ``tracking`` maps a tracking name to {key: position}, written in the same transaction.
        """

    def transaction(self) -> AbstractAsyncContextManager[StoreTransaction]: ...

    async def read_stream(self, stream_id: str) -> list[RecordedEvent]: ...

    def read_all(
        self,
        from_position: int = 0,
        *,
        batch_size: int = 1000,
        types: Sequence[str] | None = None,
        payload_fields: Sequence[str] | None = None,
        correlation_id: str | None = None,
    ) -> AsyncIterator[list[RecordedEvent]]:
        """Batches of events with global_position > from_position, in order, to the current end.

        ``types`` and ``correlation_id`` (one run's events; None: every run's) filter in the
        store, so a reader of one run does not read the others'. ``payload_fields`` is a
        hint: an adapter may drop other payload keys, or not."""

    def tail(
        self,
        from_position: int = 0,
        *,
        batch_size: int = 1000,
        poll_interval: float = 0.5,
        types: Sequence[str] | None = None,
    ) -> AsyncGenerator[list[RecordedEvent], None]:
        """Like read_all, then waits for new commits forever (LISTEN/NOTIFY or polling);
        a generator, so ``contextlib.aclosing`` ends its wait when the reader stops."""

    async def last_position(self) -> int: ...

    async def ping(self) -> None:
        """Raises ``kz_stream.faults.DependencyUnavailable`` when the database does not
        answer."""

    async def get_tracking(self, name: str) -> dict[str, int]: ...
