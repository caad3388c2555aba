"""CA-GRPO on TRL's ``GRPOTrainer``, fed finished groups instead of generating.

How this uses TRL 1.16 (read from its source, ``trl/trainer/grpo_trainer.py``):

- **The seam.** ``GRPOTrainer(rollout_func=...)`` replaces generation: for a batch of
  prompts it calls ``rollout_func(prompts, trainer)`` and expects ``prompt_ids``,
  ``completion_ids`` and ``logprobs``; any other key is merged into the inputs that reach the
  reward functions, and ``env_mask`` (a per-token 0/1 list) masks tokens out of the loss.
  ``GroupFeed`` is that function: it hands back the samples of the staged groups, with
  their verdicts as ``kz_*`` fields, so no generation happens in the trainer.
- **Rewards and advantages.** ``CoderReward`` / ``ProposerReward`` compute the rewards from
  those fields (``rewards.py``); TRL turns them into group-normalised advantages
  (``scale_rewards="group"``) and computes its clipped surrogate loss (``loss_type``).
- **Importance correction.** TRL corrects against the sampler's logprobs only when
  ``self.use_vllm and self.vllm_importance_sampling_correction``: it then recomputes the
  current policy's logprobs ``pi_old`` before the update and weights the per-token loss by
  ``clip(pi_old / pi_behaviour, C_min, C_max)`` (``vllm_importance_sampling_mode``, default
  here ``token_truncate``: truncated IS). TRL's PPO ratio ``pi / pi_old`` is 1 at the one
  update each batch gets, so this truncated weight is the clipped importance ratio against
  the behaviour policy (``epsilon`` clipping engages only with ``num_iterations > 1``, an
  override). ``use_vllm=True`` in the config would also make
  TRL build a vLLM client and connect to a server, which the learner neither needs nor has:
  its weights move as events (``save_policy`` -> ``PolicyVersionPublished``). So
  ``KzGRPOTrainer`` is built with ``use_vllm=False`` and then sets the *attribute*
  ``use_vllm = True``, with a no-op ``vllm_generation.sync_weights`` (the only vLLM call on
  the ``rollout_func`` path). Every other ``use_vllm`` branch in TRL 1.16 is either in
  ``__init__`` (already run) or in its own generation paths, which ``rollout_func`` bypasses.
- **The loop.** ``Trainer.train`` pulls prompts from a dataloader and owns the run; the
  learner instead takes one optimizer step per ``train_step(groups)`` when the store has a
  batch ready. So ``train_step`` drives TRL's own per-micro-batch ``training_step`` (which
  scores the batch through ``rollout_func``, computes TRL's loss and back-propagates) and
  then does what ``Trainer._inner_training_loop`` does at a step boundary: clip, optimizer
  and scheduler step, zero grad, advance ``global_step``.

TRL needs a fixed group size per batch (it views rewards as ``(-1, num_generations)``).
Groups shrink (timeouts, stale or broken samples), so each group is padded to the batch's
largest group with filler rows: a copy of a real row with reward ``None`` and an all-zero
``env_mask``. TRL leaves unscored rows out of the group mean and std, gives them advantage
0, and masked tokens count neither in the loss nor in its token normaliser, so fillers
change nothing but the compute.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import warnings
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import torch
from accelerate.utils import broadcast_object_list, gather_object
from datasets import Dataset
from peft import LoraConfig, PeftModel, load_peft_weights, set_peft_model_state_dict
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from kz_stream.logging import get_logger
from kz_stream.rl.groups import Group, Sample, TrainingBatch, build_batch
from kz_stream.rl.options import TrainerOptions
from kz_stream.rl.rewards import RewardConfig, ca_grpo_rewards, proposer_reward
from kz_stream.rl.schedule import Role

with warnings.catch_warnings():
    # TRL checks the installed vLLM's version in several of its modules at import and warns
    # from each when it is newer than TRL was tested with. TRL's vLLM client and generation
    # are never used here (rollouts come from the store; see KzGRPOTrainer), so the warning
    # concerns nothing the user runs.
    warnings.filterwarnings(
        "ignore", message=r"TRL currently supports vLLM versions", category=UserWarning
    )
    from trl.trainer.grpo_config import GRPOConfig
    from trl.trainer.grpo_trainer import GRPOTrainer

__all__ = [
    "CoderLearner",
    "CoderReward",
    "GRPOLearner",
    "GroupFeed",
    "KzGRPOTrainer",
    "LearnerConfig",
    "ProposerLearner",
    "ProposerReward",
    "StepResult",
    "latest_checkpoint",
    "lora_config",
    "policy_sha256",
]

ISMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]

_MANIFEST = "kz_policy.json"
_STATE = "learner_state.pt"
# Files save_pretrained writes that do not define the policy (PEFT's model card).
_UNHASHED = {_MANIFEST, _STATE, "README.md"}


@dataclass(frozen=True, slots=True)
class LearnerConfig(TrainerOptions):
    """What the learner trains and how; the defaults are the CA-GRPO setup (those the
    ``[learner]`` settings set come from ``TrainerOptions``).

    ``temperature`` must be the generators' sampling temperature: TRL scores tokens under
    ``logits / temperature``, and the importance ratio compares that with the behaviour
    logprobs. ``micro_batches`` splits a step's batch for gradient accumulation (one
    optimizer step either way). ``grpo_overrides`` passes any other ``GRPOConfig`` field
    through (e.g. ``{"entropy_coef": 0.01}``).
    """

    role: Role = "coder"
    model: str = ""  # a local directory, or a directory holding ``gguf_file``
    gguf_file: str | None = None
    output_dir: str = "kz-learner"  # TRL's scratch directory; policies go to save_policy's
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_target_modules: str | tuple[str, ...] = "all-linear"
    # A LoRA adapter the first step starts from (a warm start) when there is no checkpoint;
    # its own shape (rank, targets) replaces the lora_* fields above.
    init_adapter: str | None = None
    lr_scheduler_type: str = "constant"  # an open-ended stream has no horizon to decay over
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    loss_type: str = "dapo"  # TRL's default: token-level normalisation, no length bias
    epsilon: float = 0.2
    epsilon_high: float | None = None
    scale_rewards: str = "group"
    importance_sampling: bool = True
    # Token-level truncated IS: a kernel is ~1k tokens, and a sequence-level ratio (a
    # product over them; TRL's default "sequence_mask") would mask nearly every stale one.
    is_mode: ISMode = "token_truncate"
    is_clip_max: float | None = 3.0  # TRL's default cap C
    is_clip_min: float | None = None
    temperature: float = 1.0
    max_completion_length: int = 2048  # only the "dr_grpo" loss reads it
    logprob_batch_size: int = 8
    bf16: bool | None = None  # None: bf16 autocast iff a CUDA device supports it
    min_group_size: int = 2
    seed: int = 0
    rewards: RewardConfig = field(default_factory=RewardConfig)
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    grpo_overrides: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one ``train_step`` did (the learner service records it as an event)."""

    role: Role
    step: int  # optimizer steps taken so far, this one included
    policy_version: int  # version of the weights after this step
    trained: bool
    losses: dict[str, float]
    mean_reward: float
    rewards: dict[str, float]  # sample id -> reward, scored samples only
    kernel_ids: list[str]
    module_ids: list[str]
    group_ids: list[str]
    staleness: dict[str, float]
    dropped_stale: int
    dropped_invalid: int
    dropped_groups: int
    num_samples: int


