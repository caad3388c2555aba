"""Event envelope, typed payloads, versioning and serialization.

One envelope serves Kafka and the store alike. On the wire an event is one compact JSON
object (orjson, UTF-8, no whitespace)::

    {"event_id": "<uuid>", "type": "KernelVerified", "schema_version": 2,
     "stream_id": "kernel-<uuid>", "stream_version": 1,
     "occurred_at": "2026-11-29T16:49:29.123456Z", "producer": "verifier@host",
     "correlation_id": "run-1", "causation_id": "<uuid>|null", "payload": {...}}

Payloads are pydantic models registered by ``type``. Each payload class carries the
schema version it writes; older stored versions are upcast on read by functions in
``UPCASTERS`` keyed by ``(type, from_version)``, walked in one place (``current_payload``).
Stored rows are never rewritten. A payload is validated once per envelope: ``decode_event``
(the bus edge) or the first ``Event.decode()`` keeps it, and later decodes return it.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any, ClassVar, Literal, TypeVar

import orjson
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

# One enum for verdicts: the verify core's, which imports only the standard library (the
# core runs on GPU hosts without pydantic). The arrow points this way only: the event model
# knows verdicts, the verify core knows no events.
from kz_stream.verify import Backend, Verdict
from kz_stream.verify import Status as VerdictStatus
from kz_stream.verify._types import source_sha256  # a kernel names its module's text by it

__all__ = [
    "EVALUATION_PREFIX",
    "EVENT_TYPES",
    "RETRIED_STATUS",
    "SEED_GROUP_PREFIX",
    "SYNTHESIZED_GROUP_PREFIX",
    "UNDECIDED_STATUSES",
    "UPCASTERS",
    "Completion",
    "EvaluationProblem",
    "EvaluationStarted",
    "Event",
    "EventDecodeError",
    "FrontierUpdated",
    "KernelGenerated",
    "KernelVerified",
    "ModuleProposed",
    "ModuleValidation",
    "Payload",
    "PolicyVersionLoaded",
    "PolicyVersionPublished",
    "Role",
    "TrainingStepCompleted",
    "VerdictStatus",
    "WorkRedelivered",
    "current_payload",
    "decode_event",
    "encode_event",
    "is_evaluation",
    "new_event",
    "payload_as",
    "source_sha256",
]


# Where a module that no model wrote came from, by its group id: the run's seeds
# (hand-written and synthesized, published at its start) and the Proposer's synthesized
# fallback after a prompt that gave no valid proposal.
SEED_GROUP_PREFIX = "seed-"
SYNTHESIZED_GROUP_PREFIX = "synth-"

# Verdicts that say nothing of the kernel's worth (the check could not run here, or the
# verifier itself failed): they earn no reward, and a figure leaves them out.
UNDECIDED_STATUSES = frozenset({VerdictStatus.UNCHECKED, VerdictStatus.INFRA_ERROR})
# The verifier's own failure: an evaluation's resume and ``kz rescore`` judge the kernel
# again (a verdict with the next attempt number beside it).
RETRIED_STATUS = VerdictStatus.INFRA_ERROR

# The two roles that generate and train (kz_stream.rl.schedule re-exports it for the learner).
Role = Literal["coder", "proposer"]


class EventDecodeError(ValueError):
    """An event could not be decoded; the message names the offending field."""


class Payload(BaseModel):
    """Base of every typed payload: frozen, strict about unknown fields."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    event_type: ClassVar[str]
    schema_version: ClassVar[int] = 1


P = TypeVar("P", bound=Payload)


