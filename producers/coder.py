"""The Coder service: for each valid module on ``kz.modules`` it samples a group of G
kernels per configured backend and publishes them as ``KernelGenerated`` on ``kz.kernels``.

Admission control: a group is started only if the engine's policy is at most
``max_staleness`` versions behind the newest published one; otherwise the handler waits
for the load (the bus pauses the partitions meanwhile). New policy versions from
``kz.policy`` load without dropping groups in flight: each group reports the version it
started with. With ``max_unjudged``, a call is started only while fewer of the run's
kernels than that wait for a verdict (at most ``max_unjudged_wait_s`` at a time), and
takes only as many of the waiting modules as have room under it; the rest wait for the
next call.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence

from kz_stream.bus import BusMessage, Subscription
from kz_stream.config import CoderSettings
from kz_stream.events import (
    Event,
    KernelGenerated,
    ModuleProposed,
    PolicyVersionLoaded,
    PolicyVersionPublished,
    new_event,
    payload_as,
    source_sha256,
)
from kz_stream.faults import DependencyUnavailable, Unrecoverable
from kz_stream.llm import LLMBackend, Sample, SamplingParams
from kz_stream.modules import coder_messages, extract_code, prompt_text
from kz_stream.producers._backlog import Backlog
from kz_stream.runtime import Service, ServiceContext
from kz_stream.verify import Backend

__all__ = ["CoderService", "PolicyFollower", "kernel_event"]


def kernel_event(
    sample: Sample,
    *,
    kernel_id: str,
    module_id: str,
    module_sha256: str,
    group_id: str,
    group_size: int,
    backend: Backend,
    prompt: str,
    sampling: SamplingParams,
    producer: str,
    correlation_id: str | None,
    causation_id: uuid.UUID | None,
    event_id: uuid.UUID | None = None,
    generation_s: float | None = None,
) -> Event:
    """The ``KernelGenerated`` event of one sample: the reply's ``ModelNew`` code (the
    whole reply when it has none, so the verifier reports why), the completion, and the
    module it answers (``module_sha256``: ``source_sha256`` of the module's source), and
    ``generation_s``, how long the generation call that sampled it took."""
    payload = KernelGenerated(
        kernel_id=kernel_id,
        module_id=module_id,
        module_sha256=module_sha256,
        group_id=group_id,
        group_size=group_size,
        backend=backend,
        source=extract_code(sample.text, require="class ModelNew") or sample.text,
        prompt=prompt,
        sampling=sampling.as_dict(),
        policy_version=sample.policy_version,
        completion=sample.to_completion(),
        generation_s=None if generation_s is None else round(generation_s, 3),
    )
    return new_event(
        payload,
        stream_id=f"kernel-{kernel_id}",
        stream_version=0,
        producer=producer,
        correlation_id=correlation_id,
        causation_id=causation_id,
        event_id=event_id,
    )


POLICY_LOAD_ATTEMPTS = 3


class PolicyFollower:
    """Tracks the newest published policy of one role, and loads it into an engine."""

    def __init__(self, service: Service, backend: LLMBackend, role: str, replica: str) -> None:
        self.service, self.backend, self.role, self.replica = service, backend, role, replica
        self.latest_published = backend.policy_version
        self.changed = asyncio.Condition()

    async def subscribe(self) -> Subscription:
        ctx = self.service.ctx
        # A fresh group per process: a restarted engine must see the latest version again
        # (the topic is compacted, so reading it from the start is cheap).
        return await self.service.subscribe(
            f"kz-{self.replica}-policy-{uuid.uuid4().hex[:8]}",
            [ctx.settings.topics.policy],
            self.handle,
            from_beginning=True,
            dead_letter_topic=ctx.settings.topics.dead_letter,
        )

    async def handle(self, batch: Sequence[BusMessage]) -> None:
        newest: PolicyVersionPublished | None = None
        for m in batch:
            if m.event is None or m.event.type != "PolicyVersionPublished":
                continue
            p = payload_as(m.event, PolicyVersionPublished)
            if p.role == self.role and (newest is None or p.version > newest.version):
                newest = p
        if newest is None or newest.version <= self.backend.policy_version:
            return
        async with self.changed:
            self.latest_published = max(self.latest_published, newest.version)
            self.changed.notify_all()
        await self._load(newest)
        ctx = self.service.ctx
        loaded = new_event(
            PolicyVersionLoaded(role=newest.role, replica=self.replica, version=newest.version),
            stream_id=f"replica-{self.replica}",
            stream_version=newest.version,
            # Deterministic id: loading the same version again is one event, not a conflict.
            event_id=uuid.uuid5(uuid.NAMESPACE_URL, f"kz:{self.replica}:{newest.version}"),
            producer=ctx.producer_id,
            correlation_id=ctx.settings.run_id,
        )
        key = f"loaded-{self.replica}"
        await self.service.wait_out(
            lambda: ctx.bus.publish(ctx.settings.topics.policy, loaded, key=key)
        )
        self.service.metrics.published("PolicyVersionLoaded")
        self.service.log.info("policy_loaded", role=self.role, version=newest.version)
        async with self.changed:
            self.changed.notify_all()

    async def _load(self, policy: PolicyVersionPublished) -> None:
        """Loads ``policy`` into the engine, a failed load tried again after 1 and 2 s (a
        checkpoint still arriving on shared storage). One that still fails raises
        ``Unrecoverable``: the version would be dead-lettered and the service, admitting
        no call past ``max_staleness``, would wait for it for ever. An engine outage
        (``DependencyUnavailable``) is the bus's to wait out."""
        for attempt in range(POLICY_LOAD_ATTEMPTS):
            try:
                await self.backend.load_policy(policy.version, policy.uri, kind=policy.kind)
                return
            except (DependencyUnavailable, Unrecoverable):
                raise  # an outage, or an engine that is gone: no retry here helps
            except Exception as e:
                if attempt + 1 == POLICY_LOAD_ATTEMPTS:
                    raise Unrecoverable(
                        f"{self.role} policy version {policy.version} ({policy.uri}) could "
                        f"not be loaded: {type(e).__name__}: {e}"[:2000]) from e
                self.service.log.warning("policy_load_failed", version=policy.version,
                                         attempt=attempt + 1, error=f"{type(e).__name__}: {e}")
                await asyncio.sleep(2.0 ** attempt)

    def staleness(self) -> int:
        return self.latest_published - self.backend.policy_version

    async def admit(self, max_staleness: int) -> None:
        """Waits until a group started now would be at most ``max_staleness`` stale."""
        async with self.changed:
            if self.staleness() > max_staleness:
                self.service.log.info(
                    "admission_wait", staleness=self.staleness(), max_staleness=max_staleness
                )
                self.service.metrics.error("admission_wait")
            await self.changed.wait_for(lambda: self.staleness() <= max_staleness)


class CoderService(Service):
    """The Coder, as ``config`` (the ``[coder]`` settings) describes it; ``replica`` names
    this process (a fresh name by default)."""

    name = "coder"
    stop_stage = 0  # a generator: stops before the consumers of its kernels
    group = "kz-coder"

    def __init__(
        self,
        ctx: ServiceContext,
        backend: LLMBackend,
        config: CoderSettings,
        *,
        replica: str | None = None,
    ) -> None:
        super().__init__(ctx)
        self.backend, self.config = backend, config
        self.sampling = config.llm.sampling()
        self.replica = replica or f"coder-{uuid.uuid4().hex[:8]}"
        self.policy = PolicyFollower(self, backend, "coder", self.replica)
        # The run's kernels without a verdict (``config.max_unjudged``): this Coder's as it
        # publishes them, the others' as the store holds them (read as it grows from
        # ``_store_position``), and whether a call waits on them now.
        self.unjudged = Backlog()
        self._store_position = 0
        self.waiting_for_verifier = False
        # At a stop, give up the calls in flight instead of finishing them (their modules
        # come again at the next start): ``kz run`` does once its schedule is done.
        self.give_up_in_flight = False
        # (module event id, backend) of groups published by a batch not yet done
        self._published_groups: set[tuple[uuid.UUID, str]] = set()

    async def run(self) -> None:
        topics = self.ctx.settings.topics
        policy_sub = await self.policy.subscribe()
        sub = await self.subscribe(
            self.group,
            [topics.modules],
            self.handle_modules,
            max_batch=self.config.max_batch,
            # Merging: room for a batch per module that arrives during a model call.
            max_in_flight=self.config.max_batch if self.config.merge_waiting else 2,
            merge_waiting=self.config.merge_waiting,
            dead_letter_topic=topics.dead_letter,
        )
        self.log.info("coder_started", replica=self.replica, backends=self.config.backends)
        try:
            # A subscription ends before a stop only by failing (its handler met
            # ``Unrecoverable``: the engine is gone): then the service fails with it.
            await self.run_until_stopped(asyncio.gather(sub.wait(), policy_sub.wait()))
        finally:
            # A call in flight finishes and commits; one waiting for the verifier, or any
            # once ``give_up_in_flight`` is set, is given up (cancelled, not committed: its
            # modules come again, from the broker or, on the embedded bus, from the store
            # at the next start).
            await sub.stop(grace=0 if self.waiting_for_verifier or self.give_up_in_flight
                           else None)
            if self.give_up_in_flight:
                await self.backend.close()  # the engine stops decoding what nobody awaits
            await policy_sub.stop()

    async def handle_modules(self, batch: Sequence[BusMessage]) -> None:
        work = [(m.event, module) for m in batch
                if m.event is not None and m.event.type == "ModuleProposed"
                and (module := payload_as(m.event, ModuleProposed)).validation.valid]
        pairs = {(event.event_id, b) for event, _ in work for b in self.config.backends}
        while work:
            await self.wait_for_verifier()
            n = self._modules_with_room(len(work))
            taken, work = work[:n], work[n:]
            # Every group of the call ends before a failure fails the batch (else the
            # others went on unowned while the bus retried it), and a retry of the batch
            # skips the groups already published: new ids would make them new groups.
            results = await asyncio.gather(
                *(self.generate_group(event, module, _backend(b))
                  for event, module in taken for b in self.config.backends
                  if (event.event_id, b) not in self._published_groups),
                return_exceptions=True)
            for r in results:
                if isinstance(r, BaseException):
                    raise r
        self._published_groups -= pairs  # the batch is done: its retries are over

    def _modules_with_room(self, waiting: int) -> int:
        """How many of ``waiting`` modules the next call takes: those whose kernels keep
        the unjudged within ``max_unjudged`` (at least one: the wait has ended), so that a
        merged call of many modules does not overshoot the bound by its whole size."""
        limit = self.config.max_unjudged
        if limit is None:
            return waiting
        per_module = self.config.group_size * len(self.config.backends)
        room = limit - len(self.unjudged)
        return min(waiting, max(1, -(-room // per_module)))

    async def wait_for_verifier(self) -> None:
        """Waits while ``max_unjudged`` of the run's kernels have no verdict, for
        ``max_unjudged_wait_s`` at most. Kernels made while the verifier is that far behind
        would wait behind the others, sampled by a policy that is older by the time they
        are judged, and their generation would take the device from the verifier. The
        bound keeps the Coder going when verdicts stop coming (a verifier that is down,
        kernels it will never judge): then one call goes ahead per bound."""
        limit = self.config.max_unjudged
        if limit is None or self.stopping.is_set():
            return  # begun after the stop: the stop waits for this call (``run``)
        started = time.monotonic()
        logged = False
        self.waiting_for_verifier = True
        try:
            while True:
                await self.wait_out(self._read_unjudged)
                if stale := self.unjudged.forget_passed_over(self.config.max_unjudged_wait_s):
                    self.log.warning("kernels_never_judged", kernels=stale,
                                     waited_s=self.config.max_unjudged_wait_s,
                                     reason="newer kernels have verdicts but not these; the "
                                            "Coder no longer waits on them")
                if len(self.unjudged) < limit:
                    return
                waited = time.monotonic() - started
                if waited >= self.config.max_unjudged_wait_s:
                    self.log.warning("verifier_wait_over", unjudged=len(self.unjudged),
                                     max_unjudged=limit, waited_s=round(waited, 1))
                    return
                if not logged:
                    logged = True
                    self.log.info("coder_waits_for_verifier", unjudged=len(self.unjudged),
                                  max_unjudged=limit)
                await asyncio.sleep(1.0)  # a stop cancels the wait here (``run``)
        finally:
            self.waiting_for_verifier = False

    async def _read_unjudged(self) -> None:
        """Counts the run's kernels and verdicts stored since the last look."""
        async for batch in self.ctx.store.read_all(
            self._store_position, types=("KernelGenerated", "KernelVerified"),
            payload_fields=("kernel_id",), correlation_id=self.ctx.settings.run_id,
        ):
            for r in batch:
                kernel_id = r.event.payload["kernel_id"]
                if r.event.type == "KernelGenerated":
                    self.unjudged.add(kernel_id)
                else:
                    self.unjudged.answer(kernel_id)
                self._store_position = r.global_position

    async def generate_group(self, cause: Event, module: ModuleProposed, backend: Backend) -> None:
        await self.policy.admit(self.config.max_staleness)
        version = self.backend.policy_version
        prompt = coder_messages(module.source, backend)
        self.metrics.in_flight.inc()
        started = time.monotonic()
        try:
            [samples] = await self.backend.generate(
                [prompt], n=self.config.group_size, sampling=self.sampling
            )
        finally:
            self.metrics.in_flight.dec()
        generation_s = time.monotonic() - started
        self.metrics.llm_request(sum(len(s.token_ids) for s in samples))
        group_id = uuid.uuid4().hex
        text = prompt_text(prompt)
        module_sha256 = source_sha256(module.source)
        events = []
        for s in samples:
            events.append(
                kernel_event(
                    s,
                    kernel_id=uuid.uuid4().hex,
                    module_id=module.module_id,
                    module_sha256=module_sha256,
                    group_id=group_id,
                    group_size=self.config.group_size,
                    backend=backend,
                    prompt=text,
                    sampling=self.sampling,
                    producer=self.ctx.producer_id,
                    correlation_id=self.ctx.settings.run_id,
                    causation_id=cause.event_id,
                    generation_s=generation_s,
                )
            )
        # Waited out here: the bus retrying the handler would sample the group again.
        await self.wait_out(
            lambda: self.ctx.bus.publish_many(self.ctx.settings.topics.kernels, events)
        )
        self._published_groups.add((cause.event_id, backend))
        if self.config.max_unjudged is not None:
            # Counted now: the store holds them only once the recorder has them, and the
            # next call's check may come first.
            for e in events:
                self.unjudged.add(e.payload["kernel_id"])
        self.metrics.published("KernelGenerated", len(events))
        self.log.info(
            "group_generated",
            module_id=module.module_id,
            group_id=group_id,
            backend=backend,
            policy_version=version,
            n=len(events),
        )


def _backend(name: str) -> Backend:
    """A configured backend name as a ``Backend`` (the settings admit no other)."""
    if name == "cuda":
        return "cuda"
    if name == "triton":
        return "triton"
    raise ValueError(f"backend: {name!r} is neither 'cuda' nor 'triton'")
