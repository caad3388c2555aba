"""The composition root: builds the store, bus and services that settings describe."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from kz_stream.config import Settings
from kz_stream.logging import configure_logging
from kz_stream.runtime import Service, ServiceContext, run_services

__all__ = [
    "RunOptions",
    "RunReport",
    "ensure_sqlite_dir",
    "open_context",
    "projection_by_name",
    "run_coevolution",
    "run_named_services",
    "service_by_name",
]


@asynccontextmanager
async def open_context(
    settings: Settings, *, migrate: bool = True
) -> AsyncIterator[ServiceContext]:
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
                settings=settings,
                store=store,
                bus=bus,
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


@dataclass(frozen=True)
class RunOptions:
    """The co-evolution loop's size. Defaults fit the embedded CPU run."""

    rounds: int = 1
    steps_per_turn: int = 1
    group_size: int = 2
    groups_per_step: int = 2
    proposals_per_prompt: int = 2
    max_new_tokens: int = 256
    backends: tuple[str, ...] = ("triton",)
    seed_modules: bool = True
    order: tuple[str, ...] = ("coder", "proposer")
    time_limit_s: float = 3600.0
    checkpoint_dir: str = ".kz/policies"


@dataclass
class RunReport:
    """What a run did, for the per-round summary and for tests."""

    counts: dict[str, int] = field(default_factory=dict)
    statuses: dict[str, int] = field(default_factory=dict)
    steps: list[dict[str, Any]] = field(default_factory=list)
    finished: bool = False
    seconds: float = 0.0


async def run_coevolution(
    settings: Settings,
    options: RunOptions,
    *,
    on_tick: Callable[[RunReport], None] | None = None,
) -> RunReport:
    """Runs proposer, coder, verifier, recorder and learner in one process until the
    alternation schedule is over (or the time limit passes)."""
    import time as _time

    from consumers.learner import LearnerService, LearnerServiceConfig
    from consumers.recorder import Recorder
    from consumers.verifier import VerifierService
    from kz_stream.llm.base import SamplingParams
    from kz_stream.llm.models import smollm2_dir
    from kz_stream.llm.transformers_backend import TransformersBackend
    from kz_stream.rl import AlternationConfig
    from kz_stream.rl.trainer import CoderLearner, LearnerConfig, ProposerLearner
    from producers.coder import CoderConfig, CoderService
    from producers.proposer import ProposerConfig, ProposerService
    from producers.seeds import SEED_MODULES

    configure_logging(settings.log_level, json=settings.log_json)
    model_dir = str(smollm2_dir())
    sampling = SamplingParams(max_tokens=options.max_new_tokens, temperature=1.0)
    report = RunReport()
    t0 = _time.monotonic()

    def make_learner(role: str, directory: Any) -> Any:
        cfg = LearnerConfig(
            model=model_dir,
            output_dir=str(directory),
            temperature=1.0,
            learning_rate=1e-4,
            lora_r=8,
            logprob_batch_size=4,
        )
        cls = CoderLearner if role == "coder" else ProposerLearner
        return cls(cfg, checkpoint_dir=directory)

    async with open_context(settings) as ctx:
        proposer_llm = TransformersBackend.from_pretrained(model_dir)
        coder_llm = TransformersBackend.from_pretrained(model_dir)
        recorder = Recorder(ctx)
        proposer = ProposerService(
            ctx,
            proposer_llm,
            ProposerConfig(
                proposals_per_prompt=options.proposals_per_prompt,
                sampling=sampling,
                seed_modules=SEED_MODULES if options.seed_modules else (),
            ),
        )
        coder = CoderService(
            ctx,
            coder_llm,
            CoderConfig(
                group_size=options.group_size,
                backends=options.backends,
                sampling=sampling,
            ),
        )
        verifier = VerifierService(ctx)
        learner = LearnerService(
            ctx,
            make_learner,
            LearnerServiceConfig(
                checkpoint_dir=_as_path(options.checkpoint_dir),
                groups_per_step=options.groups_per_step,
                alternation=AlternationConfig(
                    proposer_steps=options.steps_per_turn,
                    coder_steps=options.steps_per_turn,
                    rounds=options.rounds,
                    order=options.order,  # type: ignore[arg-type]
                ),
                frontier_every_s=2.0,
            ),
        )
        services: list[Service] = [recorder, verifier, coder, proposer, learner]

        async def supervise() -> None:
            while not learner.finished.is_set():
                await asyncio.sleep(1.0)
                _fill_report(report, learner)
                report.seconds = _time.monotonic() - t0
                if on_tick:
                    on_tick(report)
                if report.seconds > options.time_limit_s:
                    break
            report.finished = learner.finished.is_set()
            # Let the last policies reach the generators (and their loads the store).
            for _ in range(600):
                if learner.state.policies_loaded():
                    break
                await asyncio.sleep(0.2)
            for s in services:
                s.request_stop()

        sup = asyncio.create_task(supervise())
        try:
            await run_services(services, http_host=settings.http_host, http_port=settings.http_port)
        finally:
            sup.cancel()
            await proposer_llm.close()
            await coder_llm.close()
        _fill_report(report, learner)
        report.seconds = _time.monotonic() - t0
    return report


def _as_path(p: str) -> Any:
    from pathlib import Path

    return Path(p)


def _fill_report(report: RunReport, learner: Any) -> None:
    state = learner.state
    report.counts = dict(state.counts)
    statuses: dict[str, int] = {}
    for k in state.kernels.values():
        if k.verdict is not None:
            statuses[k.verdict.status.value] = statuses.get(k.verdict.status.value, 0) + 1
    report.statuses = statuses
    report.steps = list(learner.step_log)
