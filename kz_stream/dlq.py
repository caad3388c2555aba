"""Dead letters: what is in the dead-letter topic, and sending them back where they came
from (``kz dlq list`` and ``kz dlq redrive``).

A re-driven record is its original key, value and headers, published again to its origin
topic with ``kz-redriven-from`` naming the dead letter. Consumers apply events
idempotently (the store skips a known event_id, verdict ids are derived from the kernel
event), so re-driving a letter twice costs work, not correctness.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kz_stream.bus import (
    HEADER_ERROR,
    HEADER_ERROR_TYPE,
    HEADER_GROUP,
    HEADER_ORIGINAL_OFFSET,
    HEADER_ORIGINAL_PARTITION,
    HEADER_ORIGINAL_TOPIC,
    HEADER_TYPE,
    Bus,
    BusMessage,
)

__all__ = ["HEADER_REDRIVEN_FROM", "DeadLetter", "RedriveReport", "list_dead_letters", "redrive"]

HEADER_REDRIVEN_FROM = "kz-redriven-from"
_DEAD_LETTER_HEADERS = frozenset({
    HEADER_ERROR, HEADER_ERROR_TYPE, HEADER_GROUP, HEADER_ORIGINAL_OFFSET,
    HEADER_ORIGINAL_PARTITION, HEADER_ORIGINAL_TOPIC,
})


def _text(headers: dict[str, bytes], name: str) -> str:
    return headers.get(name, b"").decode(errors="replace")


@dataclass(frozen=True)
class DeadLetter:
    """One record of the dead-letter topic, with its headers read."""

    message: BusMessage
    headers: dict[str, bytes] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "headers", dict(self.message.headers))

    @property
    def where(self) -> str:
        """``partition@offset`` in the dead-letter topic."""
        return f"{self.message.partition}@{self.message.offset}"

    @property
    def origin_topic(self) -> str:
        return _text(self.headers, HEADER_ORIGINAL_TOPIC)

    @property
    def origin(self) -> str:
        """``topic:partition@offset`` the record was consumed from."""
        return (f"{self.origin_topic}:{_text(self.headers, HEADER_ORIGINAL_PARTITION)}"
                f"@{_text(self.headers, HEADER_ORIGINAL_OFFSET)}")

    @property
    def error(self) -> str:
        return _text(self.headers, HEADER_ERROR)

    @property
    def group(self) -> str:
        return _text(self.headers, HEADER_GROUP)

    @property
    def event_type(self) -> str:
        return _text(self.headers, HEADER_TYPE)

    def original_headers(self) -> dict[str, bytes]:
        """The headers the record had before it was dead-lettered."""
        return {k: v for k, v in self.headers.items() if k not in _DEAD_LETTER_HEADERS}

    def as_dict(self) -> dict[str, object]:
        return {
            "partition": self.message.partition,
            "offset": self.message.offset,
            "origin": self.origin,
            "group": self.group,
            "type": self.event_type,
            "error_type": _text(self.headers, HEADER_ERROR_TYPE),
            "error": self.error,
            "key": self.message.key.decode(errors="replace") if self.message.key else None,
            "redriven_from": _text(self.headers, HEADER_REDRIVEN_FROM) or None,
        }


async def list_dead_letters(bus: Bus, topic: str) -> list[DeadLetter]:
    """Every record now in the dead-letter ``topic``, oldest first."""
    return [DeadLetter(m) for m in await bus.read_topic(topic)]


@dataclass
class RedriveReport:
    redriven: list[DeadLetter] = field(default_factory=list)
    skipped: list[tuple[DeadLetter, str]] = field(default_factory=list)  # (letter, why)


async def redrive(bus: Bus, dead_letter_topic: str, letters: Iterable[DeadLetter]) -> RedriveReport:
    """Publishes each letter to its origin topic as it was; letters without an origin, or
    whose origin is the dead-letter topic itself, are skipped."""
    report = RedriveReport()
    for letter in letters:
        origin = letter.origin_topic
        if not origin or origin == dead_letter_topic:
            report.skipped.append((letter, "no origin topic" if not origin else "loops"))
            continue
        headers = letter.original_headers()
        headers[HEADER_REDRIVEN_FROM] = f"{dead_letter_topic}:{letter.where}".encode()
        await bus.publish_raw(origin, letter.message.value, key=letter.message.key,
                              headers=headers)
        report.redriven.append(letter)
    return report
