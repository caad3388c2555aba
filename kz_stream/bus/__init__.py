"""The bus port with two adapters: in-memory (embedded) and Kafka (aiokafka)."""

from kz_stream.bus._port import (
    Bus,
    BusMessage,
    Handler,
    InfrastructureError,
    OffsetStore,
    Subscription,
    TopicSpec,
    offsets_after,
)

__all__ = [
    "Bus",
    "BusMessage",
    "Handler",
    "InfrastructureError",
    "OffsetStore",
    "Subscription",
    "TopicSpec",
    "offsets_after",
]
