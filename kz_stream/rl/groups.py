"""Plain training data: samples, groups, and the batch built from complete groups.

A ``Sample`` is one completion with what training needs: its prompt, its tokens and the
behaviour policy's per-token logprobs (for the importance correction), the version of the
policy that generated it, and its verdict. A ``Group`` is all samples for one prompt under
one policy version (a module's kernels for the Coder, an API set's modules for the
Proposer). The learner service builds these from the store; nothing here touches it.

Contract on tokens: ``prompt_ids`` (or, when absent, ``prompt`` tokenized by the learner
without special tokens) followed by ``completion_ids`` must be exactly the sequence the
generator fed and sampled, and ``logprobs`` must be the sampling distribution's logprobs of
those tokens after temperature (vLLM: ``--logprobs-mode processed_logprobs``), one per
completion token.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kz_stream.events import (
    UNDECIDED_STATUSES,
    KernelGenerated,
    KernelVerified,
    ModuleProposed,
    VerdictStatus,
)
from kz_stream.rl.rewards import filter_stale, proposer_reward, staleness_stats

__all__ = [
    "Group",
    "Sample",
    "TrainingBatch",
    "build_batch",
    "group_samples",
    "proposer_step_groups",
]


@dataclass(frozen=True, slots=True)
class Sample:
    """One completion with its behaviour logprobs and verdict.

    Coder samples carry ``kernel_id`` and the kernel verdict (``correct``, ``speedup``,
    ``speedup_ci``); Proposer samples carry the proposed ``module_id``, ``module_valid`` and
    the Coder's mean correctness on that module.
    """

    group_id: str
    prompt: str
    completion_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    policy_version: int
    kernel_id: str = ""
    module_id: str = ""
    prompt_ids: tuple[int, ...] | None = None
    # Coder verdict
    correct: bool | None = None
    speedup: float | None = None
    speedup_ci: tuple[float, float] | None = None
    # Proposer verdict
    module_valid: bool | None = None
    mean_correctness: float | None = None

    @property
    def sample_id(self) -> str:
        """Returns the kernel id for a Coder sample, the module id for a Proposer sample."""
        return self.kernel_id or self.module_id

    def problem(self) -> str | None:
        """Returns why this sample cannot be trained on, or None when it can."""
        if not self.completion_ids:
            return "empty completion"
        if len(self.logprobs) != len(self.completion_ids):
            return f"{len(self.logprobs)} logprobs for {len(self.completion_ids)} completion tokens"
        if any(math.isinf(lp) and lp > 0 for lp in self.logprobs):
            return "a logprob is +inf"
        if self.prompt_ids is not None and not self.prompt_ids:
            return "empty prompt_ids"
        return None

    @classmethod
    def from_kernel(
        cls,
        generated: KernelGenerated,
        verified: KernelVerified,
        *,
        prompt_ids: Sequence[int] | None = None,
    ) -> Sample:
        """Builds a Coder sample from a kernel's generation and verdict events."""
        if generated.kernel_id != verified.kernel_id:
            raise ValueError(
                f"kernel_id: generated {generated.kernel_id} but verified {verified.kernel_id}"
            )
        completion = generated.completion
        return cls(
            group_id=generated.group_id,
            prompt=generated.prompt,
            completion_ids=tuple(completion.token_ids) if completion else (),
            logprobs=tuple(completion.logprobs) if completion else (),
            policy_version=generated.policy_version,
            kernel_id=generated.kernel_id,
            module_id=generated.module_id,
            prompt_ids=tuple(prompt_ids) if prompt_ids is not None else None,
            # An undecided verdict is unscored (no reward either way), never a failure.
            correct=(None if verified.status in UNDECIDED_STATUSES
                     else verified.status == VerdictStatus.CORRECT),
            speedup=verified.speedup,
            speedup_ci=verified.speedup_ci,
        )

    @classmethod
    def from_module(
        cls,
        proposed: ModuleProposed,
        *,
        group_id: str,
        mean_correctness: float | None,
        prompt_ids: Sequence[int] | None = None,
    ) -> Sample:
        """Builds a Proposer sample from a proposal and the Coder's mean correctness on it."""
        completion = proposed.completion
        return cls(
            group_id=group_id,
            prompt=proposed.prompt,
            completion_ids=tuple(completion.token_ids) if completion else (),
            logprobs=tuple(completion.logprobs) if completion else (),
            policy_version=proposed.policy_version,
            module_id=proposed.module_id,
            prompt_ids=tuple(prompt_ids) if prompt_ids is not None else None,
            module_valid=proposed.validation.valid,
            mean_correctness=mean_correctness,
        )


