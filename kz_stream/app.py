"""The composition root: builds the store, bus and services that settings describe."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from kz_stream.config import CODER_MAX_TOKENS, Settings, validated_copy
from kz_stream.database_url import ensure_sqlite_dir
from kz_stream.events import WorkRedelivered, new_event
from kz_stream.logging import configure_logging, get_logger
from kz_stream.run_state import read_unfinished_work
from kz_stream.runtime import Service, ServiceContext, run_services
from kz_stream.warmstart import warm_adapter

if TYPE_CHECKING:
    from kz_stream.llm import LLMBackend
    from kz_stream.rl import Role
    from kz_stream.rl.trainer import GRPOLearner
    from kz_stream.store import EventStore
    from kz_stream.summary import Outcome, RunSummary
    from kz_stream.verify import Verifier

__all__ = [
    "RunOptions",
    "RunReport",
    "evaluation_problems",
    "load_summary",
    "make_verifier",
    "open_context",
    "projection_by_name",
    "redeliver_unfinished",
    "run_coevolution",
    "run_named_services",
    "service_by_name",
]


@asynccontextmanager
async def open_context(
    settings: Settings, *, migrate: bool = True
) -> AsyncIterator[ServiceContext]:
    """Opens the store (migrated to head) and the bus (topics created) for services, on
    the cores ``settings.cpus`` names."""
    from kz_stream.bus import open_bus
    from kz_stream.store import open_store

    cores = settings.cpu_set
    if cores is not None:
        # This thread's mask: the threads and processes the services start inherit it.
        try:
            os.sched_setaffinity(0, cores)
        except (OSError, AttributeError) as e:  # cores not here; no affinity (not Linux)
            here = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
            raise ValueError(f"cpus = {settings.cpus}: cannot run on those cores here "
                             f"({e}); this process may use {here or 'no core list'}") from None
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


def service_by_name(name: str, ctx: ServiceContext) -> Service:
    """Builds one service from ``ctx.settings``. Imports lazily: each service pulls in its
    own heavy dependencies (torch, transformers, TRL) only when it is built."""
    settings = ctx.settings
    if name == "recorder":
        from kz_stream.consumers.recorder import Recorder

        return Recorder(ctx)
    if name == "verifier":
        from kz_stream.consumers.verifier import VerifierService

        return VerifierService(ctx, make_verifier(settings))
    if name == "proposer":
        from kz_stream.producers.proposer import ProposerService
        from kz_stream.producers.seeds import SEED_MODULES, synthesized_seeds

        p = settings.proposer
        # Synthesized seeds first: they are in the form the warm Coder learned, so the
        # first Coder groups can earn a reward (the hand-written ones all scored 0 there).
        seeds = (*synthesized_seeds(p.synthesized_seeds), *SEED_MODULES) if p.seed_modules else ()
        return ProposerService(ctx, _backend(settings, "proposer"), p, seed_modules=seeds,
                               evaluation_problems=evaluation_problems(p.decontaminate))
    if name == "coder":
        from kz_stream.producers.coder import CoderService

        return CoderService(ctx, _backend(settings, "coder"), settings.coder)
    if name == "learner":
        from kz_stream.consumers.learner import LearnerService

        return LearnerService(
            ctx, lambda role, d: _make_learner(settings, role, d), settings.learner
        )
    raise ValueError(f"unknown service {name!r}")


def evaluation_problems(suites: Sequence[Path]) -> dict[str, str]:
    """The sources of the problems of evaluation suites -> "evaluation problem <id>"."""
    from kz_stream.evaluation import load_suite

    return {
        p.source: f"evaluation problem {p.problem_id}"
        for suite in suites
        for p in load_suite(suite).problems
    }


def make_verifier(settings: Settings) -> Verifier:
    """The verifier the settings describe (``[verifier]`` is its config)."""
    from kz_stream.verify import Verifier

    return Verifier(settings.verifier)


def _backend(settings: Settings, role: Role) -> LLMBackend:
    """The engine a role's generator samples from, with its warm-start adapter if any."""
    from kz_stream.llm import create_backend

    llm = settings.coder.llm if role == "coder" else settings.proposer.llm
    adapter = warm_adapter(settings, role)
    extra: dict[str, Any] = {"adapter": str(adapter)} if adapter is not None else {}
    if llm.kind == "transformers":
        extra |= {"device": llm.device, "max_batch_size": llm.batch_size,
                  "kv_cache": llm.kv_cache, "merge_adapter": llm.merge_adapter,
                  "gpu_memory_fraction": llm.gpu_memory_fraction}
    if llm.process:
        from kz_stream.llm import ProcessBackend

        return ProcessBackend(llm.kind, model=llm.model, base_url=llm.base_url,
                              log_level=settings.log_level, log_json=settings.log_json, **extra)
    return create_backend(llm.kind, model=llm.model, base_url=llm.base_url, **extra)


