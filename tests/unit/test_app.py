"""The composition root: services take their settings sections as they are, and a
``kz run``'s own values are explicit, logged, and never replace what the user set."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from kz_stream.app import RunOptions, open_context, service_by_name
from kz_stream.config import (
    CoderSettings,
    LearnerSettings,
    LLMConfig,
    ProposerSettings,
    Settings,
    load_settings,
    validated_copy,
)
from kz_stream.consumers.learner import LearnerService
from kz_stream.producers.coder import CoderService
from kz_stream.producers.proposer import ProposerService
from kz_stream.producers.seeds import SEED_MODULES
from kz_stream.rl.options import TrainerOptions


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in list(os.environ):
        if name.upper().startswith("KZ_"):
            monkeypatch.delenv(name)
    yield


def remote(**changes: object) -> LLMConfig:
    """An engine behind a URL: building its backend connects to nothing."""
    return validated_copy(LLMConfig(kind="vllm-server", base_url="http://127.0.0.1:9"), **changes)


async def test_each_service_is_built_from_its_settings_section(tmp_path: Path) -> None:
    settings = Settings(
        database_url=f"sqlite+aiosqlite:///{tmp_path}/kz.sqlite3",
        bus_url=f"memory://{uuid.uuid4().hex}",
        proposer=ProposerSettings(llm=remote(max_tokens=33, seed=7), max_modules=3,
                                  synthesized_seeds=2),
        coder=CoderSettings(llm=remote(temperature=0.5), group_size=3, max_batch=2),
        learner=LearnerSettings(groups_per_step=2, rounds=3, coder_steps=5),
        log_level="WARNING",
    )
    async with open_context(settings) as ctx:
        proposer = service_by_name("proposer", ctx)
        coder = service_by_name("coder", ctx)
        learner = service_by_name("learner", ctx)
        assert isinstance(proposer, ProposerService) and isinstance(coder, CoderService)
        assert isinstance(learner, LearnerService)
        try:
            # The section itself, not a copy of some of its fields.
            assert proposer.config is settings.proposer
            assert coder.config is settings.coder
            assert learner.config is settings.learner
            # What is not a setting is resolved from one: seeds, sampling, the schedule.
            assert len(proposer.seed_modules) == len(SEED_MODULES) + 2
            # Synthesized first: the form the warm Coder learned, so early groups can score.
            assert proposer.seed_modules[2:] == SEED_MODULES
            assert (proposer.sampling.max_tokens, proposer.sampling.seed) == (33, 7)
            assert coder.sampling.temperature == 0.5
            schedule = learner.schedule.config
            assert (schedule.rounds, schedule.coder_steps, schedule.proposer_steps) == (3, 5, 20)
        finally:
            await proposer.backend.close()
            await coder.backend.close()


async def test_no_seed_modules_when_they_are_switched_off(tmp_path: Path) -> None:
    settings = Settings(
        database_url=f"sqlite+aiosqlite:///{tmp_path}/kz.sqlite3",
        bus_url=f"memory://{uuid.uuid4().hex}",
        proposer=ProposerSettings(llm=remote(), seed_modules=False),
    )
    async with open_context(settings) as ctx:
        proposer = service_by_name("proposer", ctx)
        assert isinstance(proposer, ProposerService)
        await proposer.backend.close()
    assert proposer.seed_modules == ()


def test_a_run_fills_only_the_learner_values_the_user_left_unset() -> None:
    run = RunOptions(group_size=2, groups_per_step=3)
    learner = run.apply(Settings()).learner
    assert (learner.learning_rate, learner.lora_r) == (1e-4, 8)
    assert (learner.micro_batches, learner.gradient_checkpointing) == (6, True)

    mine = Settings(learner=LearnerSettings(learning_rate=3e-5, micro_batches=1))
    learner = run.apply(mine).learner
    assert (learner.learning_rate, learner.lora_r, learner.micro_batches) == (3e-5, 8, 1)


def test_a_learning_rate_and_rank_from_the_environment_or_file_win(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "kz.toml"
    config.write_text("[learner]\nlora_r = 32\n")
    monkeypatch.setenv("KZ_LEARNER__LEARNING_RATE", "2e-6")
    learner = RunOptions().apply(load_settings(config)).learner
    assert (learner.learning_rate, learner.lora_r) == (2e-6, 32)
    # ... and still count as the user's after a second apply (kz run applies twice).
    again = RunOptions().apply(RunOptions().apply(load_settings(config))).learner
    assert (again.learning_rate, again.lora_r) == (2e-6, 32)


def test_every_value_a_run_changes_is_logged_and_a_replaced_setting_warned() -> None:
    settings = Settings(coder=CoderSettings(group_size=8),
                        learner=LearnerSettings(lora_r=4))
    options = RunOptions(group_size=2)
    with capture_logs() as logs:
        options.log_changes(settings, options.apply(settings))
    by_key = {e["key"]: e for e in logs if e["event"] == "run_settings"}
    assert by_key["coder.group_size"]["log_level"] == "warning"
    assert (by_key["coder.group_size"]["setting"], by_key["coder.group_size"]["run"]) == (8, 2)
    assert by_key["learner.learning_rate"]["log_level"] == "info"
    assert by_key["learner.learning_rate"]["run"] == 1e-4
    assert "default where none is set" in by_key["learner.learning_rate"]["reason"]
    assert "learner.lora_r" not in by_key  # the user's 4 stands: nothing changed


def test_a_gpu_run_trains_at_the_trainers_rate_and_rank_in_one_batch() -> None:
    learner = RunOptions(device="cuda", group_size=4).apply(Settings()).learner
    trainer = TrainerOptions()
    assert (learner.learning_rate, learner.lora_r) == (trainer.learning_rate, trainer.lora_r)
    assert (learner.micro_batches, learner.gradient_checkpointing) == (1, False)


def test_a_gpu_run_puts_many_modules_in_a_call_unless_the_user_said_otherwise() -> None:
    gpu = RunOptions(device="cuda", group_size=4).apply(Settings())
    assert (gpu.coder.max_batch, gpu.coder.llm.batch_size, gpu.coder.merge_waiting) == (
        16, 64, True)
    assert (gpu.proposer.concurrency, gpu.proposer.llm.batch_size) == (8, 16)
    assert gpu.proposer.max_ahead == 32  # two Coder calls' worth of modules
    # A call waits while two steps' worth of kernels (groups of 4) wait for verdicts.
    assert gpu.coder.max_unjudged == 2 * 4 * RunOptions().groups_per_step
    assert gpu.coder.llm.merge_adapter and gpu.proposer.llm.merge_adapter
    assert gpu.coder.llm.process and gpu.proposer.llm.process  # each engine apart: the GIL
    assert (gpu.learner.micro_batches, gpu.learner.gradient_checkpointing) == (1, False)

    mine = Settings(coder=CoderSettings(max_batch=2), proposer=ProposerSettings(concurrency=1))
    gpu = RunOptions(device="cuda", group_size=4).apply(mine)
    assert (gpu.coder.max_batch, gpu.coder.llm.batch_size) == (2, 64)
    assert gpu.proposer.concurrency == 1

    cpu = RunOptions().apply(Settings())
    assert (cpu.coder.max_batch, cpu.coder.llm.batch_size) == (
        Settings().coder.max_batch, Settings().coder.llm.batch_size)
    assert cpu.proposer.concurrency == Settings().proposer.concurrency
    assert cpu.coder.merge_waiting is False
    assert not cpu.coder.llm.merge_adapter
    assert not (cpu.coder.llm.process or cpu.proposer.llm.process)
    assert cpu.proposer.max_ahead is None
    assert cpu.coder.max_unjudged is None


def test_a_run_device_reaches_both_generators_and_only_them() -> None:
    applied = RunOptions(device="cuda:1").apply(Settings())
    assert applied.coder.llm.device == applied.proposer.llm.device == "cuda:1"
    assert RunOptions().apply(Settings()).coder.llm.device is None  # the settings' (CPU)


async def test_a_transformers_generator_gets_its_device_batch_size_and_cache(
    tmp_path: Path,
) -> None:
    pytest.importorskip("transformers")
    from kz_stream.llm import TransformersBackend

    settings = Settings(
        database_url=f"sqlite+aiosqlite:///{tmp_path}/kz.sqlite3",
        bus_url=f"memory://{uuid.uuid4().hex}",
        coder=CoderSettings(llm=LLMConfig(device="cpu", batch_size=3, kv_cache="static",
                                          gpu_memory_fraction=0.5)),  # no GPU: no cap
        warm_start=False,
        log_level="WARNING",
    )
    async with open_context(settings) as ctx:
        coder = service_by_name("coder", ctx)
        assert isinstance(coder.backend, TransformersBackend)
        try:
            backend = coder.backend
            assert (backend.device.type, backend._max_batch, backend._kv_cache) == (
                "cpu", 3, "static")
        finally:
            await coder.backend.close()
