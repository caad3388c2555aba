"""Configuration: environment variables (``KZ_*``, nested with ``__``) over a TOML file over
defaults. With nothing set, everything runs embedded: in-memory bus, SQLite file store."""

from __future__ import annotations

import difflib
import os
import tomllib
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Self, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)
from pydantic_settings.exceptions import SettingsError

from kz_stream._cpus import usable_cpus
from kz_stream.bus import TopicSpec
from kz_stream.llm import KVCache
from kz_stream.rl.options import TrainerOptions
from kz_stream.rl.schedule import AlternationConfig, Role
from kz_stream.verify import Backend, VerifierConfig

if TYPE_CHECKING:
    from kz_stream.llm import SamplingParams

__all__ = [
    "CoderSettings",
    "ConfigError",
    "LLMConfig",
    "LearnerSettings",
    "ProposerSettings",
    "ResilienceSettings",
    "Settings",
    "TopicsConfig",
    "describe_validation_error",
    "load_settings",
    "usable_cpus",
    "validated_copy",
]

ENV_PREFIX = "KZ_"
ENV_NESTED = "__"
# Names the TOML file when no --config does (read here, never written).
CONFIG_FILE_ENV = "KZ_CONFIG_FILE"
# The TOML file of the Settings being built: load_settings hands it to the sources this way
# (pydantic-settings builds sources in a classmethod), for that one call only.
_config_file: ContextVar[Path | None] = ContextVar("kz_config_file", default=None)


class ConfigError(ValueError):
    """A setting is wrong; the message names the key, its value, what was expected and
    where it came from, on one or two lines."""


class _Section(BaseModel):
    # A typo'd key is an error, not a setting silently left at its default.
    model_config = ConfigDict(extra="forbid")


class TopicsConfig(_Section):
    modules: str = "kz.modules"
    kernels: str = "kz.kernels"
    frontier: str = "kz.frontier"
    policy: str = "kz.policy"
    dead_letter: str = "kz.dead-letter"
    # ``kz rescore``'s jobs: stored kernel events, for the verifier fleet to judge again.
    rescore: str = "kz.rescore"
    partitions: int = 8

    def specs(self) -> list[TopicSpec]:
        """Topic definitions; frontier and policy are compacted (latest value per key)."""
        return [
            TopicSpec(self.modules, self.partitions),
            TopicSpec(self.kernels, self.partitions),
            TopicSpec(self.rescore, self.partitions),
            TopicSpec(self.frontier, 1, compacted=True),
            TopicSpec(self.policy, 1, compacted=True),
            TopicSpec(self.dead_letter, 1),
        ]

    def all(self) -> list[str]:
        return [s.name for s in self.specs()]


class LLMConfig(_Section):
    """Which engine a generator samples from (see ``kz_stream.llm.create_backend``)."""

    kind: Literal["transformers", "vllm-server", "vllm-engine"] = "transformers"
    model: str | None = Field(default=None, description="Model dir; None: embedded SmolLM2.")
    base_url: str | None = Field(default=None, description="vLLM server URL (vllm-server).")
    device: str | None = Field(
        default=None,
        description="Where a transformers model generates (cpu, cuda, cuda:1); None: the CPU.",
    )
    batch_size: int = Field(
        default=8, ge=1, description="A transformers model's rows (prompt x sample) per call."
    )
    kv_cache: KVCache = Field(
        default="dynamic",
        description="A transformers model's KV cache: dynamic, static, or compiled (static, "
                    "decode step under torch.compile with CUDA graphs).",
    )
    merge_adapter: bool = Field(
        default=False,
        description="A transformers model's LoRA versions folded into its weights before "
                    "the calls that use them (decodes as the plain model; a copy of the "
                    "bare weights is kept).",
    )
    process: bool = Field(
        default=False,
        description="The engine runs in a process of its own (ProcessBackend), so that its "
                    "decoding does not share the GIL with the other generator and the "
                    "services.",
    )
    gpu_memory_fraction: float | None = Field(
        default=None, gt=0, le=1,
        description="A transformers model on a GPU: the share of the device's memory its "
                    "process may allocate (torch's per-process cap; with `process`, the "
                    "engine's own process). None: no cap.",
    )
    max_tokens: int = Field(default=512, ge=1)
    temperature: float = Field(default=1.0, ge=0)
    seed: int | None = Field(
        default=None, description="Sampling seed, for reproducible requests; None: random."
    )

    def sampling(self) -> SamplingParams:
        """How the generator samples: these settings as the backends' parameters."""
        from kz_stream.llm import SamplingParams

        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature,
                              seed=self.seed)


