"""The shape every long-lived service shares: settings, store and bus, JSON logs, a health
endpoint with Prometheus metrics, and graceful shutdown on SIGTERM/SIGINT.

Health means something: ``/healthz`` answers 503 while the store or the broker does not
answer a probe, a topic is missing, a service or one of its consumers waits out an outage,
a consumer has been on one batch for ``resilience.stuck_after_s`` or has failed, or a
service is shutting down; each condition clears by itself when what caused it does."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import signal
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, Unpack
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kz_stream.bus import Bus, BusMessage, Handler, SubscribeOptions, Subscription
from kz_stream.config import Settings
from kz_stream.faults import Backoff, dependency_of, describe_outage, wait_out
from kz_stream.logging import get_logger
from kz_stream.projections import GC_GEN0_THRESHOLD
from kz_stream.store import EventStore

__all__ = [
    "REGISTRY",
    "DependencyMonitor",
    "HealthServer",
    "Service",
    "ServiceContext",
    "ServiceMetrics",
    "StoreOffsets",
    "first_error",
    "run_services",
]


T = TypeVar("T")
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

    async def save_offsets(self, group: str, positions: Mapping[str, int]) -> None:
        async with self._store.transaction() as tx:
            await tx.set_tracking(group, positions)


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
_OUTAGE_RETRIES = Counter(
    "kz_outage_retries", "Store or broker operations of a service retried during an outage",
    ["service", "dependency"], registry=REGISTRY,
)
_DEPENDENCY_UP = Gauge(
    "kz_dependency_up", "1 while a dependency answers its probe, 0 while it does not",
    ["dependency"], registry=REGISTRY,
)
_TOPICS_MISSING = Gauge(
    "kz_topics_missing", "Configured topics the broker does not have", registry=REGISTRY
)

# SubscriptionStats fields exported as kz_consumer_<field>_total{service,group}.
_CONSUMER_COUNTERS = {
    "batches": "Batches whose offsets were committed",
    "messages": "Messages the handler applied",
    "retries": "Handler calls that failed on the records and were retried",
    "dead_lettered": "Records sent to the dead-letter topic",
    "outages": "Store or broker outages waited out",
    "outage_retries": "Retries while waiting out an outage",
    "dropped_batches": "Fetched batches given back uncommitted (rebalance, stop)",
    "pauses": "Times fetching paused behind a full queue",
    "assignments": "Partition assignments received",
}

# Subscription states exported as kz_consumer_<name>{service,group}: (help, reading at a
# scrape's monotonic time; None leaves the series out).
_CONSUMER_GAUGES: dict[str, tuple[str, Callable[[Subscription, float], float | None]]] = {
    "outage": ("1 while the consumer waits out an outage",
               lambda sub, now: float(sub.outage is not None)),
    "failed": ("1 once the consumer has stopped on a fatal error",
               lambda sub, now: float(sub.failure is not None)),
    "busy_seconds": ("How long the running batch has been running",
                     lambda sub, now: 0.0 if sub.busy_since is None else now - sub.busy_since),
    "lag": ("Records behind the ends of the consumer's partitions",
            lambda sub, now: sub.lag()),
}


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


class _ConsumerCollector(Collector):
    """Reads the services' subscription stats at scrape time (the bus knows nothing of
    Prometheus)."""

    def __init__(self, services: Sequence[Service]) -> None:
        self._services = services

    def collect(self) -> Iterator[Metric]:
        labels = ["service", "group"]
        counters = {
            name: CounterMetricFamily(f"kz_consumer_{name}", doc, labels=labels)
            for name, doc in _CONSUMER_COUNTERS.items()
        }
        gauges = {
            name: (GaugeMetricFamily(f"kz_consumer_{name}", doc, labels=labels), value)
            for name, (doc, value) in _CONSUMER_GAUGES.items()
        }
        now = time.monotonic()
        for service in self._services:
            for sub in service.subscriptions:
                values = [service.name, sub.group]
                for name, family in counters.items():
                    family.add_metric(values, getattr(sub.stats, name))
                for gauge, value in gauges.values():
                    reading = value(sub, now)
                    if reading is not None:
                        gauge.add_metric(values, reading)
        yield from counters.values()
        yield from (gauge for gauge, _ in gauges.values())


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


class HealthServer:
    """Serves ``/healthz`` (200 while every service is healthy, else 503) and ``/metrics``.

    A WSGI server in a daemon thread, as prometheus_client's own ``start_http_server`` does,
    but with a health route in front of its metrics app.
    """

    def __init__(
        self,
        host: str,
        port: int,
        services: list[Service],
        monitor: DependencyMonitor | None = None,
    ) -> None:
        self._services = services
        self._monitor = monitor
        self._collector = _ConsumerCollector(services)
        REGISTRY.register(self._collector)
        self._metrics_app = make_wsgi_app(REGISTRY)
        self._server: WSGIServer = make_server(host, port, self._app, handler_class=_QuietHandler)
        self.port = int(self._server.server_port)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def _app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/healthz":
            states = {s.name: s.health() for s in self._services}
            deps = self._monitor.health() if self._monitor is not None else {}
            ok = all(st["healthy"] for st in states.values()) and all(
                d["up"] for d in deps.values()
            )
            body = json.dumps({"healthy": ok, "dependencies": deps, "services": states}).encode()
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
        REGISTRY.unregister(self._collector)


class DependencyMonitor:
    """Probes the store and the broker every ``probe_interval_s`` and checks that every
    configured topic exists, creating missing ones where ``resilience.create_topics``
    allows. Logs one line when a dependency goes down or comes back, not one per probe."""

    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx
        self._settings = ctx.settings
        self._down: dict[str, str] = {}  # dependency -> why it is down
        self._missing: list[str] = []
        self.log = get_logger("kz.health")

    def health(self) -> dict[str, dict[str, Any]]:
        deps: dict[str, dict[str, Any]] = {
            name: {"up": name not in self._down, "detail": self._down.get(name, "")}
            for name in ("store", "broker")
        }
        deps["topics"] = {
            "up": not self._missing,
            "detail": f"missing: {', '.join(self._missing)}" if self._missing else "",
        }
        return deps

    async def run(self) -> None:
        while True:
            await self.probe()
            await asyncio.sleep(self._settings.resilience.probe_interval_s)

    async def probe(self) -> None:
        """One round of probes (tests call it to see a state change at once)."""
        await self._check("store", self.ctx.store.ping())
        missing = await self._check("broker", self.ctx.bus.ping(self._settings.topics.all()))
        if missing is not None:
            await self._topics(missing)

    async def _check(self, name: str, probe: Awaitable[T]) -> T | None:
        try:
            result = await probe
        except Exception as e:
            why = f"{type(e).__name__}: {e}"[:500]
            if name not in self._down:
                self.log.warning("dependency_down", dependency=name, error=why)
            self._down[name] = why
            _DEPENDENCY_UP.labels(name).set(0)
            return None
        if name in self._down:
            self.log.warning("dependency_up", dependency=name)
            del self._down[name]
        _DEPENDENCY_UP.labels(name).set(1)
        return result

    async def _topics(self, missing: list[str]) -> None:
        """Creates missing topics where allowed; logs a line only when the set of missing
        topics changes (a broker that lost its storage, not a line per probe)."""
        why = "resilience.create_topics is false"
        if missing and self._settings.resilience.create_topics:
            wanted = [s for s in self._settings.topics.specs() if s.name in missing]
            try:
                await self.ctx.bus.create_topics(wanted)
                still = await self.ctx.bus.ping(missing)
                self.log.warning("topics_created", topics=[t for t in missing if t not in still])
                missing, why = still, "created, but the broker does not show them"
            except Exception as e:
                why = f"cannot create them: {type(e).__name__}: {e}"
        if missing != self._missing:
            if missing:
                self.log.error("topics_missing", topics=missing, why=why)
            elif self._missing:
                self.log.warning("topics_present", topics=self._missing)
            self._missing = missing
        _TOPICS_MISSING.set(len(missing))


@dataclass
class ServiceContext:
    """What a service gets from the runtime."""

    settings: Settings
    store: EventStore
    bus: Bus
    producer_id: str = "kz"


class Service(ABC):
    """A long-lived asyncio service. ``run`` returns once ``stopping`` is set and in-flight
    work is finished or handed back."""

    name: str = "service"
    # ``run_services`` stops services stage by stage, lowest first, each stage once the one
    # before has finished: generators (0) before the consumers of what they publish (1),
    # the recorder (2) last, so what a stopping generator publishes last is still archived.
    stop_stage: int = 1

    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx
        self.metrics = ServiceMetrics(self.name)
        self.stopping = asyncio.Event()
        self.started_at = time.time()
        self.log = get_logger(f"kz.{self.name}").bind(service=self.name)
        self.subscriptions: list[Subscription] = []
        # The outage this service's own store or broker calls wait out (see wait_out).
        self.outage: str | None = None
        r = ctx.settings.resilience
        self.backoff = Backoff(r.backoff_initial_s, r.backoff_max_s)

    @abstractmethod
    async def run(self) -> None: ...

    def request_stop(self) -> None:
        self.stopping.set()

    async def run_until_stopped(self, work: Awaitable[object]) -> None:
        """Runs ``work`` (a subscription's ``wait()``, a service's main loop) until it ends
        or a stop is requested; work still running then is cancelled. An error it ended
        with raises here, so the service fails with it (one process, one fate)."""
        task = asyncio.ensure_future(work)
        stop = asyncio.create_task(self.stopping.wait())
        try:
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
            # Before the cancel below: a cancelled ``gather`` ends with CancelledError as
            # its exception, not as cancelled.
            ended = task.done()
        finally:
            stop.cancel()
            task.cancel()
            await asyncio.gather(task, stop, return_exceptions=True)
        if ended and not task.cancelled() and (error := task.exception()) is not None:
            raise error

    def health(self) -> dict[str, Any]:
        """Unhealthy while stopping or waiting out an outage, or while a consumer waits one
        out, is stuck on a batch or has failed; ``detail`` says which."""
        problems: list[str] = []
        if self.stopping.is_set():
            problems.append("shutting down")
        if self.outage is not None:
            problems.append(self.outage)
        stuck_after = self.ctx.settings.resilience.stuck_after_s
        now = time.monotonic()
        consumers: dict[str, Any] = {}
        for sub in self.subscriptions:
            busy = 0.0 if sub.busy_since is None else now - sub.busy_since
            consumers[sub.group] = {
                "outage": sub.outage,
                "failed": sub.failure,
                "busy_s": round(busy, 1),
                "lag": sub.lag(),
                "dead_lettered": sub.stats.dead_lettered,
            }
            if sub.failure is not None:
                problems.append(f"consumer {sub.group}: failed: {sub.failure}")
            elif sub.outage is not None:
                problems.append(f"consumer {sub.group}: {sub.outage}")
            elif busy > stuck_after:
                problems.append(f"consumer {sub.group}: stuck on one batch for {busy:.0f}s")
        return {
            "healthy": not problems,
            "detail": "; ".join(problems),
            "uptime_s": round(time.time() - self.started_at, 1),
            "consumers": consumers,
        }

    async def subscribe(self, group: str, topics: Sequence[str], handler: Handler,
                        **options: Unpack[SubscribeOptions]) -> Subscription:
        """``bus.subscribe`` with the run's dead-letter topic and outage backoff; the
        subscription counts in this service's health and metrics."""
        r = self.ctx.settings.resilience
        merged: SubscribeOptions = {
            "dead_letter_topic": self.ctx.settings.topics.dead_letter,
            "retry_backoff": r.backoff_initial_s,
            "max_backoff": r.backoff_max_s,
            **options,
        }
        sub = await self.ctx.bus.subscribe(group, topics, handler, **merged)
        self.subscriptions.append(sub)
        return sub

    async def wait_out(self, op: Callable[[], Awaitable[T]], *,
                       wake: asyncio.Event | None = None) -> T:
        """Runs ``op`` (a store, bus or LLM call), waiting out outages with backoff while
        the service reports itself unhealthy; other errors raise. ``wake``: see
        ``faults.wait_out``."""
        return await wait_out(
            op, backoff=self.backoff, on_retry=self._on_outage,
            on_recovered=self._on_recovered, wake=wake,
        )

    def _on_outage(self, error: BaseException, attempt: int, delay: float) -> None:
        dependency = dependency_of(error) or "dependency"
        _OUTAGE_RETRIES.labels(self.name, dependency).inc()
        self.outage = describe_outage(error)
        if attempt == 0 or delay >= self.backoff.cap:  # one line, then one per capped wait
            self.log.warning("outage", dependency=dependency, error=self.outage,
                             retry_in_s=round(delay, 2))

    def _on_recovered(self, attempts: int) -> None:
        self.log.warning("outage_over", retries=attempts)
        self.outage = None


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
    stop: asyncio.Event | None = None,
) -> None:
    """Runs services until all return, or SIGTERM/SIGINT or ``stop`` asks them to stop.

    A stop goes stage by stage (``Service.stop_stage``): each stage's services are asked to
    stop once those of the stages before have returned. A service that fails stops the
    others at once (one process, one fate), and the error re-raises. While they run, a
    DependencyMonitor probes their store and bus (when they have them).
    """
    log = get_logger("kz.runtime")
    _tune_gc()
    ctx = services[0].ctx if services else None
    monitor = (
        DependencyMonitor(ctx)
        if ctx is not None and ctx.store is not None and ctx.bus is not None else None
    )
    health = HealthServer(http_host, http_port, services, monitor)
    health.start()
    probes = asyncio.create_task(monitor.run()) if monitor is not None else None
    log.info("http_listening", port=health.port, services=[s.name for s in services])
    loop = asyncio.get_running_loop()
    tasks = [asyncio.create_task(s.run(), name=s.name) for s in services]
    staged: list[asyncio.Task[None]] = []

    async def stop_in_stages() -> None:
        for stage in sorted({s.stop_stage for s in services}):
            members = [(s, t) for s, t in zip(services, tasks, strict=True)
                       if s.stop_stage == stage]
            for s, _ in members:
                s.request_stop()
            await asyncio.wait([t for _, t in members])

    def stop_staged() -> None:
        if not staged:
            log.info("stop_requested")
            staged.append(asyncio.create_task(stop_in_stages(), name="kz-stop"))

    def stop_all() -> None:
        for s in services:
            s.request_stop()

    def on_signal() -> None:
        # A second signal does not wait for the stages: every service is asked at once.
        if staged:
            log.info("stop_requested_again", detail="every service is asked to stop now")
            stop_all()
        else:
            stop_staged()

    if install_signal_handlers:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal)
    watch = asyncio.create_task(stop.wait()) if stop is not None else None
    if watch is not None:
        watch.add_done_callback(lambda t: None if t.cancelled() else stop_staged())
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
        others: list[asyncio.Task[Any]] = [
            t for t in (probes, watch, *staged) if t is not None]
        for t in (*tasks, *others):
            t.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*tasks, *others, return_exceptions=True)
        if install_signal_handlers:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
        health.stop()
        # Frozen objects are never collected, not even when the interpreter exits; Triton's
        # nanobind bindings then list each of their objects left in a cycle as a leak
        # (dozens of lines after every `kz run`). Unfrozen, the final collections free them.
        gc.unfreeze()
