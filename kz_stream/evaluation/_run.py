"""``kz eval run``: sample a policy on every problem of a suite, verify every kernel, and
record it all as events, resumably.

Events (correlation id: the evaluation run id, which starts with ``eval-``):

- ``EvaluationStarted`` on stream ``evaluation-<run id>``: the suite's problems, the policy,
  backend, samples, sampling and whether the reference is also timed under
  ``torch.compile`` (``compile_baseline``);
- ``ModuleProposed`` per problem (stream ``module-kb-<sha of its source>``, shared by
  every run that evaluates the same source), so the verifier, ``kz audit`` and a future
  re-scoring find the reference where they find a proposed module's;
- ``KernelGenerated`` per problem × sample (the Coder's prompt and extraction, through
  ``kz_stream.producers.coder.kernel_event``) and its ``KernelVerified`` (through
  ``kz_stream.consumers.verifier.verdict_event``, the verifier service's own code).

Ids are derived from (run id, problem, sample index), so a run started again with the
same id skips the pairs whose verdicts are stored and verifies, without sampling again,
kernels that were stored but not yet judged. The run writes to the store itself rather
than through ``kz.kernels``: live verifiers would judge its kernels a second time, and
the resume needs to know what is stored. ``RunState`` ignores evaluation runs, so their
kernels never become training data.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kz_stream.config import Settings
from kz_stream.consumers.verifier import verdict_event
from kz_stream.evaluation._suite import Suite
from kz_stream.evaluation._throughput import StageTimes
from kz_stream.events import (
    EVALUATION_PREFIX,
    RETRIED_STATUS,
    EvaluationProblem,
    EvaluationStarted,
    Event,
    KernelGenerated,
    KernelVerified,
    ModuleProposed,
    ModuleValidation,
    PolicyVersionPublished,
    new_event,
    payload_as,
    source_sha256,
)
from kz_stream.llm import BackendError, BackendLost, KVCache, LLMBackend, SamplingParams
from kz_stream.logging import configure_logging
from kz_stream.modules import coder_messages, normalized_hash, prompt_text
from kz_stream.producers.coder import kernel_event
from kz_stream.runtime import first_error
from kz_stream.store import EventStore
from kz_stream.verify import Backend

__all__ = [
    "EvalOptions",
    "EvalProgress",
    "EvalRecord",
    "kernel_id_of",
    "load_evaluation",
    "new_run_id",
    "open_policy",
    "run_evaluation",
]

_NAMESPACE = uuid.UUID("0b6f4a51-6d0e-4f3e-9c7a-2f5e8d1c3b90")


def new_run_id() -> str:
    """A fresh evaluation run id."""
    return f"{EVALUATION_PREFIX}{uuid.uuid4().hex[:12]}"


def kernel_id_of(run_id: str, problem_id: str, sample: int) -> str:
    """The kernel id of one problem × sample pair of a run (the same on every resume)."""
    return uuid.uuid5(_NAMESPACE, f"{run_id}/{problem_id}/{sample}").hex


def _module_id(source: str) -> str:
    return "kb-" + hashlib.sha256(source.encode()).hexdigest()[:24]


@dataclass(frozen=True)
class EvalOptions:
    run_id: str
    policy: str = "base"
    backend: Backend = "triton"
    samples: int = 10
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(max_tokens=2048))
    model: str | None = None  # served model name (endpoint) or base model dir (adapter)
    api_key: str | None = None
    # problems sampled at once (at least a local model's batch of them); their samples
    # verified at once
    concurrency: int = 4
    device: str | None = None  # where a local model generates (None: the CPU)
    batch_size: int = 8  # a local model's generation batch (rows of prompt x sample)
    kv_cache: KVCache = "dynamic"  # a local model's KV cache (TransformersBackend)
    # The verifier also times the reference under torch.compile (on a GPU; once per
    # problem with a timed kernel): VerifierConfig.compiled_baseline for this run.
    compile_baseline: bool = True

    @property
    def generation_slots(self) -> int:
        """Problems sampled at once: ``concurrency``, or enough to fill a local model's batch.

        With one sample per problem, ``--batch-size 128 --concurrency 14`` generated in
        batches of 14 (an H200 held-out evaluation, 2026-12-03: 14 of 106 in 2.7 minutes).
        """
        return max(self.concurrency, -(-self.batch_size // self.samples))


@dataclass
class EvalProgress:
    """Counters the CLI draws progress bars from."""

    to_generate: int = 0
    generated: int = 0
    to_verify: int = 0
    verified: int = 0
    correct: int = 0
    resumed: int = 0  # pairs whose verdicts were already stored
    # problem id -> why its samples could not be generated (the backend's error); nothing
    # of it is stored, so a resume tries it again
    not_generated: dict[str, str] = field(default_factory=dict)


@dataclass
class EvalRecord:
    """What the store holds of one evaluation run."""

    started: EvaluationStarted
    kernels: dict[str, str] = field(default_factory=dict)  # kernel id -> problem id
    verdicts: dict[str, dict[str, Any]] = field(default_factory=dict)  # kernel id -> payload
    # kernel id -> (stream version, attempt) of its newest verdict
    verdict_at: dict[str, tuple[int, int]] = field(default_factory=dict)
    times: dict[str, StageTimes] = field(default_factory=dict)  # kernel id -> its stages


async def load_evaluation(store: EventStore, run_id: str) -> EvalRecord | None:
    """The run's start, its kernels and their newest verdicts, or None if there is no run."""
    records = await store.read_stream(f"evaluation-{run_id}")
    if not records:
        return None
    started = payload_as(records[0].event, EvaluationStarted)
    record = EvalRecord(started)
    problem_of = {p.module_id: p.problem_id for p in started.problems}
    # details: KernelBench's rule and the compiled baseline (speedup_vs_compile) are there.
    fields = ("kernel_id", "module_id", "status", "speedup", "check", "verifier_version",
              "speedup_ci", "reason", "details", "generation_s")
    generated: dict[str, tuple[float, float | None]] = {}
    verified: dict[str, tuple[float, dict[str, Any]]] = {}
    # Only this run's events: a store kept for days holds far more of training runs'.
    async for batch in store.read_all(
        0, types=["KernelGenerated", "KernelVerified"], payload_fields=fields,
        correlation_id=run_id,
    ):
        for r in batch:
            e = r.event
            kid = e.payload["kernel_id"]
            at = e.occurred_at.timestamp()
            if e.type == "KernelGenerated":
                record.kernels[kid] = problem_of[e.payload["module_id"]]
                generated[kid] = (at, e.payload.get("generation_s"))
            else:
                record.verdicts[kid] = e.payload  # the newest wins
                tries = record.verdict_at[kid][1] + 1 if kid in record.verdict_at else 0
                record.verdict_at[kid] = (e.stream_version, tries)
                verified[kid] = (at, e.payload.get("details") or {})
    for kid in generated.keys() | verified.keys():
        gen_at, gen_s = generated.get(kid, (None, None))
        ver_at, details = verified.get(kid, (None, {}))
        builds = [float(b.get("seconds") or 0) for b in details.get("builds") or []]
        record.times[kid] = StageTimes(gen_at, gen_s, ver_at, details.get("seconds"),
                                       details.get("prepare_s"), max(builds, default=0.0),
                                       float(details.get("preflight_s") or 0.0),
                                       float(details.get("host_wait_s") or 0.0),
                                       float(details.get("reference_facts_s") or 0.0))
    return record


