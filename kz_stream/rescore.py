"""``kz rescore``: verify stored kernels again under the current verifier version, beside
their old verdicts, and report the drift.

The new verdicts are written by the verifier service's own function
(``kz_stream.consumers.verifier.verdict_event``): their ids come from the kernel event, the
verifier version and the attempt, so a kernel already judged by this version is skipped
(unless that verdict was the verifier's own failure, ``infra_error``: judged again, as an
evaluation's resume does), and a rescore cut short resumes by running it again. A kernel
with no verdict at all is left to its run's verifier, whose verdict would take the same
stream version. A new verdict takes the next version of its kernel's stream (as the replay
found it; on the fleet, as the verifier reads it before judging).
The drift compares, for every kernel of the plan with a decided verdict of this version
(judged by this run or an earlier one: a run cut short, or one whose verdicts came late,
reports the whole drift when run again), its newest earlier decided verdict of another
version with it: verdicts that flipped between correct and not, grouped by the check that
decided the new one, and the training steps (and the policy versions they published)
whose rewards used a flipped kernel. Undecided verdicts (``unchecked``, ``infra_error``)
earned no reward and decide nothing: they are counted apart.

Two ways to judge: ``rescore`` verifies in this process; ``rescore_on_fleet`` publishes one
job per kernel on the rescore topic (the stored kernel event, with the verifier version in
a header) for the verifier services, which share them as a consumer group and write the
verdicts with their offsets, and waits for the verdicts to reach the store. Both report
the same drift.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kz_stream.bus import Bus
from kz_stream.events import (
    RETRIED_STATUS,
    UNDECIDED_STATUSES,
    Event,
    TrainingStepCompleted,
    payload_as,
)
from kz_stream.export import KernelFilter
from kz_stream.runtime import first_error
from kz_stream.store import EventStore
from kz_stream.verify import VERIFIER_VERSION, Verifier

__all__ = [
    "Drift",
    "RescorePlan",
    "collect_verdicts",
    "drift",
    "plan_rescore",
    "publish_jobs",
    "rescore",
    "rescore_attempt",
    "rescore_on_fleet",
]


def rescore_attempt(verdicts: Sequence[Mapping[str, Any]],
                    version: str = VERIFIER_VERSION) -> int | None:
    """The attempt number of a new verdict of ``version`` on a kernel with ``verdicts`` (its
    verdict payloads, in store order), or None when it wants none: it has no verdict yet
    (its run's verifier gives the first), or its newest verdict of ``version`` is not the
    verifier's own failure."""
    if not verdicts:
        return None
    mine = [v for v in verdicts if v.get("verifier_version") == version]
    if mine and mine[-1]["status"] != RETRIED_STATUS:
        return None
    return len(mine)


@dataclass
class RescorePlan:
    """What a replay of the store found: the kernels to judge again and the history the
    drift is measured against."""

    kernels: dict[str, Event] = field(default_factory=dict)  # kernel id -> KernelGenerated
    modules: dict[str, str] = field(default_factory=dict)  # module id -> source
    verdicts: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # in store order
    steps: list[TrainingStepCompleted] = field(default_factory=list)
    # kernel id -> the highest stream version stored in its stream (generation, verdicts)
    stream_versions: dict[str, int] = field(default_factory=dict)
    position: int = 0  # the highest global position the replay read

    def next_version(self, kernel_id: str) -> int:
        """The stream version a new verdict on the kernel takes."""
        return self.stream_versions[kernel_id] + 1

    def record_version(self, kernel_id: str, stream_version: int) -> None:
        self.stream_versions[kernel_id] = max(
            stream_version, self.stream_versions.get(kernel_id, stream_version)
        )

    def todo(self, version: str = VERIFIER_VERSION) -> list[str]:
        """Kernels whose module is in the store that want a verdict of ``version``
        (``rescore_attempt``)."""
        return [
            kid for kid, e in self.kernels.items()
            if e.payload["module_id"] in self.modules
            and rescore_attempt(self.verdicts.get(kid, []), version) is not None
        ]

    def unjudged(self) -> list[str]:
        """Kernels of the plan with no verdict at all (left to their run's verifier)."""
        return [kid for kid in self.kernels if not self.verdicts.get(kid)]


async def plan_rescore(store: EventStore, flt: KernelFilter) -> RescorePlan:
    """Replays the store: kernels that pass ``flt`` (its statuses apply to a kernel's
    newest verdict), their verdicts, module sources and training steps."""
    plan = RescorePlan()
    types = ["ModuleProposed", "KernelGenerated", "KernelVerified", "TrainingStepCompleted"]
    async for batch in store.read_all(0, types=types):
        for r in batch:
            e, p = r.event, r.event.payload
            plan.position = max(plan.position, r.global_position)
            if e.type == "ModuleProposed":
                plan.modules.setdefault(p["module_id"], p["source"])
            elif e.type == "KernelGenerated":
                plan.record_version(p["kernel_id"], e.stream_version)
                if flt.keeps_kernel(e.correlation_id, e.occurred_at):
                    plan.kernels[p["kernel_id"]] = e
            elif e.type == "KernelVerified":
                plan.record_version(p["kernel_id"], e.stream_version)
                plan.verdicts.setdefault(p["kernel_id"], []).append(p)
            else:
                plan.steps.append(payload_as(e, TrainingStepCompleted))
    if flt.statuses:
        plan.kernels = {
            kid: e for kid, e in plan.kernels.items()
            if plan.verdicts.get(kid) and plan.verdicts[kid][-1]["status"] in flt.statuses
        }
    return plan


@dataclass
class Drift:
    """How the new verdicts differ from the ones before them."""

    rescored: int = 0  # verdicts this run wrote (or, on the fleet, saw come)
    judged: int = 0  # kernels of the plan with a verdict of this version, earlier ones too
    compared: int = 0  # ... decided, with an earlier decided verdict of another version
    undecided: int = 0  # ... whose verdict of this version is unchecked or infra_error
    flips: Counter[tuple[str, str, str]] = field(default_factory=Counter)  # old, new, check
    flipped_kernels: list[str] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)  # training steps that used them
    missing: list[str] = field(default_factory=list)  # kernels whose new verdict did not come
    unjudged: int = 0  # kernels of the plan with no verdict at all (not rescored)

    def as_dict(self) -> dict[str, Any]:
        return {
            "verifier_version": VERIFIER_VERSION,
            "rescored": self.rescored,
            "judged": self.judged,
            "compared": self.compared,
            "undecided": self.undecided,
            "flipped": len(self.flipped_kernels),
            "flips": [{"from": a, "to": b, "check": c, "kernels": n}
                      for (a, b, c), n in self.flips.most_common()],
            "flipped_kernels": self.flipped_kernels,
            "training_steps": self.steps,
            "missing": self.missing,
            "unjudged": self.unjudged,
        }