# -- the rollout seam --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Row:
    """One row of the generation batch TRL sees: a sample, or a filler copy of one."""

    sample: Sample
    prompt_ids: list[int]
    filler: bool


class GroupFeed:
    """TRL ``rollout_func`` that returns staged samples instead of generating."""

    def __init__(self) -> None:
        self._rows: list[_Row] = []

    def stage(self, rows: list[_Row]) -> None:
        self._rows = rows

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        rows, self._rows = self._rows, []
        if len(prompts) != len(rows):
            raise RuntimeError(f"rollout asked for {len(prompts)} rows, {len(rows)} staged")
        for prompt, row in zip(prompts, rows, strict=True):
            if prompt != row.sample.prompt:
                raise RuntimeError(f"rollout prompt order differs at {row.sample.sample_id}")
        return {
            "prompt_ids": [r.prompt_ids for r in rows],
            "completion_ids": [list(r.sample.completion_ids) for r in rows],
            "logprobs": [list(r.sample.logprobs) for r in rows],
            "env_mask": [[0 if r.filler else 1] * len(r.sample.completion_ids) for r in rows],
            "kz_filler": [r.filler for r in rows],
            "kz_sample_id": [r.sample.sample_id for r in rows],
            "kz_group": [r.sample.group_id for r in rows],
            "kz_correct": [r.sample.correct for r in rows],
            "kz_speedup": [r.sample.speedup for r in rows],
            "kz_speedup_ci": [r.sample.speedup_ci for r in rows],
            "kz_module_valid": [r.sample.module_valid for r in rows],
            "kz_mean_correctness": [r.sample.mean_correctness for r in rows],
        }


