"""The learner's read model of a run, the per-API capability map, and the frontier.

``RunState`` is an in-memory projection rebuilt by replaying the store: modules, kernels,
their latest verdicts, and groups (all samples of one module under one policy version and
backend). The capability map and the frontier are pure functions of it.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field

from kz_stream.events import (
    EVENT_TYPES,
    UNDECIDED_STATUSES,
    Event,
    FrontierUpdated,
    KernelGenerated,
    KernelVerified,
    ModuleProposed,
    PolicyVersionLoaded,
    PolicyVersionPublished,
    TrainingStepCompleted,
    VerdictStatus,
    current_payload,
    is_evaluation,
)
from kz_stream.store import EventStore, RecordedEvent

__all__ = [
    "ApiStats",
    "CapabilityMap",
    "GroupState",
    "KernelRecord",
    "ModuleRecord",
    "RunState",
    "UnfinishedWork",
    "compute_frontier",
    "read_unfinished_work",
]

@dataclass
class UnfinishedWork:
    """A run's stored work that no later event finished, each as its stored event."""

    # Valid modules of which no kernel was generated (the Coder has not taken them up).
    modules: dict[str, Event] = field(default_factory=dict)
    # Kernels without a verdict.
    kernels: dict[str, Event] = field(default_factory=dict)


async def read_unfinished_work(store: EventStore, run_id: str) -> UnfinishedWork:
    """Reads run ``run_id``'s unfinished work from ``store``."""
    work = UnfinishedWork()
    coded: set[str] = set()
    verified: set[str] = set()
    types = ("ModuleProposed", "KernelGenerated", "KernelVerified")
    async for batch in store.read_all(0, types=types, correlation_id=run_id):
        for r in batch:
            # The ids alone, from the stored JSON: validating every kernel (source, token
            # ids, logprobs) into its model would cost a long run's start far more.
            e, p = r.event, current_payload(r.event)
            if e.type == "ModuleProposed":
                if p["validation"]["valid"]:
                    work.modules.setdefault(p["module_id"], e)
            elif e.type == "KernelGenerated":
                coded.add(p["module_id"])
                work.kernels.setdefault(p["kernel_id"], e)
            elif e.type == "KernelVerified":
                verified.add(p["kernel_id"])
    for mid in coded:
        work.modules.pop(mid, None)
    for kid in verified:
        work.kernels.pop(kid, None)
    return work


@dataclass
class ModuleRecord:
    module_id: str
    api_set: list[str]
    valid: bool
    event: ModuleProposed
    event_id: str


@dataclass
class KernelRecord:
    kernel_id: str
    module_id: str
    group_id: str
    policy_version: int
    generated: KernelGenerated
    generated_at: float
    verdict: KernelVerified | None = None

    @property
    def decided(self) -> bool:
        return self.verdict is not None and self.verdict.status not in UNDECIDED_STATUSES

    @property
    def correct(self) -> bool:
        return self.verdict is not None and self.verdict.status is VerdictStatus.CORRECT


@dataclass
class GroupState:
    group_id: str
    module_id: str
    policy_version: int
    size: int
    kernel_ids: list[str] = field(default_factory=list)
    used: bool = False

    def complete(
        self, kernels: dict[str, KernelRecord], *, timeout_s: float, now: float,
        waiting_since: float = 0.0,
    ) -> bool:
        """Every member has a verdict, or some have and the group has waited ``timeout_s``
        for the others: since its oldest kernel, or since ``waiting_since`` if later."""
        verdicts = [kernels[k].verdict is not None for k in self.kernel_ids]
        if len(verdicts) >= self.size and all(verdicts):
            return True
        if not any(verdicts):
            return False  # nothing to learn from yet, however long it waits
        oldest = min((kernels[k].generated_at for k in self.kernel_ids), default=now)
        return now - max(oldest, waiting_since) > timeout_s

    def decided_kernels(self, kernels: dict[str, KernelRecord]) -> list[KernelRecord]:
        """The members whose verdicts say what the kernel is worth: the samples a Coder
        step trains on. One without a verdict yet (timed out) or with an undecided one (the
        check could not run here, or the verifier failed itself) is evidence neither way,
        not a failure."""
        return [kernels[k] for k in self.kernel_ids if kernels[k].decided]