async def open_policy(
    spec: str, store: EventStore | None, options: EvalOptions
) -> LLMBackend:
    """The LLM a policy spec names.

    - ``base``: the embedded SmolLM2 (or ``options.model``, a model folder);
    - a folder: a LoRA adapter (``adapter_config.json``) on the base model, or a model;
    - ``run:<run id>[:<version>]``: a Coder policy version that run published (its newest
      when the version is left out), loaded as the generators load it, on the base model
      it was trained from;
    - ``http(s)://…``: an OpenAI-compatible endpoint (``options.model`` names the served
      model); only text is asked for, so hosted models work;
    - ``teacher``: the warm start's Triton teacher (``kz_stream.warmstart.teacher``), which
      lowers synthesized modules and answers others with no kernel.
    """
    from kz_stream.llm import create_backend

    local: dict[str, Any] = {"device": options.device, "max_batch_size": options.batch_size,
                             "kv_cache": options.kv_cache}
    if spec == "teacher":
        from kz_stream.warmstart.teacher import TeacherBackend

        return TeacherBackend()
    if spec.startswith(("http://", "https://")):
        return create_backend("vllm-server", base_url=spec, model=options.model,
                              api_key=options.api_key, token_ids=False)
    if spec == "base":
        return create_backend("transformers", model=options.model, **local)
    if spec.startswith("run:"):
        if store is None:
            raise ValueError(f"--policy {spec!r} needs the event store that holds the run")
        run_id, _, version = spec[len("run:"):].partition(":")
        published = await _published_policy(store, run_id, int(version) if version else None)
        # The base the learner trained on, unless --model names another.
        base = options.model or published.base_model or None
        if published.kind == "lora":
            # A policy under evaluation never changes: its adapter is merged (decodes faster).
            return create_backend("transformers", model=base, adapter=published.uri,
                                  merge_adapter=True, policy_version=published.version, **local)
        backend = create_backend("transformers", model=base, **local)
        await backend.load_policy(published.version, published.uri, kind=published.kind)
        return backend
    if _is_adapter(spec):
        return create_backend("transformers", model=options.model, adapter=spec,
                              merge_adapter=True, policy_version=1, **local)
    return create_backend("transformers", model=spec, **local)


