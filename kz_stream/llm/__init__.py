"""LLM generation behind one small interface: batched sampling of n completions per prompt
with per-token logprobs and the policy version that produced them, and hot-swapping of
policy versions (LoRA adapters or full weights).

Backends: ``TransformersBackend`` (CPU, tests, the embedded SmolLM2), ``VLLMServerBackend``
(a vLLM OpenAI-compatible server, the way vLLM runs on GPU nodes) and ``VLLMEngineBackend``
(vLLM in-process). vLLM and transformers are imported only when their backend is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kz_stream.llm.base import (
    LOGPROB_DEFINITION,
    BackendError,
    ChatMessage,
    LLMBackend,
    Prompt,
    Sample,
    SamplingParams,
)

if TYPE_CHECKING:
    from kz_stream.llm.factory import create_backend
    from kz_stream.llm.transformers_backend import TransformersBackend
    from kz_stream.llm.vllm_engine import VLLMEngineBackend
    from kz_stream.llm.vllm_server import VLLMServer, VLLMServerBackend

__all__ = [
    "LOGPROB_DEFINITION",
    "BackendError",
    "ChatMessage",
    "LLMBackend",
    "Prompt",
    "Sample",
    "SamplingParams",
    "TransformersBackend",
    "VLLMEngineBackend",
    "VLLMServer",
    "VLLMServerBackend",
    "create_backend",
]

_LAZY = {
    "TransformersBackend": "kz_stream.llm.transformers_backend",
    "VLLMEngineBackend": "kz_stream.llm.vllm_engine",
    "VLLMServer": "kz_stream.llm.vllm_server",
    "VLLMServerBackend": "kz_stream.llm.vllm_server",
    "create_backend": "kz_stream.llm.factory",
}


def __getattr__(name: str) -> Any:
    # Backends load heavy libraries (torch, httpx, vllm): import them on first use.
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kz_stream.llm' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
