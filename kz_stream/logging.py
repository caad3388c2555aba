"""structlog setup: one JSON object per line on stderr, with context variables (service,
event_id, correlation_id) merged into every line."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any

import structlog

__all__ = ["RepeatFilter", "bind_event", "configure_logging", "get_logger"]


class RepeatFilter(logging.Filter):
    """Lets a library's repeated message through once per ``interval`` seconds.

    aiokafka retries some failures every 100 ms and logs each try (``OffsetCommit failed
    ... UnknownTopicOrPartitionError`` after a broker lost its topics grew a log by a MB a
    minute). A message is the same when its logger and format string are; the one let
    through after a quiet spell says how many were held back. SQLAlchemy's pool likewise
    logs a traceback for every connection a database restart broke. Other loggers pass as
    they are.
    """

    def __init__(self, prefixes: tuple[str, ...] = ("aiokafka", "sqlalchemy.pool"),
                 interval: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.prefixes, self.interval, self.clock = prefixes, interval, clock
        self._seen: dict[tuple[str, str], tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith(self.prefixes):
            return True
        key = (record.name, str(record.msg))
        now = self.clock()
        seen = self._seen.get(key)
        if seen is not None and now - seen[0] < self.interval:
            self._seen[key] = (seen[0], seen[1] + 1)
            return False
        if seen is not None and seen[1]:
            # No "%" in the note, so the format string still formats with its args.
            record.msg = f"{record.msg} [{seen[1]} more like this in {now - seen[0]:.0f}s]"
        self._seen[key] = (now, 0)
        return True


def configure_logging(level: str = "INFO", *, json: bool = True) -> None:
    """Routes structlog (and stdlib logging) to stderr as JSON lines or console text."""
    renderer: Any = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(level=level.upper(), stream=sys.stderr, format="%(name)s %(message)s")
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RepeatFilter) for f in handler.filters):
            handler.addFilter(RepeatFilter())
    # aiokafka logs every rebalance at INFO; keep it to warnings.
    logging.getLogger("aiokafka").setLevel(logging.WARNING)


def get_logger(name: str | None = None) -> Any:
    return structlog.get_logger(name) if name else structlog.get_logger()


def bind_event(event_id: str, correlation_id: str | None) -> Any:
    """Binds the ids of the event being handled to every log line until the token resets."""
    return structlog.contextvars.bound_contextvars(event_id=event_id, correlation_id=correlation_id)
