"""The backend interface's value types and the factory, without loading a model."""

from __future__ import annotations

import pytest

from kz_stream.events import ModuleProposed, ModuleValidation
from kz_stream.llm import LOGPROB_DEFINITION, Sample, SamplingParams, create_backend, uri_to_path


def test_sampling_params_validate_and_serialise() -> None:
    sp = SamplingParams(max_tokens=5, temperature=0.5, stop=("\n\n",), seed=1)
    assert sp.as_dict() == {
        "max_tokens": 5, "temperature": 0.5, "top_p": 1.0, "top_k": 0, "seed": 1,
        "stop": ["\n\n"],
    }  # fmt: skip
    for bad in ({"max_tokens": 0}, {"temperature": -1}, {"top_p": 0}, {"top_k": -1}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)  # type: ignore[arg-type]


def test_sample_becomes_an_event_completion() -> None:
    s = Sample("hi", [1, 2], [-0.1, -0.2], "stop", policy_version=3, prompt_token_ids=[9])
    payload = ModuleProposed(
        module_id="m",
        api_set=["torch.relu"],
        source="x",
        completion=s.to_completion(),
        policy_version=s.policy_version,
        validation=ModuleValidation(valid=True),
    )
    assert payload.completion is not None and payload.completion.logprobs == [-0.1, -0.2]
    assert "temperature" in LOGPROB_DEFINITION


def test_uri_to_path_and_factory_errors() -> None:
    assert uri_to_path("file:///tmp/a%20b") == "/tmp/a b"
    assert uri_to_path("/x/y") == "/x/y"
    with pytest.raises(ValueError):
        create_backend("vllm-server")
    with pytest.raises(ValueError):
        create_backend("nope")  # type: ignore[arg-type]
