"""The shape every long-lived service shares: settings, store and bus, JSON logs, a health
endpoint with Prometheus metrics, and graceful shutdown on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import signal
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

from kz_stream.bus import Bus, BusMessage
from kz_stream.config import Settings
from kz_stream.logging import get_logger
from kz_stream.projections import GC_GEN0_THRESHOLD
from kz_stream.store import EventStore

__all__ = [
    "REGISTRY",
    "HealthServer",
    "Service",
    "ServiceContext",
    "ServiceMetrics",
    "StoreOffsets",
    "first_error",
    "run_services",
]


def first_error(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The first leaf of an exception group: what a TaskGroup's caller reports."""
    first = group.exceptions[0]
    return first_error(first) if isinstance(first, BaseExceptionGroup) else first


class StoreOffsets:
    """Reads a consumer group's Kafka offsets from the store's tracking table."""

    def __init__(self, store: EventStore) -> None:
        self._store = store

    async def load_offsets(self, group: str) -> dict[str, int]:
        return await self._store.get_tracking(group)


# One registry per process: services in one process share metric families and differ by
# the ``service`` label, so /metrics is a single valid exposition.
REGISTRY = CollectorRegistry()
_HANDLED = Counter("kz_events_handled", "Events handled", ["service", "type"], registry=REGISTRY)
_PUBLISHED = Counter(
    "kz_events_published", "Events published", ["service", "type"], registry=REGISTRY
)
_BATCH_SECONDS = Histogram(
    "kz_batch_seconds", "Time to handle one batch", ["service"], registry=REGISTRY
)
_IN_FLIGHT = Gauge("kz_in_flight", "Work items in flight", ["service"], registry=REGISTRY)
_ERRORS = Counter("kz_errors", "Errors by kind", ["service", "kind"], registry=REGISTRY)
_LLM_REQUESTS = Counter("kz_llm_requests", "LLM requests sent", ["service"], registry=REGISTRY)
_LLM_TOKENS = Counter(
    "kz_llm_tokens", "Completion tokens generated (rate() gives tokens/s)", ["service"],
    registry=REGISTRY,
)
_VALIDITY = Counter(
    "kz_modules_validated", "Proposed modules by validity", ["service", "valid"],
    registry=REGISTRY,
)


class ServiceMetrics:
    """The standard metrics of one service (labelled with its name)."""

    def __init__(self, service: str) -> None:
        self.service = service
        self.batch_seconds = _BATCH_SECONDS.labels(service)
        self.in_flight = _IN_FLIGHT.labels(service)

    def handled(self, event_type: str, n: int = 1) -> None:
        _HANDLED.labels(self.service, event_type).inc(n)

    def published(self, event_type: str, n: int = 1) -> None:
        _PUBLISHED.labels(self.service, event_type).inc(n)

    def error(self, kind: str) -> None:
        _ERRORS.labels(self.service, kind).inc()

    def llm_request(self, completion_tokens: int) -> None:
        _LLM_REQUESTS.labels(self.service).inc()
        _LLM_TOKENS.labels(self.service).inc(completion_tokens)

    def validated(self, valid: bool) -> None:
        _VALIDITY.labels(self.service, str(valid).lower()).inc()

    def count_handled(self, batch: Iterable[BusMessage]) -> None:
        counts: dict[str, int] = {}
        for m in batch:
            if m.event is not None:
                counts[m.event.type] = counts.get(m.event.type, 0) + 1
        for t, n in counts.items():
            self.handled(t, n)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


class HealthServer:
    """Serves ``/healthz`` (200 while every service is healthy, else 503) and ``/metrics``.

    A WSGI server in a daemon thread, as prometheus_client's own ``start_http_server`` does,
    but with a health route in front of its metrics app.
    """

    def __init__(self, host: str, port: int, services: list[Service]) -> None:
        self._services = services
        self._metrics_app = make_wsgi_app(REGISTRY)
        self._server: WSGIServer = make_server(host, port, self._app, handler_class=_QuietHandler)
        self.port = int(self._server.server_port)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def _app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/healthz":
            states = {s.name: s.health() for s in self._services}
            ok = all(st["healthy"] for st in states.values())
            body = json.dumps({"healthy": ok, "services": states}).encode()
            start_response(
                "200 OK" if ok else "503 Service Unavailable",
                [("Content-Type", "application/json")],
            )
            return [body]
        if path == "/metrics":
            return list(self._metrics_app(environ, start_response))
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found\n"]

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@dataclass
class ServiceContext:
    """What a service gets from the runtime."""

    settings: Settings
    store: EventStore
    bus: Bus
    producer_id: str = "kz"
    extras: dict[str, Any] = field(default_factory=dict)


class Service(ABC):
    """A long-lived asyncio service. ``run`` returns once ``stopping`` is set and in-flight
    work is finished or handed back."""

    name: str = "service"

    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx
        self.metrics = ServiceMetrics(self.name)
        self.stopping = asyncio.Event()
        self.started_at = time.time()
        self.log = get_logger(f"kz.{self.name}").bind(service=self.name)
        self._healthy = True
        self._health_detail = ""

    @abstractmethod
    async def run(self) -> None: ...

    def request_stop(self) -> None:
        self.stopping.set()

    def set_health(self, healthy: bool, detail: str = "") -> None:
        self._healthy, self._health_detail = healthy, detail

    def health(self) -> dict[str, Any]:
        return {
            "healthy": self._healthy,
            "detail": self._health_detail,
            "uptime_s": round(time.time() - self.started_at, 1),
        }


def _tune_gc() -> None:
    """Keeps the cyclic garbage collector out of the hot path of high-rate services.

    A consumer holds thousands of freshly decoded events per batch; with CPython's default
    thresholds the collector ran every 700 of their containers and rescanned every module,
    schema and model object from start-up, which measured ~40% of the recorder's CPU. Start-up
    objects are frozen (never scanned again) and young collections run far less often;
    reference counting still frees everything that is not in a cycle at once.
    """
    gc.collect()
    gc.freeze()
    gen0, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(max(gen0, GC_GEN0_THRESHOLD), gen1, gen2)


async def run_services(
    services: list[Service],
    *,
    http_host: str = "127.0.0.1",
    http_port: int = 0,
    install_signal_handlers: bool = True,
) -> None:
    """Runs services until all return or SIGTERM/SIGINT asks them to stop.

    A service that fails stops the others (one process, one fate), and the error re-raises.
    """
    log = get_logger("kz.runtime")
    _tune_gc()
    health = HealthServer(http_host, http_port, services)
    health.start()
    log.info("http_listening", port=health.port, services=[s.name for s in services])
    loop = asyncio.get_running_loop()

    def stop_all() -> None:
        log.info("stop_requested")
        for s in services:
            s.request_stop()

    if install_signal_handlers:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop_all)
    tasks = [asyncio.create_task(s.run(), name=s.name) for s in services]
    try:
        done, _pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in done:
            if t.exception() is not None:
                stop_all()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError):
                raise r
    finally:
        for t in tasks:
            t.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*tasks, return_exceptions=True)
        if install_signal_handlers:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
        health.stop()
