"""The Proposer service: samples API sets from the catalog (reweighted toward the latest
frontier), asks the Proposer model for modules, validates each in a sandbox, and publishes
every proposal — valid or not — as ``ModuleProposed`` on ``kz.modules``.

Invalid proposals are the Proposer's negative examples, so they are published too; a
proposal whose normalized hash was seen before is published as invalid (``duplicate``)
rather than handed to the Coder again. Proposals that copy an evaluation problem (one some
``kz eval run`` stored, or one of ``evaluation_problems``) are published as invalid, so
that training data cannot leak the evaluation set: with reason ``contaminated`` when their
normalized hash is the problem's, and ``contaminated_apis`` when they pass validation with
the problem's fingerprint (the same API set on inputs of the same shapes and dtypes,
``kz_stream.modules.ModuleFingerprint``) in other code.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kz_stream._cpus import usable_cpus
from kz_stream.bus import BusMessage, Subscription
from kz_stream.config import ProposerSettings
from kz_stream.events import (
    SEED_GROUP_PREFIX,
    SYNTHESIZED_GROUP_PREFIX,
    Event,
    FrontierUpdated,
    ModuleProposed,
    ModuleValidation,
    is_evaluation,
    new_event,
    payload_as,
)
from kz_stream.llm import BackendError, BackendLost, BackendUnavailable, LLMBackend, Sample
from kz_stream.modules import (
    ApiSetSampler,
    Frontier,
    ModuleFingerprint,
    extract_code,
    fingerprint_modules,
    normalized_hash,
    prompt_text,
    proposer_messages,
    validate_with_fingerprint,
)
from kz_stream.producers._backlog import Backlog
from kz_stream.producers.coder import PolicyFollower
from kz_stream.run_state import read_unfinished_work
from kz_stream.runtime import Service, ServiceContext
from kz_stream.warmstart.synth import Synthesizer, feasible, synthesize

__all__ = ["ProposerService", "SeedModule"]


@dataclass(frozen=True)
class SeedModule:
    """A hand-written module published before the Proposer's own (a warm start)."""

    api_set: tuple[str, ...]
    source: str


