"""structlog setup: one JSON object per line on stderr, with context variables (service,
event_id, correlation_id) merged into every line."""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

__all__ = ["bind_event", "configure_logging", "get_logger"]


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
    # aiokafka logs every rebalance at INFO; keep it to warnings.
    logging.getLogger("aiokafka").setLevel(logging.WARNING)


def get_logger(name: str | None = None) -> Any:
    return structlog.get_logger(name) if name else structlog.get_logger()


def bind_event(event_id: str, correlation_id: str | None) -> Any:
    """Binds the ids of the event being handled to every log line until the token resets."""
    return structlog.contextvars.bound_contextvars(event_id=event_id, correlation_id=correlation_id)
