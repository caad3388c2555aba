"""The verifier service: reads ``kz.kernels``, verifies each kernel in worker processes and
writes ``KernelVerified`` with the consumer's offsets in one transaction. The store is where
verdicts go: the learner tails it (nothing reads verdicts off the bus).

A kernel names its module (``module_id``, and since ``KernelGenerated`` v3 the source's
``module_sha256``). The service keeps the sources it saw on ``kz.modules`` (a subscription
of its own); a module it has not seen there (published before it subscribed, a replay) is
read from the store. Only a module in neither place is waited for, up to ``module_wait_s``
(its recorder may lag), and then raised as an infrastructure fault, which the bus
dead-letters. A bad kernel is a verdict.

A verdict's event id is derived from the kernel event's id and the verifier version, so a
kernel verified twice by one verifier version (a consumer that lost its partitions while
verifying, a redelivery after a crash between commit and offset) is stored once: the
store skips an event id it holds. Its stream version is computed, not read back: the
kernel event's plus one.

Every verifier also takes ``kz rescore``'s jobs from ``kz.rescore``: stored kernel events,
each with the verifier version it is to be judged by in a header. Its group is of its own
version (``kz-verifier-rescore-<version>``), so every job reaches one member of each
version's group and only the version it names acts (a fleet mid-upgrade loses none). A
rescore verdict is the same ``verdict_event`` with the offsets in one transaction; a kernel
whose verdict of this version is stored is skipped, and the verdict takes the next version
of the kernel's stream as read just before. Live kernels come first: a rescore job starts
only while no live batch is being verified, and at most ``rescore_slots`` are verified at
once, so a live batch waits for those alone; rescoring uses the gaps between live batches.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections import OrderedDict
from collections.abc import Sequence

from kz_stream.bus import BusMessage, InfrastructureError, offsets_after
from kz_stream.events import (
    Event,
    KernelGenerated,
    KernelVerified,
    ModuleProposed,
    new_event,
    payload_as,
    source_sha256,
)
from kz_stream.rescore import rescore_attempt
from kz_stream.runtime import Service, ServiceContext, StoreOffsets
from kz_stream.verify import VERIFIER_VERSION, Candidate, Problem, Verifier

__all__ = [
    "RESCORE_VERSION_HEADER",
    "ModuleSources",
    "VerifierService",
    "rescore_group",
    "verdict_event",
    "verdict_event_id",
]

_VERDICT_NAMESPACE = uuid.UUID("6d1c7f0e-3b7a-4c55-9a0e-5b2d1f8e9c41")

# The header of a rescore job naming the verifier version that is to judge it.
RESCORE_VERSION_HEADER = "kz-rescore-verifier-version"


def rescore_group(verifier_version: str = VERIFIER_VERSION) -> str:
    """The consumer group of one verifier version's members on the rescore topic."""
    return f"kz-verifier-rescore-{verifier_version}"


def verdict_event_id(kernel_event_id: uuid.UUID, verifier_version: str = VERIFIER_VERSION,
                     attempt: int = 0) -> uuid.UUID:
    """The event id of the verdict on one kernel event by one verifier version; ``attempt``
    numbers the verifications after an infrastructure failure (an evaluation's resume
    verifies such kernels again)."""
    name = f"{kernel_event_id}/{verifier_version}" + (f"/{attempt}" if attempt else "")
    return uuid.uuid5(_VERDICT_NAMESPACE, name)


async def verdict_event(
    verifier: Verifier,
    event: Event,
    module_source: str,
    *,
    producer: str,
    stream_version: int | None = None,
    attempt: int = 0,
) -> Event:
    """Verifies a ``KernelGenerated`` event against its module's source and returns the
    ``KernelVerified`` event in the kernel's stream, with its deterministic id, at
    ``stream_version`` (default: the kernel event's plus one; a re-score, which adds a
    verdict beside earlier ones, passes the stream's next version, and so does a new
    ``attempt`` after an infrastructure failure)."""
    kernel = payload_as(event, KernelGenerated)
    verdict = await verifier.verify(
        Problem(module_source), Candidate(kernel.source, backend=kernel.backend)
    )
    return new_event(
        KernelVerified.from_verdict(verdict, kernel),
        event_id=verdict_event_id(event.event_id, verdict.verifier_version, attempt),
        stream_id=event.stream_id,
        stream_version=event.stream_version + 1 if stream_version is None else stream_version,
        producer=producer,
        correlation_id=event.correlation_id,
        causation_id=event.event_id,
    )