PROPOSER_TEMPERATURE = 0.5


def _role_default(llm: LLMConfig, key: str, value: Any) -> LLMConfig:
    """``llm`` with ``value`` for ``key`` where the user set none (a ``[ROLE.llm]`` table
    or ``KZ_ROLE__LLM__*`` variables without it included), still counted as a default:
    ``kz run`` warns only where its options replace what the user set."""
    if key in llm.model_fields_set:
        return llm
    values = {name: getattr(llm, name) for name in LLMConfig.model_fields}
    return LLMConfig.model_construct(set(llm.model_fields_set), **{**values, key: value})


class ProposerSettings(_Section):
    """``[proposer]``: what ``kz_stream.producers.proposer.ProposerService`` takes as it is."""

    # Temperature 0.5: the warm Proposer writes a valid module for 53% of sampled API sets
    # there and 36% at 1.0 (96 sets, H200, docs/warmstart.md); an invalid proposal earns -1
    # and no signal, and the API sets, drawn afresh for every prompt, keep the variety.
    llm: LLMConfig = Field(default_factory=LLMConfig)

    @model_validator(mode="after")
    def _proposer_temperature(self) -> Self:
        self.llm = _role_default(self.llm, "temperature", PROPOSER_TEMPERATURE)
        return self

    proposals_per_prompt: int = Field(default=4, ge=1)
    concurrency: int = Field(default=2, ge=1)
    max_modules: int | None = Field(
        default=None, ge=0, description="Stop after publishing this many; None: run forever."
    )
    seed_modules: bool = True
    synthesized_seeds: int = Field(
        default=4, ge=0,
        description="Synthesized modules published with the hand-written seeds "
        "(kz_stream.warmstart.synth), when seed_modules is on.",
    )
    synthesized_fallback: bool = Field(
        default=True,
        description="After a prompt whose proposals were all invalid, publish one "
        "synthesized module (a supply for the Coder while the Proposer is weak).",
    )
    decontaminate: list[Path] = Field(
        default_factory=list,
        description="Evaluation suites whose problems proposals must not copy (besides "
        "every problem a kz eval run stored).",
    )
    validation_timeout_s: float = Field(
        default=60.0, gt=0, description="Sandbox time to validate one proposed module."
    )
    seed_validations: int | None = Field(
        default=None, ge=1,
        description="Seed modules validated at once; None: half the cores, 1 to 8.",
    )
    seed: int = Field(default=0, description="Seed of the API-set sampler and synthesizer.")
    max_ahead: int | None = Field(
        default=None, ge=1,
        description="A prompt waits while this many of the run's valid modules have no "
        "kernel yet (the Coder is behind, and proposals made now would meet an old "
        "frontier); None: never wait.",
    )
    max_ahead_wait_s: float = Field(
        default=600.0, gt=0,
        description="A module with no kernel while the Coder has coded modules counted "
        "this long after it (it passed it over: dead-lettered it, say) no longer holds "
        "prompts back under max_ahead.",
    )


# The Coder's completion cap: the warm Coder learned the teacher's answers, which take up
# to 1,182 tokens for a synthesized module with a matmul (tests/warmstart/test_teacher.py).
CODER_MAX_TOKENS = 1280