def _is_adapter(folder: str) -> bool:
    """Whether a policy folder is a LoRA adapter (else a model); raises if it is no folder."""
    path = Path(folder)
    if not path.is_dir():
        raise ValueError(
            f"--policy {folder!r}: not base, run:<id>[:<version>], a URL or a folder"
        )
    return (path / "adapter_config.json").exists()


async def _published_policy(
    store: EventStore, run_id: str, version: int | None
) -> PolicyVersionPublished:
    found: dict[int, PolicyVersionPublished] = {}
    async for batch in store.read_all(
        0, types=["PolicyVersionPublished"], correlation_id=run_id
    ):
        for r in batch:
            p = payload_as(r.event, PolicyVersionPublished)
            if p.role == "coder":
                found[p.version] = p
    if not found:
        raise LookupError(f"run {run_id!r} published no Coder policy in this store")
    if version is None:
        return found[max(found)]
    if version not in found:
        raise LookupError(f"run {run_id!r} published Coder versions {sorted(found)}, not {version}")
    return found[version]


def _started(suite: Suite, options: EvalOptions) -> EvaluationStarted:
    return EvaluationStarted(
        run_id=options.run_id,
        suite=str(suite.root.resolve()),
        backend=options.backend,
        samples=options.samples,
        policy={"spec": options.policy, "model": options.model},
        sampling=options.sampling.as_dict(),
        compile_baseline=options.compile_baseline,
        problems=[
            EvaluationProblem(problem_id=p.problem_id, name=p.name, level=p.level,
                              module_id=_module_id(p.source), path=str(p.path))
            for p in suite.problems
        ],
    )


def _check_resumable(stored: EvaluationStarted, wanted: EvaluationStarted) -> None:
    for name in ("backend", "samples", "policy", "sampling", "compile_baseline"):
        if getattr(stored, name) != getattr(wanted, name):
            raise ValueError(
                f"run {wanted.run_id} exists with {name}={getattr(stored, name)!r}; "
                f"resume it with the same options or choose another --run-id"
            )
    # Ids too: kernel ids derive from problem ids, and the same sources under other ids
    # (another folder name, --level) would sample every problem again, unseen by reports.
    if ([(p.problem_id, p.module_id) for p in stored.problems]
            != [(p.problem_id, p.module_id) for p in wanted.problems]):
        raise ValueError(f"run {wanted.run_id} exists with other problems; choose another --run-id")


