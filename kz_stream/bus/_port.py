"""What every bus adapter provides. Contract tests in tests/contract pin it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypedDict, Unpack

from kz_stream.events import Event, encode_event

# Headers on every published event (values are UTF-8 bytes).
HEADER_TYPE = "type"
HEADER_SCHEMA_VERSION = "schema_version"
HEADER_EVENT_ID = "event_id"

# Headers a dead-lettered record carries next to its original key, value and headers.
HEADER_ERROR = "kz-error"
HEADER_ERROR_TYPE = "kz-error-type"
HEADER_ORIGINAL_TOPIC = "kz-original-topic"
HEADER_ORIGINAL_PARTITION = "kz-original-partition"
HEADER_ORIGINAL_OFFSET = "kz-original-offset"
HEADER_GROUP = "kz-consumer-group"

DEFAULT_DEAD_LETTER_TOPIC = "kz.dead-letter"

# Headers are small; an error text that long is a traceback pasted into a message.
_MAX_ERROR_CHARS = 4000


class InfrastructureError(Exception):
    """A fault outside the event itself that does not pass by itself (a topic that cannot
    be created): retried, then dead-lettered. Outages (``kz_stream.faults``) are waited
    out instead. Bad kernels are verdicts, never this."""


@dataclass(frozen=True, slots=True)
class TopicSpec:
    name: str
    partitions: int = 4
    compacted: bool = False


@dataclass(frozen=True, slots=True)
class BusMessage:
    """One delivered record. ``event`` is None only in ``decode=False`` subscriptions
    (dead-letter inspection and replay); undecodable records never reach handlers."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    headers: Mapping[str, bytes] = field(default_factory=dict)
    event: Event | None = None


def event_headers(event: Event, extra: Mapping[str, bytes] | None = None) -> dict[str, bytes]:
    """The headers every published event carries, plus ``extra``."""
    headers = {
        HEADER_TYPE: event.type.encode(),
        HEADER_SCHEMA_VERSION: str(event.schema_version).encode(),
        HEADER_EVENT_ID: str(event.event_id).encode(),
    }
    if extra:
        headers.update(extra)
    return headers


def describe_error(error: BaseException) -> str:
    """One line naming the error's type and message (for the kz-error header)."""
    return f"{type(error).__name__}: {error}"[:_MAX_ERROR_CHARS]


def dead_letter_headers(msg: BusMessage, error: BaseException, group: str) -> dict[str, bytes]:
    """The original headers plus where the record came from and why it failed."""
    headers = dict(msg.headers)
    headers[HEADER_ERROR] = describe_error(error).encode()
    headers[HEADER_ERROR_TYPE] = type(error).__name__.encode()
    headers[HEADER_ORIGINAL_TOPIC] = msg.topic.encode()
    headers[HEADER_ORIGINAL_PARTITION] = str(msg.partition).encode()
    headers[HEADER_ORIGINAL_OFFSET] = str(msg.offset).encode()
    headers[HEADER_GROUP] = group.encode()
    return headers


# A handler gets a batch of decoded messages from one or more partitions, in offset order
# per partition; it returns once their effect is durable. Offsets are committed only after
# it returns. It may be called again with the same messages (retries, redelivery after a
# crash or rebalance), so its effect must be idempotent.
Handler = Callable[[Sequence[BusMessage]], Awaitable[None]]


class OffsetStore(Protocol):
    """Where a consumer that writes to the database keeps its offsets (the store's tracking
    table), so that effect and offset commit in one transaction. Positions are the *next*
    offset to read, keyed ``"topic:partition"``. On assignment they win over the broker's
    committed offsets; partitions it does not know start from the broker's. A position for a
    partition of which the group has no committed offset is of another log (a broker that
    lost its storage, an embedded bus of an earlier process): that partition is read from
    its start, as is one this member committed before and the group has no offset of now."""

    async def load_offsets(self, group: str) -> dict[str, int]: ...

    async def save_offsets(self, group: str, positions: Mapping[str, int]) -> None:
        """Writes positions no handler wrote: where a partition of a new log starts, and
        past records that were dead-lettered or skipped (else the store keeps an older
        position, of another log perhaps, which the next assignment would trust)."""
        ...


class SubscribeOptions(TypedDict, total=False):
    """How a subscription consumes (see ``Bus.subscribe``); defaults in brackets."""

    offsets: OffsetStore | None  # where the group's positions are kept [the broker only]
    max_batch: int  # messages per handler call at most [500]
    max_in_flight: int  # fetched batches waiting behind the running one [2]
    # Hand the handler every batch that waited behind the running one in one call (up to
    # max_batch messages): for handlers that pay per call, not per message [False]
    merge_waiting: bool
    max_retries: int  # handler retries before a batch is bisected [3]
    retry_backoff: float  # first retry delay in seconds, doubling [0.2]
    max_backoff: float  # cap of the doubling delay in seconds [30]
    dead_letter_topic: str  # where poison records go [DEFAULT_DEAD_LETTER_TOPIC]
    from_beginning: bool  # where a group without committed offsets starts [True]
    decode: bool  # False: handlers get every record raw, ``event`` None [True]


