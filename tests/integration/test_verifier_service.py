"""The verifier service on the embedded stack: kernels from the bus become verdicts in the
store (with the consumer's offsets in the same transaction) and on the verdicts topic."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from consumers.verifier import VerifierService, verdict_event_id
from kz_stream.app import open_context
from kz_stream.bus import BusMessage
from kz_stream.config import Settings, TopicsConfig
from kz_stream.events import (
    KernelGenerated,
    KernelVerified,
    ModuleProposed,
    ModuleValidation,
    VerdictStatus,
    new_event,
    payload_as,
)
from kz_stream.testing.corpus import problems, triton_honest
from kz_stream.verify import Verifier, VerifierConfig

pytestmark = pytest.mark.slow

WRONG_RELU = triton_honest.RELU.replace("tl.maximum(x, 0.0)", "tl.minimum(x, 0.0)")


def kernel_event(module_id: str, source: str) -> object:
    kid = uuid.uuid4().hex
    return new_event(
        KernelGenerated(
            kernel_id=kid,
            module_id=module_id,
            group_id="g",
            group_size=2,
            backend="triton",
            source=source,
        ),
        stream_id=f"kernel-{kid}",
        stream_version=0,
    )


async def test_kernels_become_verdicts_in_the_store_with_offsets(tmp_path: Path) -> None:
    settings = Settings(
        database_url=f"sqlite+aiosqlite:///{tmp_path}/kz.sqlite3",
        bus_url=f"memory://{uuid.uuid4().hex}",
        topics=TopicsConfig(partitions=2),
    )
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
        await ctx.bus.publish_many(settings.topics.kernels, [honest, wrong])  # type: ignore[list-item]

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
        good = payload_as(by_kernel[honest.payload["kernel_id"]], KernelVerified)  # type: ignore[attr-defined]
        bad = payload_as(by_kernel[wrong.payload["kernel_id"]], KernelVerified)  # type: ignore[attr-defined]
        assert good.status is VerdictStatus.CORRECT, good
        assert bad.status is VerdictStatus.INCORRECT and bad.max_rel_error, bad
        assert good.verifier_version and good.hardware
        assert "timing" in good.unchecked  # no GPU here: the verdict says what it skipped
        # The verdict is the next version of the kernel's stream, caused by the kernel event.
        assert by_kernel[good.kernel_id].stream_version == 1
        assert by_kernel[good.kernel_id].causation_id == honest.event_id  # type: ignore[attr-defined]
        offsets = await ctx.store.get_tracking(VerifierService.group)
        assert sum(offsets.values()) == 2


async def test_a_kernel_delivered_twice_is_stored_with_one_verdict(tmp_path: Path) -> None:
    # Two consumers can verify one kernel: one that lost its partitions mid-batch, and the
    # member that took them over. The verdict's event id depends only on the kernel event and
    # the verifier version, so the second append is a no-op.
    settings = Settings(
        database_url=f"sqlite+aiosqlite:///{tmp_path}/kz.sqlite3",
        bus_url=f"memory://{uuid.uuid4().hex}",
    )
    async with open_context(settings) as ctx:
        module = new_event(
            ModuleProposed(module_id="relu", api_set=["torch.relu"], source=problems.RELU,
                           validation=ModuleValidation(valid=True)),
            stream_id="module-relu",
            stream_version=0,
        )
        kernel = kernel_event("relu", triton_honest.RELU)
        await ctx.store.append([module, kernel])  # type: ignore[list-item]
        message = BusMessage(settings.topics.kernels, 0, 7, None, b"", event=kernel)  # type: ignore[arg-type]
        async with Verifier(VerifierConfig(devices=[])) as verifier:
            first = VerifierService(ctx, verifier)
            second = VerifierService(ctx, verifier)
            await asyncio.gather(first.verify_batch([message]), second.verify_batch([message]))
            await first.verify_batch([message])  # a redelivery after the commit

        records = await ctx.store.read_stream(kernel.stream_id)  # type: ignore[attr-defined]
        verdicts = [r.event for r in records if r.event.type == "KernelVerified"]
        assert len(verdicts) == 1
        assert verdicts[0].event_id == verdict_event_id(kernel.event_id)  # type: ignore[attr-defined]
        assert await ctx.store.get_tracking(VerifierService.group) == {
            f"{settings.topics.kernels}:0": 8
        }