@dataclass
class RunState:
    """Modules, kernels, verdicts and groups of a run, built by ``apply``-ing events."""

    modules: dict[str, ModuleRecord] = field(default_factory=dict)
    kernels: dict[str, KernelRecord] = field(default_factory=dict)
    groups: dict[str, GroupState] = field(default_factory=dict)
    # Proposer groups: proposal group id -> module ids sampled together from one prompt.
    proposals: dict[str, list[str]] = field(default_factory=dict)
    used_proposals: set[str] = field(default_factory=set)
    published: dict[str, PolicyVersionPublished] = field(default_factory=dict)
    loaded: dict[tuple[str, str], int] = field(default_factory=dict)  # (role, replica)
    position: int = 0
    frontier_version: int = 0
    training_steps: int = 0
    # Per role, the schedule's step of its latest training step (``TrainingStepCompleted.
    # step``): where a learner resumes the schedule. Not the count: a learner of one role
    # skips the other's turns without storing anything.
    last_step: dict[str, int] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    # Events this process applied as it stored them (``apply_own``), not yet read back.
    applied_ahead: set[uuid.UUID] = field(default_factory=set)
    # Verdicts stored before their kernels (the verifier appends a verdict as it judges; the
    # recorder stores the kernel it judged on its own schedule, later while it lags or is
    # down): each the newest of its kernel, attached when the kernel comes.
    early_verdicts: dict[str, KernelVerified] = field(default_factory=dict)
    # When this process began to wait for verdicts (the learner's start): a group's
    # timeout runs from then at the earliest, since a resumed run's verifier has the last
    # session's unverified kernels to judge again.
    waiting_since: float = 0.0

    def apply_all(self, records: Iterable[RecordedEvent]) -> None:
        """Applies stored events in order; one already applied by ``apply_own`` is skipped,
        so reading back what this process wrote counts it once."""
        for r in records:
            if r.event.event_id in self.applied_ahead:
                self.applied_ahead.discard(r.event.event_id)
            else:
                self.apply(r.event, recorded_at=r.recorded_at.timestamp())
            self.position = max(self.position, r.global_position)

    def apply_own(self, event: Event) -> None:
        """Applies an event this process has just stored, ahead of reading it back."""
        self.apply(event)
        self.applied_ahead.add(event.event_id)

    def apply(self, event: Event, *, recorded_at: float | None = None) -> None:
        """Folds one event in; ``recorded_at`` (epoch seconds) dates a kernel (default: now)."""
        if is_evaluation(event.correlation_id):
            return  # evaluation kernels must never train the policy or steer the frontier
        self.counts[event.type] = self.counts.get(event.type, 0) + 1
        if event.type not in EVENT_TYPES:
            return  # a type newer code wrote: nothing this read model keeps
        match event.decode():
            case ModuleProposed() as m:
                self._module_proposed(m, str(event.event_id))
            case KernelGenerated() as k:
                self._kernel_generated(k, time.time() if recorded_at is None else recorded_at)
            case KernelVerified() as v:
                if (rec := self.kernels.get(v.kernel_id)) is not None:
                    rec.verdict = v  # the latest verdict wins (re-scoring)
                else:
                    self.early_verdicts[v.kernel_id] = v
            case TrainingStepCompleted() as s:
                self._training_step(s)
            case PolicyVersionPublished() as pv:
                current = self.published.get(pv.role)
                if current is None or pv.version > current.version:
                    self.published[pv.role] = pv
            case PolicyVersionLoaded() as pl:
                key = (pl.role, pl.replica)
                self.loaded[key] = max(self.loaded.get(key, 0), pl.version)
            case FrontierUpdated() as f:
                self.frontier_version = max(self.frontier_version, f.frontier_version)
            case _:
                pass  # an evaluation's start: nothing the learner keeps

    def _module_proposed(self, m: ModuleProposed, event_id: str) -> None:
        if m.module_id in self.modules:
            return
        self.modules[m.module_id] = ModuleRecord(
            m.module_id, sorted(m.api_set), m.validation.valid, m, event_id
        )
        if m.group_id and m.completion is not None:
            # Only model-written proposals train the Proposer (seeds have no tokens).
            self.proposals.setdefault(m.group_id, []).append(m.module_id)

    def _kernel_generated(self, k: KernelGenerated, generated_at: float) -> None:
        if k.kernel_id in self.kernels:
            return
        self.kernels[k.kernel_id] = KernelRecord(
            k.kernel_id, k.module_id, k.group_id, k.policy_version, k, generated_at,
            self.early_verdicts.pop(k.kernel_id, None),
        )
        g = self.groups.get(k.group_id)
        if g is None:
            g = self.groups[k.group_id] = GroupState(
                k.group_id, k.module_id, k.policy_version, k.group_size
            )
        g.kernel_ids.append(k.kernel_id)

    def _training_step(self, s: TrainingStepCompleted) -> None:
        self.training_steps += 1
        self.last_step[s.role] = max(self.last_step.get(s.role, 0), s.step)
        for gid in s.group_ids:
            if gid in self.groups:
                self.groups[gid].used = True
            if s.role == "proposer":
                self.used_proposals.add(gid)

    def ready_groups(
        self, *, timeout_s: float = 600.0, now: float | None = None
    ) -> list[GroupState]:
        """Complete groups not yet used for training, oldest first."""
        now = time.time() if now is None else now
        return [
            g
            for g in self.groups.values()
            if not g.used and g.complete(self.kernels, timeout_s=timeout_s, now=now,
                                         waiting_since=self.waiting_since)
        ]

    def policies_loaded(self) -> bool:
        """Every published policy version has been loaded by at least one replica (version
        0, a warm start, is what the generators start with)."""
        return all(
            pv.version == 0
            or any(r == role and v >= pv.version for (r, _), v in self.loaded.items())
            for role, pv in self.published.items()
        )

    def proposal_readiness(
        self, *, timeout_s: float = 600.0, now: float | None = None
    ) -> tuple[list[str], int]:
        """Proposal groups not yet trained on: the ready ones, whose valid modules all have a
        complete Coder group (so ``l̄`` is known), oldest first; and how many others are
        being scored: the Coder has taken up all their valid modules (each has kernels) and
        not finished. A module the Coder has not reached may wait behind many others, so
        its group does not count as being scored."""
        now = time.time() if now is None else now
        started: set[str] = set()
        complete: set[str] = set()
        for g in self.groups.values():
            started.add(g.module_id)
            if g.complete(self.kernels, timeout_s=timeout_s, now=now,
                          waiting_since=self.waiting_since):
                complete.add(g.module_id)
        ready: list[str] = []
        being_scored = 0
        for gid, mids in self.proposals.items():
            if gid in self.used_proposals:
                continue
            valid = [m for m in mids if self.modules[m].valid]
            if all(m in complete for m in valid):
                ready.append(gid)
            elif all(m in started for m in valid):
                being_scored += 1
        return ready, being_scored

    def module_correctness(self) -> dict[str, float]:
        """``l̄`` per module: the Coder's mean correctness over its decided samples."""
        per: dict[str, list[bool]] = {}
        for k in self.kernels.values():
            if k.decided:
                per.setdefault(k.module_id, []).append(k.correct)
        return {m: sum(v) / len(v) for m, v in per.items()}


