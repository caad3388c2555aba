"""The service runtime: health and metrics over HTTP, stop on request, one fate."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import Sequence

import pytest

from kz_stream.bus import BusMessage, InMemoryBus
from kz_stream.config import ResilienceSettings, Settings
from kz_stream.events import KernelVerified, new_event
from kz_stream.infra import free_port
from kz_stream.runtime import Service, ServiceContext, run_services


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


def ctx() -> ServiceContext:
    return ServiceContext(settings=Settings(), store=None, bus=None)  # type: ignore[arg-type]


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
    svc.set_health(False, "database unreachable")
    status, body = await asyncio.to_thread(get, f"http://127.0.0.1:{port}/healthz")
    assert status == 503 and json.loads(body)["services"]["waiting"]["detail"] == (
        "database unreachable"
    )
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
    svc = Consuming(ServiceContext(settings=settings, store=None, bus=bus))  # type: ignore[arg-type]
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
