"""TransformersBackend with the real embedded model (SmolLM2-135M-Instruct) on the CPU."""

from __future__ import annotations

import asyncio
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from kz_stream.llm import BackendError, ChatMessage, SamplingParams, TransformersBackend
from tests.llm.conftest import make_lora
from tests.llm.prompts_data import CHAT, TEXT

pytest.importorskip("transformers")

TOL = 2e-3  # float32, batched with left padding vs. one unpadded forward pass


@pytest.fixture
async def backend(smollm2_path: Path) -> Any:
    b = TransformersBackend.from_pretrained(smollm2_path, max_batch_size=8)
    yield b
    await b.close()


async def test_sampling_shapes_and_logprobs_match_recomputation(
    backend: TransformersBackend,
) -> None:
    sp = SamplingParams(max_tokens=10, temperature=0.7, seed=1)
    out = await backend.generate([CHAT, TEXT], n=2, sampling=sp)
    assert [len(group) for group in out] == [2, 2]
    for group in out:
        for s in group:
            assert 0 < len(s.token_ids) == len(s.logprobs) <= 10
            assert s.finish_reason in ("stop", "length")
            assert s.policy_version == 0
            assert s.prompt_token_ids
            assert all(lp <= 0 for lp in s.logprobs)
            # What a learner recomputes under the same weights: log_softmax(logits / T).
            again = backend.sequence_logprobs(
                s.prompt_token_ids, s.token_ids, temperature=sp.temperature
            )
            assert again == pytest.approx(s.logprobs, abs=TOL)
            assert s.to_completion().token_ids == s.token_ids
    # The chat went through the chat template; the text prompt did not.
    assert out[0][0].prompt_token_ids != backend.encode_prompt(str(CHAT))
    assert out[1][0].prompt_token_ids == backend.encode_prompt(TEXT)


async def test_greedy_and_truncated_distributions(backend: TransformersBackend) -> None:
    greedy = await backend.generate(
        [TEXT], n=2, sampling=SamplingParams(max_tokens=8, temperature=0)
    )
    a, b = greedy[0]
    assert a.token_ids == b.token_ids
    assert backend.sequence_logprobs(a.prompt_token_ids, a.token_ids) == pytest.approx(
        a.logprobs, abs=TOL
    )
    # top_k=1 leaves one token: the sampled distribution gives it probability 1, and the
    # stored logprob is of that processed distribution.
    top1 = await backend.generate(
        [TEXT], n=1, sampling=SamplingParams(max_tokens=8, top_k=1, seed=3)
    )
    assert top1[0][0].token_ids == a.token_ids
    assert top1[0][0].logprobs == pytest.approx([0.0] * len(a.token_ids), abs=1e-6)


async def test_stop_strings(backend: TransformersBackend) -> None:
    sp = SamplingParams(max_tokens=12, temperature=0, stop=(" 8",))
    ((s,),) = await backend.generate(["1, 2, 3, 4, 5,"], sampling=sp)
    assert s.finish_reason == "stop"
    assert s.text == " 6, 7,"  # cut before the stop string, as vLLM does
    assert backend.tokenizer.decode(s.token_ids).endswith(" 8")


async def test_a_row_that_ends_early_keeps_only_its_own_tokens(
    backend: TransformersBackend,
) -> None:
    # One call, two rows: a short answer ends on EOS while counting runs to the cap, and
    # transformers pads the ended row (with the EOS id here) until the call ends.
    answer: list[ChatMessage] = [{"role": "user", "content": "Reply with one word: yes or no?"}]
    counting = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"
    greedy = SamplingParams(max_tokens=40, temperature=0)
    short, long = (g[0] for g in await backend.generate([answer, counting], sampling=greedy))
    eos = backend.tokenizer.eos_token_id
    assert short.finish_reason == "stop"
    assert len(short.token_ids) < 10 and short.token_ids[-1] == eos  # EOS kept, as vLLM does
    assert eos not in short.token_ids[:-1]
    assert len(short.logprobs) == len(short.token_ids)
    assert (long.finish_reason, len(long.token_ids)) == ("length", 40)
    assert long.text.startswith(" 13, 14, 15")


