"""Responses of OpenAI-compatible endpoints that return no token ids (hosted models):
text-only samples for evaluation, and a clear error where tokens are required."""

from __future__ import annotations

import pytest

from kz_stream.llm.base import BackendError
from kz_stream.llm.vllm_server import _parse_choices

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


def test_text_only_samples_keep_text_order_and_finish_reason() -> None:
    samples = _parse_choices(HOSTED_CHAT, chat=True, version=3, token_ids=False)
    assert [s.text for s in samples] == ["first", "second"]
    assert [s.finish_reason for s in samples] == ["stop", "length"]
    assert all(s.token_ids == [] and s.logprobs == [] and s.policy_version == 3
               for s in samples)
    [text] = _parse_choices(HOSTED_TEXT, chat=False, version=0, token_ids=False)
    assert text.text == "code" and text.to_completion().token_ids == []


def test_training_mode_still_requires_token_ids() -> None:
    chat = {"choices": [{"index": 0, "message": {"content": "x"}, "finish_reason": "stop",
                         "logprobs": {"content": [{"logprob": -0.5}]}}]}
    with pytest.raises(BackendError, match="return_token_ids"):
        _parse_choices(chat, chat=True, version=0)
