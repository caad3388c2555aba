"""The event envelope: compact round trips, upcasting on read, clear rejections."""

from __future__ import annotations

import hashlib
import uuid
from typing import Any

import orjson
import pytest

from kz_stream.events import (
    Completion,
    EvaluationProblem,
    EvaluationStarted,
    EventDecodeError,
    KernelGenerated,
    KernelVerified,
    TrainingStepCompleted,
    VerdictStatus,
    current_payload,
    decode_event,
    encode_event,
    new_event,
    payload_as,
    source_sha256,
)
from kz_stream.verify import Verdict


def kernel_generated() -> KernelGenerated:
    return KernelGenerated(
        kernel_id="k1",
        module_id="m1",
        group_id="g1",
        backend="triton",
        source="@triton.jit\ndef k(): pass",
        prompt="write a kernel",
        sampling={"temperature": 1.0},
        policy_version=3,
        completion=Completion(text="x", token_ids=[1, 2], logprobs=[-0.5, -1.25]),
    )


def test_an_event_round_trips_through_its_wire_form_unchanged() -> None:
    event = new_event(kernel_generated(), stream_id="kernel-k1", stream_version=0, producer="t")
    wire = encode_event(event)
    assert decode_event(wire) == event
    assert payload_as(decode_event(wire), KernelGenerated) == kernel_generated()


def test_the_wire_form_is_compact_json_with_the_envelope_fields() -> None:
    event = new_event(kernel_generated(), stream_id="kernel-k1", stream_version=0)
    wire = encode_event(event)
    obj = orjson.loads(wire)
    assert wire == orjson.dumps(obj)  # no whitespace between tokens
    assert set(obj) == {
        "event_id",
        "type",
        "schema_version",
        "stream_id",
        "stream_version",
        "occurred_at",
        "producer",
        "correlation_id",
        "causation_id",
        "payload",
    }
    assert obj["type"] == "KernelGenerated" and obj["schema_version"] == 4


def test_a_v1_kernel_generated_is_upcast_to_the_current_version_on_read() -> None:
    event = new_event(kernel_generated(), stream_id="kernel-k1", stream_version=0)
    obj = orjson.loads(encode_event(event))
    obj["schema_version"] = 1
    obj["payload"]["language"] = obj["payload"].pop("backend")
    del obj["payload"]["module_sha256"]
    stored_v1 = decode_event(orjson.dumps(obj))
    assert stored_v1.schema_version == 1  # the stored form is kept as it was
    assert payload_as(stored_v1, KernelGenerated).backend == "triton"
    assert current_payload(stored_v1) == {**event.payload, "module_sha256": "",
                                          "generation_s": None}


def test_a_v2_kernel_generated_reads_with_no_module_hash() -> None:
    payload = kernel_generated().model_copy(update={"module_sha256": source_sha256("m")})
    obj = orjson.loads(encode_event(new_event(payload, stream_id="s", stream_version=0)))
    assert obj["payload"]["module_sha256"] == hashlib.sha256(b"m").hexdigest()
    obj["schema_version"] = 2
    del obj["payload"]["module_sha256"]
    assert payload_as(decode_event(orjson.dumps(obj)), KernelGenerated).module_sha256 == ""


def test_a_v1_evaluation_started_reads_as_a_run_without_the_compiled_baseline() -> None:
    started = EvaluationStarted(
        run_id="eval-x", suite="/s", backend="triton", samples=2, compile_baseline=True,
        problems=[EvaluationProblem(problem_id="level1/1_A", name="1_A", module_id="kb-1")])
    obj = orjson.loads(encode_event(new_event(started, stream_id="evaluation-eval-x",
                                              stream_version=0)))
    assert obj["schema_version"] == 2 and obj["payload"]["compile_baseline"] is True
    obj["schema_version"] = 1
    del obj["payload"]["compile_baseline"]
    old = payload_as(decode_event(orjson.dumps(obj)), EvaluationStarted)
    assert old.compile_baseline is False  # it timed eager PyTorch only
    assert old.problems == started.problems


def test_a_v1_training_step_reads_with_its_times_unknown() -> None:
    step = TrainingStepCompleted(role="coder", step=3, policy_version=2, mean_reward=0.5,
                                 train_seconds=1.25, waited_seconds=4.0)
    obj = orjson.loads(encode_event(new_event(step, stream_id="learner-coder",
                                              stream_version=2)))
    assert obj["schema_version"] == 2 and obj["payload"]["train_seconds"] == 1.25
    obj["schema_version"] = 1
    del obj["payload"]["train_seconds"], obj["payload"]["waited_seconds"]
    old = payload_as(decode_event(orjson.dumps(obj)), TrainingStepCompleted)
    assert old.train_seconds is None and old.waited_seconds is None
    assert old.mean_reward == 0.5 and old.step == 3


def test_a_payload_is_validated_once_per_envelope() -> None:
    event = new_event(kernel_generated(), stream_id="s", stream_version=0)
    decoded = decode_event(encode_event(event))  # the bus edge validates ...
    first = decoded.decode()
    assert decoded.decode() is first  # ... and a handler's decode reuses that
    assert decoded == event  # whether decoded or not is no part of equality
    assert payload_as(event, KernelGenerated) is payload_as(event, KernelGenerated)