async def test_concurrent_calls_are_batched(
    backend: TransformersBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    original = backend._generate_sync

    def counting(rows: Any) -> Any:
        calls.append(len(rows))
        return original(rows)

    monkeypatch.setattr(backend, "_generate_sync", counting)
    sp = SamplingParams(max_tokens=4, temperature=0.9, seed=5)
    results = await asyncio.gather(*(backend.generate([TEXT], n=2, sampling=sp) for _ in range(4)))
    assert all(len(r[0]) == 2 for r in results)
    assert sum(calls) == 8 and len(calls) < 4  # rows of different calls shared a batch


async def test_every_generation_runs_on_one_thread(
    backend: TransformersBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A compiled decode step's CUDA graphs live in the thread that recorded them; the
    # event loop's default pool may hand each call another thread (here: a new pool).
    threads: list[int] = []
    original = backend._generate_sync

    def recording(rows: Any) -> Any:
        threads.append(threading.get_ident())
        return original(rows)

    monkeypatch.setattr(backend, "_generate_sync", recording)
    sp = SamplingParams(max_tokens=2, temperature=0)
    loop = asyncio.get_running_loop()
    for _ in range(2):
        loop.set_default_executor(ThreadPoolExecutor(1))
        await backend.generate([TEXT], sampling=sp)
    assert len(threads) == 2 and threads[0] == threads[1]


async def test_close_ends_a_generation_in_flight(smollm2_path: Path) -> None:
    backend = TransformersBackend.from_pretrained(smollm2_path)
    # Greedy, with room for minutes of tokens on this CPU: only close can end it soon.
    long = SamplingParams(max_tokens=4000, temperature=0)
    counting = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16,"  # goes on and on
    inflight = asyncio.create_task(backend.generate([counting], sampling=long))
    await asyncio.sleep(2)  # its batch is in the generation thread
    await backend.close()
    with pytest.raises(BackendError, match="backend closed"):
        await inflight
    # The generation thread ends at its next step, so it can be joined (without the stop
    # it ran on to 4,000 tokens: minutes here).
    await asyncio.wait_for(asyncio.to_thread(backend._generation_thread.shutdown, True), 60)


@pytest.mark.parametrize("merge_adapter", [False, True], ids=["unmerged", "folded"])
async def test_lora_hot_swap_mid_stream(
    smollm2_path: Path, lora_path: Path, merge_adapter: bool
) -> None:
    backend = TransformersBackend.from_pretrained(smollm2_path, merge_adapter=merge_adapter)
    greedy = SamplingParams(max_tokens=8, temperature=0)
    try:
        ((base,),) = await backend.generate([TEXT], sampling=greedy)
        # A request already queued when the new version arrives finishes under the old one.
        inflight = asyncio.create_task(backend.generate([TEXT], n=2, sampling=greedy))
        await asyncio.sleep(0)
        await backend.load_policy(1, str(lora_path))
        assert backend.policy_version == 1
        ((tuned,),) = await backend.generate([TEXT], sampling=greedy)
        old = (await inflight)[0]
        assert [s.policy_version for s in old] == [0, 0]
        assert old[0].token_ids == base.token_ids
        assert tuned.policy_version == 1
        assert tuned.token_ids != base.token_ids
        # Stored logprobs match a recomputation under the adapter's weights.
        again = backend.sequence_logprobs(tuned.prompt_token_ids, tuned.token_ids, version=1)
        assert again == pytest.approx(tuned.logprobs, abs=TOL)
        # Back to the base weights (an empty uri) as version 2; version 1's adapter goes.
        await backend.load_policy(2, "")
        ((back,),) = await backend.generate([TEXT], sampling=greedy)
        assert back.policy_version == 2 and back.token_ids == base.token_ids
        assert set(backend._policies) == {2}  # version 1 was released
        await backend.load_policy(2, "")  # replaying the same version is a no-op
    finally:
        await backend.close()


async def test_a_warm_start_adapter_is_version_zero(smollm2_path: Path, lora_path: Path) -> None:
    greedy = SamplingParams(max_tokens=8, temperature=0)
    bare = TransformersBackend.from_pretrained(smollm2_path)
    warm = TransformersBackend.from_pretrained(smollm2_path, adapter=str(lora_path))
    try:
        ((plain,),) = await bare.generate([TEXT], sampling=greedy)
        ((tuned,),) = await warm.generate([TEXT], sampling=greedy)
        assert warm.policy_version == tuned.policy_version == 0
        assert tuned.token_ids != plain.token_ids
        again = warm.sequence_logprobs(tuned.prompt_token_ids, tuned.token_ids, version=0)
        assert again == pytest.approx(tuned.logprobs, abs=TOL)
        # The learner's first version replaces the warm start, quietly (peft warns when the
        # active adapter is deleted); then the base is still reachable.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            await warm.load_policy(1, str(lora_path))
            ((swapped,),) = await warm.generate([TEXT], sampling=greedy)
        assert swapped.policy_version == 1 and set(warm._policies) == {1}
        assert [str(w.message) for w in caught if "adapter" in str(w.message).lower()] == []
        await warm.load_policy(2, "")
        ((back,),) = await warm.generate([TEXT], sampling=greedy)
        assert back.policy_version == 2 and back.token_ids == plain.token_ids
    finally:
        await bare.close()
        await warm.close()


async def test_folded_lora_versions_decode_as_the_unmerged_ones(
    smollm2_path: Path, lora_path: Path, tmp_path: Path
) -> None:
    other = make_lora(smollm2_path, tmp_path / "other", seed=1)
    greedy = SamplingParams(max_tokens=8, temperature=0)
    unmerged = TransformersBackend.from_pretrained(smollm2_path, adapter=str(lora_path))
    folded = TransformersBackend.from_pretrained(
        smollm2_path, adapter=str(lora_path), merge_adapter=True, policy_version=3
    )
    bare = TransformersBackend.from_pretrained(smollm2_path)
    try:
        # The warm start, another adapter, the bare model, the first adapter again.
        for version, uri in [(3, None), (4, str(other)), (5, ""), (6, str(lora_path))]:
            if uri is not None:
                await unmerged.load_policy(version, uri)
                await folded.load_policy(version, uri)
            ((want,),) = await unmerged.generate([TEXT], sampling=greedy)
            ((got,),) = await folded.generate([TEXT], sampling=greedy)
            assert got.policy_version == version
            assert got.token_ids == want.token_ids
            assert got.logprobs == pytest.approx(want.logprobs, abs=TOL)
            again = folded.sequence_logprobs(got.prompt_token_ids, got.token_ids)
            assert again == pytest.approx(got.logprobs, abs=TOL)
            if uri == "":  # each fold starts from the bare weights: nothing drifts
                peft_model = folded._policies[5].model.get_base_model()
                mine = {k.replace(".base_layer", ""): w
                        for k, w in peft_model.state_dict().items() if "lora_" not in k}
                for name, weight in bare._policies[0].model.state_dict().items():
                    assert mine[name].equal(weight), name
    finally:
        for b in (unmerged, folded, bare):
            await b.close()


async def test_a_static_kv_cache_decodes_as_the_dynamic_one(
    backend: TransformersBackend, smollm2_path: Path
) -> None:
    static = TransformersBackend.from_pretrained(smollm2_path, kv_cache="static")
    try:
        greedy = SamplingParams(max_tokens=12, temperature=0)
        # Two prompts of different lengths: left padding, here up to a width bucket too.
        dynamic_out = await backend.generate([CHAT, TEXT], sampling=greedy)
        static_out = await static.generate([CHAT, TEXT], sampling=greedy)
        for (d,), (s,) in zip(dynamic_out, static_out, strict=True):
            assert s.token_ids == d.token_ids
            assert s.prompt_token_ids == d.prompt_token_ids  # the padding is not the prompt
            assert s.logprobs == pytest.approx(d.logprobs, abs=TOL)
            assert s.finish_reason == d.finish_reason
    finally:
        await static.close()
    with pytest.raises(ValueError, match="kv_cache must be one of"):
        TransformersBackend.from_pretrained(smollm2_path, kv_cache="paged")


@pytest.mark.gpu
async def test_a_compiled_decode_step_decodes_as_the_eager_one(smollm2_path: Path) -> None:
    import torch

    # float32 on both, so that a greedy token is not decided by bfloat16 rounding.
    eager, compiled = (
        TransformersBackend.from_pretrained(smollm2_path, device="cuda", dtype=torch.float32,
                                            kv_cache=kind)
        for kind in ("dynamic", "compiled")
    )
    try:
        greedy = SamplingParams(max_tokens=16, temperature=0)
        for _ in range(2):  # the second call replays what the first compiled
            want = await eager.generate([CHAT, TEXT], sampling=greedy)
            got = await compiled.generate([CHAT, TEXT], sampling=greedy)
            for (w,), (g,) in zip(want, got, strict=True):
                assert g.token_ids == w.token_ids
                assert g.logprobs == pytest.approx(w.logprobs, abs=1e-3)
    finally:
        await eager.close()
        await compiled.close()


def test_generation_dtype_follows_the_device() -> None:
    import torch

    default_dtype = TransformersBackend.default_dtype
    assert default_dtype(None) == default_dtype("cpu") == torch.float32
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        assert default_dtype("cuda") == default_dtype("cuda:0") == torch.bfloat16
    else:
        assert default_dtype("cuda") == torch.float32


async def test_full_weight_version(smollm2_path: Path) -> None:
    backend = TransformersBackend.from_pretrained(smollm2_path)
    greedy = SamplingParams(max_tokens=6, temperature=0)
    try:
        ((base,),) = await backend.generate([TEXT], sampling=greedy)
        await backend.load_policy(7, f"file://{smollm2_path}", kind="full")
        ((again,),) = await backend.generate([TEXT], sampling=greedy)
        assert again.policy_version == 7 and again.token_ids == base.token_ids
    finally:
        await backend.close()


@pytest.mark.gpu
async def test_a_gpu_memory_fraction_caps_what_the_process_may_allocate(
    smollm2_path: Path,
) -> None:
    import torch

    backend = TransformersBackend.from_pretrained(smollm2_path, device="cuda",
                                                  gpu_memory_fraction=0.05)
    try:
        total = torch.cuda.get_device_properties(0).total_memory
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(int(total * 0.1), dtype=torch.uint8, device="cuda")
        [[sample]] = await backend.generate([CHAT], sampling=SamplingParams(max_tokens=4))
        assert sample.token_ids  # the model itself fits its share
    finally:
        await backend.close()
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