@dataclass(slots=True)
class SubscriptionStats:
    """Counters a service exports as metrics."""

    batches: int = 0  # batches whose offsets were committed
    messages: int = 0  # messages the handler applied
    retries: int = 0  # handler calls that raised (not for an outage) and were retried
    outages: int = 0  # store or broker outages waited out (each one counted once)
    outage_retries: int = 0  # retries while waiting out an outage (handler, commit, DLQ)
    dead_lettered: int = 0  # records sent to the dead-letter topic
    dropped_batches: int = 0  # fetched batches given back uncommitted (rebalance, stop)
    pauses: int = 0  # times fetching paused because max_in_flight batches were waiting
    assignments: int = 0  # partition assignments received (the first one included)


class Subscription(Protocol):
    group: str
    stats: SubscriptionStats
    # The store or broker outage being waited out, None when there is none.
    outage: str | None
    # time.monotonic() when the running batch started, None while idle.
    busy_since: float | None
    # The fatal error that ended the subscription by itself, None while it runs or after a
    # stop that was asked for.
    failure: str | None

    def assignment(self) -> frozenset[tuple[str, int]]:
        """The (topic, partition) pairs this subscription currently owns."""

    def lag(self) -> int | None:
        """Records between the last committed batch and the ends of the logs (None until a
        batch is committed on this assignment)."""

    async def stop(self, grace: float | None = None) -> None:
        """Stops fetching, drops fetched batches not yet started (they are redelivered),
        waits up to ``grace`` seconds (None: as long as it takes) for the running batch
        to finish and commit, cancels it past that (uncommitted, so redelivered), and leaves
        the group."""

    async def wait(self) -> None:
        """Returns when the subscription has stopped (or raises its fatal error)."""

    def describe_state(self) -> dict[str, Any]:
        """What this member is doing now (assignment, positions, pauses, queue): plain
        values for a log line or a report, to diagnose a member that reads nothing."""


class Bus(Protocol):
    # Whether the topics outlive this process (a broker's do; the embedded bus's die with
    # it, so a resumed run finds them empty and its consumers' offsets point nowhere).
    logs_outlive_the_process: bool

    async def start(self) -> None: ...

    async def close(self) -> None:
        """Stops every subscription (letting running batches finish) and the producer."""

    async def read_topic(self, topic: str) -> list[BusMessage]:
        """Every record in ``topic`` now, from its start, undecoded (``event`` None), in
        offset order per partition; joins no group and commits nothing (``kz dlq``)."""

    async def ping(self, topics: Sequence[str] = ()) -> list[str]:
        """Raises ``kz_stream.faults.DependencyUnavailable`` when the bus does not answer;
        returns those of ``topics`` that do not exist."""

    async def create_topics(self, topics: Sequence[TopicSpec]) -> None:
        """Creates missing topics; existing ones are left as they are."""

    async def publish(
        self,
        topic: str,
        event: Event,
        *,
        key: str | None = None,
        headers: Mapping[str, bytes] | None = None,
    ) -> None:
        """Publishes one event; key defaults to its stream_id. Returns once acknowledged.

        Adapters that subclass the port inherit this: the event's encoded bytes with the
        event headers, through ``publish_raw``."""
        await self.publish_raw(
            topic, encode_event(event), key=(key or event.stream_id).encode(),
            headers=event_headers(event, headers),
        )

    async def publish_many(self, topic: str, events: Sequence[Event]) -> None:
        """Publishes events keyed by stream_id, in order per key; returns once all are
        acknowledged."""

    async def publish_raw(
        self,
        topic: str,
        value: bytes,
        *,
        key: bytes | None = None,
        headers: Mapping[str, bytes] | None = None,
    ) -> None:
        """Publishes bytes as they are (dead letters, replays of them, tests)."""

    async def subscribe(
        self, group: str, topics: Sequence[str], handler: Handler,
        **options: Unpack[SubscribeOptions],
    ) -> Subscription:
        """Joins ``group`` and feeds ``handler`` batches of at most ``max_batch`` messages.

        Fetching pauses while ``max_in_flight`` batches wait behind the running one, so a
        slow handler keeps its partitions; with ``merge_waiting`` the batches that waited
        behind it reach the handler together, in order, as one call of at most
        ``max_batch`` messages. A handler that raises is retried ``max_retries``
        times (backoff ``retry_backoff`` seconds, doubling); then the batch is split to
        isolate the failing messages, which go to ``dead_letter_topic``; the rest are
        applied and the consumer goes on. Undecodable records go there at once. An outage
        of the store or broker (``kz_stream.faults.is_transient``) is never dead-lettered:
        the same call is retried, backoff doubling up to ``max_backoff`` seconds, until it
        passes, while fetching pauses and ``outage`` names it. With
        ``decode=False`` handlers get every record raw (``event`` None).
        """


class PublishRaw(Protocol):
    """``Bus.publish_raw``, as a value (the consumer core sends dead letters through it)."""

    async def __call__(
        self, topic: str, value: bytes, *, key: bytes | None = None,
        headers: Mapping[str, bytes] | None = None,
    ) -> None: ...


def offsets_after(batch: Sequence[BusMessage]) -> dict[str, int]:
    """The next offset to read per ``"topic:partition"`` once ``batch`` is applied."""
    positions: dict[str, int] = {}
    for m in batch:
        key = f"{m.topic}:{m.partition}"
        positions[key] = max(positions.get(key, 0), m.offset + 1)
    return positions