class _Reward:
    """A TRL reward function over the ``kz_*`` fields ``GroupFeed`` adds to the inputs.

    A filler row, or a sample without a verdict, gets None (unscored: out of the group
    baseline); ``last`` keeps the latest batch's rewards by sample id.
    """

    def __init__(self, config: RewardConfig) -> None:
        self.config = config
        self.last: dict[str, float] = {}  # sample id -> reward of the latest batch

    def __call__(
        self,
        prompts: list[Any],
        completions: list[Any],
        completion_ids: list[list[int]],
        *,
        kz_filler: list[bool],
        kz_sample_id: list[str],
        **fields: Any,
    ) -> list[float | None]:
        out = self._score(kz_filler, fields)
        self.last = {kz_sample_id[i]: r for i, r in enumerate(out) if r is not None}
        return out

    def _score(self, filler: list[bool], fields: dict[str, Any]) -> list[float | None]:
        raise NotImplementedError


class CoderReward(_Reward):
    """CA-GRPO rewards from the verdict fields (``rewards.py``), per group."""

    def _score(self, filler: list[bool], fields: dict[str, Any]) -> list[float | None]:
        correct: list[bool | None] = fields["kz_correct"]
        speedup: list[float | None] = fields["kz_speedup"]
        speedup_ci: list[tuple[float, float] | None] = fields["kz_speedup_ci"]
        out: list[float | None] = [None] * len(filler)
        members: dict[str, list[int]] = {}
        for i, (fill, ok) in enumerate(zip(filler, correct, strict=True)):
            if not fill and ok is not None:
                members.setdefault(fields["kz_group"][i], []).append(i)
        for idx in members.values():
            rewards = ca_grpo_rewards(
                [bool(correct[i]) for i in idx],
                [speedup[i] for i in idx],
                [speedup_ci[i] for i in idx],
                self.config,
            )
            for i, r in zip(idx, rewards, strict=True):
                out[i] = r
        return out


class ProposerReward(_Reward):
    """``1 - 2|l - 0.5|`` for valid modules, a penalty otherwise."""

    def _score(self, filler: list[bool], fields: dict[str, Any]) -> list[float | None]:
        valid: list[bool | None] = fields["kz_module_valid"]
        lbar: list[float | None] = fields["kz_mean_correctness"]
        return [
            None if fill or ok is None
            else proposer_reward(ok, mean, self.config.invalid_module_reward)
            for fill, ok, mean in zip(filler, valid, lbar, strict=True)
        ]


class _NoWeightSync:
    """Stands in for TRL's vLLM client: policies reach generators as events, not over NCCL."""

    def sync_weights(self) -> None:
        return None


class _FillerWarningFilter(logging.Filter):
    """Drops TRL's "all reward functions returned None" warning for our filler rows."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "'kz_filler': True" not in record.getMessage()


_FILLER_FILTER = _FillerWarningFilter()


class KzGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` with the behaviour-logprob importance correction on and no vLLM.

    See the module docstring for why the correction is switched on through the
    ``use_vllm`` attribute after construction rather than the config flag.
    """

    def __init__(self, *args: Any, importance_sampling: bool, **kwargs: Any) -> None:
        with warnings.catch_warnings():
            # rollout_func is marked experimental in TRL 1.16; it is the documented seam.
            warnings.filterwarnings("ignore", message=".*rollout_func.*", category=UserWarning)
            super().__init__(*args, **kwargs)
        # Fillers are unscored on purpose; TRL would warn about each one, every step.
        logging.getLogger("trl.trainer.grpo_trainer").addFilter(_FILLER_FILTER)
        if importance_sampling:
            self.use_vllm = True
            self.vllm_generation = _NoWeightSync()  # type: ignore[assignment]  # duck-typed stub
            self._last_loaded_step = -1


