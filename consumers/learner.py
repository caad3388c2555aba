"""The learner service: tails the event store, keeps the run's read model, publishes the
frontier, and trains the Coder (CA-GRPO) and the Proposer in alternating turns.

Each training step appends ``TrainingStepCompleted`` (naming the groups and kernels it
used) and ``PolicyVersionPublished`` in one transaction, then announces the policy on
``kz.policy``. On restart the learner replays the store: groups named by a stored step are
never trained on again, and it resumes from the checkpoint of the last *published*
version (a checkpoint written by a step that never committed is discarded).

A store or broker outage is waited out, not died of: appends and publishes are retried
with backoff (the same events, so a retry after a commit whose answer was lost is a no-op),
and a tail or replay that breaks resumes from the last position applied once the store
answers again. Meanwhile the service reports itself unhealthy.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from kz_stream.config import LearnerSettings
from kz_stream.events import (
    Event,
    FrontierUpdated,
    PolicyVersionPublished,
    TrainingStepCompleted,
    new_event,
)
from kz_stream.faults import is_transient
from kz_stream.rl import AlternationSchedule, Group, Role, Sample, proposer_step_groups
from kz_stream.run_state import RunState, compute_frontier
from kz_stream.runtime import Service, ServiceContext

if TYPE_CHECKING:
    from kz_stream.rl.trainer import GRPOLearner, LearnerConfig, StepResult

__all__ = ["LearnerService"]


class LearnerService(Service):
    """The learner, as ``config`` (the ``[learner]`` settings) describes it; ``make_learner``
    builds a role's trainer, whose checkpoints go to the folder it is given."""

    name = "learner"
    tracking_name = "kz-learner"

    def __init__(
        self,
        ctx: ServiceContext,
        make_learner: Callable[[Role, Path], GRPOLearner],
        config: LearnerSettings,
    ) -> None:
        super().__init__(ctx)
        self.make_learner, self.config = make_learner, config
        self.state = RunState()
        self.schedule = AlternationSchedule(config.alternation())
        self.learners: dict[Role, GRPOLearner] = {}
        self.steps_done = 0
        self.finished = asyncio.Event()  # the alternation schedule is over
        self.step_log: list[dict[str, object]] = []
        self._acting = asyncio.Lock()
        self._frontier_at = 0.0
        self._frontier_basis: tuple[int, int] = (-1, -1)
        # When the learner last became ready to train: its start, then each step's end.
        self._idle_since = time.perf_counter()
        self._expired: set[str] = set()  # groups logged as too stale to train on

    # -- lifecycle --------------------------------------------------------------------

    async def run(self) -> None:
        await self._through_outages(self._replay)
        # The schedule's place after this learner's roles' latest steps (turns of roles it
        # does not train were skipped, unstored); the count of steps was wrong for a
        # learner of one role, whose next step then met a stored stream version.
        self.steps_done = max((self.state.last_step.get(r, 0) for r in self.config.roles),
                              default=0)
        self.log.info(
            "learner_replayed",
            position=self.state.position,
            steps=self.steps_done,
            used_groups=sum(g.used for g in self.state.groups.values()),
        )
        try:
            for role in self.config.roles:
                await self._load_learner(role)
            self._idle_since = time.perf_counter()  # waiting for groups starts now
            self.state.waiting_since = time.time()  # and group timeouts count from now
            await self.run_until_stopped(self._follow())
        finally:
            for learner in self.learners.values():
                learner.close()

    async def _replay(self) -> None:
        """Applies the store from where the read model stands (0 on a fresh start)."""
        async for batch in self.ctx.store.read_all(self.state.position):
            self.state.apply_all(batch)

    async def _through_outages(self, loop: Callable[[], Awaitable[None]]) -> None:
        """Runs ``loop``; when an outage breaks it, waits until the store answers and runs
        it again (it resumes from ``state.position``). Other errors raise."""
        failures = 0
        while True:
            try:
                await loop()
                return
            except Exception as e:
                if not is_transient(e):
                    raise
                delay = self.backoff.delay(failures)
                failures += 1
                self._on_outage(e, 0, delay)
                # A store that answers at once but keeps failing the loop must not spin.
                await asyncio.sleep(delay)
                await self.wait_out(self.ctx.store.last_position)
                if self.outage is not None:
                    self._on_recovered(failures)

    async def _load_learner(self, role: Role) -> None:
        directory = self.config.checkpoint_dir / role
        published = self.state.published.get(role)
        _discard_unpublished(directory, role, published.version if published else 0)
        learner = await asyncio.to_thread(self.make_learner, role, directory)
        self.learners[role] = learner
        if published is not None and learner.version < published.version:
            # Training on from an older version would publish version numbers the store
            # already holds, for other weights.
            raise CheckpointMismatchError(
                f"the {role} policy's last published version is v{published.version} "
                f"({published.uri}), but its checkpoint is not in {directory} (the newest "
                f"there is v{learner.version}); restore the run's checkpoints to "
                f"{self.config.checkpoint_dir} or start a new run with a new store")
        history = await self.wait_out(lambda: self.ctx.store.read_stream(f"policy-{role}"))
        if not history and learner.version == 0 and learner.config.init_adapter:
            await self._record_warm_start(role, learner.config)
        if history:
            # Re-announce the stored event (same event_id, so the recorder skips it): a crash
            # may have come between the store commit and the publish.
            await self._announce(history[-1].event)
        self.log.info(
            "learner_loaded",
            role=role,
            version=learner.version,
            resumed_from=str(learner.resumed_from or ""),
        )

    async def _record_warm_start(self, role: Role, config: LearnerConfig) -> None:
        """Stores where policy version 0 came from: the warm-start adapter the generators
        and this learner start from (not announced: the generators loaded it at start)."""
        from kz_stream.rl.trainer import policy_sha256

        adapter = Path(str(config.init_adapter))
        uri = await asyncio.to_thread(lambda: adapter.resolve().as_uri())
        event = new_event(
            PolicyVersionPublished(
                role=role, version=0, uri=uri,
                sha256=await asyncio.to_thread(policy_sha256, adapter),
                base_model=config.model, kind="lora",
            ),
            stream_id=f"policy-{role}",
            stream_version=0,
            producer=self.ctx.producer_id,
            correlation_id=self.ctx.settings.run_id,
        )
        await self.wait_out(lambda: self.ctx.store.append([event]))
        self.state.apply_own(event)
        self.log.info("warm_start_recorded", role=role, adapter=str(adapter))

    async def _follow(self) -> None:
        # The ticker and the tail run side by side; a failure in either stops both and is
        # raised (a ticker that died quietly would stop timed training for good).
        # The tail resumes by itself after an outage; the ticker's store and bus calls wait
        # outages out in place, so a step trained during one still commits (and only once).
        both = {
            asyncio.create_task(self._tick()),
            asyncio.create_task(self._through_outages(self._tail)),
        }
        try:
            done, _ = await asyncio.wait(both, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()
        finally:
            for task in both:
                task.cancel()
            await asyncio.gather(*both, return_exceptions=True)

    async def _tail(self) -> None:
        await self._act()
        async for batch in self.ctx.store.tail(
            self.state.position, poll_interval=self.config.poll_interval
        ):
            async with self._acting:  # not between an append of ours and its apply_own
                self.state.apply_all(batch)
            await self._act()

    async def _tick(self) -> None:
        """Acts without new events too: groups time out, and the frontier has a cadence."""
        while True:
            await asyncio.sleep(self.config.frontier_every_s)
            await self._act()

    async def _act(self) -> None:
        async with self._acting:
            await self.maybe_publish_frontier()
            while await self.maybe_train():
                pass

    # -- frontier -----------------------------------------------------------------------

    async def maybe_publish_frontier(self, *, force: bool = False) -> FrontierUpdated | None:
        basis = (
            len(self.state.kernels),
            sum(k.verdict is not None for k in self.state.kernels.values()),
        )
        now = time.monotonic()
        if not force and (
            basis == self._frontier_basis or now - self._frontier_at < self.config.frontier_every_s
        ):
            return None
        frontier = compute_frontier(self.state)
        event = new_event(
            frontier,
            stream_id="frontier",
            stream_version=frontier.frontier_version,
            producer=self.ctx.producer_id,
            correlation_id=self.ctx.settings.run_id,
        )
        tracking = {self.tracking_name: self._tracking()}
        await self.wait_out(lambda: self.ctx.store.append([event], tracking=tracking))
        self.state.apply_own(event)
        await self.wait_out(
            lambda: self.ctx.bus.publish(self.ctx.settings.topics.frontier, event, key="frontier")
        )
        self.metrics.published("FrontierUpdated")
        self._frontier_at, self._frontier_basis = now, basis
        return frontier

    # -- training -----------------------------------------------------------------------

    def _tracking(self) -> dict[str, int]:
        return {"position": self.state.position}

    def coder_groups(self) -> list[Group]:
        out = []
        for g in self.state.ready_groups(timeout_s=self.config.group_timeout_s):
            if g.group_id in self._expired:
                continue  # for good; not worth building its samples again
            samples = []
            for k in g.decided_kernels(self.state.kernels):
                assert k.verdict is not None
                completion = k.generated.completion
                prompt_ids = completion.prompt_token_ids if completion else None
                samples.append(
                    Sample.from_kernel(k.generated, k.verdict, prompt_ids=prompt_ids or None)
                )
            # A group with no decided verdict trains nothing, and a step takes it all the
            # same (as one too stale): else a run whose kernels cannot be checked on its
            # host (CUDA kernels on the CPU: unchecked) would wait for ever for a step.
            out.append(Group(g.group_id, tuple(samples)))
        return self._unexpired("coder", out)

    def proposer_step_groups(self) -> list[Group]:
        """The groups of the next Proposer step: ones whose rewards differ, waiting up to
        ``proposer_wait_s`` for groups being scored rather than train on equal rewards
        (``proposer_step_groups`` in ``rl/groups.py``)."""
        ready, being_scored = self.state.proposal_readiness(
            timeout_s=self.config.group_timeout_s)
        lbar = self.state.module_correctness()
        groups = []
        for gid in ready:
            if gid in self._expired:
                continue
            samples = []
            for mid in self.state.proposals[gid]:
                m = self.state.modules[mid].event
                completion = m.completion
                prompt_ids = completion.prompt_token_ids if completion else None
                samples.append(
                    Sample.from_module(
                        m,
                        group_id=gid,
                        mean_correctness=lbar.get(mid),
                        prompt_ids=prompt_ids or None,
                    )
                )
            groups.append(Group(gid, tuple(samples)))
        # The wait is bounded (from the learner's start or its last step, as
        # waited_seconds): the schedule's next Coder step waits behind this one, and on an
        # H200 (2026-12-05) new valid proposals kept groups "being scored" for a whole
        # 300 s slot with three of four informative groups ready: no step at all.
        waited = time.perf_counter() - self._idle_since
        waiting = being_scored > 0 and waited < self.config.proposer_wait_s
        n = self.config.groups_per_step
        invalid = self.learners["proposer"].config.rewards.invalid_module_reward
        fresh = self._unexpired("proposer", groups)
        chosen = proposer_step_groups(fresh, n, invalid_reward=invalid, waiting=waiting)
        if (being_scored and not waiting and len(chosen) >= n
                and not proposer_step_groups(fresh, n, invalid_reward=invalid, waiting=True)):
            # Said only when the bound decides the step: it goes ahead without them.
            self.log.info("proposer_wait_over", waited_s=round(waited, 1),
                          being_scored=being_scored, ready=len(fresh))
        return chosen

    def current_role(self) -> Role | None:
        turn = self.schedule.turn_at(self.steps_done)
        if turn is None:
            return None
        if turn.role not in self.learners:
            # A role this learner does not train: skip its turn in the schedule.
            self.steps_done += 1
            return self.current_role()
        return turn.role

    async def maybe_train(self) -> bool:
        """Takes one step when the current role has enough complete groups."""
        role = self.current_role()
        if role is None:
            self.finished.set()
            return False
        groups = self.coder_groups() if role == "coder" else self.proposer_step_groups()
        if len(groups) < self.config.groups_per_step:
            return False
        groups = groups[: self.config.groups_per_step]
        learner = self.learners[role]
        t0 = time.perf_counter()
        waited = t0 - self._idle_since
        result = await asyncio.to_thread(learner.train_step, groups)
        await self._commit_step(role, learner, result, groups, time.perf_counter() - t0,
                                waited)
        self._idle_since = time.perf_counter()
        return True

    def _unexpired(self, role: Role, groups: list[Group]) -> list[Group]:
        """Leaves out groups too stale to train on, for good (``Group.expired``): a step of
        them would train on nothing and spend the role's turn (seen on an H200: groups
        redelivered to a resumed run, generated four and five versions before, made three
        empty steps in a row)."""
        learner = self.learners[role]
        keep = []
        for g in groups:
            if not g.expired(learner.version, learner.config.max_staleness):
                keep.append(g)
            elif g.group_id not in self._expired:
                self._expired.add(g.group_id)
                self.log.info("group_expired", role=role, group_id=g.group_id,
                              policy_version=learner.version,
                              max_staleness=learner.config.max_staleness)
        return keep

    async def _commit_step(
        self,
        role: Role,
        learner: GRPOLearner,
        result: StepResult,
        groups: list[Group],
        seconds: float,
        waited: float,
    ) -> None:
        step = TrainingStepCompleted(
            role=role,
            step=self.steps_done + 1,  # the schedule's step, not the optimizer's count
            policy_version=result.policy_version,
            kernel_ids=result.kernel_ids,
            module_ids=result.module_ids,
            # Every group offered, not only those trained on: even a step that trained
            # nothing (all samples stale) uses its groups up, so they are not offered again.
            group_ids=[g.group_id for g in groups],
            losses=result.losses,
            mean_reward=result.mean_reward,
            staleness=result.staleness,
            dropped_stale=result.dropped_stale,
            store_position=self.state.position,
            train_seconds=round(seconds, 3),
            waited_seconds=round(max(waited, 0.0), 3),
        )
        events = [
            new_event(
                step,
                stream_id=f"learner-{role}",
                stream_version=self.steps_done,
                producer=self.ctx.producer_id,
                correlation_id=self.ctx.settings.run_id,
            )
        ]
        announcement = None
        if result.trained:
            uri, sha = await asyncio.to_thread(
                learner.save_policy, self.config.checkpoint_dir / role, learner.version
            )
            published = PolicyVersionPublished(
                role=role,
                version=learner.version,
                uri=uri,
                sha256=sha,
                base_model=learner.config.model,
                kind="full" if learner.config.full_finetune else "lora",
            )
            announcement = new_event(
                published,
                stream_id=f"policy-{role}",
                stream_version=learner.version,
                producer=self.ctx.producer_id,
                correlation_id=self.ctx.settings.run_id,
            )
            events.append(announcement)
        # Retried as it is through an outage: the step is trained already, and these events
        # (same ids) are appended once however many tries it takes.
        tracking = {self.tracking_name: self._tracking()}
        await self.wait_out(lambda: self.ctx.store.append(events, tracking=tracking))
        for e in events:
            self.state.apply_own(e)
        self.steps_done += 1
        if announcement is not None:
            await self._announce(announcement)
        self.metrics.published("TrainingStepCompleted")
        turn = self.schedule.turn_at(self.steps_done - 1)
        self.step_log.append(
            {
                "step": self.steps_done,
                "round": turn.round if turn else -1,
                "role": role,
                "trained": result.trained,
                "policy_version": learner.version,
                "mean_reward": result.mean_reward,
                "samples": result.num_samples,
                "kernels": len(result.kernel_ids),
                "dropped_stale": result.dropped_stale,
                "seconds": seconds,
            }
        )
        self.log.info(
            "training_step",
            role=role,
            step=self.steps_done,
            trained=result.trained,
            policy_version=learner.version,
            mean_reward=round(result.mean_reward, 4),
            samples=result.num_samples,
            dropped_stale=result.dropped_stale,
            losses=result.losses,
            seconds=round(seconds, 2),
            waited=round(waited, 2),
        )

    async def _announce(self, event: Event) -> None:
        role = event.payload["role"]
        await self.wait_out(
            lambda: self.ctx.bus.publish(self.ctx.settings.topics.policy, event, key=role)
        )
        self.metrics.published("PolicyVersionPublished")


class CheckpointMismatchError(RuntimeError):
    """The store and the checkpoint folder disagree: a published version's checkpoint is
    not on disk, or checkpoints are there that no step of this store could have left."""


def _discard_unpublished(directory: Path, role: Role, published_version: int) -> None:
    """Removes the checkpoint of the version after the last published one: its step never
    committed to the store, so its groups will be offered (and trained on) again. Newer
    ones than that no crash leaves (a step writes one version, then commits): they belong
    to another store, and are not deleted."""
    if not directory.exists():
        return
    prefix = f"{role}-v"
    unknown = []
    for child in directory.iterdir():
        if child.is_dir() and child.name.startswith(prefix):
            try:
                version = int(child.name[len(prefix) :].split(".", 1)[0])
            except ValueError:
                continue
            if ".tmp-" in child.name or version == published_version + 1:
                shutil.rmtree(child, ignore_errors=True)
            elif version > published_version + 1:
                unknown.append(version)
    if unknown:
        raise CheckpointMismatchError(
            f"{directory} holds {role} checkpoints up to v{max(unknown)}, but the store's "
            f"last published {role} version is v{published_version}: this is not the "
            "store those checkpoints were trained with (a store replaced or lost?); use "
            "the run's own store, or another checkpoint folder for a new run")
