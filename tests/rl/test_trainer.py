"""The learner on TRL: its loss against a hand computation, the seam, staleness, checkpoints.

The model is a tiny Llama built from a config; all prompts have one length so TRL's
left-padding cannot shift positions and the hand computation sees the same sequences.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kz_stream.llm import uri_to_path
from kz_stream.rl.groups import Group, Sample
from kz_stream.rl.trainer import (
    CoderLearner,
    LearnerConfig,
    ProposerLearner,
    latest_checkpoint,
    policy_sha256,
)
from kz_stream.testing.tiny import (
    EOS,
    make_groups,
    prompt_ids,
    prompt_text,
    tiny_model,
    tiny_tokenizer,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

# Group A (gate open, accuracy 3/4): rewards 1.1, 0.9, 0, 1.2 (see test_rewards).
# Group B (gate closed, accuracy 1/3): rewards 1, 0, 0; padded with one filler row.
ADV_A = [0.547622575759252, 0.18254085858641736, -1.4603268686913389, 0.7301634343456694]
ADV_B = [1.1545005730142688, -0.5772502865071344, -0.5772502865071344]
COMPLETIONS_A = [[4, EOS], [4, 5, EOS], [7, EOS], [4]]
COMPLETIONS_B = [[5, 6, EOS], [1, EOS], [2]]
VERDICTS_A = [(True, (2.0, 2.2)), (True, (0.5, 0.7)), (False, (3.0, 3.1)), (True, (8.0, 10.0))]
VERDICTS_B = [(True, (8.0, 9.0)), (False, None), (False, None)]
# Behaviour logprob = current logprob + delta, so the truncated IS ratio is exp(-delta)
# capped at 3: e^2 = 7.4 -> 3 (clipped), e^-0.5 = 0.61, e^0.3 = 1.35, 1.
DELTAS = [-2.0, 0.5, -0.3, 0.0]


@pytest.fixture(autouse=True)
def _seed() -> Iterator[None]:
    torch.manual_seed(0)
    yield


def _completion_logps(model: torch.nn.Module, d: int, completion: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt_ids(d) + completion])
    logits = model(input_ids=ids).logits[0, len(prompt_ids(d)) - 1 : -1]
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, torch.tensor(completion)[:, None])[
        :, 0
    ]


def _groups(model: torch.nn.Module, shift_logprobs: bool, version: int = 0) -> list[Group]:
    groups = []
    for name, d, completions, verdicts in (
        ("A", 1, COMPLETIONS_A, VERDICTS_A),
        ("B", 2, COMPLETIONS_B, VERDICTS_B),
    ):
        samples = []
        for i, (comp, (ok, ci)) in enumerate(zip(completions, verdicts, strict=True)):
            with torch.no_grad():
                lp = _completion_logps(model, d, comp).tolist()
            if shift_logprobs:
                lp = [x + DELTAS[t % len(DELTAS)] for t, x in enumerate(lp)]
            samples.append(
                Sample(
                    group_id=name,
                    prompt=prompt_text(d),
                    prompt_ids=tuple(prompt_ids(d)),
                    completion_ids=tuple(comp),
                    logprobs=tuple(lp),
                    policy_version=version,
                    kernel_id=f"{name}{i}",
                    module_id=f"m{d}",
                    correct=ok,
                    speedup=ci[0] if ci else None,
                    speedup_ci=ci,
                )
            )
        groups.append(Group(name, tuple(samples)))
    return groups


def _hand_loss(
    model: torch.nn.Module, groups: list[Group], importance_sampling: bool
) -> torch.Tensor:
    """-(1/N) * sum_i A_i * sum_t w_it * logp_it, w = min(exp(logp - behaviour), 3) or 1.

    Its value at the current weights, with w detached and the PPO ratio pi/pi_old = 1, is
    the surrogate whose value and gradient TRL's loss must reproduce.
    """
    total = torch.zeros(())
    n_tokens = 0
    for g, adv in zip(groups, (ADV_A, ADV_B), strict=True):
        for s, a in zip(g.samples, adv, strict=True):
            d = s.prompt_ids[1] if s.prompt_ids else 0
            logp = _completion_logps(model, d, list(s.completion_ids))
            if importance_sampling:
                w = torch.clamp(torch.exp(logp.detach() - torch.tensor(s.logprobs)), max=3.0)
            else:
                w = torch.ones_like(logp)
            # w * (ratio = exp(logp - logp.detach()) = 1 in value, d/dtheta = dlogp)
            total = total + a * (w * torch.exp(logp - logp.detach())).sum()
            n_tokens += len(s.completion_ids)
    return -total / n_tokens


def _learner(importance_sampling: bool, scratch: Path, **kw: object) -> CoderLearner:
    options: dict[str, object] = {"learning_rate": 1e-3, **kw}
    cfg = LearnerConfig(
        full_finetune=True,
        max_grad_norm=0.0,
        importance_sampling=importance_sampling,
        output_dir=str(scratch),
        **options,  # type: ignore[arg-type]
    )
    return CoderLearner(cfg, model=tiny_model(init_range=0.3), tokenizer=tiny_tokenizer())


def _capture_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            p.register_hook(  # type: ignore[no-untyped-call]
                lambda g, name=name: grads.__setitem__(name, g.detach().clone())
            )
    return grads


@pytest.mark.parametrize("importance_sampling", [False, True])
def test_loss_and_gradient_match_hand_computation(
    importance_sampling: bool, tmp_path: Path
) -> None:
    learner = _learner(importance_sampling, tmp_path)
    model = learner.model
    groups = _groups(model, shift_logprobs=True)
    hand = _hand_loss(model, groups, importance_sampling)
    hand_grads = torch.autograd.grad(
        hand, [p for p in model.parameters() if p.requires_grad], allow_unused=True
    )
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    grads = _capture_grads(model)

    result = learner.train_step(groups)

    assert result.trained and result.num_samples == 7
    assert result.losses["loss"] == pytest.approx(hand.item(), rel=1e-5, abs=1e-7)
    for name, expected in zip(names, hand_grads, strict=True):
        if expected is None:
            continue
        torch.testing.assert_close(grads[name], expected, rtol=1e-4, atol=1e-6)
    # TRL's advantages, in row order (the filler row last, at 0), equal the reference.
    advantages = list(learner.trainer._logs["advantages"])[-8:]
    assert advantages == pytest.approx([*ADV_A, *ADV_B, 0.0], rel=1e-5)
    assert result.rewards == pytest.approx(
        {"A0": 1.1, "A1": 0.9, "A2": 0.0, "A3": 1.2, "B0": 1.0, "B1": 0.0, "B2": 0.0}
    )
    assert result.mean_reward == pytest.approx(4.2 / 7)
    if importance_sampling:
        # Ratios 3 (clipped from e^2), e^-0.5, e^0.3, 1 repeat over the tokens.
        assert result.losses["sampling/importance_sampling_ratio/max"] == pytest.approx(3.0)
        assert result.losses["sampling/importance_sampling_ratio/min"] == pytest.approx(
            math.exp(-0.5), rel=1e-5
        )
    else:
        assert "sampling/importance_sampling_ratio/mean" not in result.losses


def test_a_learning_rate_of_zero_is_a_control_step_that_changes_no_weight(
    tmp_path: Path,
) -> None:
    learner = _learner(True, tmp_path, learning_rate=0.0)
    before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    groups = _groups(learner.model, shift_logprobs=True)

    result = learner.train_step(groups)

    # The same step as a treatment run's (loss, rewards, a new version), no update.
    assert result.trained and result.policy_version == 1 and result.losses["loss"] != 0
    for name, p in learner.model.named_parameters():
        assert torch.equal(p, before[name]), name


def test_importance_correction_uses_behaviour_logprobs(tmp_path: Path) -> None:
    """With IS the loss moves with the stored logprobs; without it, it does not."""
    losses = {}
    for is_on in (False, True):
        for shift in (False, True):
            learner = _learner(is_on, tmp_path)
            groups = _groups(learner.model, shift_logprobs=shift)
            losses[is_on, shift] = learner.train_step(groups).losses["loss"]
    assert losses[False, False] == pytest.approx(losses[False, True])
    assert losses[True, False] == pytest.approx(losses[False, False], rel=1e-5)  # ratio 1
    assert losses[True, True] != pytest.approx(losses[True, False], rel=1e-3)


def test_staleness_is_filtered_and_counted(tmp_path: Path) -> None:
    learner = _learner(True, tmp_path, max_staleness=2)
    fresh = _groups(learner.model, shift_logprobs=False, version=10)
    stale_b = Group("B", tuple(replace(s, policy_version=7) for s in fresh[1].samples))
    result = learner.train_step([fresh[0], stale_b], policy_version=10)
    assert result.trained
    assert result.dropped_stale == 3 and result.dropped_groups == 1
    assert result.kernel_ids == ["A0", "A1", "A2", "A3"] and result.group_ids == ["A"]
    assert result.staleness == {"min": 0.0, "mean": 0.0, "max": 0.0}
    assert result.policy_version == 1 and result.step == 1

    skipped = learner.train_step([stale_b], policy_version=10)
    assert not skipped.trained and skipped.dropped_stale == 3 and skipped.policy_version == 1



def test_micro_batches_and_uneven_groups(tmp_path: Path) -> None:
    """Two micro-batches over groups of 4 and 3 (+1 filler) give the one-batch loss."""
    one = _learner(True, tmp_path)
    groups = _groups(one.model, shift_logprobs=True)
    expected = one.train_step(groups).losses["loss"]
    two = _learner(True, tmp_path, micro_batches=2)
    assert two.train_step(_groups(two.model, shift_logprobs=True)).losses["loss"] == (
        pytest.approx(expected, rel=1e-5)
    )
    three = _learner(True, tmp_path, micro_batches=3)  # 8 rows -> padded with a filler group to 12
    assert three.train_step(_groups(three.model, shift_logprobs=True)).losses["loss"] == (
        pytest.approx(expected, rel=1e-5)
    )


def test_gradient_checkpointing_is_on_and_keeps_the_loss(tmp_path: Path) -> None:
    plain = _learner(True, tmp_path)
    expected = plain.train_step(_groups(plain.model, shift_logprobs=True)).losses["loss"]
    learner = _learner(True, tmp_path, gradient_checkpointing=True)
    assert learner.model.is_gradient_checkpointing
    got = learner.train_step(_groups(learner.model, shift_logprobs=True)).losses["loss"]
    assert got == pytest.approx(expected, rel=1e-5)


def test_proposer_rewards(tmp_path: Path) -> None:
    learner = ProposerLearner(
        LearnerConfig(learning_rate=1e-3, output_dir=str(tmp_path)),
        model=tiny_model(init_range=0.3),
        tokenizer=tiny_tokenizer(),
    )
    verdicts = [(True, 0.5), (True, 0.75), (True, 0.0), (False, None), (True, None)]
    samples = tuple(
        Sample(
            group_id="apis",
            prompt=prompt_text(3),
            completion_ids=(4, EOS),
            logprobs=(-1.0, -1.0),
            policy_version=0,
            module_id=f"mod{i}",
            module_valid=valid,
            mean_correctness=lbar,
        )
        for i, (valid, lbar) in enumerate(verdicts)
    )
    result = learner.train_step([Group("apis", samples)])
    # 1 - 2|l - 0.5|: 1, 0.5, 0; invalid: -1; valid without verdicts: unscored
    assert result.rewards == pytest.approx({"mod0": 1.0, "mod1": 0.5, "mod2": 0.0, "mod3": -1.0})
    assert result.module_ids == [f"mod{i}" for i in range(5)] and result.kernel_ids == []
    assert result.role == "proposer"


def test_save_and_resume(tmp_path: Path) -> None:
    cfg = LearnerConfig(learning_rate=1e-2, output_dir=str(tmp_path / "scratch"))
    learner = CoderLearner(cfg, model=tiny_model(init_range=0.3), tokenizer=tiny_tokenizer())
    for step in range(2):
        learner.train_step(make_groups(learner.model, [0, 1], 4, learner.version, f"s{step}"))
    uri, sha = learner.save_policy(tmp_path / "policies")
    path = tmp_path / "policies" / "coder-v00000002"
    assert uri == path.resolve().as_uri()
    assert (path / "adapter_model.safetensors").is_file() and (
        path / "adapter_config.json"
    ).is_file()
    assert sha == policy_sha256(path) and len(sha) == 64
    assert latest_checkpoint(tmp_path / "policies", "coder") == path
    assert latest_checkpoint(tmp_path / "policies", "proposer") is None
    # Saving the same weights again gives the same digest; a partial save is ignored.
    assert learner.save_policy(tmp_path / "again")[1] == sha
    (tmp_path / "policies" / "coder-v00000009.tmp-1").mkdir()
    assert latest_checkpoint(tmp_path / "policies", "coder") == path

    resumed = CoderLearner(
        cfg,
        model=tiny_model(init_range=0.3),
        tokenizer=tiny_tokenizer(),
        checkpoint_dir=tmp_path / "policies",
    )
    assert resumed.resumed_from == path
    assert resumed.version == 2 and resumed.trainer.state.global_step == 2
    before = dict(learner.model.named_parameters())
    for name, p in resumed.model.named_parameters():
        torch.testing.assert_close(p, before[name])
    assert learner.trainer.optimizer is not None and resumed.trainer.optimizer is not None
    old_state = learner.trainer.optimizer.state_dict()["state"]
    new_state = resumed.trainer.optimizer.state_dict()["state"]
    assert old_state.keys() == new_state.keys() and old_state
    for key, st in old_state.items():
        torch.testing.assert_close(new_state[key]["exp_avg"], st["exp_avg"])
    result = resumed.train_step(make_groups(resumed.model, [0, 1], 4, resumed.version, "r"))
    assert result.trained and result.policy_version == 3


def test_a_resumed_learner_trains_at_the_configured_rate_not_the_saved_one(
    tmp_path: Path,
) -> None:
    cfg = LearnerConfig(learning_rate=1e-2, output_dir=str(tmp_path / "scratch"))
    learner = CoderLearner(cfg, model=tiny_model(init_range=0.3), tokenizer=tiny_tokenizer())
    learner.train_step(make_groups(learner.model, [0, 1], 4, learner.version, "s"))
    learner.save_policy(tmp_path / "policies")
    resumed = CoderLearner(replace(cfg, learning_rate=1e-3), model=tiny_model(init_range=0.3),
                           tokenizer=tiny_tokenizer(), checkpoint_dir=tmp_path / "policies")
    assert resumed.version == 1
    resumed.train_step(make_groups(resumed.model, [0, 1], 4, resumed.version, "r"))
    optimizer = resumed.trainer.optimizer
    assert optimizer is not None
    assert [g["lr"] for g in optimizer.param_groups] == [1e-3] * len(optimizer.param_groups)


def test_every_version_keeps_its_weights_and_only_the_newest_two_their_optimizer_state(
    tmp_path: Path,
) -> None:
    cfg = LearnerConfig(learning_rate=1e-2, output_dir=str(tmp_path / "scratch"))
    learner = CoderLearner(cfg, model=tiny_model(init_range=0.3), tokenizer=tiny_tokenizer())
    saved = []
    for step in range(3):
        learner.train_step(make_groups(learner.model, [0, 1], 4, learner.version, f"s{step}"))
        saved.append(Path(uri_to_path(learner.save_policy(tmp_path / "policies")[0])))
    assert [p.name for p in saved] == [f"coder-v0000000{i}" for i in (1, 2, 3)]
    assert all((p / "adapter_model.safetensors").is_file() for p in saved)
    assert [(p / "learner_state.pt").is_file() for p in saved] == [False, True, True]
    assert latest_checkpoint(tmp_path / "policies", "coder") == saved[-1]


def test_saving_a_lora_policy_looks_nothing_up_on_the_hub(tmp_path: Path) -> None:
    import warnings

    cfg = LearnerConfig(learning_rate=1e-2, output_dir=str(tmp_path / "scratch"))
    learner = CoderLearner(cfg, model=tiny_model(), tokenizer=tiny_tokenizer())
    # The packaged warm-start adapter names its base by folder name, which is no local path.
    learner.model.peft_config["default"].base_model_name_or_path = "smollm2-135m-instruct-f32"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        learner.save_policy(tmp_path / "policies")
    assert [str(w.message) for w in caught if "config" in str(w.message)] == []


def test_full_finetune_save_and_resume(tmp_path: Path) -> None:
    learner = _learner(True, tmp_path)
    learner.train_step(_groups(learner.model, shift_logprobs=False))
    learner.save_policy(tmp_path, version=7)
    assert (tmp_path / "coder-v00000007" / "model.safetensors").is_file()
    assert (tmp_path / "coder-v00000007" / "tokenizer.json").is_file()
    resumed = CoderLearner(learner.config, tokenizer=tiny_tokenizer(), checkpoint_dir=tmp_path)
    assert resumed.version == 7
    before = dict(learner.model.named_parameters())
    for name, p in resumed.model.named_parameters():
        torch.testing.assert_close(p, before[name])
