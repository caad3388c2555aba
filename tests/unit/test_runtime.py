"""The service runtime: health and metrics over HTTP, stop on request, one fate."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import cast

import pytest

from kz_stream.bus import Bus, BusMessage, InMemoryBus
from kz_stream.config import ResilienceSettings, Settings
from kz_stream.events import Event, KernelVerified, new_event
from kz_stream.faults import DependencyUnavailable
from kz_stream.infra import free_port
from kz_stream.runtime import Service, ServiceContext, run_services
from kz_stream.store import EventStore


class Waiting(Service):
    name = "waiting"

    async def run(self) -> None:
        self.metrics.handled("KernelGenerated", 3)
        await self.stopping.wait()


class Failing(Service):
    name = "failing"

    async def run(self) -> None:
        await asyncio.sleep(0.05)
        raise RuntimeError("boom")


def ctx(settings: Settings | None = None, bus: Bus | None = None) -> ServiceContext:
    """A context with no store (these services never touch one) and ``bus`` if given."""
    return ServiceContext(
        settings=settings or Settings(), store=cast(EventStore, None), bus=cast(Bus, bus)
    )


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


async def test_healthz_reports_each_service_and_metrics_are_exposed() -> None:
    port = free_port()
    svc = Waiting(ctx())
    task = asyncio.create_task(run_services([svc], http_port=port, install_signal_handlers=False))
    await asyncio.sleep(0.1)
    status, body = await asyncio.to_thread(get, f"http://127.0.0.1:{port}/healthz")
    assert status == 200 and json.loads(body)["services"]["waiting"]["healthy"] is True
    status, body = await asyncio.to_thread(get, f"http://127.0.0.1:{port}/metrics")
    assert status == 200
    assert 'kz_events_handled_total{service="waiting",type="KernelGenerated"} 3.0' in body
    svc.request_stop()
    await asyncio.wait_for(task, 5)


async def test_a_failing_service_stops_the_others_and_its_error_surfaces() -> None:
    waiting = Waiting(ctx())
    with pytest.raises(RuntimeError, match="boom"):
        await asyncio.wait_for(
            run_services([waiting, Failing(ctx())], install_signal_handlers=False), 5
        )
    assert waiting.stopping.is_set()


class Lingering(Service):
    """Takes until ``released`` to finish once asked to stop, as a draining service does."""

    name = "lingering"

    def __init__(self, ctx: ServiceContext) -> None:
        super().__init__(ctx)
        self.released = asyncio.Event()

    async def run(self) -> None:
        await self.stopping.wait()
        await self.released.wait()


async def test_healthz_is_503_while_a_service_shuts_down() -> None:
    port = free_port()
    svc = Lingering(ctx())
    task = asyncio.create_task(run_services([svc], http_port=port, install_signal_handlers=False))
    await asyncio.sleep(0.1)
    assert (await asyncio.to_thread(get, f"http://127.0.0.1:{port}/healthz"))[0] == 200
    svc.request_stop()
    status, body = await asyncio.to_thread(get, f"http://127.0.0.1:{port}/healthz")
    assert status == 503 and json.loads(body)["services"]["lingering"]["detail"] == (
        "shutting down"
    )
    svc.released.set()
    await asyncio.wait_for(task, 5)


class Consuming(Service):
    """Consumes one topic with a handler that blocks until ``released``."""

    name = "consuming"

    def __init__(self, ctx: ServiceContext) -> None:
        super().__init__(ctx)
        self.released = asyncio.Event()
        self.started = asyncio.Event()

    async def handle(self, batch: Sequence[BusMessage]) -> None:
        self.started.set()
        await self.released.wait()

    async def run(self) -> None:
        sub = await self.subscribe("g-stuck", ["t"], self.handle)
        await self.stopping.wait()
        self.released.set()
        await sub.stop()


async def test_a_consumer_stuck_on_a_batch_makes_healthz_503_and_shows_in_metrics() -> None:
    port = free_port()
    bus = InMemoryBus()
    settings = Settings(resilience=ResilienceSettings(stuck_after_s=0.01))
    svc = Consuming(ctx(settings, bus))
    task = asyncio.create_task(run_services([svc], http_port=port, install_signal_handlers=False))
    await bus.publish("t", new_event(
        KernelVerified(kernel_id="k", module_id="m", group_id="g", status="correct"),
        stream_id="kernel-k", stream_version=1,
    ))
    await asyncio.wait_for(svc.started.wait(), 5)
    await asyncio.sleep(0.05)  # past stuck_after_s: the condition itself, not a timing check
    status, body = await asyncio.to_thread(get, f"http://127.0.0.1:{port}/healthz")
    assert status == 503
    assert "consumer g-stuck: stuck on one batch" in json.loads(body)["services"]["consuming"][
        "detail"]
    _, metrics = await asyncio.to_thread(get, f"http://127.0.0.1:{port}/metrics")
    assert 'kz_consumer_outage{group="g-stuck",service="consuming"} 0.0' in metrics
    assert 'kz_consumer_dead_lettered_total{group="g-stuck",service="consuming"} 0.0' in metrics
    svc.request_stop()
    await asyncio.wait_for(task, 5)
    assert svc.subscriptions[0].stats.messages == 1


class Scripted(Service):
    """Consumes one topic; what the handler does is named by the kernel id of the record:
    ``poison`` always raises, ``outage`` finds the store unreachable until ``recovered``,
    ``fatal`` raises CancelledError (which ends a subscription). Waits only for a stop, as
    the coder does, so a failed subscription leaves the service running."""

    name = "scripted"

    def __init__(self, ctx: ServiceContext, *, wait_for_subscription: bool = False) -> None:
        super().__init__(ctx)
        self.recovered = asyncio.Event()
        self.wait_for_subscription = wait_for_subscription

    async def handle(self, batch: Sequence[BusMessage]) -> None:
        for m in batch:
            kind = m.event.payload["kernel_id"] if m.event is not None else ""
            if kind == "poison":
                raise ValueError("not a kernel this handler can apply")
            if kind == "outage" and not self.recovered.is_set():
                raise DependencyUnavailable("store", "connection refused")
            if kind == "fatal":
                raise asyncio.CancelledError

    async def run(self) -> None:
        sub = await self.subscribe("g-scripted", ["t"], self.handle, max_batch=1)
        try:
            if self.wait_for_subscription:
                await self.run_until_stopped(sub.wait())
            else:
                await self.stopping.wait()
        finally:
            await sub.stop()


def record(kind: str) -> Event:
    return new_event(
        KernelVerified(kernel_id=kind, module_id="m", group_id="g", status="correct"),
        stream_id=f"kernel-{kind}", stream_version=1,
    )


def fast_settings() -> Settings:
    return Settings(resilience=ResilienceSettings(backoff_initial_s=0.01, backoff_max_s=0.05))


async def until(url: str, status: int, text: str = "") -> str:
    """The body of ``url`` once it answers ``status`` with ``text`` in it (5 s at most)."""
    got, body = 0, ""
    for _ in range(250):
        with contextlib.suppress(urllib.error.URLError):  # not listening yet
            got, body = await asyncio.to_thread(get, url)
        if got == status and text in body:
            return body
        await asyncio.sleep(0.02)
    raise AssertionError(f"{url} never answered {status} with {text!r}; last: {got} {body}")


async def test_retries_dead_letters_and_outages_move_the_metrics_and_health_recovers() -> None:
    port = free_port()
    bus = InMemoryBus()
    svc = Scripted(ctx(fast_settings(), bus))
    task = asyncio.create_task(run_services([svc], http_port=port, install_signal_handlers=False))
    base, labels = f"http://127.0.0.1:{port}", 'group="g-scripted",service="scripted"'
    await until(f"{base}/healthz", 200)

    await bus.publish("t", record("poison"))
    metrics = await until(
        f"{base}/metrics", 200, f"kz_consumer_dead_lettered_total{{{labels}}} 1.0"
    )
    assert f"kz_consumer_retries_total{{{labels}}} 3.0" in metrics
    assert len(await bus.read_topic(svc.ctx.settings.topics.dead_letter)) == 1
    await until(f"{base}/healthz", 200)  # a dead letter is handled, not a fault of the service

    await bus.publish("t", record("outage"))
    body = await until(f"{base}/healthz", 503, "store unreachable")
    assert "consumer g-scripted: store unreachable" in json.loads(body)["services"]["scripted"][
        "detail"]
    await until(f"{base}/metrics", 200, f"kz_consumer_outage{{{labels}}} 1.0")
    svc.recovered.set()
    await until(f"{base}/healthz", 200)
    metrics = await until(f"{base}/metrics", 200, f"kz_consumer_outage{{{labels}}} 0.0")
    assert f"kz_consumer_outages_total{{{labels}}} 1.0" in metrics
    assert f"kz_consumer_messages_total{{{labels}}} 1.0" in metrics
    svc.request_stop()
    await asyncio.wait_for(task, 5)


async def test_a_failed_consumer_makes_healthz_503_while_its_service_runs() -> None:
    port = free_port()
    bus = InMemoryBus()
    svc = Scripted(ctx(fast_settings(), bus))
    task = asyncio.create_task(run_services([svc], http_port=port, install_signal_handlers=False))
    base = f"http://127.0.0.1:{port}"
    await until(f"{base}/healthz", 200)
    await bus.publish("t", record("fatal"))
    body = await until(f"{base}/healthz", 503, "failed")
    state = json.loads(body)["services"]["scripted"]
    assert state["detail"] == (
        "consumer g-scripted: failed: RuntimeError: the handler was cancelled; batch not committed"
    )
    assert state["consumers"]["g-scripted"]["failed"].startswith("RuntimeError")
    await until(f"{base}/metrics", 200,
                'kz_consumer_failed{group="g-scripted",service="scripted"} 1.0')
    svc.request_stop()
    await asyncio.wait_for(task, 5)


async def test_run_until_stopped_raises_what_ended_the_work_and_cancels_it_on_stop() -> None:
    bus = InMemoryBus()
    failing = Scripted(ctx(fast_settings(), bus), wait_for_subscription=True)
    task = asyncio.create_task(run_services([failing], install_signal_handlers=False))
    await asyncio.sleep(0.05)
    await bus.publish("t", record("fatal"))
    with pytest.raises(RuntimeError, match="the handler was cancelled"):
        await asyncio.wait_for(task, 5)

    waiting = Scripted(ctx(fast_settings(), InMemoryBus()), wait_for_subscription=True)
    task = asyncio.create_task(run_services([waiting], install_signal_handlers=False))
    await asyncio.sleep(0.05)
    waiting.request_stop()
    await asyncio.wait_for(task, 5)
    assert waiting.subscriptions[0].failure is None


class Staged(Service):
    """Notes when it is asked to stop and when it returns, after ``linger_s`` of work."""

    def __init__(self, context: ServiceContext, stage: int, log: list[str],
                 linger_s: float = 0.0) -> None:
        super().__init__(context)
        self.name, self.stop_stage, self.notes, self.linger_s = f"s{stage}", stage, log, linger_s

    async def run(self) -> None:
        await self.stopping.wait()
        self.notes.append(f"{self.name} asked")
        await asyncio.sleep(self.linger_s)
        self.notes.append(f"{self.name} returned")


async def test_a_stop_goes_stage_by_stage_each_after_the_one_before_has_returned() -> None:
    notes: list[str] = []
    services: list[Service] = [Staged(ctx(), 2, notes), Staged(ctx(), 0, notes, 0.2),
                               Staged(ctx(), 1, notes, 0.1)]
    stop = asyncio.Event()
    task = asyncio.create_task(
        run_services(services, install_signal_handlers=False, stop=stop))
    await asyncio.sleep(0.05)
    assert notes == []
    stop.set()
    await asyncio.wait_for(task, 5)
    assert notes == ["s0 asked", "s0 returned", "s1 asked", "s1 returned",
                     "s2 asked", "s2 returned"]


class Held(Service):
    """A generator whose call in flight lasts until ``release`` is set."""

    name = "held"
    stop_stage = 0

    def __init__(self, context: ServiceContext, release: asyncio.Event) -> None:
        super().__init__(context)
        self.release = release

    async def run(self) -> None:
        await self.stopping.wait()
        await self.release.wait()


async def test_a_second_signal_asks_every_service_to_stop_without_waiting_for_stages() -> None:
    release = asyncio.Event()
    held, last = Held(ctx(), release), Staged(ctx(), 2, [])
    task = asyncio.create_task(run_services([held, last]))
    await asyncio.sleep(0.05)
    os.kill(os.getpid(), signal.SIGINT)
    await asyncio.sleep(0.1)
    assert held.stopping.is_set() and not last.stopping.is_set()  # waits for the first stage
    os.kill(os.getpid(), signal.SIGINT)
    await asyncio.sleep(0.1)
    assert last.stopping.is_set()
    release.set()
    await asyncio.wait_for(task, 5)
