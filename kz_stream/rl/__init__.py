"""CA-GRPO: rewards, groups, the alternation schedule and (in ``kz_stream.rl.trainer``) the learner.

This package imports without torch; ``kz_stream.rl.trainer`` pulls in torch, transformers,
peft and TRL (the ``train`` extra) and is imported explicitly.
"""

from kz_stream.rl.groups import (
    Group,
    Sample,
    TrainingBatch,
    build_batch,
    group_samples,
    proposer_step_groups,
)
from kz_stream.rl.options import TrainerOptions
from kz_stream.rl.rewards import (
    RewardConfig,
    ca_grpo_rewards,
    filter_stale,
    group_accuracy,
    group_advantages,
    group_gate,
    proposer_reward,
    speed_term,
    staleness_stats,
)
from kz_stream.rl.schedule import AlternationConfig, AlternationSchedule, Role, Turn

__all__ = [
    "AlternationConfig",
    "AlternationSchedule",
    "Group",
    "RewardConfig",
    "Role",
    "Sample",
    "TrainerOptions",
    "TrainingBatch",
    "Turn",
    "build_batch",
    "ca_grpo_rewards",
    "filter_stale",
    "group_accuracy",
    "group_advantages",
    "group_gate",
    "group_samples",
    "proposer_reward",
    "proposer_step_groups",
    "speed_term",
    "staleness_stats",
]
