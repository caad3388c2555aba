"""The verifier service: reads ``kz.kernels``, verifies each kernel in worker processes,
writes ``KernelVerified`` with the consumer's offsets in one transaction, then publishes
the verdict on ``kz.verdicts``.

A bad kernel is a verdict. A kernel whose module is not in the store (yet) is retried for
a while and then raised as an infrastructure fault, which the bus dead-letters.

A verdict's event id is derived from the kernel event's id and the verifier version, so a
kernel verified twice by one verifier version (a consumer that lost its partitions while
verifying, a redelivery after a crash between commit and offset) is stored once: the
store skips an event id it holds.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Sequence

from kz_stream.bus import BusMessage, InfrastructureError, offsets_after
from kz_stream.events import (
    Event,
    KernelGenerated,
    ModuleProposed,
    new_event,
    payload_as,
)
from kz_stream.runtime import Service, ServiceContext, StoreOffsets
from kz_stream.store import EventStore, RecordedEvent
from kz_stream.verify import VERIFIER_VERSION, Candidate, Problem, Verifier
from kz_stream.verify.events import to_kernel_verified

__all__ = ["VerifierService", "verdict_event", "verdict_event_id"]

_VERDICT_NAMESPACE = uuid.UUID("6d1c7f0e-3b7a-4c55-9a0e-5b2d1f8e9c41")


def verdict_event_id(kernel_event_id: uuid.UUID, verifier_version: str = VERIFIER_VERSION
                     ) -> uuid.UUID:
    """The event id of the verdict on one kernel event by one verifier version."""
    return uuid.uuid5(_VERDICT_NAMESPACE, f"{kernel_event_id}/{verifier_version}")


async def verdict_event(
    verifier: Verifier, store: EventStore, event: Event, module_source: str, *, producer: str,
    read_stream: Callable[[str], Awaitable[Sequence[RecordedEvent]]] | None = None,
) -> Event:
    """Verifies a ``KernelGenerated`` event against its module's source and returns the
    ``KernelVerified`` event, next in the kernel's stream, with its deterministic id.
    ``read_stream`` reads the kernel's stream (default: ``store.read_stream``)."""
    kernel = payload_as(event, KernelGenerated)
    verdict = await verifier.verify(
        Problem(module_source), Candidate(kernel.source, backend=kernel.backend)
    )
    payload = to_kernel_verified(
        verdict,
        kernel_id=kernel.kernel_id,
        module_id=kernel.module_id,
        group_id=kernel.group_id,
        policy_version=kernel.policy_version,
    )
    history = await (read_stream or store.read_stream)(event.stream_id)
    version = max([r.event.stream_version for r in history] + [event.stream_version]) + 1
    return new_event(
        payload,
        event_id=verdict_event_id(event.event_id, verdict.verifier_version),
        stream_id=event.stream_id,
        stream_version=version,
        producer=producer,
        correlation_id=event.correlation_id,
        causation_id=event.event_id,
    )


class VerifierService(Service):
    name = "verifier"
    group = "kz-verifier"

    def __init__(
        self,
        ctx: ServiceContext,
        verifier: Verifier | None = None,
        *,
        module_wait_s: float = 30.0,
        max_batch: int = 8,
    ) -> None:
        super().__init__(ctx)
        self.verifier = verifier or Verifier()
        self.module_wait_s = module_wait_s
        self.max_batch = max_batch
        self._modules: dict[str, str] = {}

    async def run(self) -> None:
        topics = self.ctx.settings.topics
        sub = await self.subscribe(
            self.group,
            [topics.kernels],
            self.verify_batch,
            offsets=StoreOffsets(self.ctx.store),
            max_batch=self.max_batch,
            max_in_flight=1,
            dead_letter_topic=topics.dead_letter,
        )
        self.log.info("verifier_started", manifest=self.verifier.manifest())
        try:
            await self.run_until_stopped(sub.wait())
        finally:
            await sub.stop()
            await self.verifier.aclose()

    async def _module_source(self, module_id: str) -> str:
        """The reference module's source, from the store (the recorder may lag a little)."""
        if module_id in self._modules:
            return self._modules[module_id]
        delay, waited = 0.05, 0.0
        while True:
            records = await self.wait_out(
                lambda: self.ctx.store.read_stream(f"module-{module_id}")
            )
            for r in records:
                if r.event.type == "ModuleProposed":
                    source = payload_as(r.event, ModuleProposed).source
                    self._modules[module_id] = source
                    return source
            if waited >= self.module_wait_s:
                raise InfrastructureError(f"module {module_id} is not in the store")
            await asyncio.sleep(delay)
            waited += delay
            delay = min(delay * 2, 1.0)

    async def _verify_one(self, event: Event) -> Event:
        kernel = payload_as(event, KernelGenerated)
        source = await self._module_source(kernel.module_id)
        self.metrics.in_flight.inc()
        try:
            return await verdict_event(
                self.verifier, self.ctx.store, event, source, producer=self.ctx.producer_id,
                # An outage after the verification is waited out, not a reason to verify
                # the whole batch again.
                read_stream=lambda sid: self.wait_out(lambda: self.ctx.store.read_stream(sid)),
            )
        finally:
            self.metrics.in_flight.dec()

    async def verify_batch(self, batch: Sequence[BusMessage]) -> None:
        """Verifies a batch concurrently (the pool bounds the parallelism), then commits the
        verdicts and the offsets after the batch in one transaction."""
        # One verification per kernel event, even if a producer's retry delivered it twice.
        kernels = list({
            m.event.event_id: m.event
            for m in batch if m.event is not None and m.event.type == "KernelGenerated"
        }.values())
        verdicts = await asyncio.gather(*(self._verify_one(e) for e in kernels))
        # An outage is waited out here, not by the bus retrying the handler: that would
        # verify the whole batch again.
        await self.wait_out(
            lambda: self.ctx.store.append(verdicts, tracking={self.group: offsets_after(batch)})
        )
        await self.wait_out(
            lambda: self.ctx.bus.publish_many(self.ctx.settings.topics.verdicts, verdicts)
        )
        for v in verdicts:
            self.metrics.handled("KernelVerified")
            status = v.payload.get("status", "")
            self.log.info("kernel_verified", kernel_id=v.payload["kernel_id"], status=status)