class Completion(BaseModel):
    """One sampled completion with what off-policy correction needs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    text: str
    token_ids: list[int] = Field(default_factory=list)
    logprobs: list[float] = Field(default_factory=list)
    finish_reason: str | None = None
    # The exact prompt tokens the engine was fed (chat template applied), so the learner
    # recomputes logprobs on the same sequence.
    prompt_token_ids: list[int] = Field(default_factory=list)


class ModuleValidation(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    valid: bool
    reason: str | None = None  # e.g. "wrong_apis", "crash", "timeout", "degenerate"
    detail: str | None = None
    apis_called: list[str] = Field(default_factory=list)


class ModuleProposed(Payload):
    event_type: ClassVar[str] = "ModuleProposed"

    module_id: str
    group_id: str = ""  # the proposals sampled together from one prompt
    api_set: list[str]
    source: str
    prompt: str = ""
    completion: Completion | None = None
    policy_version: int = 0
    normalized_hash: str = ""
    validation: ModuleValidation


class KernelGenerated(Payload):
    """A Coder sample. v1 named the backend ``language``; v2 calls it ``backend``; v3 adds
    ``module_sha256``, the ``source_sha256`` of the module source the kernel was written
    for, so a verifier can take that source from its own cache and know it is the one; v4
    adds ``generation_s``, the wall seconds of the generation call that sampled it (one
    call samples a group, so its samples share the figure)."""

    event_type: ClassVar[str] = "KernelGenerated"
    schema_version: ClassVar[int] = 4

    kernel_id: str
    module_id: str
    group_id: str
    group_size: int = Field(default=1, ge=1)
    backend: Backend
    source: str
    prompt: str = ""
    sampling: dict[str, Any] = Field(default_factory=dict)
    policy_version: int = 0
    completion: Completion | None = None
    module_sha256: str = ""  # "" in kernels generated before v3
    generation_s: float | None = Field(default=None, ge=0)  # None before v4

    @property
    def cut_at_token_limit(self) -> bool:
        """Whether the completion stopped at its token limit, not at its end."""
        return self.completion is not None and self.completion.finish_reason == "length"


# The verdicts a completion cut at its token limit can explain (not the verifier's own
# failures, nor what it could not check here).
_CUT_SHOWS = frozenset({VerdictStatus.COMPILE_ERROR, VerdictStatus.RUNTIME_ERROR,
                        VerdictStatus.INCORRECT, VerdictStatus.HACK})


class KernelVerified(Payload):
    """A verdict on a kernel. Past the kernel's ids, the fields are those of the verify
    core's ``Verdict`` (a dataclass: the core runs without pydantic); ``from_verdict``
    converts, and tests/unit/test_events.py pins that the two keep the same fields."""

    event_type: ClassVar[str] = "KernelVerified"

    kernel_id: str
    module_id: str
    group_id: str
    status: VerdictStatus
    reason: str | None = None
    check: str | None = None
    input_index: int | None = None
    max_rel_error: float | None = None
    speedup: float | None = None
    speedup_ci: tuple[float, float] | None = None
    verifier_version: str = ""
    hardware: dict[str, Any] = Field(default_factory=dict)
    policy_version: int = 0
    details: dict[str, Any] = Field(default_factory=dict)
    # What this verifier could not check here (e.g. "timing" on a machine without a GPU).
    unchecked: list[str] = Field(default_factory=list)

    @classmethod
    def from_verdict(cls, verdict: Verdict, kernel: KernelGenerated) -> KernelVerified:
        """The payload of ``verdict`` on ``kernel``: the one verdict-to-event conversion.
        A failed kernel whose completion stopped at its token limit says so in its reason
        (a cut answer reads as a syntax error otherwise)."""
        fields = verdict.to_dict()
        if kernel.cut_at_token_limit and verdict.status in _CUT_SHOWS:
            cap = kernel.sampling.get("max_tokens")
            limit = f"its limit of {cap} tokens" if cap else "its token limit"
            fields["reason"] = (f"{fields.get('reason') or verdict.status.value} (the "
                                f"completion stopped at {limit})")
        return cls.model_validate(
            {
                "kernel_id": kernel.kernel_id,
                "module_id": kernel.module_id,
                "group_id": kernel.group_id,
                "policy_version": kernel.policy_version,
                **fields,
            }
        )


class FrontierUpdated(Payload):
    event_type: ClassVar[str] = "FrontierUpdated"

    frontier_version: int
    weak_apis: dict[str, float] = Field(default_factory=dict)
    weak_pairs: dict[str, float] = Field(default_factory=dict)
    slow_apis: dict[str, float] = Field(default_factory=dict)
    module_correctness: dict[str, float] = Field(default_factory=dict)
    based_on_position: int = 0


class TrainingStepCompleted(Payload):
    """A learner step. v2 adds ``train_seconds`` (the step's wall time in the trainer) and
    ``waited_seconds`` (how long the learner had been idle, waiting for complete groups,
    when the step began: since its previous step, or since it started)."""

    event_type: ClassVar[str] = "TrainingStepCompleted"
    schema_version: ClassVar[int] = 2

    role: Role
    step: int
    policy_version: int
    kernel_ids: list[str] = Field(default_factory=list)
    module_ids: list[str] = Field(default_factory=list)
    group_ids: list[str] = Field(default_factory=list)
    losses: dict[str, float] = Field(default_factory=dict)
    mean_reward: float = 0.0
    staleness: dict[str, float] = Field(default_factory=dict)
    dropped_stale: int = 0
    store_position: int = 0
    train_seconds: float | None = Field(default=None, ge=0)  # None before v2
    waited_seconds: float | None = Field(default=None, ge=0)  # None before v2


class PolicyVersionPublished(Payload):
    event_type: ClassVar[str] = "PolicyVersionPublished"

    role: Role
    version: int
    uri: str
    sha256: str
    base_model: str = ""
    kind: Literal["lora", "full"] = "lora"


class PolicyVersionLoaded(Payload):
    event_type: ClassVar[str] = "PolicyVersionLoaded"

    role: Role
    replica: str
    version: int


class WorkRedelivered(Payload):
    """A session of a run on the embedded bus published again the store's unfinished work
    (the bus of a new process starts empty; ``kz_stream.app.redeliver_unfinished``): the
    kernels without a verdict and the valid modules without a kernel. An audit fact: a
    kernel named here that has no verdict afterwards was in flight when that session
    stopped, not lost (``kz_stream.integrity.check_slots``)."""

    event_type: ClassVar[str] = "WorkRedelivered"

    kernel_ids: list[str] = Field(default_factory=list)
    module_ids: list[str] = Field(default_factory=list)


# Correlation ids of evaluation runs start with this; their events never become training
# data or frontier statistics (``kz_stream.run_state.RunState`` skips them).
EVALUATION_PREFIX = "eval-"


def is_evaluation(correlation_id: str | None) -> bool:
    """Whether an event's correlation id names an evaluation run."""
    return correlation_id is not None and correlation_id.startswith(EVALUATION_PREFIX)


class EvaluationProblem(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    problem_id: str  # "level1/19_ReLU"
    name: str
    level: int | None = None
    module_id: str  # the ModuleProposed stream holding its source
    path: str = ""


class EvaluationStarted(Payload):
    """An evaluation run: the suite's problems, the policy and how it is sampled, and
    whether the verifier times the reference under ``torch.compile`` too (v2)."""

    event_type: ClassVar[str] = "EvaluationStarted"
    schema_version: ClassVar[int] = 2

    run_id: str
    suite: str
    backend: Backend
    samples: int = Field(ge=1)
    policy: dict[str, Any] = Field(default_factory=dict)
    sampling: dict[str, Any] = Field(default_factory=dict)
    problems: list[EvaluationProblem]
    compile_baseline: bool = False


EVENT_TYPES: dict[str, type[Payload]] = {
    cls.event_type: cls
    for cls in (
        ModuleProposed,
        KernelGenerated,
        KernelVerified,
        FrontierUpdated,
        TrainingStepCompleted,
        PolicyVersionPublished,
        PolicyVersionLoaded,
        EvaluationStarted,
        WorkRedelivered,
    )
}


def _kernel_generated_v1_to_v2(payload: dict[str, Any]) -> dict[str, Any]:
    upcast = dict(payload)
    upcast["backend"] = upcast.pop("language")
    return upcast


def _kernel_generated_v2_to_v3(payload: dict[str, Any]) -> dict[str, Any]:
    return {"module_sha256": "", **payload}  # the module's hash was not recorded


def _kernel_generated_v3_to_v4(payload: dict[str, Any]) -> dict[str, Any]:
    return {"generation_s": None, **payload}  # the generation time was not recorded


def _training_step_v1_to_v2(payload: dict[str, Any]) -> dict[str, Any]:
    return {"train_seconds": None, "waited_seconds": None, **payload}  # not recorded


def _evaluation_started_v1_to_v2(payload: dict[str, Any]) -> dict[str, Any]:
    return {"compile_baseline": False, **payload}  # runs before it timed eager PyTorch only


Upcaster = Callable[[dict[str, Any]], dict[str, Any]]

# (type, from_version) -> function returning the payload at from_version + 1.
UPCASTERS: dict[tuple[str, int], Upcaster] = {
    ("KernelGenerated", 1): _kernel_generated_v1_to_v2,
    ("KernelGenerated", 2): _kernel_generated_v2_to_v3,
    ("TrainingStepCompleted", 1): _training_step_v1_to_v2,
    ("KernelGenerated", 3): _kernel_generated_v3_to_v4,
    ("EvaluationStarted", 1): _evaluation_started_v1_to_v2,
}


def _now() -> datetime:
    return datetime.now(UTC)


class Event(BaseModel):
    """The envelope. ``payload`` is the raw JSON object at ``schema_version``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    event_id: uuid.UUID
    # The store's column widths (``store._schema``): PostgreSQL refuses a longer value
    # (SQLite would keep it), and a refused event was dead-lettered with all its run's.
    type: str = Field(max_length=100)
    schema_version: int = Field(ge=1)
    stream_id: str = Field(min_length=1, max_length=200)
    stream_version: int = Field(ge=0)
    occurred_at: datetime
    producer: str = Field(default="", max_length=200)
    correlation_id: str | None = Field(default=None, max_length=200)
    causation_id: uuid.UUID | None = None
    payload: dict[str, Any]

    # The validated payload, kept by the first decode (``decode_event`` or ``decode()``).
    _decoded: Payload | None = PrivateAttr(default=None)

    def __eq__(self, other: object) -> bool:
        # The envelope's fields, not whether its payload was decoded yet.
        if not isinstance(other, Event):
            return NotImplemented
        return self.__dict__ == other.__dict__

    def decode(self) -> Payload:
        """Returns the typed payload, upcast to the current schema version; validated on
        the first call only."""
        decoded = self._decoded
        if decoded is None:
            cls = _payload_class(self.type)
            try:
                decoded = cls.model_validate(current_payload(self))
            except ValidationError as e:
                raise EventDecodeError(_first_error(e, prefix="payload")) from e
            self._decoded = decoded
        return decoded


def _payload_class(event_type: str) -> type[Payload]:
    cls = EVENT_TYPES.get(event_type)
    if cls is None:
        raise EventDecodeError(f"type: unknown event type {event_type!r}")
    return cls


def current_payload(event: Event) -> dict[str, Any]:
    """The event's payload upcast to its type's current schema version, not validated: the
    one walk over ``UPCASTERS``. Projections read this (every stored row was validated on
    append); ``Event.decode()`` validates it."""
    cls = _payload_class(event.type)
    data, version = event.payload, event.schema_version
    if version > cls.schema_version:
        raise EventDecodeError(
            f"schema_version: {event.type} v{version} is newer than this code "
            f"(v{cls.schema_version})"
        )
    while version < cls.schema_version:
        upcast = UPCASTERS.get((event.type, version))
        if upcast is None:
            raise EventDecodeError(f"schema_version: no upcaster for {event.type} v{version}")
        try:
            data = upcast(data)
        except KeyError as e:
            raise EventDecodeError(
                f"payload.{e.args[0]}: missing in {event.type} v{version}"
            ) from e
        version += 1
    return data


def payload_as(event: Event, cls: type[P]) -> P:
    """Decodes ``event`` and checks that it is a ``cls``."""
    payload = event.decode()
    if not isinstance(payload, cls):
        raise EventDecodeError(f"type: expected {cls.event_type}, got {event.type}")
    return payload


def new_event(
    payload: Payload,
    *,
    stream_id: str,
    stream_version: int,
    producer: str = "",
    correlation_id: str | None = None,
    causation_id: uuid.UUID | None = None,
    event_id: uuid.UUID | None = None,
    occurred_at: datetime | None = None,
) -> Event:
    """Wraps a typed payload in a fresh envelope."""
    return Event(
        event_id=event_id or uuid.uuid4(),
        type=payload.event_type,
        schema_version=payload.schema_version,
        stream_id=stream_id,
        stream_version=stream_version,
        occurred_at=occurred_at or _now(),
        producer=producer,
        correlation_id=correlation_id,
        causation_id=causation_id,
        payload=_without_nul(payload.model_dump(mode="json")),
    )


def _without_nul(value: Any) -> Any:
    """Replaces NUL characters (LLM output can hold them; Postgres jsonb cannot) with U+FFFD."""
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd") if "\x00" in value else value
    if isinstance(value, dict):
        return {k: _without_nul(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_without_nul(v) for v in value]
    return value


def _first_error(e: ValidationError, prefix: str = "") -> str:
    err = e.errors()[0]
    loc = ".".join(str(p) for p in err["loc"])
    field = f"{prefix}.{loc}" if prefix and loc else (loc or prefix or "event")
    return f"{field}: {err['msg']}"


def encode_event(event: Event) -> bytes:
    """Serializes an envelope to compact JSON bytes."""
    return orjson.dumps(
        {
            "event_id": str(event.event_id),
            "type": event.type,
            "schema_version": event.schema_version,
            "stream_id": event.stream_id,
            "stream_version": event.stream_version,
            "occurred_at": event.occurred_at.isoformat(),
            "producer": event.producer,
            "correlation_id": event.correlation_id,
            "causation_id": str(event.causation_id) if event.causation_id else None,
            "payload": event.payload,
        }
    )


def decode_event(data: bytes | str | Mapping[str, Any]) -> Event:
    """Parses and validates an envelope; unknown types and bad fields raise EventDecodeError.

    The payload is validated against its type (after upcasting) so that a malformed event
    is rejected here, at the edge, with the field named.
    """
    if isinstance(data, bytes | str):
        try:
            obj = _loads(data)
        except orjson.JSONDecodeError as e:
            raise EventDecodeError(f"event: not valid JSON ({e})") from e
    else:
        obj = data
    if not isinstance(obj, dict):
        raise EventDecodeError("event: expected a JSON object")
    # pydantic's validators are called directly: this runs for every event a consumer
    # receives, and model_validate's and Event.decode()'s Python wrappers cost ~0.7 us of
    # its ~10 (measured at 800 B).
    try:
        event: Event = _validate_envelope(obj)
    except ValidationError as e:
        raise EventDecodeError(_first_error(e)) from e
    cls = EVENT_TYPES.get(event.type)
    if cls is not None and event.schema_version == cls.schema_version:
        # Current version: nothing to upcast, so this is all that decode() would do.
        try:
            event._decoded = cls.__pydantic_validator__.validate_python(event.payload)
        except ValidationError as e:
            raise EventDecodeError(_first_error(e, prefix="payload")) from e
    else:
        event.decode()  # unknown type, upcasts, newer versions: errors name the field
    return event


_loads = orjson.loads
_validate_envelope = Event.__pydantic_validator__.validate_python
