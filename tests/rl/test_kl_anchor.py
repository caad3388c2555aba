"""The KL anchor (``kl_beta``): its reference is the run's version 0, in every slot.

Version 0 is the warm-start adapter when the run has one, else the bare model. TRL copies
whatever adapter it is handed into its frozen reference, which after a resume would be the
latest checkpoint; the learner points it back at version 0.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from trl.trainer.utils import use_adapter

from kz_stream.rl.trainer import CoderLearner, LearnerConfig
from kz_stream.testing.tiny import make_groups, prompt_ids, tiny_model, tiny_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

DIGITS = [0, 1, 2, 3, 4, 5]


@pytest.fixture(autouse=True)
def _seed() -> Iterator[None]:
    torch.manual_seed(0)
    yield


@pytest.fixture
def warm_adapter(tmp_path: Path) -> Path:
    """A LoRA adapter with non-zero B, so the warm start differs from the bare model."""
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    model = get_peft_model(tiny_model(), config)
    path = tmp_path / "warm"
    model.save_pretrained(str(path), save_embedding_layers=False)
    return path


def _next_token_logps(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.tensor([prompt_ids(d) for d in DIGITS])
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=ids).logits[:, -1].float(), dim=-1)


def _reference_logps(learner: CoderLearner) -> torch.Tensor:
    """What TRL scores the reference with: the "ref" adapter, or none when absent."""
    model = learner.model
    assert isinstance(model, PeftModel)
    with use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None):
        return _next_token_logps(model)


def _config(tmp_path: Path, **kw: object) -> LearnerConfig:
    options: dict[str, object] = {"learning_rate": 5e-2, "kl_beta": 0.1, **kw}
    return LearnerConfig(output_dir=str(tmp_path / "scratch"), **options)  # type: ignore[arg-type]


def _train(learner: CoderLearner, steps: int, tag: str) -> list[dict[str, float]]:
    losses = []
    for step in range(steps):
        groups = make_groups(learner.model, DIGITS, 8, learner.version, f"{tag}{step}")
        result = learner.train_step(groups)
        assert result.trained
        losses.append(result.losses)
    return losses


def test_the_reference_is_the_warm_start_in_every_slot(tmp_path: Path, warm_adapter: Path) -> None:
    warm = _next_token_logps(PeftModel.from_pretrained(tiny_model(), str(warm_adapter)))
    cfg = _config(tmp_path, init_adapter=str(warm_adapter))
    learner = CoderLearner(cfg, model=tiny_model(), tokenizer=tiny_tokenizer())
    torch.testing.assert_close(_reference_logps(learner), warm)
    losses = _train(learner, 2, "a")
    # The first step starts at the reference; after it the policy has moved away.
    assert losses[0]["kl"] == pytest.approx(0.0, abs=1e-6) and losses[0]["grad_norm"] > 0
    assert losses[1]["kl"] > 1e-6
    moved = _next_token_logps(learner.model)
    assert not torch.allclose(moved, warm, atol=1e-4)
    torch.testing.assert_close(_reference_logps(learner), warm)

    learner.save_policy(tmp_path / "policies")
    saved = tmp_path / "policies" / "coder-v00000002"
    assert not (saved / "ref").exists()  # the reference is not part of the policy
    resumed = CoderLearner(cfg, model=tiny_model(), tokenizer=tiny_tokenizer(),
                           checkpoint_dir=tmp_path / "policies")
    assert resumed.resumed_from == saved
    torch.testing.assert_close(_next_token_logps(resumed.model), moved)
    torch.testing.assert_close(_reference_logps(resumed), warm)
    trainable = {n for n, p in resumed.model.named_parameters() if p.requires_grad}
    assert trainable and not any(".ref." in n for n in trainable)
    assert _train(resumed, 1, "b")[0]["kl"] > 1e-6


def test_without_a_warm_start_the_reference_is_the_bare_model_in_every_slot(
    tmp_path: Path,
) -> None:
    bare = _next_token_logps(tiny_model())
    cfg = _config(tmp_path)
    learner = CoderLearner(cfg, model=tiny_model(), tokenizer=tiny_tokenizer())
    _train(learner, 1, "a")
    learner.save_policy(tmp_path / "policies")
    resumed = CoderLearner(cfg, model=tiny_model(), tokenizer=tiny_tokenizer(),
                           checkpoint_dir=tmp_path / "policies")
    for each in (learner, resumed):
        torch.testing.assert_close(_reference_logps(each), bare)
        assert not torch.allclose(_next_token_logps(each.model), bare, atol=1e-4)
    assert _train(resumed, 1, "b")[0]["kl"] > 1e-6


def test_a_slot_that_would_anchor_elsewhere_is_refused(tmp_path: Path, warm_adapter: Path) -> None:
    learner = CoderLearner(_config(tmp_path, init_adapter=str(warm_adapter)),
                           model=tiny_model(), tokenizer=tiny_tokenizer())
    _train(learner, 1, "a")
    learner.save_policy(tmp_path / "policies")
    other = tmp_path / "other"
    config = LoraConfig(r=4, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    get_peft_model(tiny_model(), config).save_pretrained(str(other), save_embedding_layers=False)
    for init in (str(other), None):  # another warm start, or none
        with pytest.raises(ValueError, match="version 0"):
            CoderLearner(_config(tmp_path, init_adapter=init), model=tiny_model(),
                         tokenizer=tiny_tokenizer(), checkpoint_dir=tmp_path / "policies")
    # Without an anchor nothing depends on version 0: the run goes on.
    resumed = CoderLearner(_config(tmp_path, init_adapter=str(other), kl_beta=0.0),
                           model=tiny_model(), tokenizer=tiny_tokenizer(),
                           checkpoint_dir=tmp_path / "policies")
    assert resumed.version == 1


def test_the_penalty_keeps_the_policy_nearer_its_reference(
    tmp_path: Path, warm_adapter: Path
) -> None:
    warm = PeftModel.from_pretrained(tiny_model(), str(warm_adapter))
    groups = make_groups(warm, DIGITS, 8, 0, "g")  # the same data for both learners
    ref = _next_token_logps(warm)

    def kl_after(beta: float) -> float:
        cfg = _config(tmp_path, init_adapter=str(warm_adapter), kl_beta=beta,
                      max_staleness=10)
        learner = CoderLearner(cfg, model=tiny_model(), tokenizer=tiny_tokenizer())
        for _ in range(4):
            assert learner.train_step(groups, policy_version=0).trained
        logp = _next_token_logps(learner.model)
        return float((logp.exp() * (logp - ref)).sum(-1).mean())

    free, anchored = kl_after(0.0), kl_after(1.0)
    assert anchored < 0.8 * free


def test_an_anchor_under_full_finetuning_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="kl_beta"):
        CoderLearner(_config(tmp_path, full_finetune=True), model=tiny_model(),
                     tokenizer=tiny_tokenizer())
