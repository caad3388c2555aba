"""The verifier service on the embedded stack: kernels from the bus become verdicts in the
store (with the consumer's offsets in the same transaction); a kernel's module comes from
``kz.modules`` or, failing that, from the store."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import pytest

from kz_stream.app import open_context
from kz_stream.bus import BusMessage, InfrastructureError
from kz_stream.config import Settings, TopicsConfig
from kz_stream.consumers.verifier import VerifierService, verdict_event_id
from kz_stream.events import (
    Event,
    KernelGenerated,
    KernelVerified,
    ModuleProposed,
    ModuleValidation,
    VerdictStatus,
    new_event,
    payload_as,
    source_sha256,
)
from kz_stream.testing.corpus import problems, triton_honest
from kz_stream.verify import Verifier, VerifierConfig

pytestmark = pytest.mark.slow

WRONG_RELU = triton_honest.RELU.replace("tl.maximum(x, 0.0)", "tl.minimum(x, 0.0)")


def embedded(tmp_path: Path, **settings: Any) -> Settings:
    """Settings of an embedded stack of this test's own (SQLite file, in-memory bus)."""
    return Settings(
        database_url=f"sqlite+aiosqlite:///{tmp_path}/kz.sqlite3",
        bus_url=f"memory://{uuid.uuid4().hex}",
        **settings,
    )


def delivered(topic: str, offset: int, event: Event) -> BusMessage:
    return BusMessage(topic, 0, offset, None, b"", event=event)


def kernel_event(module_id: str, source: str, module_source: str = problems.RELU) -> Event:
    kid = uuid.uuid4().hex
    return new_event(
        KernelGenerated(
            kernel_id=kid,
            module_id=module_id,
            module_sha256=source_sha256(module_source),
            group_id="g",
            group_size=2,
            backend="triton",
            source=source,
        ),
        stream_id=f"kernel-{kid}",
        stream_version=0,
    )


async def test_kernels_become_verdicts_in_the_store_with_offsets(tmp_path: Path) -> None:
    settings = embedded(tmp_path, topics=TopicsConfig(partitions=2))
    async with open_context(settings) as ctx:
        module = new_event(
            ModuleProposed(
                module_id="relu",
                api_set=["torch.relu"],
                source=problems.RELU,
                validation=ModuleValidation(valid=True),
            ),
            stream_id="module-relu",
            stream_version=0,
        )
        await ctx.store.append([module])  # as the recorder would
        honest, wrong = kernel_event("relu", triton_honest.RELU), kernel_event("relu", WRONG_RELU)
        await ctx.bus.publish_many(settings.topics.kernels, [honest, wrong])

        verifier = Verifier(VerifierConfig(devices=[]))
        service = VerifierService(ctx, verifier)
        run = asyncio.create_task(service.run())
        try:
            for _ in range(600):
                verdicts = [
                    r async for b in ctx.store.read_all(0, types=["KernelVerified"]) for r in b
                ]
                if len(verdicts) == 2:
                    break
                assert not run.done(), run.exception()
                await asyncio.sleep(0.2)
        finally:
            service.request_stop()
            await asyncio.wait_for(run, 60)

        by_kernel = {payload_as(r.event, KernelVerified).kernel_id: r.event for r in verdicts}
        good = payload_as(by_kernel[honest.payload["kernel_id"]], KernelVerified)
        bad = payload_as(by_kernel[wrong.payload["kernel_id"]], KernelVerified)
        assert good.status is VerdictStatus.CORRECT, good
        assert bad.status is VerdictStatus.INCORRECT and bad.max_rel_error, bad
        assert good.verifier_version and good.hardware
        assert "timing" in good.unchecked  # no GPU here: the verdict says what it skipped
        # The verdict is the next version of the kernel's stream, caused by the kernel event.
        assert by_kernel[good.kernel_id].stream_version == 1
        assert by_kernel[good.kernel_id].causation_id == honest.event_id
        offsets = await ctx.store.get_tracking(VerifierService.group)
        assert sum(offsets.values()) == 2


