"""The bus port with two adapters: in-memory (embedded) and Kafka (aiokafka)."""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

from kz_stream.bus._kafka import KafkaBus
from kz_stream.bus._memory import InMemoryBus
from kz_stream.bus._port import (
    DEFAULT_DEAD_LETTER_TOPIC,
    HEADER_ERROR,
    HEADER_ERROR_TYPE,
    HEADER_EVENT_ID,
    HEADER_GROUP,
    HEADER_ORIGINAL_OFFSET,
    HEADER_ORIGINAL_PARTITION,
    HEADER_ORIGINAL_TOPIC,
    HEADER_SCHEMA_VERSION,
    HEADER_TYPE,
    Bus,
    BusMessage,
    Handler,
    InfrastructureError,
    OffsetStore,
    SubscribeOptions,
    Subscription,
    SubscriptionStats,
    TopicSpec,
    dead_letter_headers,
    event_headers,
    offsets_after,
)

__all__ = [
    "DEFAULT_DEAD_LETTER_TOPIC",
    "HEADER_ERROR",
    "HEADER_ERROR_TYPE",
    "HEADER_EVENT_ID",
    "HEADER_GROUP",
    "HEADER_ORIGINAL_OFFSET",
    "HEADER_ORIGINAL_PARTITION",
    "HEADER_ORIGINAL_TOPIC",
    "HEADER_SCHEMA_VERSION",
    "HEADER_TYPE",
    "Bus",
    "BusMessage",
    "Handler",
    "InMemoryBus",
    "InfrastructureError",
    "KafkaBus",
    "OffsetStore",
    "SubscribeOptions",
    "Subscription",
    "SubscriptionStats",
    "TopicSpec",
    "dead_letter_headers",
    "event_headers",
    "offsets_after",
    "open_bus",
]

# Named in-memory buses, so that services of one process that each open "memory://" meet
# on the same bus (the embedded default).
_MEMORY_BUSES: dict[str, InMemoryBus] = {}


def open_bus(url: str, *, client_id: str = "kz-stream") -> Bus:
    """A bus (not yet started) for ``url``.

    - ``memory://`` or ``memory://NAME``: the process-wide in-memory bus of that name
      (construct ``InMemoryBus()`` for a private one);
    - ``kafka://host:port[,host:port...][?compression=zstd&client_id=ID]``: a KafkaBus.
    """
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "memory":
        name = parts.netloc or "default"
        bus = _MEMORY_BUSES.get(name)
        if bus is None:
            bus = _MEMORY_BUSES[name] = InMemoryBus()
        return bus
    if scheme == "kafka":
        if not parts.netloc:
            raise ValueError(f"bus URL {url!r}: expected kafka://host:port[,host:port]")
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        unknown = set(query) - {"compression", "compression_type", "client_id"}
        if unknown:
            raise ValueError(f"bus URL {url!r}: unknown option(s) {', '.join(sorted(unknown))}")
        compression = query.get("compression") or query.get("compression_type")
        return KafkaBus(
            parts.netloc,
            client_id=query.get("client_id", client_id),
            compression_type=compression,
        )
    raise ValueError(f"bus URL {url!r}: scheme must be memory:// or kafka://")