def _make_learner(settings: Settings, role: Role, directory: Path) -> GRPOLearner:
    """A role's trainer: the ``[learner]`` settings, the role's sampling temperature (the
    importance ratios need it) and its warm-start adapter."""
    from kz_stream.rl.trainer import CoderLearner, LearnerConfig, ProposerLearner

    lc = settings.learner
    if lc.model:
        model_dir = lc.model
    else:
        from kz_stream.llm import smollm2_dir

        model_dir = str(smollm2_dir())
    llm = settings.coder.llm if role == "coder" else settings.proposer.llm
    adapter = warm_adapter(settings, role)
    cfg = LearnerConfig(model=model_dir, output_dir=str(directory), temperature=llm.temperature,
                        init_adapter=str(adapter) if adapter else None, **lc.trainer_options())
    cls = CoderLearner if role == "coder" else ProposerLearner
    return cls(cfg, checkpoint_dir=directory)


@dataclass(frozen=True)
class Redelivered:
    """What ``redeliver_unfinished`` published again."""

    modules: int = 0
    kernels: int = 0


async def redeliver_unfinished(ctx: ServiceContext) -> Redelivered:
    """Publishes again the run's work that the store holds unfinished: valid modules of
    which no kernel was generated, and kernels without a verdict.

    The embedded bus of a new process starts empty while the store keeps everything, so a
    resumed embedded run would otherwise never code or verify what the last session left in
    flight (its proposal and Coder groups would wait for them for ever). The events go out
    as stored (same ids): the recorder skips them as duplicates, the Coder and the verifier
    act on them. A broker keeps its logs and the groups' offsets, so a Kafka stack needs
    none of this: on a bus whose logs outlive the process this publishes nothing.
    """
    if ctx.bus.logs_outlive_the_process:
        return Redelivered()
    work = await read_unfinished_work(ctx.store, ctx.settings.run_id)
    uncoded, unverified = list(work.modules.values()), list(work.kernels.values())
    topics = ctx.settings.topics
    if uncoded:
        await ctx.bus.publish_many(topics.modules, uncoded)
    if unverified:
        await ctx.bus.publish_many(topics.kernels, unverified)
    if uncoded or unverified:
        # Stored too, so an audit of the run's slots can tell a kernel still in flight when
        # a session stopped from one that was lost (kz_stream.integrity.check_slots).
        record = new_event(
            WorkRedelivered(kernel_ids=list(work.kernels), module_ids=list(work.modules)),
            stream_id=f"redelivery-{uuid.uuid4().hex}", stream_version=0,
            producer=ctx.producer_id, correlation_id=ctx.settings.run_id)
        await ctx.store.append([record])
        get_logger("kz.run").info(
            "unfinished_work_redelivered", modules=len(uncoded), kernels=len(unverified),
            reason="the embedded bus starts empty; the store holds these unfinished")
    return Redelivered(modules=len(uncoded), kernels=len(unverified))