async def test_a_kernel_delivered_twice_is_stored_with_one_verdict(tmp_path: Path) -> None:
    # Two consumers can verify one kernel: one that lost its partitions mid-batch, and the
    # member that took them over. The verdict's event id depends only on the kernel event and
    # the verifier version, so the second append is a no-op.
    settings = embedded(tmp_path)
    async with open_context(settings) as ctx:
        module = new_event(
            ModuleProposed(module_id="relu", api_set=["torch.relu"], source=problems.RELU,
                           validation=ModuleValidation(valid=True)),
            stream_id="module-relu",
            stream_version=0,
        )
        kernel = kernel_event("relu", triton_honest.RELU)
        await ctx.store.append([module, kernel])
        message = delivered(settings.topics.kernels, 7, kernel)
        async with Verifier(VerifierConfig(devices=[])) as verifier:
            first = VerifierService(ctx, verifier)
            second = VerifierService(ctx, verifier)
            await asyncio.gather(first.verify_batch([message]), second.verify_batch([message]))
            await first.verify_batch([message])  # a redelivery after the commit

        records = await ctx.store.read_stream(kernel.stream_id)
        verdicts = [r.event for r in records if r.event.type == "KernelVerified"]
        assert len(verdicts) == 1
        assert verdicts[0].event_id == verdict_event_id(kernel.event_id)
        assert await ctx.store.get_tracking(VerifierService.group) == {
            f"{settings.topics.kernels}:0": 8
        }


def relu_module(module_id: str) -> Event:
    return new_event(
        ModuleProposed(module_id=module_id, api_set=["torch.relu"], source=problems.RELU,
                       validation=ModuleValidation(valid=True)),
        stream_id=f"module-{module_id}",
        stream_version=0,
    )


async def test_a_module_seen_on_the_bus_needs_no_store_and_a_wrong_one_is_refused(
    tmp_path: Path,
) -> None:
    # The verifier keeps the modules it sees on kz.modules: no wait for the recorder. A
    # kernel whose module hash names another source is an infrastructure fault.
    settings = embedded(tmp_path)
    async with open_context(settings) as ctx:
        message = delivered(settings.topics.modules, 0, relu_module("m1"))
        kernel = kernel_event("m1", triton_honest.RELU)
        other = kernel_event("m1", triton_honest.RELU, module_source="class Model: ...")
        async with Verifier(VerifierConfig(devices=[])) as verifier:
            service = VerifierService(ctx, verifier, module_wait_s=0.0)
            await service.remember_modules([message])
            await service.verify_batch([delivered(settings.topics.kernels, 0, kernel)])
            with pytest.raises(InfrastructureError, match="not the one kernel"):
                await service.verify_batch([delivered(settings.topics.kernels, 1, other)])
        records = await ctx.store.read_stream(kernel.stream_id)
        assert [r.event.stream_version for r in records] == [1]  # the kernel's + 1, computed
        assert payload_as(records[0].event, KernelVerified).status is VerdictStatus.CORRECT


async def test_a_module_only_in_the_store_is_read_from_there_and_a_missing_one_fails(
    tmp_path: Path,
) -> None:
    settings = embedded(tmp_path)
    async with open_context(settings) as ctx:
        await ctx.store.append([relu_module("stored")])  # proposed before this verifier
        stored, missing = kernel_event("stored", triton_honest.RELU), kernel_event("gone", "x")
        async with Verifier(VerifierConfig(devices=[])) as verifier:
            service = VerifierService(ctx, verifier, module_wait_s=0.2)
            await service.verify_batch([delivered(settings.topics.kernels, 0, stored)])
            assert service.modules.get("stored") is not None  # kept for its next kernels
            with pytest.raises(InfrastructureError, match="not in the store"):
                await service.verify_batch([delivered(settings.topics.kernels, 1, missing)])
        verdicts = [r async for b in ctx.store.read_all(0, types=["KernelVerified"]) for r in b]
        assert [r.event.causation_id for r in verdicts] == [stored.event_id]


async def test_a_batch_failed_by_one_kernel_judges_the_others_once(tmp_path: Path) -> None:
    """A kernel whose module is nowhere fails its batch; the bus then retries the batch and
    splits it. The other kernels' verdicts, judged already, are not judged again."""
    from tests.integration.test_rescore import CountingVerifier

    settings = embedded(tmp_path)
    async with open_context(settings) as ctx:
        await ctx.store.append([relu_module("relu")])
        honest, orphan = kernel_event("relu", triton_honest.RELU), kernel_event("gone", "x")
        batch = [delivered(settings.topics.kernels, i, e) for i, e in enumerate((honest, orphan))]
        async with CountingVerifier() as verifier:
            service = VerifierService(ctx, verifier, module_wait_s=0.2)
            with pytest.raises(InfrastructureError, match="not in the store"):
                await service.verify_batch(batch)
            assert verifier.judged == 1
            await service.verify_batch(batch[:1])  # the half the bus tries on its own
            assert verifier.judged == 1
        verdicts = [r async for b in ctx.store.read_all(0, types=["KernelVerified"]) for r in b]
        assert [r.event.causation_id for r in verdicts] == [honest.event_id]
