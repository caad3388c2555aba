"""Resuming an embedded stack: its bus starts empty, so the run's work that the store holds
unfinished (valid modules never coded, kernels never verified) is published again, and a
resumed session finishes it, each event stored once."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from pathlib import Path

import pytest

from kz_stream.app import open_context, redeliver_unfinished
from kz_stream.bus import Bus, BusMessage
from kz_stream.config import Settings
from kz_stream.consumers.recorder import Recorder
from kz_stream.consumers.verifier import VerifierService
from kz_stream.events import (
    Event,
    KernelGenerated,
    KernelVerified,
    ModuleProposed,
    ModuleValidation,
    VerdictStatus,
    WorkRedelivered,
    new_event,
    payload_as,
    source_sha256,
)
from kz_stream.runtime import Service, run_services
from kz_stream.testing.corpus import problems, triton_honest
from kz_stream.verify import Verifier, VerifierConfig


def session(tmp_path: Path) -> Settings:
    """One session of the run: the run's store, and a bus of this session's own."""
    return Settings(
        database_url=f"sqlite+aiosqlite:///{tmp_path}/kz.sqlite3",
        bus_url=f"memory://{uuid.uuid4().hex}",
        run_id="run-resumed",
    )


def module(module_id: str, *, valid: bool = True, run_id: str = "run-resumed") -> Event:
    return new_event(
        ModuleProposed(module_id=module_id, api_set=["torch.relu"], source=problems.RELU,
                       validation=ModuleValidation(valid=valid)),
        stream_id=f"module-{module_id}", stream_version=0, correlation_id=run_id,
    )


def kernel(module_id: str) -> Event:
    kid = uuid.uuid4().hex
    return new_event(
        KernelGenerated(kernel_id=kid, module_id=module_id,
                        module_sha256=source_sha256(problems.RELU), group_id=f"g-{module_id}",
                        group_size=2, backend="triton", source=triton_honest.RELU),
        stream_id=f"kernel-{kid}", stream_version=0, correlation_id="run-resumed",
    )


def verdict(k: Event) -> Event:
    g = payload_as(k, KernelGenerated)
    return new_event(
        KernelVerified(kernel_id=g.kernel_id, module_id=g.module_id, group_id=g.group_id,
                       status=VerdictStatus.CORRECT),
        stream_id=k.stream_id, stream_version=1, correlation_id="run-resumed",
    )


async def drain(bus: Bus, topic: str, expected: int) -> list[Event]:
    """The events on ``topic`` of a session's bus, once ``expected`` have arrived."""
    got: list[Event] = []

    async def keep(batch: Sequence[BusMessage]) -> None:
        got.extend(m.event for m in batch if m.event is not None)

    sub = await bus.subscribe(f"reader-{uuid.uuid4().hex}", [topic], keep)
    for _ in range(100):
        if len(got) >= expected:
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.2)  # and nothing more after them
    await sub.stop()
    return got


async def test_a_resumed_session_republishes_only_its_runs_unfinished_work(
    tmp_path: Path,
) -> None:
    coded, uncoded, invalid = module("coded"), module("uncoded"), module("bad", valid=False)
    other_run = module("elsewhere", run_id="another-run")
    judged, unjudged = kernel("coded"), kernel("coded")
    async with open_context(session(tmp_path)) as first:
        await first.store.append(
            [coded, uncoded, invalid, other_run, judged, unjudged, verdict(judged)])

    resumed = session(tmp_path)
    async with open_context(resumed) as ctx:
        again = await redeliver_unfinished(ctx)
        assert (again.modules, again.kernels) == (1, 1)
        modules = await drain(ctx.bus, resumed.topics.modules, 1)
        kernels = await drain(ctx.bus, resumed.topics.kernels, 1)
    # As stored: the same envelopes, so the recorder skips them and ids stay stable.
    assert modules == [uncoded]
    assert kernels == [unjudged]
    # And the store says what was sent again, for an audit of the run's slots.
    async with open_context(session(tmp_path)) as ctx:
        (record,) = [r.event async for b in ctx.store.read_all(0, types=["WorkRedelivered"])
                     for r in b]
        assert payload_as(record, WorkRedelivered) == WorkRedelivered(
            kernel_ids=[unjudged.payload["kernel_id"]],
            module_ids=[uncoded.payload["module_id"]])
        assert record.correlation_id == resumed.run_id


@pytest.mark.slow
async def test_a_kernel_left_unverified_is_verified_when_the_run_resumes(
    tmp_path: Path,
) -> None:
    left = kernel("relu")
    async with open_context(session(tmp_path)) as first:
        await first.store.append([module("relu"), left])  # the session stopped here

    resumed = session(tmp_path)
    async with open_context(resumed) as ctx:
        await redeliver_unfinished(ctx)
        async with Verifier(VerifierConfig(devices=[])) as verifier:
            services = [Recorder(ctx), VerifierService(ctx, verifier)]
            tasks = [asyncio.create_task(s.run()) for s in services]
            try:
                for _ in range(600):
                    stream = await ctx.store.read_stream(left.stream_id)
                    if len(stream) == 2:
                        break
                    assert not any(t.done() for t in tasks), [t.exception() for t in tasks]
                    await asyncio.sleep(0.2)
            finally:
                for s in services:
                    s.request_stop()
                await asyncio.wait_for(asyncio.gather(*tasks), 60)

        stream = await ctx.store.read_stream(left.stream_id)
        # The kernel once (the recorder skipped the republished copy), then its verdict.
        assert [r.event.type for r in stream] == ["KernelGenerated", "KernelVerified"]
        assert payload_as(stream[1].event, KernelVerified).status is VerdictStatus.CORRECT
        assert (await redeliver_unfinished(ctx)).kernels == 0  # nothing left to finish


class LastWords(Service):
    """A generator that publishes one more module as it stops, as the Coder and the
    Proposer do with the call they had in flight."""

    name = "last-words"
    stop_stage = 0

    async def run(self) -> None:
        await self.stopping.wait()
        await asyncio.sleep(0.3)
        await self.ctx.bus.publish(self.ctx.settings.topics.modules, module("last"))


async def test_what_a_generator_publishes_as_it_stops_is_archived(tmp_path: Path) -> None:
    stop = asyncio.Event()
    async with open_context(session(tmp_path)) as ctx:
        run = asyncio.create_task(run_services(
            [Recorder(ctx), LastWords(ctx)], install_signal_handlers=False, stop=stop))
        await asyncio.sleep(0.2)
        stop.set()
        await asyncio.wait_for(run, 30)
        stored = [r.event.stream_id for b in [await ctx.store.read_stream("module-last")]
                  for r in b]
    assert stored == ["module-last"]