async def run_named_services(settings: Settings, names: Sequence[str]) -> None:
    configure_logging(settings.log_level, json=settings.log_json)
    async with open_context(settings) as ctx:
        await redeliver_unfinished(ctx)
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
    """The co-evolution loop's size. Defaults fit the embedded CPU run.

    ``apply`` makes the settings of the run, in two kinds of change, each logged by
    ``run_coevolution`` (``run_settings``; a warning where it replaces a value the user
    set):

    - The size below (``kz run``'s own options) replaces the settings' values: proposals
      per prompt, group size, groups per step, steps per turn, rounds, order, each
      generator's ``max_tokens``, and both generators' ``temperature`` and ``device`` when
      given.
    - The learner needs values of its own for a short CPU run (``learner_defaults``:
      learning rate 1e-4 and LoRA rank 8, so one step moves the policy; one completion per
      micro-batch with gradient checkpointing, so a step fits in memory). Each is used
      only where the user left that ``[learner]`` key unset (file, environment or
      arguments): an explicit setting wins.
    - A GPU run (``device`` cuda) fills, the same way, the learner's one-batch step and
      the generators' rows per call (``generator_defaults``); its learning rate and rank
      stay the trainer's (``TrainerOptions``).
    """

    rounds: int = 1
    steps_per_turn: int = 1
    group_size: int = 2
    groups_per_step: int = 2
    proposals_per_prompt: int = 2
    # The Coder's completion cap (the settings' default). The warm Coder learned the
    # teacher's answers: for 400 synthesized modules (seed 0) those take 273-556 tokens
    # without a matmul and 658-1,182 with one (median 914), so this run's earlier cap of
    # 640 cut every matmul answer (42% of the modules) into a syntax error, and 1,024 cut
    # 31 of 400.
    max_new_tokens: int = CODER_MAX_TOKENS
    # The Proposer's: its answers are modules, at most 274 tokens (median 184) for 400
    # synthesized sets; a row
    # that degenerates into repetition runs to the cap, and its call waits for it.
    proposer_max_new_tokens: int = 640
    # Both generators' (and so the learner's) sampling temperature; None: the settings'.
    temperature: float | None = None
    # Where both generators' models run (cpu, cuda, cuda:1); None: the settings'. The
    # learner takes a visible GPU by itself, the verifier every visible GPU.
    device: str | None = None
    order: tuple[Role, ...] = ("coder", "proposer")
    time_limit_s: float = 3600.0

    @property
    def on_gpu(self) -> bool:
        return self.device is not None and self.device.startswith("cuda")

    def learner_defaults(self) -> dict[str, Any]:
        """The learner values this run needs where the user set none."""
        if self.on_gpu:
            # A step's groups in one batch: the small model's activations fit a GPU. The
            # rate and rank stay the trainer's: at 1e-4 (this default's until 2026-12-05)
            # the updated Coder passed 1 of 134 kernels on an H200 against its control's
            # 20 of 184 (docs/learning.md).
            return {"micro_batches": 1, "gradient_checkpointing": False}
        # A rate and rank at which one step moves the policy, in a run of a few steps; one
        # completion per micro-batch, activations recomputed: a step peaked at 15.6 GB on
        # the CPU in one batch (two learners' steps then exceeded a 23 GB machine), 4.2 GB
        # this way, and ran faster.
        return {"learning_rate": 1e-4, "lora_r": 8,
                "micro_batches": self.group_size * self.groups_per_step,
                "gradient_checkpointing": True}

    def generator_defaults(self) -> dict[str, dict[str, Any]]:
        """The generators' values a GPU run needs where the user set none, by section.

        On an H200 a transformers decode step took 95-180 ms in the loop whatever a call's
        rows, and every Coder call held one module (4 rows) and took 37-142 s (2026-12-03,
        docs/operations.md), so the loop was bound by calls, not rows. A GPU run puts many
        modules and prompts in a call instead: up to 16 modules (64 rows) for the Coder,
        those that waited behind its running call merged into its next one, and 8 prompts
        for the Proposer; and both decode with their LoRA versions folded into the weights
        (peft's unmerged layers add kernels to a launch-bound step). The Proposer waits
        while two Coder calls' worth of modules (32) have no kernel: in three slots of
        2026-12-04 it ran 60 valid modules ahead, proposals for an old frontier that took
        the GPU and the GIL from the Coder. Each generator's engine runs in a process of its
        own (``llm.process``): beside the Proposer in one process, the Coder's decode step
        took 2.5 times as long (the GIL); in the loop of 2026-12-04 with the engines apart,
        a step took 26-108 ms (median 53-58) against 70-125 ms. The Coder starts a call
        only while fewer than two steps' worth of its kernels wait for a verdict: in the
        ninth run (2026-12-05) it stayed ahead of a verifier judging 16 a minute, and 132 of
        the treatment's 174 kernels came from version 0, sampled before the first step
        (not yet measured with the bound).
        """
        if not self.on_gpu:
            return {}
        modules_per_call = 16
        coder_rows = modules_per_call * self.group_size
        step_kernels = self.group_size * self.groups_per_step
        return {
            "coder": {"max_batch": modules_per_call, "merge_waiting": True,
                      "max_unjudged": 2 * step_kernels},
            "coder.llm": {"batch_size": coder_rows, "merge_adapter": True, "process": True},
            "proposer": {"concurrency": 8, "max_ahead": 2 * modules_per_call},
            "proposer.llm": {"batch_size": 8 * self.proposals_per_prompt,
                             "merge_adapter": True, "process": True},
        }

    def apply(self, settings: Settings) -> Settings:
        """The settings of a one-process run of this size (the verifier on the CPU path
        unless a GPU is visible); see the class docstring for what changes."""
        s = settings
        llm: dict[str, Any] = {}
        if self.temperature is not None:
            llm["temperature"] = self.temperature
        if self.device is not None:
            llm["device"] = self.device
        unset = {k: v for k, v in self.learner_defaults().items()
                 if k not in s.learner.model_fields_set}
        gpu = self.generator_defaults()

        def fill(section: BaseModel, key: str) -> dict[str, Any]:
            return {k: v for k, v in gpu.get(key, {}).items()
                    if k not in section.model_fields_set}

        return s.model_copy(
            update={
                "proposer": validated_copy(
                    s.proposer, proposals_per_prompt=self.proposals_per_prompt,
                    llm=validated_copy(s.proposer.llm, **llm,
                                       max_tokens=self.proposer_max_new_tokens,
                                       **fill(s.proposer.llm, "proposer.llm")),
                    **fill(s.proposer, "proposer"),
                ),
                "coder": validated_copy(
                    s.coder, group_size=self.group_size,
                    llm=validated_copy(s.coder.llm, **llm, max_tokens=self.max_new_tokens,
                                       **fill(s.coder.llm, "coder.llm")),
                    **fill(s.coder, "coder"),
                ),
                "learner": validated_copy(
                    s.learner,
                    groups_per_step=self.groups_per_step,
                    proposer_steps=self.steps_per_turn,
                    coder_steps=self.steps_per_turn,
                    rounds=self.rounds,
                    order=self.order,
                    **unset,
                ),
            }
        )

    def log_changes(self, settings: Settings, applied: Settings) -> None:
        """Logs each value ``apply`` changed: a warning where the user had set it."""
        log = get_logger("kz.run")
        own = {f"learner.{k}" for k in self.learner_defaults()} | {
            f"{section}.{k}" for section, values in self.generator_defaults().items()
            for k in values
        }
        for key, old, new, user_set in _changes(settings, applied):
            if user_set:
                log.warning("run_settings", key=key, setting=old, run=new,
                            reason="kz run option replaces the setting")
            else:
                reason = "the run's default where none is set" if key in own else "kz run option"
                log.info("run_settings", key=key, default=old, run=new, reason=reason)