class ModuleSources:
    """Module sources by module id with their SHA-256, the newest ``capacity`` kept (a
    kernel's module is one proposed shortly before it; an older one is in the store)."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._sources: OrderedDict[str, tuple[str, str]] = OrderedDict()
        self._added = asyncio.Event()

    def __len__(self) -> int:
        return len(self._sources)

    def put(self, module_id: str, source: str) -> None:
        self._sources[module_id] = (source, source_sha256(source))
        self._sources.move_to_end(module_id)
        while len(self._sources) > self.capacity:
            self._sources.popitem(last=False)
        self._added.set()
        self._added = asyncio.Event()

    def get(self, module_id: str) -> tuple[str, str] | None:
        """The source and its SHA-256, or None when the module is not here."""
        return self._sources.get(module_id)

    async def wait_for_more(self, seconds: float) -> None:
        """Returns when a module is added, or after ``seconds``."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._added.wait(), seconds)


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
        rescore_slots: int = 2,
    ) -> None:
        super().__init__(ctx)
        self.verifier = verifier or Verifier()
        self.module_wait_s = module_wait_s
        self.max_batch = max_batch
        self.modules = ModuleSources()
        self.rescore_group = rescore_group()
        self._rescore_slots = asyncio.Semaphore(rescore_slots)
        self._live_batches = 0
        self._live_idle = asyncio.Event()
        self._live_idle.set()
        # Verdicts of kernels whose batch failed (another kernel of it did): its retry, or
        # the halves the bus splits it into, reuse them rather than judge them again.
        self._judged: dict[uuid.UUID, Event] = {}

    async def run(self) -> None:
        topics = self.ctx.settings.topics
        # A group of this process's own: every verifier needs every module. From the end of
        # the topic: modules proposed before this process started are read from the store.
        modules_sub = await self.subscribe(
            f"{self.group}-modules-{uuid.uuid4().hex[:8]}",
            [topics.modules],
            self.remember_modules,
            from_beginning=False,
        )
        sub = await self.subscribe(
            self.group,
            [topics.kernels],
            self.verify_batch,
            offsets=StoreOffsets(self.ctx.store),
            max_batch=self.max_batch,
            max_in_flight=1,
            dead_letter_topic=topics.dead_letter,
        )
        # From the beginning: jobs published before this version's first member started.
        rescore_sub = await self.subscribe(
            self.rescore_group,
            [topics.rescore],
            self.rescore_batch,
            offsets=StoreOffsets(self.ctx.store),
            max_batch=self.max_batch,
            max_in_flight=1,
            dead_letter_topic=topics.dead_letter,
        )
        self.log.info("verifier_started", manifest=self.verifier.manifest())

        async def consume() -> None:
            await asyncio.gather(sub.wait(), rescore_sub.wait())

        try:
            await self.run_until_stopped(consume())
        finally:
            await sub.stop()
            await rescore_sub.stop()
            await modules_sub.stop()
            await self.verifier.aclose()

    async def remember_modules(self, batch: Sequence[BusMessage]) -> None:
        """Keeps the sources of the valid modules on ``kz.modules`` (the Coder's work)."""
        for m in batch:
            if m.event is not None and m.event.type == "ModuleProposed":
                module = payload_as(m.event, ModuleProposed)  # validated by the bus already
                if module.validation.valid:
                    self.modules.put(module.module_id, module.source)

    async def _stored_module(self, module_id: str) -> str | None:
        records = await self.wait_out(lambda: self.ctx.store.read_stream(f"module-{module_id}"))
        for r in records:
            if r.event.type == "ModuleProposed":
                source = payload_as(r.event, ModuleProposed).source
                self.modules.put(module_id, source)
                return source
        return None

    async def _module_source(self, kernel: KernelGenerated) -> str:
        """The source of the kernel's module: kept from ``kz.modules``, else from the store;
        a module in neither is waited for (the recorder may lag) up to ``module_wait_s``."""
        delay, waited = 0.05, 0.0
        while (known := self.modules.get(kernel.module_id)) is None:
            if await self._stored_module(kernel.module_id) is not None:
                continue
            if waited >= self.module_wait_s:
                raise InfrastructureError(f"module {kernel.module_id} is not in the store")
            await self.modules.wait_for_more(delay)
            waited += delay
            delay = min(delay * 2, 1.0)
        source, sha256 = known
        if kernel.module_sha256 and kernel.module_sha256 != sha256:
            raise InfrastructureError(
                f"module {kernel.module_id}: its source is not the one kernel "
                f"{kernel.kernel_id} was written for (sha256 {kernel.module_sha256})"
            )
        return source

    async def _verify_one(self, event: Event) -> Event:
        if (judged := self._judged.get(event.event_id)) is not None:
            return judged
        source = await self._module_source(payload_as(event, KernelGenerated))
        self.metrics.in_flight.inc()
        try:
            return await verdict_event(
                self.verifier, event, source, producer=self.ctx.producer_id
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
        self._live_batches += 1
        self._live_idle.clear()
        try:
            # Every verification ends before a failure fails the batch: they went on
            # unowned while the bus retried it, and judged every kernel again.
            results = await asyncio.gather(*(self._verify_one(e) for e in kernels),
                                           return_exceptions=True)
        finally:
            self._live_batches -= 1
            if not self._live_batches:
                self._live_idle.set()
        verdicts = [r for r in results if isinstance(r, Event)]
        if len(verdicts) < len(results):
            self._judged.update((e.event_id, r) for e, r in zip(kernels, results, strict=True)
                                if isinstance(r, Event))
            raise next(r for r in results if isinstance(r, BaseException))
        # An outage is waited out here, not by the bus retrying the handler: that would
        # verify the whole batch again.
        await self.wait_out(
            lambda: self.ctx.store.append(verdicts, tracking={self.group: offsets_after(batch)})
        )
        for e in kernels:
            self._judged.pop(e.event_id, None)
        for v in verdicts:
            self.metrics.handled("KernelVerified")
            status = v.payload.get("status", "")
            self.log.info("kernel_verified", kernel_id=v.payload["kernel_id"], status=status)

    async def _rescore_one(self, event: Event) -> Event | None:
        """The verdict of this version on a stored kernel event, or None when it wants none
        (``rescore_attempt``: the store holds a decided one, or none at all)."""
        stream = await self.wait_out(lambda: self.ctx.store.read_stream(event.stream_id))
        if not stream:
            raise InfrastructureError(f"rescore job: {event.stream_id} is not in the store")
        attempt = rescore_attempt([r.event.payload for r in stream
                                   if r.event.type == "KernelVerified"])
        if attempt is None:
            return None
        source = await self._module_source(payload_as(event, KernelGenerated))
        async with self._rescore_slots:
            await self._live_idle.wait()
            self.metrics.in_flight.inc()
            try:
                return await verdict_event(
                    self.verifier, event, source, producer=self.ctx.producer_id,
                    stream_version=max(r.event.stream_version for r in stream) + 1,
                    attempt=attempt,
                )
            finally:
                self.metrics.in_flight.dec()

    async def rescore_batch(self, batch: Sequence[BusMessage]) -> None:
        """Judges the batch's rescore jobs for this verifier version, then commits the new
        verdicts and the offsets after the batch in one transaction. A verdict that meets
        another in its stream version (one of another verifier version, written meanwhile)
        rolls the batch back and the bus retries it: the retry reads the streams again."""
        mine = VERIFIER_VERSION.encode()
        jobs = list({
            m.event.event_id: m.event for m in batch
            if m.event is not None and m.event.type == "KernelGenerated"
            and m.headers.get(RESCORE_VERSION_HEADER) == mine
        }.values())
        if others := sum(m.headers.get(RESCORE_VERSION_HEADER) != mine for m in batch):
            self.log.info("rescore_jobs_of_another_version", jobs=others)
        judged = await asyncio.gather(*(self._rescore_one(e) for e in jobs))
        verdicts = [v for v in judged if v is not None]
        await self.wait_out(lambda: self.ctx.store.append(
            verdicts, tracking={self.rescore_group: offsets_after(batch)}))
        for v in verdicts:
            self.metrics.handled("KernelVerified")
            self.log.info("kernel_rescored", kernel_id=v.payload["kernel_id"],
                          status=v.payload.get("status", ""))
