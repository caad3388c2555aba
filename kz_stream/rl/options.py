"""The trainer knobs the ``[learner]`` settings set, with their one set of defaults.

``kz_stream.rl.trainer.LearnerConfig`` extends ``TrainerOptions`` and
``kz_stream.config.LearnerSettings`` takes its defaults from it, so the two cannot disagree.
This module imports without torch.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TrainerOptions"]


@dataclass(frozen=True, slots=True)
class TrainerOptions:
    """How a learner trains, as far as the settings choose it."""

    learning_rate: float = 1e-5
    lora_r: int = 16
    full_finetune: bool = False
    # Versions a sample may lag the trained policy by before the step drops it.
    max_staleness: int = 4
    # KL penalty toward the run's first policy (version 0: the warm-start adapter, or the
    # bare model without one), TRL's ``beta``; 0 computes no reference.
    kl_beta: float = 0.0
    # Memory of a training step: gradient accumulation over this many micro-batches, and
    # activations recomputed in the backward pass (both trade a little time for memory).
    micro_batches: int = 1
    gradient_checkpointing: bool = False