class CoderSettings(_Section):
    """``[coder]``: what ``kz_stream.producers.coder.CoderService`` takes as it is."""

    llm: LLMConfig = Field(default_factory=LLMConfig)

    @model_validator(mode="after")
    def _coder_max_tokens(self) -> Self:
        self.llm = _role_default(self.llm, "max_tokens", CODER_MAX_TOKENS)
        return self

    group_size: int = Field(default=4, ge=1)
    backends: tuple[Backend, ...] = ("triton",)
    max_staleness: int = Field(default=1, ge=0)
    max_batch: int = Field(default=4, ge=1, description="Modules taken from the bus at once.")
    merge_waiting: bool = Field(
        default=False,
        description="Hand the model, in one call, every module that waited behind the "
        "running call (max_batch at most): on a GPU a call's rows are nearly free, on the "
        "CPU each row costs its share.",
    )
    max_unjudged: int | None = Field(
        default=None, ge=1,
        description="A call waits while this many of the run's kernels have no verdict (the "
        "verifier is behind: kernels made now would be judged late, for an older policy); "
        "None: never wait.",
    )
    max_unjudged_wait_s: float = Field(
        default=600.0, gt=0,
        description="The longest a call waits under max_unjudged (then it goes ahead: "
        "verdicts may have stopped coming); and a kernel with no verdict while kernels "
        "counted this long after it have one (the verifier passed it over) counts no more.",
    )


ModelT = TypeVar("ModelT", bound=BaseModel)


def validated_copy(model: ModelT, **changes: Any) -> ModelT:
    """``model`` with ``changes`` applied and validated (``model_copy(update=...)`` takes
    them as given, so ``lora_r=0`` would pass). What the user set stays marked as set
    (``model_fields_set``), and so do the changes."""
    return type(model).model_validate({**model.model_dump(exclude_unset=True), **changes})


# The alternation schedule's defaults live with the schedule (the paper's), the trainer's
# with the trainer's options.
_SCHEDULE = AlternationConfig()
_TRAINER = TrainerOptions()


class LearnerSettings(_Section):
    """``[learner]``: what ``kz_stream.consumers.learner.LearnerService`` takes as it is, and the
    knobs its trainers get (``trainer_options``)."""

    model: str | None = Field(default=None, description="Base model dir; None: SmolLM2.")
    checkpoint_dir: Path = Path(".kz/policies")
    roles: tuple[Role, ...] = ("proposer", "coder")
    groups_per_step: int = Field(default=4, ge=1)
    learning_rate: float = Field(
        default=_TRAINER.learning_rate, ge=0,
        description="0: a control run (the same steps and policy versions, no update).")
    lora_r: int = Field(default=_TRAINER.lora_r, ge=1)
    full_finetune: bool = _TRAINER.full_finetune
    max_staleness: int = Field(default=_TRAINER.max_staleness, ge=0)
    kl_beta: float = Field(
        default=_TRAINER.kl_beta, ge=0,
        description="KL penalty toward the run's version 0 (the warm start); 0: none.")
    micro_batches: int = Field(default=_TRAINER.micro_batches, ge=1)
    gradient_checkpointing: bool = _TRAINER.gradient_checkpointing
    proposer_steps: int = Field(default=_SCHEDULE.proposer_steps, ge=0)
    coder_steps: int = Field(default=_SCHEDULE.coder_steps, ge=0)
    rounds: int = Field(default=_SCHEDULE.rounds, ge=1)
    order: tuple[Role, ...] = _SCHEDULE.order
    group_timeout_s: float = Field(default=600.0, gt=0)
    proposer_wait_s: float = Field(
        default=120.0, gt=0,
        description="Most seconds (from the learner's start or its last step) a Proposer "
                    "step waits for proposal groups the Coder is scoring before it trains on "
                    "the ready ones, equal-reward groups included (its turn blocks the "
                    "Coder's).")
    frontier_every_s: float = Field(
        default=5.0, gt=0, description="Least time between two published frontiers."
    )
    poll_interval: float = Field(default=0.2, gt=0, description="Store tail poll, seconds.")

    @model_validator(mode="after")
    def _anchor_needs_lora(self) -> Self:
        if self.kl_beta and self.full_finetune:
            raise ValueError("kl_beta needs LoRA: under full_finetune the KL reference "
                             "would be the latest checkpoint, not version 0")
        return self

    def trainer_options(self) -> dict[str, Any]:
        """The settings the trainer (``kz_stream.rl.trainer.LearnerConfig``) takes as they
        are (``TrainerOptions``' fields); the model, the temperature and the warm-start
        adapter are resolved per role."""
        return self.model_dump(include={f.name for f in fields(TrainerOptions)})

    def alternation(self) -> AlternationConfig:
        """The alternation schedule these settings describe."""
        return AlternationConfig(proposer_steps=self.proposer_steps,
                                 coder_steps=self.coder_steps, rounds=self.rounds,
                                 order=self.order)