# -- checkpoints -------------------------------------------------------------------------


def policy_sha256(path: str | Path) -> str:
    """Returns the sha256 of a saved policy directory: of its files' names and contents.

    The learner's own state (optimizer, manifest) and PEFT's model card are left out, so the
    digest names the weights and configs a generator loads.
    """
    root = Path(path)
    digest = hashlib.sha256()
    for p in sorted(q for q in root.rglob("*") if q.is_file()):
        rel = p.relative_to(root).as_posix()
        if rel in _UNHASHED:
            continue
        digest.update(rel.encode())
        digest.update(b"\0")
        digest.update(hashlib.sha256(p.read_bytes()).hexdigest().encode())
        digest.update(b"\n")
    return digest.hexdigest()


def _checkpoint_name(role: Role, version: int) -> str:
    return f"{role}-v{version:08d}"


# Resuming needs the optimizer state of the newest version only; the one before stays too,
# in case the newest is damaged. Older versions keep their weights (what the store's
# kernels were sampled from) without it: a state is twice an adapter's size.
_STATES_KEPT = 2


def _versions(root: Path, role: Role) -> list[tuple[int, Path]]:
    """``role``'s saved versions under ``root``, oldest first. Only renamed-into-place
    directories count: a crash mid-save leaves a ``*.tmp-*`` one."""
    found = []
    for p in root.glob(f"{role}-v*"):
        suffix = p.name[len(role) + 2 :]
        if suffix.isdigit():
            found.append((int(suffix), p))
    return sorted(found)


def _drop_old_states(root: Path, role: Role, newest: int) -> None:
    """Deletes the optimizer state of ``role``'s versions older than the last kept."""
    older = [p for v, p in _versions(root, role) if v <= newest]
    for path in older[:-_STATES_KEPT]:
        (path / _STATE).unlink(missing_ok=True)


def latest_checkpoint(directory: str | Path, role: Role) -> Path | None:
    """Returns the newest complete checkpoint of ``role`` under ``directory``, if any."""
    root = Path(directory)
    if not root.is_dir():
        return None
    complete = [p for _, p in _versions(root, role)
                if (p / _MANIFEST).is_file() and (p / _STATE).is_file()]
    return complete[-1] if complete else None


# -- the learner -------------------------------------------------------------------------


def lora_config(config: LearnerConfig) -> LoraConfig:
    """The LoRA shape the learner trains (and the warm start's SFT copies)."""
    targets = config.lora_target_modules
    return LoraConfig(
        task_type="CAUSAL_LM",
        r=config.lora_r,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=targets if isinstance(targets, str) else list(targets),
    )


def _bf16_available() -> bool:
    # TRL defaults bf16 to True, which transformers rejects on a machine without a GPU.
    return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())


def load_model(config: LearnerConfig, path: str | Path | None = None) -> PreTrainedModel:
    """Loads the base model (``gguf_file`` is dequantized by transformers)."""
    source = str(path or config.model)
    if not source:
        raise ValueError("model: no model given and LearnerConfig.model is empty")
    kwargs = dict(config.model_kwargs)
    if config.gguf_file and path is None:
        kwargs["gguf_file"] = config.gguf_file
    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    if "gguf_file" in kwargs:
        _forget_gguf_quantization(model)
    return model


def _forget_gguf_quantization(model: PreTrainedModel) -> None:
    # transformers dequantizes GGUF tensors to float on load but still tags the model as
    # GGUF-quantized, and Trainer refuses to train such a model; the weights are plain
    # floats, so drop the tag (and keep it out of a saved config.json).
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)