def drift(plan: RescorePlan, new: dict[str, dict[str, Any]]) -> Drift:
    """Compares each kernel's newest verdict of this version (``new``, kernel id -> payload,
    those this run got; else the stored one) with its newest earlier decided verdict of
    another version."""
    current = {kid: mine[-1] for kid in plan.kernels
               if (mine := [v for v in plan.verdicts.get(kid, [])
                            if v.get("verifier_version") == VERIFIER_VERSION])}
    current.update(new)
    d = Drift(rescored=len(new), judged=len(current), unjudged=len(plan.unjudged()))
    for kid, v in sorted(current.items()):
        if v["status"] in UNDECIDED_STATUSES:
            d.undecided += 1
            continue
        before = [o for o in plan.verdicts.get(kid, [])
                  if o.get("verifier_version") != v.get("verifier_version")
                  and o["status"] not in UNDECIDED_STATUSES]
        if not before:
            continue
        d.compared += 1
        old = before[-1]
        if (old["status"] == "correct") != (v["status"] == "correct"):
            d.flips[(old["status"], v["status"], v.get("check") or "-")] += 1
            d.flipped_kernels.append(kid)
    flipped = set(d.flipped_kernels)
    for s in plan.steps:
        used = sorted(flipped.intersection(s.kernel_ids))
        if used:
            d.steps.append({"role": s.role, "step": s.step, "policy_version": s.policy_version,
                            "flipped_kernels": used})
    return d


