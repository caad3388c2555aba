"""CA-GRPO and Proposer rewards, group-normalised advantages and the staleness filter.

Everything here is pure Python over plain values, so the formulas can be unit-tested by hand
and reused by projections and reports without importing torch.

Coder (CA-GRPO), for kernel ``i`` in a group ``G`` of samples for one module::

    r_i  = 0                          if kernel i is incorrect
    r_i  = 1 + T(G) * beta * S_i      otherwise
    T(G) = [accuracy(G) >= alpha]     (alpha = 0.5, beta = 0.1 as in the paper)

``S_i`` is a speed term computed from the measured speedup and its confidence interval; its
form is chosen by ``RewardConfig.speed_term`` (see ``speed_term``). Proposer, for a module
whose Coder mean correctness is ``l``::

    r = 1 - 2 * |l - 0.5|    if the module is valid (peaks at l = 0.5: the frontier)
    r = invalid_reward       otherwise (negative)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar

__all__ = [
    "RewardConfig",
    "SpeedTerm",
    "Versioned",
    "ca_grpo_rewards",
    "filter_stale",
    "group_accuracy",
    "group_advantages",
    "group_gate",
    "proposer_reward",
    "speed_term",
    "staleness_stats",
]

SpeedTerm = Literal["log2_ci_low", "log2_point", "linear_ci_low", "none"]


@dataclass(frozen=True, slots=True)
class RewardConfig:
    """Reward parameters for both roles.

    ``speed_term`` selects ``S_i`` (see ``speed_term``); ``speed_clip`` bounds it. The
    constructor rejects settings under which a correct kernel could earn no more than an
    incorrect one (``1 + beta * speed_clip[0] <= 0``): correctness must always dominate.
    """

    alpha: float = 0.5
    beta: float = 0.1
    speed_term: SpeedTerm = "log2_ci_low"
    speed_clip: tuple[float, float] = (-1.0, 2.0)
    invalid_module_reward: float = -1.0

    def __post_init__(self) -> None:
        lo, hi = self.speed_clip
        if lo > hi:
            raise ValueError(f"speed_clip: lower bound {lo} exceeds upper bound {hi}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha: {self.alpha} is not in [0, 1]")
        if self.beta < 0.0:
            raise ValueError(f"beta: {self.beta} is negative")
        if 1.0 + self.beta * lo <= 0.0:
            raise ValueError(
                f"beta * speed_clip[0] = {self.beta * lo}: a correct kernel would earn no more "
                "than an incorrect one"
            )
        if self.invalid_module_reward >= 0.0:
            raise ValueError(f"invalid_module_reward: {self.invalid_module_reward} is not negative")


def speed_term(
    speedup: float | None,
    speedup_ci: tuple[float, float] | None,
    config: RewardConfig | None = None,
) -> float:
    """Returns ``S_i`` for one correct kernel.

    The default, ``log2_ci_low``, is ``clip(log2(lower CI bound of the speedup), -1, 2)``:

    - log2 makes halving and doubling the time symmetric (0.5x -> -1, 2x -> +1, parity -> 0),
      so the term measures speed in "doublings" rather than in a ratio skewed towards gains;
    - the lower bound of the confidence interval pays only for speed the verifier is sure
      of: a noisy measurement of a parity kernel has a lower bound under 1 and earns nothing,
      so timing noise is not rewarded (a point estimate would pay noise half the time);
    - the clip keeps the bonus small and bounded: with beta = 0.1 a correct kernel earns
      between 0.9 and 1.2, never less than an incorrect one, and 4x is "fast enough" so
      that a single outlier cannot dominate its group's advantages.

    Alternatives: ``log2_point`` (log2 of the point estimate, for verifiers without an
    interval), ``linear_ci_low`` (``lower bound - 1``, linear in the speedup) and ``none``
    (``S = 0``: a pure correctness reward). When the interval is missing, the point
    estimate stands in for its lower bound; when the speedup is missing (e.g. a verifier
    that could not time the kernel) the term is 0, neither reward nor penalty.
    """
    cfg = config or RewardConfig()
    if cfg.speed_term == "none":
        return 0.0
    point = speedup
    low = speedup_ci[0] if speedup_ci is not None else speedup
    value = point if cfg.speed_term == "log2_point" else low
    if value is None or math.isnan(value):
        return 0.0
    lo, hi = cfg.speed_clip
    if cfg.speed_term == "linear_ci_low":
        raw = value - 1.0
    else:
        # A non-positive speedup is a broken measurement; it earns the floor, not an error.
        raw = math.log2(value) if value > 0.0 else lo
    return min(max(raw, lo), hi)


def group_accuracy(correct: Sequence[bool]) -> float:
    """Returns the fraction of correct samples (0 for an empty group)."""
    return sum(correct) / len(correct) if correct else 0.0


def group_gate(correct: Sequence[bool], alpha: float = 0.5) -> bool:
    """Returns ``T(G)``: whether the group's accuracy reaches ``alpha``."""
    return bool(correct) and group_accuracy(correct) >= alpha