class ResilienceSettings(_Section):
    """How services ride out outages and judge their own health."""

    backoff_initial_s: float = Field(default=0.2, gt=0, description="First retry delay.")
    backoff_max_s: float = Field(default=30.0, gt=0, description="Cap of the doubling delay.")
    probe_interval_s: float = Field(
        default=5.0, gt=0, description="How often the store and broker are probed."
    )
    stuck_after_s: float = Field(
        default=1800.0, gt=0, description="A batch running longer makes its consumer stuck."
    )
    create_topics: bool = Field(
        default=True, description="Create missing topics (at start and when found missing)."
    )


class Settings(BaseSettings):
    """Everything a service needs to know about its surroundings."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter=ENV_NESTED, extra="forbid", toml_file=None
    )

    database_url: str = Field(
        default="sqlite+aiosqlite:///.kz/kz.sqlite3",
        description="SQLAlchemy URL of the event store (sqlite+aiosqlite or postgresql+psycopg).",
    )
    bus_url: str = Field(default="memory://", description="memory:// or kafka://host:port[,...]")
    run_id: str = Field(default="run-0", min_length=1, max_length=200,
                        description="Correlation id stamped on every event (the store's "
                                    "correlation_id column holds 200 characters).")
    topics: TopicsConfig = Field(default_factory=TopicsConfig)
    http_host: str = "127.0.0.1"
    http_port: int = Field(default=0, description="Health and /metrics port; 0 picks a free one.")
    log_level: str = "INFO"
    log_json: bool = True
    cpus: str | None = Field(
        default=None, pattern=r"^\d+(-\d+)?(,\d+(-\d+)?)*$",
        description="The cores this process and the processes it starts run on, as a list "
                    "of cores and ranges (0-7,12), for services and runs that share a host; "
                    "None: all (Linux only).",
    )
    proposer: ProposerSettings = Field(default_factory=ProposerSettings)
    coder: CoderSettings = Field(default_factory=CoderSettings)
    verifier: VerifierConfig = Field(default_factory=VerifierConfig)
    learner: LearnerSettings = Field(default_factory=LearnerSettings)
    resilience: ResilienceSettings = Field(default_factory=ResilienceSettings)
    warm_start: bool = Field(
        default=True,
        description="Start the embedded SmolLM2 Coder and Proposer (generators and learner) "
        "from the packaged warm-start adapters as policy version 0; false: the bare model.",
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        config_file = _config_file.get()
        if config_file is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=config_file))
        return tuple(sources)

    @property
    def embedded(self) -> bool:
        return self.bus_url.startswith("memory://")

    @field_validator("cpus")
    @classmethod
    def _ranges_go_up(cls, value: str | None) -> str | None:
        for first, last in _core_ranges(value or ""):
            if last < first:
                raise ValueError(f"the range {first}-{last} runs backwards")
        return value

    @property
    def cpu_set(self) -> set[int] | None:
        """The cores of ``cpus`` as a set; None when it is not set."""
        if self.cpus is None:
            return None
        return {c for first, last in _core_ranges(self.cpus) for c in range(first, last + 1)}


def _core_ranges(spec: str) -> list[tuple[int, int]]:
    """``0-7,12`` as ``[(0, 7), (12, 12)]`` (the pattern of ``Settings.cpus`` checked)."""
    ranges = []
    for part in filter(None, spec.split(",")):
        first, _, last = part.partition("-")
        ranges.append((int(first), int(last or first)))
    return ranges


Loc = tuple[int | str, ...]


@contextmanager
def _reading(config_file: Path | None) -> Iterator[None]:
    """Settings built inside read ``config_file`` as their TOML source."""
    token = _config_file.set(config_file)
    try:
        yield
    finally:
        _config_file.reset(token)


def load_settings(config_file: Path | None = None, **overrides: Any) -> Settings:
    """Reads settings: ``overrides`` over environment variables over the TOML file
    (``config_file``, else the one ``KZ_CONFIG_FILE`` names) over defaults. Every service,
    the CLI and Alembic's ``migrations/env.py`` load them here.

    Raises ConfigError naming the key, value, expectation and source of a bad setting.
    """
    path, named_by = config_file, "--config"
    if path is None and os.environ.get(CONFIG_FILE_ENV):
        path, named_by = Path(os.environ[CONFIG_FILE_ENV]), CONFIG_FILE_ENV
    toml: dict[str, Any] = {}
    if path is not None:
        if not path.exists():
            raise ConfigError(f"config file {path} does not exist ({named_by})")
        try:
            toml = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML: {e}") from None
    try:
        with _reading(path):
            return Settings(**overrides)
    except ValidationError as e:
        raise ConfigError(
            describe_validation_error(e, lambda loc: _origin(loc, overrides, path, toml))
        ) from None
    except SettingsError as e:
        # A nested env value that is not valid JSON (e.g. KZ_VERIFIER__DEVICES=0,1).
        raise ConfigError(f"{e}; {_env_hint()}") from None


def describe_validation_error(
    error: ValidationError, origin: Callable[[Loc], str], *, key: Callable[[Loc], str] | None = None
) -> str:
    """The first problem as ``key = value (origin): expected ...``, and a second line
    naming the others."""
    problems = error.errors()
    name = key or _dotted
    first = problems[0]
    loc = tuple(first["loc"])
    if first["type"] == "extra_forbidden":
        what = "unknown key" + _suggestion(error.title, loc)
    else:
        what = _expected(first["msg"])
    line = f"{name(loc)} = {_show(first.get('input'))} ({origin(loc)}): {what}"
    if len(problems) > 1:
        others = ", ".join(name(tuple(p["loc"])) for p in problems[1:])
        line += f"\nalso invalid: {others}"
    return line


def _dotted(loc: Loc) -> str:
    return ".".join(str(part) for part in loc) or "?"


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _expected(msg: str) -> str:
    for lead in ("Input should be ", "Value should be "):
        if msg.startswith(lead):
            return "expected " + msg[len(lead):]
    return msg[:1].lower() + msg[1:]


def _suggestion(model_name: str, loc: Loc) -> str:
    """``; did you mean ...?`` with the closest known key at that level, if any."""
    model: Any = Settings if model_name == "Settings" else None
    for part in loc[:-1]:
        field = model.model_fields.get(str(part)) if model is not None else None
        model = field.annotation if field is not None else None
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return ""
    if model is None:
        return ""
    close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _origin(loc: Loc, overrides: Mapping[str, Any], path: Path | None,
            toml: Mapping[str, Any]) -> str:
    """Where the value at ``loc`` came from, by the sources' precedence."""
    if loc and loc[0] in overrides:
        return f"argument {loc[0]}"
    env = {k.upper(): k for k in os.environ}
    for n in range(len(loc), 0, -1):
        name = ENV_PREFIX + ENV_NESTED.join(str(p) for p in loc[:n]).upper()
        if name in env:
            return f"environment variable {env[name]}"
    node: Any = toml
    for part in loc:
        if not isinstance(node, Mapping) or str(part) not in node:
            break
        node = node[str(part)]
    else:
        return f"in {path}"
    if path is not None and loc and str(loc[0]) in toml:
        return f"in {path}"
    return "default"


def _env_hint() -> str:
    names = sorted(k for k in os.environ if k.upper().startswith(ENV_PREFIX)
                   and ENV_NESTED in k)
    return f"check {', '.join(names)}" if names else f"check the {ENV_PREFIX}* variables"