EVAL_ORACLES_PER_GPU = 2


async def run_evaluation(
    settings: Settings,
    suite: Suite,
    options: EvalOptions,
    *,
    on_progress: Callable[[EvalProgress], None] | None = None,
) -> EvalProgress:
    """Runs (or resumes) an evaluation and returns its counters; the store holds the rest."""
    from kz_stream.app import make_verifier, open_context

    if not options.run_id.startswith(EVALUATION_PREFIX):
        raise ValueError(f"an evaluation run id starts with {EVALUATION_PREFIX!r}")
    configure_logging(settings.log_level, json=settings.log_json)
    verifier_update: dict[str, Any] = {"compiled_baseline": options.compile_baseline}
    if "preflight" not in settings.verifier.model_fields_set:
        # Weak policies' kernels mostly fail at import or construction: on a GPU, where a
        # KernelBench problem's preparation takes up to minutes, find out first.
        verifier_update["preflight"] = "gpu"
    if "oracles" not in settings.verifier.model_fields_set and settings.verifier.device_ids():
        # An evaluation prepares every problem of the suite, up to minutes each at
        # KernelBench's sizes, mostly host work: several at once (docs/evaluation.md).
        verifier_update["oracles"] = EVAL_ORACLES_PER_GPU
    settings = settings.model_copy(update={
        "run_id": options.run_id,
        "verifier": settings.verifier.model_copy(update=verifier_update),
    })
    progress = EvalProgress()

    def notify() -> None:
        if on_progress is not None:
            on_progress(progress)

    wanted = _started(suite, options)
    sources = {p.problem_id: p.source for p in suite.problems}
    async with open_context(settings) as ctx:
        store, producer = ctx.store, ctx.producer_id
        record = await load_evaluation(store, options.run_id)
        if record is None:
            await store.append(_start_events(suite, wanted, producer))
            record = EvalRecord(wanted)
        else:
            _check_resumable(record.started, wanted)
        todo: dict[str, list[int]] = {}  # problem id -> sample indices to generate
        unverified: list[str] = []  # kernel ids stored without a verdict
        for p in wanted.problems:
            for i in range(options.samples):
                kid = kernel_id_of(options.run_id, p.problem_id, i)
                if kid in record.verdicts and record.verdicts[kid]["status"] == RETRIED_STATUS:
                    unverified.append(kid)  # the verifier's failure, not the kernel's: again
                elif kid in record.verdicts:
                    progress.resumed += 1
                elif kid in record.kernels:
                    unverified.append(kid)
                else:
                    todo.setdefault(p.problem_id, []).append(i)
        progress.to_generate = sum(len(v) for v in todo.values())
        progress.to_verify = progress.to_generate + len(unverified)
        notify()
        if not progress.to_verify:
            return progress
        verifier = make_verifier(settings)
        module_of = {p.problem_id: p.module_id for p in wanted.problems}
        # One gate per stage: with one shared gate, the problems still waiting to be
        # sampled took every slot a finished sample freed, so no kernel was verified
        # until the last one was generated. Verification's gate is wide (every sample
        # of `concurrency` problems): the verifier limits its own work (workers, oracles,
        # the host's memory), and on an H200 the samples of problems waiting for the
        # host's memory held a narrow gate while the kernels that need no preparation
        # (92% of the warm start's) waited behind them (docs/evaluation.md, sixth attempt).
        generating = asyncio.Semaphore(options.generation_slots)
        verifying = asyncio.Semaphore(options.concurrency * options.samples)

        async def verify(event: Event, problem_id: str) -> None:
            again = record.verdict_at.get(payload_as(event, KernelGenerated).kernel_id)
            async with verifying:
                verdict = await verdict_event(
                    verifier, event, sources[problem_id], producer=producer,
                    stream_version=None if again is None else again[0] + 1,
                    attempt=0 if again is None else again[1] + 1,
                )
            await store.append([verdict])
            progress.verified += 1
            progress.correct += payload_as(verdict, KernelVerified).status == "correct"
            notify()

        async def generate(problem_id: str, indices: Sequence[int]) -> list[Event]:
            async with generating:
                events = await _sample(backend, options, problem_id, module_of[problem_id],
                                       sources[problem_id], indices, producer)
            await store.append(events)
            progress.generated += len(events)
            notify()
            return events

        async def generate_then_verify(pid: str, indices: list[int]) -> None:
            try:
                events = await generate(pid, indices)
            except BackendLost:
                raise  # the engine is gone: no problem will be sampled
            except BackendError as error:
                # One problem the backend refuses (an endpoint's 400 for a prompt over the
                # context, an out-of-memory batch) must not stop the others, nor every
                # resume at the same problem.
                progress.not_generated[pid] = str(error)
                notify()
                return
            async with asyncio.TaskGroup() as tg:
                for e in events:
                    tg.create_task(verify(e, pid))

        backend = await open_policy(options.policy, store, options)
        try:
            async with verifier, asyncio.TaskGroup() as tg:
                for k in unverified:
                    tg.create_task(verify(await _stored_kernel(store, k), record.kernels[k]))
                for pid, indices in todo.items():
                    tg.create_task(generate_then_verify(pid, indices))
        except BaseExceptionGroup as group:
            # One failure cancels the rest (a TaskGroup); report it, not the group.
            raise first_error(group) from None
        finally:
            await backend.close()
    return progress


