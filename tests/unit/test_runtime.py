"""The service runtime: health and metrics over HTTP, stop on request, one fate."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest

from kz_stream.config import Settings
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
