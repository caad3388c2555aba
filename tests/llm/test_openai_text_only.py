"""Responses of OpenAI-compatible endpoints that return no token ids (hosted models):
text-only samples for evaluation, and a clear error where tokens are required. A canned
endpoint answers over real HTTP, so the backend's own request and parsing path runs."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

import pytest

from kz_stream.llm import BackendError, ChatMessage, SamplingParams, VLLMServerBackend

# The shape a hosted chat-completions endpoint returns: no token_ids, no logprobs.
HOSTED_CHAT = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "choices": [
        {"index": 1, "message": {"role": "assistant", "content": "second"},
         "finish_reason": "length", "logprobs": None},
        {"index": 0, "message": {"role": "assistant", "content": "first"},
         "finish_reason": "stop", "logprobs": None},
    ],
}
HOSTED_TEXT = {"choices": [{"index": 0, "text": "code", "finish_reason": "stop"}]}


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def endpoint() -> Iterator[dict[str, Any]]:
    """A server answering every completion request with ``answers[path]``; yields
    ``answers`` (fill it in) with its URL under ``"url"``."""
    answers: dict[str, Any] = {}

    def app(environ: dict[str, Any], start: Callable[..., Any]) -> list[bytes]:
        start("200 OK", [("Content-Type", "application/json")])
        return [json.dumps(answers[environ["PATH_INFO"]]).encode()]

    server = make_server("127.0.0.1", 0, app, handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    answers["url"] = f"http://127.0.0.1:{server.server_port}"
    yield answers
    server.shutdown()
    server.server_close()


CHAT: list[ChatMessage] = [{"role": "user", "content": "write a kernel"}]


async def sample(endpoint: dict[str, Any], prompt: str | list[ChatMessage], n: int,
                 *, token_ids: bool) -> list[Any]:
    backend = VLLMServerBackend(endpoint["url"], model="hosted", policy_version=3,
                                token_ids=token_ids)
    async with backend:
        [samples] = await backend.generate([prompt], n=n, sampling=SamplingParams())
    return samples


async def test_text_only_samples_keep_text_order_and_finish_reason(
    endpoint: dict[str, Any],
) -> None:
    endpoint["/v1/chat/completions"] = HOSTED_CHAT
    endpoint["/v1/completions"] = HOSTED_TEXT
    samples = await sample(endpoint, CHAT, 2, token_ids=False)
    assert [s.text for s in samples] == ["first", "second"]
    assert [s.finish_reason for s in samples] == ["stop", "length"]
    assert all(s.token_ids == [] and s.logprobs == [] and s.policy_version == 3
               for s in samples)
    [text] = await sample(endpoint, "def f():", 1, token_ids=False)
    assert text.text == "code" and text.to_completion().token_ids == []


async def test_training_mode_still_requires_token_ids(endpoint: dict[str, Any]) -> None:
    endpoint["/v1/chat/completions"] = {
        "choices": [{"index": 0, "message": {"content": "x"}, "finish_reason": "stop",
                     "logprobs": {"content": [{"logprob": -0.5}]}}]}
    with pytest.raises(BackendError, match="return_token_ids"):
        await sample(endpoint, CHAT, 1, token_ids=True)
