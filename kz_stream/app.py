"""The composition root: builds the store, bus and services that settings describe."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kz_stream.config import Settings, validated_copy
from kz_stream.logging import configure_logging
from kz_stream.runtime import Service, ServiceContext, run_services
from kz_stream.warmstart import warm_adapter

if TYPE_CHECKING:
    from kz_stream.store import EventStore
    from kz_stream.summary import Outcome, RunSummary
    from kz_stream.verify import Verifier

__all__ = [
    "RunOptions",
    "RunReport",
    "ensure_sqlite_dir",
    "evaluation_hashes",
    "load_summary",
    "make_verifier",
    "open_context",
    "projection_by_name",
    "redact_url",
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
            if settings.resilience.create_topics:
                await bus.create_topics(settings.topics.specs())
            # Otherwise the DependencyMonitor's first probe reports any that are missing.
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


def redact_url(url: str) -> str:
    """A database URL with its password hidden, for messages."""
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


def service_by_name(name: str, ctx: ServiceContext) -> Service:
    """Builds one service from ``ctx.settings``. Imports lazily: each service pulls in its
    own heavy dependencies (torch, transformers, TRL) only when it is built."""
    settings = ctx.settings
    if name == "recorder":
        from consumers.recorder import Recorder

        return Recorder(ctx)
    if name == "verifier":
        from consumers.verifier import VerifierService

        return VerifierService(ctx, make_verifier(settings))
    if name == "proposer":
        from producers.proposer import ProposerConfig, ProposerService
        from producers.seeds import SEED_MODULES, synthesized_seeds

        p = settings.proposer
        return ProposerService(
            ctx,
            _backend(p.llm, warm_adapter(settings, "proposer")),
            ProposerConfig(
                proposals_per_prompt=p.proposals_per_prompt,
                concurrency=p.concurrency,
                max_modules=p.max_modules,
                sampling=_sampling(p.llm),
                seed_modules=(*SEED_MODULES, *synthesized_seeds(p.synthesized_seeds))
                if p.seed_modules else (),
                synthesized_fallback=p.synthesized_fallback,
                evaluation_hashes=evaluation_hashes(p.decontaminate),
            ),
        )
    if name == "coder":
        from producers.coder import CoderConfig, CoderService

        c = settings.coder
        return CoderService(
            ctx,
            _backend(c.llm, warm_adapter(settings, "coder")),
            CoderConfig(
                group_size=c.group_size,
                backends=c.backends,
                max_staleness=c.max_staleness,
                sampling=_sampling(c.llm),
            ),
        )
    if name == "learner":
        from consumers.learner import LearnerService, LearnerServiceConfig
        from kz_stream.rl import AlternationConfig

        lc = settings.learner
        return LearnerService(
            ctx,
            lambda role, d: _make_learner(settings, role, d),
            LearnerServiceConfig(
                checkpoint_dir=lc.checkpoint_dir,
                groups_per_step=lc.groups_per_step,
                group_timeout_s=lc.group_timeout_s,
                roles=lc.roles,
                alternation=AlternationConfig(
                    proposer_steps=lc.proposer_steps,
                    coder_steps=lc.coder_steps,
                    rounds=lc.rounds,
                    order=lc.order,
                ),
            ),
        )
    raise ValueError(f"unknown service {name!r}")


def evaluation_hashes(suites: Sequence[Path]) -> dict[str, str]:
    """Normalized hashes of the problems of evaluation suites -> "evaluation problem <id>"."""
    from kz_stream.evaluation import load_suite
    from kz_stream.modules import normalized_hash

    return {
        normalized_hash(p.source): f"evaluation problem {p.problem_id}"
        for suite in suites
        for p in load_suite(suite).problems
    }


def make_verifier(settings: Settings) -> Verifier:
    """The verifier the settings describe (its GPUs; ``[]``: the CPU path)."""
    from kz_stream.verify import Verifier, VerifierConfig

    chosen = settings.verifier.model_dump(exclude_none=True)  # every field is a config knob
    return Verifier(VerifierConfig(**chosen))


def _backend(llm: Any, adapter: Path | None = None) -> Any:
    from kz_stream.llm import create_backend

    extra = {"adapter": str(adapter)} if adapter is not None else {}
    return create_backend(llm.kind, model=llm.model, base_url=llm.base_url, **extra)


def _sampling(llm: Any) -> Any:
    from kz_stream.llm import SamplingParams

    return SamplingParams(max_tokens=llm.max_tokens, temperature=llm.temperature)


def _make_learner(settings: Settings, role: str, directory: Any) -> Any:
    from kz_stream.rl.trainer import CoderLearner, LearnerConfig, ProposerLearner

    lc = settings.learner
    if lc.model:
        model_dir = lc.model
    else:
        from kz_stream.llm import smollm2_dir

        model_dir = str(smollm2_dir())
    llm = settings.coder.llm if role == "coder" else settings.proposer.llm
    cfg = LearnerConfig(
        model=model_dir,
        output_dir=str(directory),
        temperature=llm.temperature,
        learning_rate=lc.learning_rate,
        lora_r=lc.lora_r,
        full_finetune=lc.full_finetune,
        max_staleness=lc.max_staleness,
        micro_batches=lc.micro_batches,
        gradient_checkpointing=lc.gradient_checkpointing,
        init_adapter=str(adapter)
        if (adapter := warm_adapter(settings, "coder" if role == "coder" else "proposer"))
        else None,
    )
    cls = CoderLearner if role == "coder" else ProposerLearner
    return cls(cfg, checkpoint_dir=directory)


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
    max_new_tokens: int = 640  # most warm-Coder kernels fit (p50 504 tokens); CPU time
    # Both generators' (and so the learner's) sampling temperature; None: the settings'.
    temperature: float | None = None
    backends: tuple[str, ...] = ("triton",)
    seed_modules: bool = True
    order: tuple[str, ...] = ("coder", "proposer")
    time_limit_s: float = 3600.0
    checkpoint_dir: str = ".kz/policies"

    def apply(self, settings: Settings) -> Settings:
        """The settings of a one-process run of this size (the verifier on the CPU path
        unless a GPU is visible)."""

        def llm(cfg: Any) -> Any:
            changes: dict[str, Any] = {"max_tokens": self.max_new_tokens}
            if self.temperature is not None:
                changes["temperature"] = self.temperature
            return validated_copy(cfg, **changes)

        s = settings
        return s.model_copy(
            update={
                "proposer": validated_copy(
                    s.proposer,
                    proposals_per_prompt=self.proposals_per_prompt,
                    seed_modules=self.seed_modules,
                    llm=llm(s.proposer.llm),
                ),
                "coder": validated_copy(
                    s.coder,
                    group_size=self.group_size,
                    backends=self.backends,
                    llm=llm(s.coder.llm),
                ),
                "learner": validated_copy(
                    s.learner,
                    checkpoint_dir=Path(self.checkpoint_dir),
                    groups_per_step=self.groups_per_step,
                    proposer_steps=self.steps_per_turn,
                    coder_steps=self.steps_per_turn,
                    rounds=self.rounds,
                    order=self.order,
                    learning_rate=1e-4,
                    lora_r=8,
                    # One completion per micro-batch, activations recomputed: a step
                    # peaked at 15.6 GB on the CPU in one batch (two learners' steps
                    # then exceeded a 23 GB machine), 4.2 GB this way, and ran faster.
                    micro_batches=self.group_size * self.groups_per_step,
                    gradient_checkpointing=True,
                ),
            }
        )


@dataclass
class RunReport:
    """What a run did: live counters for the per-round tables, how it ended, and at the
    end the summary replayed from the store."""

    counts: dict[str, int] = field(default_factory=dict)
    statuses: dict[str, int] = field(default_factory=dict)
    steps: list[dict[str, Any]] = field(default_factory=list)
    finished: bool = False
    seconds: float = 0.0
    # "finished", "time_limit", or "interrupted" (SIGINT/SIGTERM stopped the services).
    outcome: Outcome | None = None
    summary: RunSummary | None = None


async def load_summary(
    store: EventStore,
    settings: Settings,
    *,
    outcome: Outcome,
    session_seconds: float,
    session_started: datetime | None = None,
    detail: str = "",
) -> RunSummary:
    """The summary of run ``settings.run_id`` in ``store``; ``settings`` as the run used
    them (``RunOptions.apply``-ed), for the planned schedule and where things are."""
    from kz_stream.rl import AlternationConfig
    from kz_stream.summary import load_run_summary

    lc = settings.learner
    schedule = AlternationConfig(proposer_steps=lc.proposer_steps, coder_steps=lc.coder_steps,
                                 rounds=lc.rounds, order=lc.order)
    return await load_run_summary(
        store, settings.run_id, outcome=outcome, detail=detail,
        session_seconds=session_seconds, session_started=session_started, schedule=schedule,
        store_url=settings.database_url, checkpoint_dir=lc.checkpoint_dir,
    )


async def run_coevolution(
    settings: Settings,
    options: RunOptions,
    *,
    on_tick: Callable[[RunReport], None] | None = None,
) -> RunReport:
    """Runs proposer, coder, verifier, recorder and learner in one process until the
    alternation schedule is over (or the time limit passes, or SIGINT/SIGTERM); the report
    ends with the run's summary, replayed from the store."""
    import time as _time

    settings = options.apply(settings)
    configure_logging(settings.log_level, json=settings.log_json)
    report = RunReport()
    started = datetime.now(UTC)
    t0 = _time.monotonic()
    async with open_context(settings) as ctx:
        names = ["recorder", "verifier", "coder", "proposer", "learner"]
        services = [service_by_name(n, ctx) for n in names]
        learner: Any = services[-1]

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
            report.outcome = "finished" if report.finished else "time_limit"
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
            for s in services:
                backend = getattr(s, "backend", None)
                if backend is not None:
                    await backend.close()
        _fill_report(report, learner)
        report.seconds = _time.monotonic() - t0
        # The services returned before the supervisor stopped them: a signal did.
        report.outcome = report.outcome or "interrupted"
        report.summary = await load_summary(
            ctx.store, settings, outcome=report.outcome, session_seconds=report.seconds,
            session_started=started,
            detail=f"{options.time_limit_s:.0f}s" if report.outcome == "time_limit" else "",
        )
    return report


def _fill_report(report: RunReport, learner: Any) -> None:
    state = learner.state
    report.counts = dict(state.counts)
    statuses: dict[str, int] = {}
    for k in state.kernels.values():
        if k.verdict is not None:
            statuses[k.verdict.status.value] = statuses.get(k.verdict.status.value, 0) + 1
    report.statuses = statuses
    report.steps = list(learner.step_log)
