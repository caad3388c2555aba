"""LLM generation behind one small interface: batched sampling of n completions per prompt
with per-token logprobs and the policy version that produced them, and hot-swapping of
policy versions (LoRA adapters or full weights).

Backends: ``TransformersBackend`` (CPU, tests, the embedded SmolLM2), ``VLLMServerBackend``
(a vLLM OpenAI-compatible server, the way vLLM runs on GPU nodes) and ``VLLMEngineBackend``
(vLLM in-process). vLLM and transformers are imported only when their backend is used.
The modules of this package are private; this is its API.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kz_stream._lazy import lazy_exports
from kz_stream.llm._base import (
    LOGPROB_DEFINITION,
    BackendError,
    BackendLost,
    BackendUnavailable,
    ChatMessage,
    KVCache,
    LLMBackend,
    Prompt,
    Sample,
    SamplingParams,
    ServingBackend,
    encode_prompt,
    uri_to_path,
)
from kz_stream.llm._models import smollm2_dir

if TYPE_CHECKING:
    from kz_stream.llm._factory import BackendKind, create_backend
    from kz_stream.llm._process_backend import ProcessBackend
    from kz_stream.llm._transformers_backend import TransformersBackend
    from kz_stream.llm._vllm_engine import VLLMEngineBackend
    from kz_stream.llm._vllm_server import VLLMServer, VLLMServerBackend

__all__ = [
    "LOGPROB_DEFINITION",
    "BackendError",
    "BackendKind",
    "BackendLost",
    "BackendUnavailable",
    "ChatMessage",
    "KVCache",
    "LLMBackend",
    "ProcessBackend",
    "Prompt",
    "Sample",
    "SamplingParams",
    "ServingBackend",
    "TransformersBackend",
    "VLLMEngineBackend",
    "VLLMServer",
    "VLLMServerBackend",
    "create_backend",
    "encode_prompt",
    "smollm2_dir",
    "uri_to_path",
]

# Backends load heavy libraries (torch, httpx, vllm): imported on first use.
__getattr__ = lazy_exports(__name__, {
    "BackendKind": "._factory",
    "create_backend": "._factory",
    "ProcessBackend": "._process_backend",
    "TransformersBackend": "._transformers_backend",
    "VLLMEngineBackend": "._vllm_engine",
    "VLLMServer": "._vllm_server",
    "VLLMServerBackend": "._vllm_server",
})