@dataclass(frozen=True, slots=True)
class Group:
    """All samples for one prompt under one policy version."""

    group_id: str
    samples: tuple[Sample, ...]

    def __post_init__(self) -> None:
        for s in self.samples:
            if s.group_id != self.group_id:
                raise ValueError(
                    f"sample {s.sample_id} belongs to {s.group_id}, not {self.group_id}"
                )

    def __len__(self) -> int:
        return len(self.samples)

    def expired(self, policy_version: int, max_staleness: int) -> bool:
        """Says whether the group's samples are too stale to train on at ``policy_version``.

        A group's samples come from one policy version and staleness only grows, so an
        expired group never becomes trainable: a step that took it would train on nothing
        (``build_batch`` drops it whole) and spend its turn.
        """
        fresh, stale = filter_stale(self.samples, policy_version, max_staleness)
        return stale > 0 and not fresh

    @property
    def accuracy(self) -> float:
        """Returns the fraction of samples judged correct (Coder groups)."""
        return (
            sum(bool(s.correct) for s in self.samples) / len(self.samples) if self.samples else 0.0
        )


def group_samples(samples: Iterable[Sample]) -> list[Group]:
    """Groups samples by ``group_id``, keeping first-seen order of groups and samples."""
    by_id: dict[str, list[Sample]] = {}
    for s in samples:
        by_id.setdefault(s.group_id, []).append(s)
    return [Group(gid, tuple(members)) for gid, members in by_id.items()]


def proposer_step_groups(
    ready: Sequence[Group], n: int, *, invalid_reward: float, waiting: bool
) -> list[Group]:
    """Picks the ``n`` groups a Proposer step trains on from ``ready`` (oldest first).

    A group whose proposals all earn the same reward (every one invalid, most often) has
    zero advantage: a step on such groups changes nothing. Groups whose rewards differ come
    first; while other proposal groups are being scored (``waiting``: the Coder has taken up
    their valid modules and their verdicts are coming) the step waits for them rather than
    train on equal-reward groups, and returns ``[]``. Otherwise equal-reward groups fill
    the step. (DAPO's dynamic sampling drops such groups likewise; TRL has no
    equivalent, since the learner, not TRL, chooses the groups.)
    """

    informative: list[Group] = []
    equal: list[Group] = []
    for g in ready:
        # None: a valid module whose l̄ is unknown (all its verdicts undecided) is unscored,
        # so it makes no difference to the advantages.
        rewards = {proposer_reward(bool(s.module_valid), s.mean_correctness, invalid_reward)
                   for s in g.samples} - {None}
        (informative if len(rewards) > 1 else equal).append(g)
    if len(informative) >= n:
        return informative[:n]
    if waiting:
        return []
    return [*informative, *equal][:n]


@dataclass(frozen=True, slots=True)
class TrainingBatch:
    """The groups one training step uses, and what was left out and why."""

    groups: tuple[Group, ...]
    policy_version: int
    dropped_stale: int = 0
    dropped_invalid: int = 0
    dropped_groups: int = 0
    staleness: dict[str, float] = field(default_factory=dict)

    @property
    def samples(self) -> list[Sample]:
        """Returns every sample, group by group."""
        return [s for g in self.groups for s in g.samples]

    @property
    def kernel_ids(self) -> list[str]:
        return [s.kernel_id for s in self.samples if s.kernel_id]

    @property
    def module_ids(self) -> list[str]:
        return list(dict.fromkeys(s.module_id for s in self.samples if s.module_id))

    @property
    def group_ids(self) -> list[str]:
        return [g.group_id for g in self.groups]


def build_batch(
    groups: Iterable[Group],
    *,
    policy_version: int,
    max_staleness: int,
    min_group_size: int = 2,
) -> TrainingBatch:
    """Builds a training batch from complete groups.

    Samples more than ``max_staleness`` versions behind ``policy_version`` are dropped and
    counted in ``dropped_stale``; samples that cannot be trained on (see
    ``Sample.problem``) in ``dropped_invalid``. A group left with fewer than
    ``min_group_size`` samples has no usable group baseline, so it is dropped whole and
    counted in ``dropped_groups`` (a count of groups).
    """
    if min_group_size < 2:
        raise ValueError("min_group_size: GRPO needs at least 2 samples per group")
    kept_groups: list[Group] = []
    dropped_stale = dropped_invalid = dropped_groups = 0
    for g in groups:
        fresh, stale = filter_stale(g.samples, policy_version, max_staleness)
        dropped_stale += stale
        usable = [s for s in fresh if s.problem() is None]
        dropped_invalid += len(fresh) - len(usable)
        if len(usable) < min_group_size:
            dropped_groups += 1
            continue
        kept_groups.append(Group(g.group_id, tuple(usable)))
    kept = [s for g in kept_groups for s in g.samples]
    return TrainingBatch(
        groups=tuple(kept_groups),
        policy_version=policy_version,
        dropped_stale=dropped_stale,
        dropped_invalid=dropped_invalid,
        dropped_groups=dropped_groups,
        staleness=staleness_stats(kept, policy_version),
    )