def _start_events(suite: Suite, started: EvaluationStarted, producer: str) -> list[Event]:
    """``EvaluationStarted`` and each problem's ``ModuleProposed`` (ids fixed by content,
    so a problem evaluated by many runs is stored once)."""
    events = [new_event(started, stream_id=f"evaluation-{started.run_id}", stream_version=0,
                        producer=producer, correlation_id=started.run_id)]
    for p, meta in zip(suite.problems, started.problems, strict=True):
        module = ModuleProposed(
            module_id=meta.module_id,
            api_set=[],
            source=p.source,
            normalized_hash=normalized_hash(p.source),
            validation=ModuleValidation(valid=True, detail=f"evaluation problem {p.problem_id}"),
        )
        events.append(new_event(module, stream_id=f"module-{meta.module_id}", stream_version=0,
                                event_id=uuid.uuid5(_NAMESPACE, meta.module_id),
                                producer=producer, correlation_id=started.run_id))
    return events


async def _stored_kernel(store: EventStore, kernel_id: str) -> Event:
    [first, *_] = await store.read_stream(f"kernel-{kernel_id}")
    return first.event


async def _sample(
    backend: LLMBackend,
    options: EvalOptions,
    problem_id: str,
    module_id: str,
    source: str,
    indices: Sequence[int],
    producer: str,
) -> list[Event]:
    """Samples the missing kernels of one problem with the Coder's own prompt."""
    prompt = coder_messages(source, options.backend)
    started = time.monotonic()
    [samples] = await backend.generate([prompt], n=len(indices), sampling=options.sampling)
    generation_s = time.monotonic() - started
    text = prompt_text(prompt)
    events = []
    for i, sample in zip(indices, samples, strict=True):
        kid = kernel_id_of(options.run_id, problem_id, i)
        events.append(kernel_event(
            sample,
            kernel_id=kid,
            module_id=module_id,
            module_sha256=source_sha256(source),
            group_id=f"{options.run_id}/{problem_id}",
            group_size=options.samples,
            backend=options.backend,
            prompt=text,
            sampling=options.sampling,
            producer=producer,
            correlation_id=options.run_id,
            causation_id=None,
            event_id=uuid.uuid5(_NAMESPACE, f"kernel/{kid}"),
            generation_s=generation_s,
        ))
    return events