def ca_grpo_rewards(
    correct: Sequence[bool],
    speedups: Sequence[float | None],
    speedup_cis: Sequence[tuple[float, float] | None],
    config: RewardConfig | None = None,
) -> list[float]:
    """Returns the CA-GRPO reward of every sample of one group (see module docstring)."""
    cfg = config or RewardConfig()
    if not len(correct) == len(speedups) == len(speedup_cis):
        raise ValueError("correct, speedups and speedup_cis differ in length")
    gate = 1.0 if group_gate(correct, cfg.alpha) else 0.0
    return [
        1.0 + gate * cfg.beta * speed_term(s, ci, cfg) if ok else 0.0
        for ok, s, ci in zip(correct, speedups, speedup_cis, strict=True)
    ]


def group_advantages(
    rewards: Sequence[float | None], eps: float = 1e-4, scale: bool = True
) -> list[float]:
    """Returns GRPO advantages ``(r_i - mean) / (std + eps)`` for one group.

    This is the reference for what TRL computes with ``scale_rewards="group"``: ``std`` is the
    sample standard deviation (Bessel-corrected); unscored samples (``None``) are left out of
    the mean and std and get advantage 0. With ``scale=False`` (Dr. GRPO, TRL's
    ``scale_rewards="none"``) the advantage is ``r_i - mean``.

    Zero-std case: when every scored sample has the same reward (all wrong, or all right at
    the same speed) every advantage is exactly 0 and the group gives no gradient; ``eps``
    only guards the division. A group with fewer than two scored samples also gets zeros.
    """
    scored = [r for r in rewards if r is not None]
    if len(scored) < 2:
        return [0.0] * len(rewards)
    mean = sum(scored) / len(scored)
    std = math.sqrt(sum((r - mean) ** 2 for r in scored) / (len(scored) - 1))
    denom = std + eps if scale else 1.0
    return [0.0 if r is None else (r - mean) / denom for r in rewards]


def proposer_reward(
    valid: bool, mean_correctness: float | None, invalid_reward: float = -1.0
) -> float | None:
    """Returns the Proposer's reward ``1 - 2|l - 0.5|`` for a valid module, else ``invalid_reward``.

    ``None`` means "not scorable yet": a valid module whose kernels have no verdicts.
    """
    if not valid:
        return invalid_reward
    if mean_correctness is None:
        return None
    if not 0.0 <= mean_correctness <= 1.0:
        raise ValueError(f"mean_correctness: {mean_correctness} is not in [0, 1]")
    return 1.0 - 2.0 * abs(mean_correctness - 0.5)


class Versioned(Protocol):
    """Anything tagged with the policy version that generated it."""

    @property
    def policy_version(self) -> int: ...


V = TypeVar("V", bound=Versioned)


def filter_stale(
    samples: Iterable[V], current_version: int, max_staleness: int
) -> tuple[list[V], int]:
    """Keeps samples at most ``max_staleness`` versions behind ``current_version``.

    Returns ``(kept, dropped)``. Staleness is ``current_version - policy_version``; a sample
    from a newer version than the learner's (negative staleness, e.g. after the learner
    restarted from an older checkpoint) is kept: the importance correction covers it.
    """
    if max_staleness < 0:
        raise ValueError(f"max_staleness: {max_staleness} is negative")
    kept: list[V] = []
    dropped = 0
    for s in samples:
        if current_version - s.policy_version > max_staleness:
            dropped += 1
        else:
            kept.append(s)
    return kept, dropped


def staleness_stats(samples: Sequence[Versioned], current_version: int) -> dict[str, float]:
    """Returns min, mean and max staleness (in versions) of ``samples``; empty when none."""
    if not samples:
        return {}
    ages = [current_version - s.policy_version for s in samples]
    return {"min": float(min(ages)), "mean": sum(ages) / len(ages), "max": float(max(ages))}
