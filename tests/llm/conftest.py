"""Shared fixtures for the LLM backend tests: the embedded model as safetensors (converted
once from the packaged GGUF into the user cache) and a small LoRA adapter made here."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

# Nothing may download weights: every model comes from a package or this test.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    pytest.importorskip("transformers")
    from kz_stream.llm import smollm2_dir

    return smollm2_dir()


def make_lora(base: Path, out: Path, seed: int) -> Path:
    """A rank-8 LoRA on q/v projections with random (non-zero) B, so it changes outputs."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    torch.manual_seed(seed)
    config = LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    get_peft_model(model, config).save_pretrained(str(out))
    return out


@pytest.fixture(scope="session")
def lora_path(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    pytest.importorskip("peft")
    yield make_lora(smollm2_path, tmp_path_factory.mktemp("lora") / "adapter", seed=0)
