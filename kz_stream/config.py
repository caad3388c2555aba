"""Configuration: environment variables (``KZ_*``, nested with ``__``) over a TOML file over
defaults. With nothing set, everything runs embedded: in-memory bus, SQLite file store."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, Field
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from kz_stream.bus import TopicSpec

__all__ = [
    "CoderSettings",
    "LLMConfig",
    "LearnerSettings",
    "ProposerSettings",
    "Settings",
    "TopicsConfig",
    "VerifierSettings",
    "load_settings",
]


class TopicsConfig(BaseModel):
    modules: str = "kz.modules"
    kernels: str = "kz.kernels"
    verdicts: str = "kz.verdicts"
    frontier: str = "kz.frontier"
    policy: str = "kz.policy"
    dead_letter: str = "kz.dead-letter"
    partitions: int = 8

    def specs(self) -> list[TopicSpec]:
        """Topic definitions; frontier and policy are compacted (latest value per key)."""
        return [
            TopicSpec(self.modules, self.partitions),
            TopicSpec(self.kernels, self.partitions),
            TopicSpec(self.verdicts, self.partitions),
            TopicSpec(self.frontier, 1, compacted=True),
            TopicSpec(self.policy, 1, compacted=True),
            TopicSpec(self.dead_letter, 1),
        ]

    def all(self) -> list[str]:
        return [s.name for s in self.specs()]


class LLMConfig(BaseModel):
    """Which engine a generator samples from (see ``kz_stream.llm.create_backend``)."""

    kind: Literal["transformers", "vllm-server", "vllm-engine"] = "transformers"
    model: str | None = Field(default=None, description="Model dir; None: embedded SmolLM2.")
    base_url: str | None = Field(default=None, description="vLLM server URL (vllm-server).")
    max_tokens: int = Field(default=512, ge=1)
    temperature: float = Field(default=1.0, ge=0)


class ProposerSettings(BaseModel):
    llm: LLMConfig = Field(default_factory=LLMConfig)
    proposals_per_prompt: int = Field(default=4, ge=1)
    concurrency: int = Field(default=2, ge=1)
    max_modules: int | None = None
    seed_modules: bool = True
    decontaminate: list[Path] = Field(
        default_factory=list,
        description="Evaluation suites whose problems proposals must not copy (besides "
        "every problem a kz eval run stored).",
    )


class CoderSettings(BaseModel):
    llm: LLMConfig = Field(default_factory=LLMConfig)
    group_size: int = Field(default=4, ge=1)
    backends: tuple[Literal["cuda", "triton"], ...] = ("triton",)
    max_staleness: int = Field(default=1, ge=0)


class VerifierSettings(BaseModel):
    devices: list[int] | None = Field(
        default=None, description="GPU indices; None: all visible; []: the CPU path."
    )
    prewarm: int | None = Field(
        default=None,
        ge=0,
        description="Workers started ahead of need per device; None: the verifier's default.",
    )


ModelT = TypeVar("ModelT", bound=BaseModel)


def validated_copy(model: ModelT, **changes: Any) -> ModelT:
    """``model`` with ``changes`` applied and validated (``model_copy(update=...)`` takes
    them as given, so ``lora_r=0`` would pass)."""
    return type(model).model_validate({**model.model_dump(), **changes})


class LearnerSettings(BaseModel):
    model: str | None = Field(default=None, description="Base model dir; None: SmolLM2.")
    checkpoint_dir: Path = Path(".kz/policies")
    roles: tuple[Literal["proposer", "coder"], ...] = ("proposer", "coder")
    groups_per_step: int = Field(default=4, ge=1)
    learning_rate: float = Field(default=1e-5, gt=0)
    lora_r: int = Field(default=16, ge=1)
    full_finetune: bool = False
    max_staleness: int = Field(default=4, ge=0)
    # Memory of a training step: gradient accumulation over this many micro-batches, and
    # activations recomputed in the backward pass (both trade a little time for memory).
    micro_batches: int = Field(default=1, ge=1)
    gradient_checkpointing: bool = False
    proposer_steps: int = Field(default=20, ge=0)
    coder_steps: int = Field(default=20, ge=0)
    rounds: int = Field(default=4, ge=1)
    order: tuple[Literal["proposer", "coder"], ...] = ("proposer", "coder")
    group_timeout_s: float = Field(default=600.0, gt=0)


class Settings(BaseSettings):
    """Everything a service needs to know about its surroundings."""

    model_config = SettingsConfigDict(
        env_prefix="KZ_", env_nested_delimiter="__", extra="ignore", toml_file=None
    )

    database_url: str = Field(
        default="sqlite+aiosqlite:///.kz/kz.sqlite3",
        description="SQLAlchemy URL of the event store (sqlite+aiosqlite or postgresql+psycopg).",
    )
    bus_url: str = Field(default="memory://", description="memory:// or kafka://host:port[,...]")
    run_id: str = Field(default="run-0", description="Correlation id stamped on every event.")
    topics: TopicsConfig = Field(default_factory=TopicsConfig)
    http_host: str = "127.0.0.1"
    http_port: int = Field(default=0, description="Health and /metrics port; 0 picks a free one.")
    log_level: str = "INFO"
    log_json: bool = True
    proposer: ProposerSettings = Field(default_factory=ProposerSettings)
    coder: CoderSettings = Field(default_factory=CoderSettings)
    verifier: VerifierSettings = Field(default_factory=VerifierSettings)
    learner: LearnerSettings = Field(default_factory=LearnerSettings)

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
        config_file = os.environ.get("KZ_CONFIG_FILE")
        if config_file:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=Path(config_file)))
        return tuple(sources)

    @property
    def embedded(self) -> bool:
        return self.bus_url.startswith("memory://")


def load_settings(config_file: Path | None = None, **overrides: Any) -> Settings:
    """Reads settings; ``config_file`` (TOML) sits under environment variables."""
    if config_file is not None:
        if not config_file.exists():
            raise FileNotFoundError(f"config file {config_file} does not exist")
        os.environ["KZ_CONFIG_FILE"] = str(config_file)
    return Settings(**overrides)
