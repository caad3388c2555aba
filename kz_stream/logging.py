"""structlog setup: one JSON object per line on stderr, with context variables (service,
event_id, correlation_id) merged into every line; and the filters that keep third-party
noise (repeated retries, lines that do not concern the user, per-load progress bars) off it."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any

import structlog

__all__ = [
    "NOISE",
    "NoiseFilter",
    "RepeatFilter",
    "configure_logging",
    "get_logger",
]

# Third-party log lines that say nothing a kz_stream user can act on: (logger name prefix,
# text in the message's format string). Each is dropped at the handler, nothing else from
# that logger is.
NOISE: tuple[tuple[str, str], ...] = (
    # TRL imports vLLM (for a client kz_stream never uses), and vLLM, on a CPU-only machine,
    # warns at import that it turns off Triton for its own kernels. kz_stream's Triton kernels
    # run through the interpreter, untouched by that.
    ("vllm.triton_utils", "Triton is installed, but doesn't include CPU backend"),
)


class NoiseFilter(logging.Filter):
    """Drops the log lines listed in ``rules`` (see ``NOISE``); every other line passes."""

    def __init__(self, rules: tuple[tuple[str, str], ...] = NOISE) -> None:
        super().__init__()
        self.rules = rules

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        return not any(record.name.startswith(p) and text in msg for p, text in self.rules)


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
        logger_factory=_stderr_logger,
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(level=level.upper(), stream=sys.stderr, format="%(name)s %(message)s")
    for handler in logging.getLogger().handlers:
        for kind in (RepeatFilter, NoiseFilter):
            if not any(isinstance(f, kind) for f in handler.filters):
                handler.addFilter(kind())
    # aiokafka logs every rebalance at INFO; keep it to warnings.
    logging.getLogger("aiokafka").setLevel(logging.WARNING)
    _quiet_progress_bars()
    _quiet_untrusted_source_warnings()


def _quiet_untrusted_source_warnings() -> None:
    """Drops the compiler's warnings about model-written code that kz_stream parses
    (``ast.parse`` names it ``<unknown>``): an evaluation of the bare model printed
    hundreds of "<unknown>:1: SyntaxWarning: invalid decimal literal" lines. Such code
    gets its verdict or validation reason; the warnings concern no file of the user's."""
    import warnings

    for category in (SyntaxWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module="<unknown>")


def _stderr_logger(*args: Any) -> structlog.PrintLogger:
    """A logger on the ``sys.stderr`` of the moment: a factory that kept the one of its
    configuration wrote to a closed file once that stream was replaced and closed (a
    test's captured stderr; the services of later tests then failed on every log line)."""
    return structlog.PrintLogger(file=sys.stderr)


def _quiet_progress_bars() -> None:
    """Turns off the Hugging Face libraries' progress bars. transformers draws one for every
    model it loads ("Loading weights": four in a ``kz run``, each gone in under a second)
    between the run's own bars and tables, and nothing is downloaded that a bar would follow.
    The one long load, the first run's GGUF conversion, keeps its bar (plain tqdm)."""
    from huggingface_hub.utils.tqdm import disable_progress_bars

    disable_progress_bars()
    if "transformers" in sys.modules:  # it copied the hub's setting when it was imported
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]


def get_logger(name: str | None = None) -> Any:
    return structlog.get_logger(name) if name else structlog.get_logger()