def _changes(
    before: BaseModel, after: BaseModel, prefix: str = ""
) -> Iterator[tuple[str, Any, Any, bool]]:
    """The values that differ between two settings: dotted key, old and new value, and
    whether the old one was set by the user (not a default)."""
    for name in type(before).model_fields:
        old, new = getattr(before, name), getattr(after, name)
        if isinstance(old, BaseModel) and isinstance(new, BaseModel):
            yield from _changes(old, new, f"{prefix}{name}.")
        elif old != new:
            yield f"{prefix}{name}", old, new, name in before.model_fields_set


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
    # Set once the run has begun to stop on its own (schedule done or time limit).
    stopping: bool = False


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
    from kz_stream.summary import load_run_summary

    lc = settings.learner
    return await load_run_summary(
        store, settings.run_id, outcome=outcome, detail=detail,
        session_seconds=session_seconds, session_started=session_started,
        schedule=lc.alternation(), store_url=settings.database_url,
        checkpoint_dir=lc.checkpoint_dir,
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

    applied = options.apply(settings)
    configure_logging(applied.log_level, json=applied.log_json)
    options.log_changes(settings, applied)
    settings = applied
    report = RunReport()
    started = datetime.now(UTC)
    t0 = _time.monotonic()
    async with open_context(settings) as ctx:
        await redeliver_unfinished(ctx)
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
            report.stopping = True
            if on_tick:
                on_tick(report)
            # A finished run lets its last policies reach the generators (and their loads
            # the store); at a time limit the slot's time is up: a resumed run loads them.
            for _ in range(600 if report.finished else 0):
                if learner.state.policies_loaded():
                    break
                await asyncio.sleep(0.2)
            if report.finished:
                # No step will train on what the generators are sampling now: give it up
                # (its modules come again at a next start). On the CPU the calls in flight
                # at the end took 17 of a run's 37 minutes (2026-12-05).
                from kz_stream.producers.coder import CoderService
                from kz_stream.producers.proposer import ProposerService

                for s in services:
                    if isinstance(s, CoderService | ProposerService):
                        s.give_up_in_flight = True
            stop.set()

        stop = asyncio.Event()
        sup = asyncio.create_task(supervise())
        try:
            await run_services(services, http_host=settings.http_host,
                               http_port=settings.http_port, stop=stop)
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