async def rescore(
    store: EventStore,
    verifier: Verifier,
    plan: RescorePlan,
    *,
    producer: str,
    concurrency: int = 4,
    on_verdict: Callable[[int, int], None] | None = None,
) -> Drift:
    """Verifies ``plan.todo()`` again, appends each new verdict as it comes, and returns
    the drift."""
    from kz_stream.consumers.verifier import verdict_event

    todo = plan.todo()
    gate = asyncio.Semaphore(concurrency)
    new: dict[str, dict[str, Any]] = {}

    async def one(kid: str) -> None:
        kernel = plan.kernels[kid]
        async with gate:
            verdict = await verdict_event(verifier, kernel,
                                          plan.modules[kernel.payload["module_id"]],
                                          producer=producer, stream_version=plan.next_version(kid),
                                          attempt=rescore_attempt(plan.verdicts[kid]) or 0)
        await store.append([verdict])
        new[kid] = verdict.payload
        if on_verdict is not None:
            on_verdict(len(new), len(todo))

    try:
        async with verifier, asyncio.TaskGroup() as tg:
            for kid in todo:
                tg.create_task(one(kid))
    except BaseExceptionGroup as group:
        raise first_error(group) from None
    return drift(plan, new)


async def publish_jobs(bus: Bus, topic: str, plan: RescorePlan, kernel_ids: Sequence[str],
                       *, window: int = 256) -> None:
    """Publishes the kernels' stored events on ``topic`` as rescore jobs for the current
    verifier version (keyed by stream, so a kernel's jobs stay in order), ``window`` of
    them awaiting their acknowledgement at once."""
    from kz_stream.consumers.verifier import RESCORE_VERSION_HEADER

    headers = {RESCORE_VERSION_HEADER: VERIFIER_VERSION.encode()}
    for start in range(0, len(kernel_ids), window):
        await asyncio.gather(*(bus.publish(topic, plan.kernels[kid], headers=headers)
                               for kid in kernel_ids[start:start + window]))


async def collect_verdicts(
    store: EventStore,
    kernel_ids: Sequence[str],
    *,
    after: int,
    timeout_s: float,
    poll_s: float = 0.5,
    on_verdict: Callable[[int, int], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """Follows the store's verdicts past position ``after`` (its ``tail``: woken by each
    commit on PostgreSQL, polled every ``poll_s`` on SQLite) until every kernel has one of
    the current verifier version, or ``timeout_s`` has passed; returns those that came."""
    waiting = set(kernel_ids)
    new: dict[str, dict[str, Any]] = {}
    if not waiting:
        return new
    with contextlib.suppress(TimeoutError):
        async with (
            asyncio.timeout(timeout_s),
            contextlib.aclosing(
                store.tail(after, poll_interval=poll_s, types=["KernelVerified"])
            ) as batches,
        ):
            async for batch in batches:
                for r in batch:
                    p = r.event.payload
                    if p["kernel_id"] in waiting and p.get("verifier_version") == VERIFIER_VERSION:
                        waiting.discard(p["kernel_id"])
                        new[p["kernel_id"]] = p
                        if on_verdict is not None:
                            on_verdict(len(new), len(kernel_ids))
                if not waiting:
                    break
    return new


async def rescore_on_fleet(
    store: EventStore,
    bus: Bus,
    plan: RescorePlan,
    *,
    topic: str,
    timeout_s: float,
    poll_s: float = 0.5,
    on_verdict: Callable[[int, int], None] | None = None,
) -> Drift:
    """Publishes ``plan.todo()`` as rescore jobs, waits up to ``timeout_s`` for the
    verifiers' verdicts in the store and returns the drift; kernels still without one are
    ``missing`` (their jobs stay queued: running it again waits for them)."""
    todo = plan.todo()
    await publish_jobs(bus, topic, plan, todo)
    new = await collect_verdicts(store, todo, after=plan.position, timeout_s=timeout_s,
                                 poll_s=poll_s, on_verdict=on_verdict)
    d = drift(plan, new)
    d.missing = sorted(set(todo) - set(new))
    return d
