"""The one interface every LLM backend implements, and the values it trades in."""

from __future__ import annotations

import abc
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict

from kz_stream.events import Completion
from kz_stream.faults import DependencyUnavailable, Unrecoverable

# What every backend stores in ``Sample.logprobs``; the learner must recompute the same thing.
LOGPROB_DEFINITION = (
    "log p(token) under the distribution the token was drawn from: softmax of the behaviour "
    "policy's logits after temperature scaling and then top-k / top-p filtering (vLLM's "
    "logprobs_mode='processed_logprobs'). With top_k=0 and top_p=1.0, the defaults, this "
    "is log_softmax(logits / temperature), exactly what TRL's GRPO recomputes; with a "
    "filter on, the learner's unfiltered recomputation differs, so sample with the "
    "defaults when the logprobs feed off-policy correction. Greedy decoding "
    "(temperature 0) stores log_softmax(logits)."
)


class ChatMessage(TypedDict):
    """One chat turn in the OpenAI shape."""

    role: Literal["system", "user", "assistant"]
    content: str


# A prompt is either a chat (rendered with the model's chat template) or raw text.
Prompt = Sequence[ChatMessage] | str
# How a transformers model keeps its KV cache while it decodes (``TransformersBackend``).
KVCache = Literal["dynamic", "static", "compiled"]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample; the same fields mean the same thing in every backend.

    ``top_k=0`` and ``top_p=1.0`` switch those filters off. ``seed`` makes one request
    reproducible where the backend supports it (transformers: always; vLLM: per request).
    """

    max_tokens: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")

    def as_dict(self) -> dict[str, Any]:
        """Returns a JSON-ready dict (what ``KernelGenerated.sampling`` stores)."""
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop": list(self.stop),
        }


@dataclass(frozen=True, slots=True)
class Sample:
    """One sampled completion and what off-policy correction needs.

    ``logprobs[i]`` belongs to ``token_ids[i]``; see ``LOGPROB_DEFINITION``.
    ``finish_reason`` is ``"stop"`` (EOS or a stop string) or ``"length"``.
    """

    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    policy_version: int
    prompt_token_ids: list[int] = field(default_factory=list)

    def to_completion(self) -> Completion:
        """Returns the event-payload form (``kz_stream.events.Completion``)."""
        return Completion(
            text=self.text,
            token_ids=list(self.token_ids),
            logprobs=list(self.logprobs),
            finish_reason=self.finish_reason,
            prompt_token_ids=list(self.prompt_token_ids),
        )


class BackendError(RuntimeError):
    """The engine failed to serve a request (not a property of the generated text)."""


class BackendLost(BackendError, Unrecoverable):
    """The engine is gone (its process exited, the backend was closed): no request will
    succeed again, so a service that meets it fails rather than retry."""


class BackendUnavailable(BackendError, DependencyUnavailable):
    """The engine did not answer (its server down or restarting, past the client's own
    retries): an outage, which the services wait out as they do the store's and the
    broker's, rather than a request it refused."""

    def __init__(self, message: str) -> None:
        DependencyUnavailable.__init__(self, "llm", message)


class LLMBackend(abc.ABC):
    """Batched sampling of ``n`` completions per prompt from a hot-swappable policy.

    Implementations are safe to call concurrently from one event loop: many ``generate``
    calls may be in flight while ``load_policy`` swaps the policy; requests already started
    finish under the version they started with and report that version.
    """

    @property
    @abc.abstractmethod
    def policy_version(self) -> int:
        """The version new requests are served with."""

    @abc.abstractmethod
    async def generate(
        self, prompts: Sequence[Prompt], *, n: int = 1, sampling: SamplingParams
    ) -> list[list[Sample]]:
        """Returns ``n`` samples for each prompt, in prompt order."""

    @abc.abstractmethod
    async def load_policy(self, version: int, uri: str, *, kind: str = "lora") -> None:
        """Makes ``version`` (a LoRA adapter dir, or full weights for ``kind="full"``) current.

        ``uri`` is a local path or ``file://`` URI. Loading the base model again is
        ``uri=""`` with ``kind="lora"``.
        """

    @abc.abstractmethod
    async def close(self) -> None:
        """Releases the engine or connection; idempotent."""

    async def __aenter__(self) -> LLMBackend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class ServingBackend(LLMBackend):
    """An ``LLMBackend`` that serves policy versions from an engine: the current version,
    the checks every call makes, the no-op reload of the current version and an idempotent
    close. Subclasses implement ``_generate``, ``_load_policy`` and ``_close``."""

    def __init__(self, policy_version: int = 0) -> None:
        self._version = policy_version
        self._closed = False

    @property
    def policy_version(self) -> int:
        return self._version

    async def generate(
        self, prompts: Sequence[Prompt], *, n: int = 1, sampling: SamplingParams
    ) -> list[list[Sample]]:
        if self._closed:
            raise BackendError("backend is closed")
        if n < 1:
            raise ValueError("n must be >= 1")
        return await self._generate(prompts, n, sampling)

    async def load_policy(self, version: int, uri: str, *, kind: str = "lora") -> None:
        if self._closed:
            raise BackendError("backend is closed")
        if version == self._version:
            return  # replays of the same PolicyVersionPublished are no-ops
        path = uri_to_path(uri)
        await self._load_policy(version, path, kind)
        logging.getLogger(type(self).__module__).info(
            "policy version %d loaded (%s: %s)", version, kind, path or "base"
        )

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            await self._close()

    @abc.abstractmethod
    async def _generate(
        self, prompts: Sequence[Prompt], n: int, sampling: SamplingParams
    ) -> list[list[Sample]]:
        """``generate`` once the backend is known open and ``n`` valid."""

    @abc.abstractmethod
    async def _load_policy(self, version: int, path: str, kind: str) -> None:
        """Loads ``version`` from the local ``path`` ("" for the base model) and makes it
        current (``self._version``)."""

    @abc.abstractmethod
    async def _close(self) -> None:
        """Releases the engine or connection (called once)."""


def encode_prompt(tokenizer: Any, prompt: Prompt) -> list[int]:
    """Token ids of a prompt as vLLM's OpenAI server renders it: chats through the chat
    template (which holds the special tokens), text tokenized plainly."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt).input_ids)
    text = tokenizer.apply_chat_template(
        [{"role": m["role"], "content": m["content"]} for m in prompt],
        tokenize=False,
        add_generation_prompt=True,
    )
    return list(tokenizer(str(text), add_special_tokens=False).input_ids)


def uri_to_path(uri: str) -> str:
    """Turns a ``file://`` URI or plain path into a filesystem path."""
    if uri.startswith("file://"):
        from urllib.parse import unquote, urlparse

        return unquote(urlparse(uri).path)
    return uri