def load_tokenizer(config: LearnerConfig) -> PreTrainedTokenizerBase:
    if not config.model:
        raise ValueError("tokenizer: no tokenizer given and LearnerConfig.model is empty")
    kwargs: dict[str, Any] = {"gguf_file": config.gguf_file} if config.gguf_file else {}
    tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(config.model, **kwargs)
    return tokenizer


class GRPOLearner:
    """Trains one role's policy with CA-GRPO, one optimizer step per batch of groups.

    ``version`` counts optimizer steps (resumed from the checkpoint): the weights after step
    ``s`` are policy version ``s``, and a sample's staleness is ``version`` minus the version
    that generated it.
    """

    def __init__(
        self,
        config: LearnerConfig,
        *,
        model: PreTrainedModel | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        checkpoint_dir: str | Path | None = None,
    ) -> None:
        self.config = config
        self.role: Role = config.role
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config)
        resume = latest_checkpoint(checkpoint_dir, self.role) if checkpoint_dir else None
        self.resumed_from = resume
        state: dict[str, Any] = {}
        if resume is not None:
            state = torch.load(resume / _STATE, weights_only=True)

        if config.full_finetune and config.kl_beta:
            # TRL would load its reference from the model's own path: after a resume, the
            # latest checkpoint rather than version 0.
            raise ValueError("kl_beta: a KL anchor needs LoRA (full_finetune=False)")
        peft_config: LoraConfig | None = None
        policy: PreTrainedModel | PeftModel
        if config.full_finetune:
            policy = load_model(config, resume) if resume else (model or load_model(config))
        else:
            base = model if model is not None else load_model(config)
            if resume is not None:
                policy = PeftModel.from_pretrained(base, str(resume), is_trainable=True)
            elif config.init_adapter:
                policy = PeftModel.from_pretrained(base, config.init_adapter, is_trainable=True)
            else:
                policy = base
                peft_config = lora_config(config)

        self.feed = GroupFeed()
        self.reward: CoderReward | ProposerReward = (
            CoderReward(config.rewards) if self.role == "coder" else ProposerReward(config.rewards)
        )
        self.trainer = KzGRPOTrainer(
            model=policy,
            reward_funcs=[self.reward],
            args=self._grpo_config(),
            # Never iterated: train_step drives the loop. TRL requires a dataset.
            train_dataset=Dataset.from_dict({"prompt": [""]}),
            processing_class=self.tokenizer,
            peft_config=peft_config,
            rollout_func=self.feed,
            importance_sampling=config.importance_sampling,
        )
        # What version 0 was (the digest of the warm-start adapter, or "bare"), carried in
        # every checkpoint's manifest: a KL anchor must not move between slots.
        here = policy_sha256(config.init_adapter) if config.init_adapter else "bare"
        saved = json.loads((resume / _MANIFEST).read_text()).get("version0") if resume else None
        if config.kl_beta and saved is not None and saved != here:
            raise ValueError(
                f"kl_beta: this run's version 0 was {saved[:16]}, but its init adapter now "
                f"is {here[:16]} ({config.init_adapter or 'none'}); a KL anchor needs the "
                "same one in every slot")
        self.version0: str = saved or here
        if config.kl_beta and resume is not None:
            self._anchor_reference_at_version_0()
        if config.gradient_checkpointing:
            # Trainer.train() would turn it on; train_step drives the trainer itself.
            self.model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
            self.model.config.use_cache = False
        self._prepare_optimizer(state)
        self.version: int = int(state.get("version", 0))
        self.trainer.state.global_step = int(state.get("global_step", 0))

    def _anchor_reference_at_version_0(self) -> None:
        """Points TRL's KL reference at version 0 after a resume.

        Given a ``PeftModel``, TRL copies its adapter into a frozen "ref" adapter; resumed,
        that copy is the latest checkpoint, so each slot of a run would anchor somewhere
        else. Version 0 is the warm-start adapter (loaded into "ref"), or the bare model
        (no "ref": TRL then disables the adapter for the reference).
        """
        model = self.model
        if "ref" not in getattr(model, "peft_config", {}):
            return
        if self.config.init_adapter:
            # The manifest's version0 digest matched this adapter, so its shape fits.
            weights = load_peft_weights(self.config.init_adapter, device="cpu")
            set_peft_model_state_dict(model, weights, adapter_name="ref")
        else:
            model.delete_adapter("ref")

    def _grpo_config(self) -> GRPOConfig:
        c = self.config
        kwargs: dict[str, Any] = {
            "output_dir": c.output_dir,
            "learning_rate": c.learning_rate,
            "lr_scheduler_type": c.lr_scheduler_type,
            "weight_decay": c.weight_decay,
            "max_grad_norm": c.max_grad_norm,
            "per_device_train_batch_size": c.logprob_batch_size,
            "gradient_accumulation_steps": c.micro_batches,
            "steps_per_generation": c.micro_batches,
            "num_generations": 2,  # nominal; set from each batch's group size
            "num_iterations": 1,
            "max_completion_length": c.max_completion_length,
            "temperature": c.temperature,
            "beta": c.kl_beta,
            "epsilon": c.epsilon,
            "epsilon_high": c.epsilon_high,
            "loss_type": c.loss_type,
            "scale_rewards": c.scale_rewards,
            "vllm_importance_sampling_correction": c.importance_sampling,
            "vllm_importance_sampling_mode": c.is_mode,
            "vllm_importance_sampling_clip_max": c.is_clip_max,
            "vllm_importance_sampling_clip_min": c.is_clip_min,
            # Dropout would make the recomputed logprobs noisy against the behaviour ones.
            "disable_dropout": True,
            "report_to": "none",
            "save_strategy": "no",
            "logging_strategy": "no",
            "seed": c.seed,
            "bf16": _bf16_available() if c.bf16 is None else c.bf16,
            "gradient_checkpointing": c.gradient_checkpointing,
        }
        kwargs.update(c.grpo_overrides)
        return GRPOConfig(**kwargs)

    def _prepare_optimizer(self, state: dict[str, Any]) -> None:
        # What Trainer._prepare_for_training does before its loop, minus the dataloader.
        t = self.trainer
        t.create_optimizer()
        model, optimizer = t.accelerator.prepare(t.model, t.optimizer)
        t.model_wrapped, t.optimizer = model, optimizer
        t.create_scheduler(num_training_steps=1_000_000, optimizer=optimizer)
        if "optimizer" in state:
            self._optimizer.load_state_dict(state["optimizer"])
        if "scheduler" in state:
            self._scheduler.load_state_dict(state["scheduler"])
        # The saved state carries the rate it was saved with; the configured one wins (a
        # run resumed with another learning rate would otherwise keep the old one).
        rate = self.config.learning_rate
        saved = {float(g["lr"]) for g in self._optimizer.param_groups}
        if saved != {rate}:
            if state:
                get_logger("kz.learner").info("learning_rate_set_on_resume",
                                               saved=sorted(saved), now=rate)
            for group in self._optimizer.param_groups:
                group["lr"] = group["initial_lr"] = rate
            self._scheduler.base_lrs = [rate] * len(self._optimizer.param_groups)

    @property
    def _optimizer(self) -> torch.optim.Optimizer:
        opt = self.trainer.optimizer
        assert opt is not None  # created in _prepare_optimizer
        return opt

    @property
    def _scheduler(self) -> torch.optim.lr_scheduler.LRScheduler:
        sched = self.trainer.lr_scheduler
        assert sched is not None  # created in _prepare_optimizer
        return sched

    @property
    def model(self) -> PreTrainedModel | PeftModel:
        """Returns the policy being trained (a ``PeftModel`` under LoRA)."""
        unwrapped: PreTrainedModel | PeftModel = self.trainer.accelerator.unwrap_model(
            self.trainer.model
        )
        return unwrapped

    def build_batch(
        self, groups: Sequence[Group], policy_version: int | None = None
    ) -> TrainingBatch:
        """Returns the batch ``train_step`` would train on (staleness filter applied)."""
        return build_batch(
            groups,
            policy_version=self.version if policy_version is None else policy_version,
            max_staleness=self.config.max_staleness,
            min_group_size=self.config.min_group_size,
        )

    def train_step(
        self, groups: Sequence[Group], *, policy_version: int | None = None
    ) -> StepResult:
        """Takes one optimizer step on ``groups`` and returns what it did.

        ``policy_version`` overrides the version staleness is measured against (default:
        ``self.version``). When nothing is left after filtering, no step is taken and the
        result has ``trained=False``.
        """
        batch = self.build_batch(groups, policy_version)
        if not batch.groups:
            return self._result(batch, trained=False, losses={})
        t = self.trainer
        k = self.config.micro_batches
        processes, rank = t.accelerator.num_processes, t.accelerator.process_index
        rows, group_size = self._layout(batch, k, processes)
        # Data parallel: each process trains on its own whole groups. TRL gathers the
        # rewards of all processes in process order to compute group advantages, then
        # keeps this process's slice, so the slices must be contiguous and equal.
        per_process = len(rows) // processes
        rows = rows[rank * per_process : (rank + 1) * per_process]
        self.feed.stage(rows)
        t.num_generations = group_size
        # TRL buffers one scored generation batch and slices it over k micro-steps; start
        # each step with an empty buffer so the staged rows are what gets scored.
        t._step = 0
        t._buffered_inputs = None
        t.current_gradient_accumulation_steps = k
        inputs = [{"prompt": r.sample.prompt} for r in rows]
        total = 0.0
        try:
            for i in range(k):
                last = i == k - 1
                t.accelerator.gradient_state._set_sync_gradients(last)
                # Data parallel: all-reduce gradients once, on the last micro-step.
                with nullcontext() if last else t.accelerator.no_sync(t.model_wrapped):
                    loss = t.training_step(t.model_wrapped, inputs, None)  # type: ignore[no-untyped-call]
                total += float(loss)
            grad_norm = self._apply_gradients()
        except BaseException:
            t.model_wrapped.zero_grad(set_to_none=True)
            t._buffered_inputs = None
            raise
        self.version += 1
        losses = {"loss": total, "grad_norm": grad_norm, **self._drain_metrics()}
        return self._result(batch, trained=True, losses=losses)

    def _apply_gradients(self) -> float:
        # The step boundary of Trainer._inner_training_loop.
        t = self.trainer
        model = t.model_wrapped
        if self.config.max_grad_norm > 0:
            norm = t.accelerator.clip_grad_norm_(model.parameters(), self.config.max_grad_norm)
        else:
            norm = t.accelerator.clip_grad_norm_(model.parameters(), float("inf"))
        self._optimizer.step()
        self._scheduler.step()
        model.zero_grad(set_to_none=True)
        t.state.global_step += 1
        return float(norm)

    def _layout(
        self, batch: TrainingBatch, micro_batches: int, processes: int = 1
    ) -> tuple[list[_Row], int]:
        size = max(len(g) for g in batch.groups)
        rows: list[_Row] = []
        for g in batch.groups:
            real = [_Row(s, self._prompt_ids(s), filler=False) for s in g.samples]
            rows.extend(real)
            rows.extend(replace(real[0], filler=True) for _ in range(size - len(real)))
        # Every process takes the same number of whole groups, and its rows split evenly
        # into micro-batches: pad with whole filler groups.
        while (len(rows) // size) % processes or (len(rows) // processes) % micro_batches:
            rows.extend(replace(rows[0], filler=True) for _ in range(size))
        return rows, size

    def _prompt_ids(self, sample: Sample) -> list[int]:
        if sample.prompt_ids is not None:
            return list(sample.prompt_ids)
        ids: list[int] = self.tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]
        return ids

    def _drain_metrics(self) -> dict[str, float]:
        train: dict[str, list[float]] = self.trainer._metrics["train"]
        out: dict[str, float] = {}
        for key, values in train.items():
            finite = [float(v) for v in values if v is not None and math.isfinite(float(v))]
            if finite:
                out[key] = sum(finite) / len(finite)
        train.clear()
        return out

    def _result(
        self, batch: TrainingBatch, *, trained: bool, losses: dict[str, float]
    ) -> StepResult:
        rewards: dict[str, float] = {}
        if trained:  # each process scored its own slice of the batch
            for part in gather_object([self.reward.last]):
                rewards.update(part)
        self.reward.last = {}
        return StepResult(
            role=self.role,
            step=self.trainer.state.global_step,
            policy_version=self.version,
            trained=trained,
            losses=losses,
            mean_reward=sum(rewards.values()) / len(rewards) if rewards else 0.0,
            rewards=rewards,
            kernel_ids=batch.kernel_ids,
            module_ids=batch.module_ids,
            group_ids=batch.group_ids,
            staleness=dict(batch.staleness),
            dropped_stale=batch.dropped_stale,
            dropped_invalid=batch.dropped_invalid,
            dropped_groups=batch.dropped_groups,
            num_samples=len(batch.samples),
        )

    def save_policy(self, directory: str | Path, version: int | None = None) -> tuple[str, str]:
        """Writes the policy as ``<directory>/<role>-v<version>``; returns ``(uri, sha256)``.

        Under LoRA the directory is a PEFT adapter (what vLLM hot-loads); under full
        fine-tuning a ``save_pretrained`` model with its tokenizer. The optimizer state and
        a manifest ride along for resuming. The directory appears atomically (written under
        a temporary name, then renamed), so a reader never sees a partial policy.
        """
        v = self.version if version is None else version
        root = Path(directory)
        final = root / _checkpoint_name(self.role, v)
        accelerator = self.trainer.accelerator
        error: Exception | None = None
        outcome = [""]  # data parallel: one writer; the others learn how its write went
        if accelerator.is_main_process:
            try:
                self._write_policy(root, final, v)
            except Exception as e:
                error = e
                outcome = [f"{type(e).__name__}: {e}"]
        # Every process takes part, also after a failed write: a bare barrier skipped by a
        # failing writer left the others waiting in it for ever.
        outcome = broadcast_object_list(outcome, from_process=0)
        if error is not None:
            raise error
        if outcome[0]:
            raise RuntimeError(f"the main process could not write {final.name}: {outcome[0]}")
        sha = str(json.loads((final / _MANIFEST).read_text())["sha256"])
        return final.resolve().as_uri(), sha

    def close(self) -> None:
        """Leaves the process group when launched data-parallel (a no-op otherwise).

        A rank that exits with the group's threads still running can abort at teardown
        ("terminate called without an active exception", seen in CI); a second call, or
        one from the other role's learner in the same process, finds no group left.
        """
        self.trainer.accelerator.end_training()

    def _write_policy(self, root: Path, final: Path, v: int) -> None:
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f"{final.name}.tmp-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        model = self.model
        if self.config.full_finetune:
            model.save_pretrained(str(tmp))
            self.tokenizer.save_pretrained(str(tmp))
        else:
            # LoRA never targets the embeddings here; without this PEFT looks the base model
            # up on the Hub (a network call and a warning) to see if the vocabulary changed.
            # Only the policy: a KL reference adapter ("ref") is not part of it.
            model.save_pretrained(str(tmp), save_embedding_layers=False,
                                  selected_adapters=["default"])
        sha = policy_sha256(tmp)
        manifest = {
            "role": self.role,
            "version": v,
            "kind": "full" if self.config.full_finetune else "lora",
            "base_model": self.config.model,
            "sha256": sha,
            "global_step": self.trainer.state.global_step,
            "version0": self.version0,
            "saved_at": datetime.now(UTC).isoformat(),
        }
        (tmp / _MANIFEST).write_text(json.dumps(manifest, indent=2))
        torch.save(
            {
                "version": v,
                "global_step": self.trainer.state.global_step,
                "optimizer": self._optimizer.state_dict(),
                "scheduler": self._scheduler.state_dict(),
            },
            tmp / _STATE,
        )
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        _drop_old_states(root, self.role, v)


class CoderLearner(GRPOLearner):
    """The Coder's learner: CA-GRPO on kernel groups."""

    def __init__(self, config: LearnerConfig | None = None, **kwargs: Any) -> None:
        super().__init__(replace(config or LearnerConfig(), role="coder"), **kwargs)


class ProposerLearner(GRPOLearner):
    """The Proposer's learner: GRPO on module groups with the frontier reward."""

    def __init__(self, config: LearnerConfig | None = None, **kwargs: Any) -> None:
        super().__init__(replace(config or LearnerConfig(), role="proposer"), **kwargs)