class ProposerService(Service):
    """The Proposer, as ``config`` (the ``[proposer]`` settings) describes it.

    ``seed_modules`` are published before the Proposer's own; ``evaluation_problems`` maps
    the sources of evaluation problems to their names (besides those in the store);
    ``replica`` names this process (a fresh name by default).
    """

    name = "proposer"
    stop_stage = 0  # a generator: stops before the consumers of its modules

    def __init__(
        self,
        ctx: ServiceContext,
        backend: LLMBackend,
        config: ProposerSettings,
        *,
        seed_modules: Sequence[SeedModule] = (),
        evaluation_problems: Mapping[str, str] | None = None,
        replica: str | None = None,
    ) -> None:
        super().__init__(ctx)
        self.backend, self.config = backend, config
        self.sampling = config.llm.sampling()
        self.seed_modules = tuple(seed_modules)
        self.replica = replica or f"proposer-{uuid.uuid4().hex[:8]}"
        self.sampler = ApiSetSampler(seed=config.seed)
        self.frontier: FrontierUpdated | None = None
        self.policy = PolicyFollower(self, backend, "proposer", self.replica)
        self.seen_hashes: set[str] = set()
        self.evaluation_hashes: dict[str, str] = {}
        self.evaluation_fingerprints: dict[ModuleFingerprint, str] = {}
        self._to_fingerprint: dict[str, str] = {}  # evaluation sources -> names, until run
        for source, problem in (evaluation_problems or {}).items():
            self._know_evaluation_problem(source, problem)
        self.published = 0
        self.valid = 0
        self.done = asyncio.Event()
        self._synthesizer: Synthesizer | None = None
        # This run's valid seed modules stored by an earlier session, by normalized hash.
        self._stored_seeds: dict[str, Event] = {}
        # The run's valid modules of which the Coder has generated no kernel yet, and a
        # wake-up for prompts waiting on them (``config.max_ahead``).
        self.uncoded = Backlog()
        self._coded = asyncio.Event()
        self._waiting_logged = False
        self._behind_since: float | None = None  # since when max_ahead holds prompts back
        # At a stop, give up the prompts in flight instead of finishing them: ``kz run``
        # does once its schedule is done (nothing will train on them).
        self.give_up_in_flight = False

    async def run(self) -> None:
        topics = self.ctx.settings.topics
        await self.wait_out(self._load_seen_hashes)
        await self._fingerprint_evaluation_problems()
        frontier_sub = await self.subscribe(
            f"kz-{self.replica}-frontier-{uuid.uuid4().hex[:8]}",
            [topics.frontier],
            self.handle_frontier,
            from_beginning=True,
            dead_letter_topic=topics.dead_letter,
        )
        policy_sub = await self.policy.subscribe()
        subs = [frontier_sub, policy_sub]
        if self.config.max_ahead is not None:
            # From the end: what the store holds is read next, so nothing falls between.
            subs.append(await self.subscribe(
                f"kz-{self.replica}-kernels-{uuid.uuid4().hex[:8]}",
                [topics.kernels], self.handle_kernels, from_beginning=False,
                dead_letter_topic=topics.dead_letter,
            ))
            work = await self.wait_out(
                lambda: read_unfinished_work(self.ctx.store, self.ctx.settings.run_id))
            for module_id in work.modules:
                self.uncoded.add(module_id)
        self.log.info("proposer_started", replica=self.replica)
        try:
            await self._publish_seeds()
            workers = [asyncio.create_task(self._worker()) for _ in range(self.config.concurrency)]
            stop = asyncio.create_task(self.stopping.wait())
            # A subscription ends before a stop only by failing (its handler met
            # ``Unrecoverable``): then the service fails with it.
            failed = asyncio.ensure_future(asyncio.gather(*(s.wait() for s in subs)))
            waiting: list[asyncio.Future[Any]] = [stop, failed, *workers]
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
            if failed.done() and (error := failed.exception()) is not None:
                for w in workers:
                    w.cancel()
                await asyncio.gather(*workers, return_exceptions=True)
                raise error
            failed.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await failed
            # Finish the prompts in flight (graceful), unless asked to stop twice or to
            # give them up.
            if self.give_up_in_flight:
                for w in workers:
                    w.cancel()
                await self.backend.close()  # its engine stops decoding the given-up prompts
            results = await asyncio.gather(*workers, return_exceptions=True)
            for r in results:
                if isinstance(r, Exception):
                    raise r
        finally:
            await _stop_all(subs)

    async def _load_seen_hashes(self) -> None:
        """Dedup survives restarts: every proposal ever stored is known by hash, and so is
        every evaluation problem (``ModuleProposed`` of an evaluation run)."""
        run_id = self.ctx.settings.run_id
        async for batch in self.ctx.store.read_all(0, types=["ModuleProposed"]):
            for r in batch:
                h = r.event.payload.get("normalized_hash")
                if h and is_evaluation(r.event.correlation_id):
                    self._know_stored_evaluation_problem(r.event, h)
                elif h:
                    self.seen_hashes.add(h)
                    p = r.event.payload
                    if (r.event.correlation_id == run_id and p.get("completion") is None
                            and p["validation"]["valid"]):
                        self._stored_seeds.setdefault(h, r.event)

    def _know_stored_evaluation_problem(self, event: Event, digest: str) -> None:
        payload = payload_as(event, ModuleProposed)
        name = payload.validation.detail or "an evaluation problem"
        self._know_evaluation_problem(payload.source, name, digest)

    def _know_evaluation_problem(self, source: str, name: str, digest: str | None = None) -> None:
        """Screens proposals against this problem by hash now, and by fingerprint once
        ``_fingerprint_evaluation_problems`` has run it (once per distinct problem)."""
        digest = digest or normalized_hash(source)
        if digest not in self.evaluation_hashes:
            self.evaluation_hashes[digest] = name
            self._to_fingerprint[source] = name

    async def _fingerprint_evaluation_problems(self) -> None:
        """Fingerprints the evaluation problems known so far, in one sandboxed process."""
        sources, self._to_fingerprint = self._to_fingerprint, {}
        if not sources:
            return
        # The sandbox is one process for all problems; get_inputs() runs on the meta device.
        timeout_s = self.config.validation_timeout_s + len(sources)
        try:
            found = await asyncio.to_thread(
                fingerprint_modules, list(sources), timeout_s=timeout_s
            )
        except RuntimeError as e:
            # The hash screen still holds; a Proposer that would not start is worse.
            self.log.error("evaluation_fingerprints_failed", problems=len(sources), error=str(e))
            return
        missing = []
        for name, fingerprint in zip(sources.values(), found, strict=True):
            if fingerprint is None:
                missing.append(name)
            else:
                self.evaluation_fingerprints.setdefault(fingerprint, name)
        self.log.info("evaluation_fingerprints", problems=len(sources),
                      fingerprints=len(self.evaluation_fingerprints))
        if missing:
            self.log.warning("evaluation_problems_without_fingerprint", problems=missing[:20],
                             count=len(missing))

    def screen(self, digest: str) -> ModuleValidation | None:
        """The verdict on a proposal known by its normalized hash before it is run: an
        evaluation problem's (``contaminated``) or a seen one's (``duplicate``); None for a
        new one, which is then remembered."""
        if digest in self.evaluation_hashes:
            return ModuleValidation(
                valid=False, reason="contaminated",
                detail=f"normalized hash {digest[:12]} is {self.evaluation_hashes[digest]}",
            )
        if digest in self.seen_hashes:
            return ModuleValidation(
                valid=False, reason="duplicate", detail=f"normalized hash {digest[:12]} seen before"
            )
        self.seen_hashes.add(digest)
        return None

    def screen_fingerprint(
        self, validation: ModuleValidation, fingerprint: ModuleFingerprint | None
    ) -> ModuleValidation:
        """The verdict on a validated proposal: a valid one whose fingerprint is an
        evaluation problem's is invalid (``contaminated_apis``); others keep theirs."""
        problem = self.evaluation_fingerprints.get(fingerprint) if fingerprint else None
        if not validation.valid or problem is None:
            return validation
        return ModuleValidation(
            valid=False, reason="contaminated_apis", detail=f"{fingerprint}, as {problem}",
            apis_called=validation.apis_called,
        )

    async def handle_frontier(self, batch: Sequence[BusMessage]) -> None:
        for m in batch:
            if m.event is not None and m.event.type == "FrontierUpdated":
                f = payload_as(m.event, FrontierUpdated)
                if self.frontier is None or f.frontier_version >= self.frontier.frontier_version:
                    self.frontier = f
                    self.sampler.frontier = Frontier.from_event(f)

    def _budget_left(self) -> bool:
        return self.config.max_modules is None or self.published < self.config.max_modules

    async def _worker(self) -> None:
        while not self.stopping.is_set() and self._budget_left():
            if await self._coder_is_behind():
                continue
            try:
                await self._propose_through_outages()
            except BackendLost:
                raise  # no prompt will succeed again: the service fails, and says why
            except BackendError as e:
                # A prompt the engine refused: the next one goes on (this ended the worker,
                # and with the last one the service and a whole kz run).
                self.log.warning("proposal_failed", error=str(e))
                await asyncio.sleep(1.0)
        self.done.set()

    async def _propose_through_outages(self) -> None:
        """``propose_once``, its engine's outages (``BackendUnavailable``) waited out as the
        store's are, until a stop: then nothing is in flight to finish."""

        async def once() -> None:
            try:
                await self.propose_once()
            except BackendUnavailable:
                if not self.stopping.is_set():
                    raise

        await self.wait_out(once, wake=self.stopping)

    async def handle_kernels(self, batch: Sequence[BusMessage]) -> None:
        """Notes the modules the Coder has taken up (``config.max_ahead``)."""
        for m in batch:
            if m.event is not None and m.event.type == "KernelGenerated":
                self.uncoded.answer(m.event.payload["module_id"])
        self._coded.set()

    async def _coder_is_behind(self) -> bool:
        """Waits (up to a second, then the caller looks again) while ``max_ahead`` of the
        run's valid modules have no kernel; whether it did."""
        limit = self.config.max_ahead
        if limit is None:
            return False
        self._forget_modules_never_coded()
        if len(self.uncoded) < limit:
            self._behind_since = None
            return False
        now = time.monotonic()
        if self._behind_since is None:
            self._behind_since = now
        elif now - self._behind_since >= self.config.max_ahead_wait_s:
            # No module coded for the whole wait (the Coder down, or the modules counted
            # all passed over: nothing newer was coded to show it): one prompt goes ahead
            # per wait, as the Coder's wait for verdicts is bounded. Else it waited for ever.
            self.log.warning("coder_wait_over", uncoded=len(self.uncoded), max_ahead=limit,
                             waited_s=round(now - self._behind_since, 1))
            self._behind_since = now
            return False
        if not self._waiting_logged:
            self._waiting_logged = True
            self.log.info("proposer_waits_for_coder", uncoded=len(self.uncoded),
                          max_ahead=limit)
        self._coded.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._coded.wait(), 1.0)
        if len(self.uncoded) < limit:
            self._waiting_logged = False
        return True

    def _forget_modules_never_coded(self) -> None:
        """Stops counting the modules the Coder passed over (``Backlog``)."""
        if stale := self.uncoded.forget_passed_over(self.config.max_ahead_wait_s):
            self.log.warning("modules_never_coded", modules=stale,
                             waited_s=self.config.max_ahead_wait_s,
                             reason="the Coder has coded newer modules but not these; "
                                    "prompts no longer wait on them")

    async def _publish_seeds(self) -> None:
        """Validates the seeds a few at once and publishes them in their order.

        Each validation is two sandboxed runs of a few seconds: on an H200 host, seeds
        validated one after another reached the Coder one every 8 s while it waited."""
        seeds = list(self.seed_modules)
        if self.config.max_modules is not None:
            seeds = seeds[: max(0, self.config.max_modules - self.published)]
        gate = asyncio.Semaphore(self.config.seed_validations or _seed_validations())

        async def validate(seed: SeedModule) -> tuple[str, ModuleValidation]:
            async with gate:
                return await self._validate(list(seed.api_set), seed.source)

        # A resumed run's seeds are in the store already: validated again they would be
        # published as duplicates (invalid), and the Coder would get none of them.
        stored = [self._stored_seeds.get(normalized_hash(seed.source)) for seed in seeds]
        checks = {i: asyncio.create_task(validate(seed))
                  for i, seed in enumerate(seeds) if stored[i] is None}
        try:
            for i, seed in enumerate(seeds):
                event = stored[i]
                if event is not None:
                    self._resume_seed(event)
                    continue
                digest, validation = await checks[i]
                await self._publish_validated(
                    list(seed.api_set), seed.source, digest, validation, prompt="",
                    sample=None, group_id=f"{SEED_GROUP_PREFIX}{uuid.uuid4().hex}",
                )
        finally:
            for check in checks.values():
                check.cancel()
            # Retrieved, so that the other seeds' failures (a host whose sandbox cannot run
            # fails them all alike) are not each logged again as never retrieved.
            await asyncio.gather(*checks.values(), return_exceptions=True)

    def _resume_seed(self, event: Event) -> None:
        """Counts a seed stored by an earlier session of this run as published. A broker
        still holds it; a fresh embedded bus gets it again, if no kernel was generated for
        it, from ``kz_stream.app.redeliver_unfinished``."""
        self.published += 1
        self.valid += 1
        self.log.info("seed_module_resumed", module_id=event.payload["module_id"])

    async def propose_once(self) -> None:
        """One prompt: sample an API set, generate, validate and publish each proposal."""
        api_set = self.sampler.sample()
        prompt = proposer_messages(api_set)
        [samples] = await self.backend.generate(
            [prompt], n=self.config.proposals_per_prompt, sampling=self.sampling
        )
        self.metrics.llm_request(sum(len(s.token_ids) for s in samples))
        group_id = uuid.uuid4().hex
        text = prompt_text(prompt)
        valid = 0
        for s in samples:
            if not self._budget_left():
                return
            source = extract_code(s.text, require="class Model") or s.text
            valid += await self._publish(api_set, source, prompt=text, sample=s,
                                         group_id=group_id)
        if not valid and self.config.synthesized_fallback and self._budget_left():
            await self._publish_synthesized(api_set)

    async def _publish_synthesized(self, api_set: list[str]) -> None:
        if self._synthesizer is None:
            # Drawn from a point that moves with the stored modules: a resumed run's
            # fallback would otherwise repeat the first session's modules, as duplicates.
            self._synthesizer = Synthesizer(seed=self.config.seed + len(self.seen_hashes))
        apis = api_set if feasible(api_set) else self._synthesizer.api_set()
        module = synthesize(apis, self._synthesizer.rng)
        await self._publish(list(module.api_set), module.source, prompt="", sample=None,
                            group_id=f"{SYNTHESIZED_GROUP_PREFIX}{uuid.uuid4().hex}")

    async def _publish(
        self,
        api_set: list[str],
        source: str,
        *,
        prompt: str,
        sample: Sample | None,
        group_id: str,
    ) -> bool:
        """Validates and publishes one module; returns whether it was valid."""
        digest, validation = await self._validate(api_set, source)
        return await self._publish_validated(api_set, source, digest, validation,
                                             prompt=prompt, sample=sample, group_id=group_id)

    async def _validate(self, api_set: list[str], source: str) -> tuple[str, ModuleValidation]:
        """A module's normalized hash and its verdict (screens, then the sandbox)."""
        digest = normalized_hash(source)
        validation = self.screen(digest)
        if validation is None:
            validated, fingerprint = await asyncio.to_thread(
                validate_with_fingerprint, source, api_set,
                timeout_s=self.config.validation_timeout_s,
            )
            validation = self.screen_fingerprint(validated, fingerprint)
        return digest, validation

    async def _publish_validated(
        self,
        api_set: list[str],
        source: str,
        digest: str,
        validation: ModuleValidation,
        *,
        prompt: str,
        sample: Sample | None,
        group_id: str,
    ) -> bool:
        """Publishes one validated module; returns whether it was valid."""
        module_id = uuid.uuid4().hex
        payload = ModuleProposed(
            module_id=module_id,
            group_id=group_id,
            api_set=api_set,
            source=source,
            prompt=prompt,
            completion=sample.to_completion() if sample else None,
            policy_version=sample.policy_version if sample else self.backend.policy_version,
            normalized_hash=digest,
            validation=validation,
        )
        event = new_event(
            payload,
            stream_id=f"module-{module_id}",
            stream_version=0,
            producer=self.ctx.producer_id,
            correlation_id=self.ctx.settings.run_id,
        )
        await self.wait_out(lambda: self.ctx.bus.publish(self.ctx.settings.topics.modules, event))
        self.published += 1
        self.valid += validation.valid
        if validation.valid:
            self.uncoded.add(event.payload["module_id"])
        self.metrics.validated(validation.valid)
        self.metrics.published("ModuleProposed")
        self.log.info(
            "module_proposed",
            module_id=module_id,
            apis=api_set,
            valid=validation.valid,
            reason=validation.reason,
        )
        return validation.valid


def _seed_validations() -> int:
    """Seed validations at once: half the cores (each is a torch process), 1 to 8."""
    return max(1, min(8, usable_cpus() // 2))


async def _stop_all(subs: list[Subscription]) -> None:
    for sub in subs:
        await sub.stop()
