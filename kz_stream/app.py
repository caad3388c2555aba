"""The composition root: builds the store, bus and services that settings describe."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from kz_stream.config import Settings
from kz_stream.logging import configure_logging
from kz_stream.runtime import Service, ServiceContext, run_services

__all__ = [
    "ensure_sqlite_dir","open_context", "projection_by_name", "run_named_services", "service_by_name"]


@asynccontextmanager
async def open_context(settings: Settings, *, migrate: bool = True) -> AsyncIterator[ServiceContext]:
    """Opens the store (migrated to head) and the bus (topics created) for services."""
    from kz_stream.bus import open_bus
    from kz_stream.store import open_store

    ensure_sqlite_dir(settings.database_url)
    async with open_store(settings.database_url, create_schema=migrate) as store:
        bus = open_bus(settings.bus_url)
        try:
            await bus.start()
            await bus.create_topics(settings.topics.specs())
            yield ServiceContext(
                settings=settings, store=store, bus=bus,
                producer_id=f"{socket.gethostname()}:{os.getpid()}",
            )
        finally:
            with contextlib.suppress(Exception):
                await bus.close()


def ensure_sqlite_dir(url: str) -> None:
    """Creates the directory of a SQLite database file, so a fresh checkout just runs."""
    from sqlalchemy.engine import make_url

    u = make_url(url)
    if u.get_backend_name() == "sqlite" and u.database and u.database != ":memory:":
        os.makedirs(os.path.dirname(os.path.abspath(u.database)), exist_ok=True)


def service_by_name(name: str, ctx: ServiceContext) -> Service:
    """Builds one service. Imports lazily: each pulls in its own heavy dependencies."""
    if name == "recorder":
        from consumers.recorder import Recorder

        return Recorder(ctx)
    raise ValueError(f"service {name!r} is not available in this build")


async def run_named_services(settings: Settings, names: Sequence[str]) -> None:
    configure_logging(settings.log_level, json=settings.log_json)
    async with open_context(settings) as ctx:
        services = [service_by_name(n, ctx) for n in names]
        await run_services(services, http_host=settings.http_host, http_port=settings.http_port)


def projection_by_name(name: str) -> Any:
    from kz_stream import projections

    known = {"kernels": projections.KernelsProjection}
    if name not in known:
        raise ValueError(f"unknown projection {name!r}; choose from {', '.join(known)}")
    return known[name]()
