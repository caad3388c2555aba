"""The packaged warm-start adapters and when a run starts from them."""

from __future__ import annotations

import json

from kz_stream.config import LLMConfig, Settings
from kz_stream.warmstart import packaged_adapter, warm_adapter


def test_both_roles_ship_an_adapter_with_its_card() -> None:
    for role in ("coder", "proposer"):
        folder = packaged_adapter(role)  # type: ignore[arg-type]
        assert folder is not None
        card = json.loads((folder / "warmstart.json").read_text())
        assert card["role"] == role and card["kind"] == "lora" and card["data"]["rows"] > 0
        assert card["metrics"]["last_loss"] < card["metrics"]["first_loss"]
        config = json.loads((folder / "adapter_config.json").read_text())
        assert config["peft_type"] == "LORA"


def test_the_embedded_default_starts_warm_and_can_start_bare() -> None:
    assert warm_adapter(Settings(), "coder") == packaged_adapter("coder")
    assert warm_adapter(Settings(warm_start=False), "coder") is None


def test_no_warm_start_on_another_base_model_or_engine() -> None:
    other = Settings.model_validate({"coder": {"llm": LLMConfig(model="/m").model_dump()}})
    assert warm_adapter(other, "coder") is None
    served = Settings.model_validate(
        {"proposer": {"llm": {"kind": "vllm-server", "base_url": "http://x"}}})
    assert warm_adapter(served, "proposer") is None
    assert warm_adapter(Settings.model_validate({"learner": {"full_finetune": True}}),
                        "coder") is None
