"""What every bus adapter provides. Contract tests in tests/contract pin it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kz_stream.events import Event


class InfrastructureError(Exception):
    """A fault outside the event itself (database down, disk full): retried, then
    dead-lettered. Bad kernels are verdicts, never this."""


@dataclass(frozen=True, slots=True)
class TopicSpec:
    name: str
    partitions: int = 4
    compacted: bool = False


@dataclass(frozen=True, slots=True)
class BusMessage:
    """One delivered record. ``event`` is None only for dead-letter inspection of
    undecodable records, which never reach handlers."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    headers: Mapping[str, bytes] = field(default_factory=dict)
    event: Event | None = None


# A handler gets a batch of decoded messages from one or more partitions; it returns once
# their effect is durable. Offsets are committed only after it returns.
Handler = Callable[[Sequence[BusMessage]], Awaitable[None]]


class OffsetStore(Protocol):
    """Where a consumer that writes to the database keeps its offsets (the store's tracking
    table), so that effect and offset commit in one transaction. Positions are the *next*
    offset to read, keyed ``"topic:partition"``."""

    async def load_offsets(self, group: str) -> dict[str, int]: ...


class Subscription(Protocol):
    async def stop(self) -> None:
        """Stops fetching, waits for in-flight batches to finish and commits their offsets."""

    async def wait(self) -> None:
        """Returns when the subscription has stopped (or raises its fatal error)."""


class Bus(Protocol):
    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def create_topics(self, topics: Sequence[TopicSpec]) -> None: ...

    async def publish(
        self,
        topic: str,
        event: Event,
        *,
        key: str | None = None,
        headers: Mapping[str, bytes] | None = None,
    ) -> None:
        """Publishes one event; key defaults to its stream_id. Returns once acknowledged."""

    async def publish_many(self, topic: str, events: Sequence[Event]) -> None: ...

    async def subscribe(
        self,
        group: str,
        topics: Sequence[str],
        handler: Handler,
        *,
        offsets: OffsetStore | None = None,
        max_batch: int = 500,
        max_in_flight: int = 2,
        max_retries: int = 3,
        dead_letter_topic: str = "kz.dead-letter",
        from_beginning: bool = True,
    ) -> Subscription: ...


def offsets_after(batch: Sequence[BusMessage]) -> dict[str, int]:
    """The next offset to read per ``"topic:partition"`` once ``batch`` is applied."""
    positions: dict[str, int] = {}
    for m in batch:
        key = f"{m.topic}:{m.partition}"
        positions[key] = max(positions.get(key, 0), m.offset + 1)
    return positions