def test_a_verdict_becomes_its_event_payload_with_the_kernel_it_judges() -> None:
    kernel = kernel_generated()
    verdict = Verdict(VerdictStatus.CORRECT, speedup=1.5, speedup_ci=(1.4, 1.6),
                      hardware={"gpu": "H200"}, unchecked=("timing",))
    payload = KernelVerified.from_verdict(verdict, kernel)
    assert (payload.kernel_id, payload.module_id, payload.group_id, payload.policy_version) == (
        "k1", "m1", "g1", 3)
    assert payload.status is VerdictStatus.CORRECT and payload.speedup_ci == (1.4, 1.6)
    assert payload.verifier_version == verdict.verifier_version
    assert (payload.hardware, payload.unchecked) == ({"gpu": "H200"}, ["timing"])
    kernel_fields = {"kernel_id", "module_id", "group_id", "policy_version"}
    assert set(KernelVerified.model_fields) == kernel_fields | set(verdict.to_dict())


def test_a_failed_kernel_whose_completion_hit_its_token_limit_says_so() -> None:
    cut = kernel_generated().model_copy(update={
        "sampling": {"max_tokens": 640},
        "completion": Completion(text="x", token_ids=[1, 2], finish_reason="length")})
    syntax = Verdict(VerdictStatus.COMPILE_ERROR, reason="does not parse: invalid syntax",
                     check="python_syntax")
    payload = KernelVerified.from_verdict(syntax, cut)
    assert payload.reason == ("does not parse: invalid syntax (the completion stopped at its "
                              "limit of 640 tokens)")
    assert payload.check == "python_syntax"
    assert KernelVerified.from_verdict(Verdict(VerdictStatus.CORRECT), cut).reason is None
    own = Verdict(VerdictStatus.INFRA_ERROR, reason="the verifier ran out of memory")
    assert KernelVerified.from_verdict(own, cut).reason == own.reason  # not the cut's doing
    ended = cut.model_copy(update={"completion": Completion(text="x", finish_reason="stop")})
    assert KernelVerified.from_verdict(syntax, ended).reason == syntax.reason


def test_an_unknown_event_type_is_rejected_naming_the_type() -> None:
    event = new_event(kernel_generated(), stream_id="s", stream_version=0)
    obj = orjson.loads(encode_event(event))
    obj["type"] = "KernelTeleported"
    with pytest.raises(EventDecodeError, match=r"^type: unknown event type 'KernelTeleported'"):
        decode_event(orjson.dumps(obj))


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda o: o.pop("event_id"), "event_id"),
        (lambda o: o.update(stream_version=-1), "stream_version"),
        (lambda o: o.update(event_id="not-a-uuid"), "event_id"),
        (lambda o: o["payload"].update(backend="opencl"), "payload.backend"),
        (lambda o: o["payload"].pop("kernel_id"), "payload.kernel_id"),
        (lambda o: o["payload"].update(surprise=1), "payload.surprise"),
    ],
)
def test_a_malformed_event_is_rejected_with_the_field_named(mutate: Any, field: str) -> None:
    event = new_event(kernel_generated(), stream_id="s", stream_version=0)
    obj = orjson.loads(encode_event(event))
    mutate(obj)
    with pytest.raises(EventDecodeError) as info:
        decode_event(orjson.dumps(obj))
    assert str(info.value).startswith(f"{field}:")


def test_bytes_that_are_not_json_are_rejected() -> None:
    with pytest.raises(EventDecodeError, match="not valid JSON"):
        decode_event(b"\x00\xffgarbage")


def test_a_newer_schema_version_than_the_code_knows_is_rejected() -> None:
    event = new_event(kernel_generated(), stream_id="s", stream_version=0)
    obj = orjson.loads(encode_event(event))
    obj["schema_version"] = 9
    with pytest.raises(EventDecodeError, match="newer than this code"):
        decode_event(orjson.dumps(obj))


def test_payload_as_refuses_the_wrong_type() -> None:
    event = new_event(kernel_generated(), stream_id="s", stream_version=0)
    with pytest.raises(EventDecodeError, match="expected KernelVerified"):
        payload_as(event, KernelVerified)


def test_verdict_payload_keeps_its_enum_and_interval() -> None:
    verdict = KernelVerified(
        kernel_id="k",
        module_id="m",
        group_id="g",
        status=VerdictStatus.CORRECT,
        speedup=1.5,
        speedup_ci=(1.4, 1.6),
    )
    event = new_event(verdict, stream_id="kernel-k", stream_version=1, causation_id=uuid.uuid4())
    back = payload_as(decode_event(encode_event(event)), KernelVerified)
    assert back.status is VerdictStatus.CORRECT and back.speedup_ci == (1.4, 1.6)


def test_nul_characters_from_a_model_are_replaced_so_every_store_accepts_them() -> None:
    payload = kernel_generated().model_copy(update={"source": "a\x00b"})
    event = new_event(payload, stream_id="s", stream_version=0)
    assert event.payload["source"] == "a\ufffdb"


def test_an_envelope_wider_than_the_stores_columns_is_refused() -> None:
    with pytest.raises(ValueError, match="at most 200 characters"):
        new_event(kernel_generated(), stream_id="kernel-k", stream_version=0,
                  correlation_id="r" * 201)