@dataclass
class ApiStats:
    """Pass rate and speed of kernels for modules that use an API (or API pair)."""

    n: int = 0
    correct: int = 0
    speedups: list[float] = field(default_factory=list)
    recent: list[bool] = field(default_factory=list)

    def add(self, correct: bool, speedup: float | None, window: int) -> None:
        self.n += 1
        self.correct += correct
        if correct and speedup is not None:
            self.speedups.append(speedup)
        self.recent.append(correct)
        if len(self.recent) > window:
            self.recent.pop(0)

    @property
    def pass_rate(self) -> float:
        return self.correct / self.n if self.n else 0.0

    def smoothed_pass_rate(self, prior: float = 1.0) -> float:
        """Pass rate with a Beta(prior, prior) prior, so one sample is not a verdict."""
        return (self.correct + prior) / (self.n + 2 * prior)

    @property
    def median_speedup(self) -> float | None:
        return statistics.median(self.speedups) if self.speedups else None

    @property
    def slow_fraction(self) -> float:
        """Share of correct kernels that are slower than PyTorch eager."""
        return sum(s < 1.0 for s in self.speedups) / len(self.speedups) if self.speedups else 0.0

    @property
    def trend(self) -> float:
        """Recent pass rate minus overall pass rate (positive: improving)."""
        return (sum(self.recent) / len(self.recent) - self.pass_rate) if self.recent else 0.0


@dataclass
class CapabilityMap:
    apis: dict[str, ApiStats]
    pairs: dict[str, ApiStats]

    @classmethod
    def from_state(cls, state: RunState, *, window: int = 50) -> CapabilityMap:
        apis: dict[str, ApiStats] = {}
        pairs: dict[str, ApiStats] = {}
        for k in state.kernels.values():
            module = state.modules.get(k.module_id)
            if module is None or not k.decided or k.verdict is None:
                continue
            speedup = k.verdict.speedup
            for api in module.api_set:
                apis.setdefault(api, ApiStats()).add(k.correct, speedup, window)
            for a, b in itertools.combinations(module.api_set, 2):
                pairs.setdefault(f"{a}+{b}", ApiStats()).add(k.correct, speedup, window)
        return cls(apis, pairs)


# The most APIs (and pairs) each list of the frontier names.
_TOP_K = 20


def compute_frontier(state: RunState) -> FrontierUpdated:
    """The Proposer's target: weak APIs and pairs, slow APIs, and per-module ``l̄``.

    Weakness is ``1 − smoothed pass rate``; slowness is the share of correct kernels slower
    than eager, weighted by how often the Coder is correct (a speed target is only
    reachable where correctness is).
    """
    cmap = CapabilityMap.from_state(state)

    def top(d: dict[str, float]) -> dict[str, float]:
        items = sorted(d.items(), key=lambda kv: (-kv[1], kv[0]))[:_TOP_K]
        return {k: round(v, 6) for k, v in items if not math.isnan(v)}

    weak = {a: 1 - s.smoothed_pass_rate() for a, s in cmap.apis.items()}
    weak_pairs = {p: 1 - s.smoothed_pass_rate() for p, s in cmap.pairs.items()}
    slow = {a: s.slow_fraction * s.pass_rate for a, s in cmap.apis.items() if s.speedups}
    return FrontierUpdated(
        frontier_version=state.frontier_version + 1,
        weak_apis=top(weak),
        weak_pairs=top(weak_pairs),
        slow_apis=top(slow),
        module_correctness={m: round(v, 6) for m, v in state.module_correctness().items()},
        based_on_position=state.position,
    )
