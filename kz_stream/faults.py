"""Telling an outage from a poison record, and waiting an outage out.

An outage (the database restarting, the broker unreachable, a topic gone) passes by itself:
the operation that hit it is retried with capped exponential backoff for as long as it
takes. Anything else is about the input and is for the caller to judge (retry a few times,
then dead-letter).
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

__all__ = [
    "Backoff",
    "DependencyUnavailable",
    "Unrecoverable",
    "dependency_of",
    "describe_outage",
    "is_transient",
    "wait_out",
]

T = TypeVar("T")


class DependencyUnavailable(ConnectionError):
    """A dependency (``"store"`` or ``"broker"``) did not answer; transient by definition."""

    def __init__(self, dependency: str, message: str) -> None:
        super().__init__(message)
        self.dependency = dependency


class Unrecoverable(RuntimeError):
    """The service itself cannot go on (its model engine is gone): neither a retry nor a
    dead letter helps, and dead-lettering would lose records that are not at fault. A
    consumer whose handler raises it fails at once, the batch uncommitted, so the records
    come again when the service is started again."""


@dataclass(frozen=True, slots=True)
class Backoff:
    """Delays that double from ``initial`` up to ``cap`` seconds."""

    initial: float = 0.2
    cap: float = 30.0

    def delay(self, attempt: int) -> float:
        """The wait before retry number ``attempt + 1``."""
        return float(min(self.cap, self.initial * 2.0 ** min(attempt, 62)))


def _transient_classes() -> list[tuple[str, tuple[type[BaseException], ...]]]:
    """(dependency, exception classes) pairs; imports are optional because the GPU host
    runs the verifier without the database and broker clients."""
    classes: list[tuple[str, tuple[type[BaseException], ...]]] = []
    try:
        import sqlalchemy.exc as sa

        # OperationalError covers refused, reset and shut-down connections (and SQLite's
        # "database is locked"); TimeoutError is a pool with no connection to give.
        classes.append(("store", (sa.OperationalError, sa.InterfaceError, sa.TimeoutError,
                                  sa.DisconnectionError)))
    except ImportError:  # pragma: no cover - the GPU host
        pass
    try:
        import psycopg

        # AdminShutdown and CannotConnectNow are OperationalErrors.
        classes.append(("store", (psycopg.OperationalError, psycopg.InterfaceError)))
    except ImportError:  # pragma: no cover
        pass
    try:
        import aiokafka.errors as ke

        # UnknownError is Kafka's UNKNOWN_SERVER_ERROR: the broker failed, not the record
        # (tansu answers it to two producers racing to write a partition it re-created).
        classes.append(("broker", (ke.KafkaConnectionError, ke.NodeNotReadyError,
                                   ke.UnknownError,
                                   ke.NoBrokersAvailable, ke.KafkaTimeoutError,
                                   ke.RequestTimedOutError, ke.UnknownTopicOrPartitionError,
                                   ke.LeaderNotAvailableError, ke.NotLeaderForPartitionError,
                                   ke.CoordinatorNotAvailableError,
                                   ke.NotCoordinatorError)))
    except ImportError:  # pragma: no cover
        pass
    return classes


_TRANSIENT: list[tuple[str, tuple[type[BaseException], ...]]] | None = None


def dependency_of(error: BaseException) -> str | None:
    """The dependency an outage error is about (``"store"``, ``"broker"``, ``"network"``),
    or None when the error is not an outage. Follows the chain of causes, because SQLAlchemy
    and the bus wrap the driver's error."""
    global _TRANSIENT
    if _TRANSIENT is None:
        _TRANSIENT = _transient_classes()
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if _sqlite_error_that_stays(e):
            return None
        if isinstance(e, DependencyUnavailable):
            return e.dependency
        for dependency, classes in _TRANSIENT:
            if isinstance(e, classes):
                return dependency
        if isinstance(e, ConnectionError):
            return "network"
        e = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
    return None


# SQLite's primary result codes that pass by themselves: busy, locked, I/O error, disk
# full, cannot open, lock protocol. SQLAlchemy raises every sqlite3.OperationalError as its
# OperationalError, an outage for the other drivers; a read-only file or a missing table
# is one too there, and a service waited it out for ever with health saying "store
# unreachable".
_SQLITE_PASSING = frozenset({5, 6, 10, 13, 14, 15})


def _sqlite_error_that_stays(error: BaseException) -> bool:
    """True for an SQLite error (or SQLAlchemy's wrapping one) that no retry will pass."""
    driver = getattr(error, "orig", error)
    code = getattr(driver, "sqlite_errorcode", None)
    return isinstance(driver, sqlite3.Error) and code is not None and (
        code & 0xFF) not in _SQLITE_PASSING


def describe_outage(error: BaseException) -> str:
    """One line for health and logs: ``store unreachable: OperationalError: ...``."""
    text = f"{dependency_of(error) or 'dependency'} unreachable: {type(error).__name__}: {error}"
    return text[:500]


def is_transient(error: BaseException) -> bool:
    """True for an outage: retrying the same operation later can succeed."""
    return dependency_of(error) is not None


async def wait_out(
    op: Callable[[], Awaitable[T]],
    *,
    backoff: Backoff,
    on_retry: Callable[[BaseException, int, float], None] | None = None,
    on_recovered: Callable[[int], None] | None = None,
    wake: asyncio.Event | None = None,
) -> T:
    """Runs ``op`` until it returns, retrying outages forever with ``backoff``.

    Any other error raises at once. ``on_retry(error, attempt, delay)`` runs before each
    wait, ``on_recovered(attempts)`` once ``op`` succeeds after at least one outage.
    ``wake`` set ends each wait early (a stop: ``op`` tries once more and decides).
    Cancelling the caller cancels the wait.
    """
    attempt = 0
    while True:
        try:
            result = await op()
        except Exception as e:
            if not is_transient(e):
                raise
            delay = backoff.delay(attempt)
            if on_retry is not None:
                on_retry(e, attempt, delay)
            attempt += 1
            if wake is None:
                await asyncio.sleep(delay)
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), delay)
        else:
            if attempt and on_recovered is not None:
                on_recovered(attempt)
            return result
