"""Bad configuration is named: the key, its value, what was expected, and its source."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kz_stream.cli import app
from kz_stream.config import ConfigError, Settings, load_settings


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No KZ_* variable from the caller's shell."""
    for name in list(os.environ):
        if name.upper().startswith("KZ_"):
            monkeypatch.delenv(name)


def toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kz.toml"
    path.write_text(text)
    return path


def error_of(config: Path | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_settings(config)
    return str(info.value)


def test_a_typo_in_a_toml_section_is_an_unknown_key_with_a_suggestion(tmp_path: Path) -> None:
    path = toml(tmp_path, "[learner]\nlora_rr = 4\n")
    msg = error_of(path)
    assert msg == f"learner.lora_rr = 4 (in {path}): unknown key; did you mean 'lora_r'?"


def test_a_top_level_typo_is_an_unknown_key(tmp_path: Path) -> None:
    msg = error_of(toml(tmp_path, 'databse_url = "sqlite+aiosqlite:///x.db"\n'))
    assert msg.startswith("databse_url = 'sqlite+aiosqlite:///x.db' (in ")
    assert "did you mean 'database_url'?" in msg


def test_a_wrong_type_in_toml_names_key_value_expectation_and_file(tmp_path: Path) -> None:
    path = toml(tmp_path, '[learner]\nlora_r = "many"\n')
    msg = error_of(path)
    assert msg.startswith(f"learner.lora_r = 'many' (in {path}): expected a valid integer")


def test_several_problems_are_two_lines(tmp_path: Path) -> None:
    msg = error_of(toml(tmp_path, "[coder]\ngroup_size = 0\n[learner]\nrounds = 0\n"))
    first, second = msg.splitlines()
    assert first.startswith("coder.group_size = 0 (in ")
    assert second == "also invalid: learner.rounds"


def test_a_bad_environment_variable_is_named_and_wins_over_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = toml(tmp_path, "[learner]\nlora_r = 8\n")
    monkeypatch.setenv("KZ_LEARNER__LORA_R", "0")
    msg = error_of(path)
    assert msg == (
        "learner.lora_r = '0' (environment variable KZ_LEARNER__LORA_R): "
        "expected greater than or equal to 1"
    )


def test_an_unknown_nested_environment_variable_is_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KZ_CODER__GROUPSIZE", "3")
    msg = error_of()
    assert msg.startswith("coder.groupsize = '3' (environment variable KZ_CODER__GROUPSIZE)")
    assert "did you mean 'group_size'?" in msg


def test_a_file_that_is_not_toml_is_named(tmp_path: Path) -> None:
    path = toml(tmp_path, "[learner\nlora_r = 4\n")
    assert error_of(path).startswith(f"{path}: not valid TOML")


def test_good_settings_still_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KZ_CODER__GROUP_SIZE", "3")
    settings = load_settings(toml(tmp_path, "[learner]\nlora_r = 4\n"))
    assert settings.learner.lora_r == 4 and settings.coder.group_size == 3


def test_the_cli_prints_the_named_key_on_one_line_not_a_validation_error(
    tmp_path: Path,
) -> None:
    path = toml(tmp_path, "[learner]\nlora_r = -3\n")
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("KZ_")}
    out = subprocess.run(
        [sys.executable, "-m", "kz_stream.cli", "db", "upgrade", "--config", str(path)],
        capture_output=True, text=True, env={**env, "COLUMNS": "300"}, timeout=120,
    )
    assert out.returncode == 1
    assert out.stderr.strip() == (
        f"error: config: learner.lora_r = -3 (in {path}): expected greater than or equal to 1"
    )


def test_a_bad_command_line_option_names_option_and_value() -> None:
    result = CliRunner().invoke(app, ["train", "--lora-r", "0"])
    assert result.exit_code == 1
    assert "--lora-r = 0 (command line): expected greater than or equal to 1" in result.output


def test_verifier_settings_reach_the_verifier(monkeypatch: pytest.MonkeyPatch) -> None:
    from kz_stream.app import make_verifier

    assert make_verifier(Settings()).config.candidates_per_gpu == 3  # unset: the default
    monkeypatch.setenv("KZ_VERIFIER__DEVICES", "[]")
    monkeypatch.setenv("KZ_VERIFIER__CANDIDATES_PER_GPU", "12")
    monkeypatch.setenv("KZ_VERIFIER__TIMING", "false")
    config = make_verifier(load_settings(None)).config
    assert (list(config.devices or []), config.candidates_per_gpu, config.timing) == ([], 12, False)


def test_candidates_per_gpu_below_one_is_refused(tmp_path: Path) -> None:
    path = toml(tmp_path, "[verifier]\ncandidates_per_gpu = 0\n")
    assert "verifier.candidates_per_gpu = 0" in error_of(path)


def test_the_config_file_is_read_for_that_load_only_never_through_the_environment(
    tmp_path: Path,
) -> None:
    path = toml(tmp_path, "[learner]\nlora_r = 4\n")
    before = dict(os.environ)
    assert load_settings(path).learner.lora_r == 4
    assert dict(os.environ) == before
    assert load_settings().learner.lora_r == Settings().learner.lora_r  # no file now
    assert Settings().learner.lora_r == 16  # a bare Settings() reads no file either


def test_kz_config_file_names_the_file_when_no_argument_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KZ_CONFIG_FILE", str(toml(tmp_path, "[coder]\ngroup_size = 5\n")))
    assert load_settings().coder.group_size == 5
    other = tmp_path / "other"
    other.mkdir()
    assert load_settings(toml(other, "[coder]\ngroup_size = 6\n")).coder.group_size == 6
    monkeypatch.setenv("KZ_CONFIG_FILE", str(tmp_path / "missing.toml"))
    assert error_of() == f"config file {tmp_path / 'missing.toml'} does not exist (KZ_CONFIG_FILE)"


def test_every_verifier_knob_is_a_setting_the_verifier_gets(tmp_path: Path) -> None:
    from kz_stream.app import make_verifier

    path = toml(tmp_path, "[verifier]\ncall_timeout_s = 7.5\nl2_flush = \"read\"\n"
                          "l2_flush_factor = 4\nmin_input_sets = 3\nstrong_isolation = false\n")
    config = make_verifier(load_settings(path)).config
    assert (config.call_timeout_s, config.l2_flush, config.l2_flush_factor) == (7.5, "read", 4)
    assert (config.min_input_sets, config.strong_isolation) == (3, False)
    assert config == load_settings(path).verifier  # the settings section is the config


@pytest.mark.parametrize(("text", "named"), [
    ('l2_flush = "flush"', "verifier.l2_flush = 'flush'"),
    ("worker_memory_fraction = 1.5", "verifier.worker_memory_fraction = 1.5"),
    ("devices = [-1]", "verifier.devices.0 = -1"),
    ("call_timeout_s = 0", "verifier.call_timeout_s = 0"),
    ("prewarm = 0\nprewarmed = 1", "verifier.prewarmed = 1"),
])
def test_a_bad_verifier_knob_is_named(tmp_path: Path, text: str, named: str) -> None:
    assert named in error_of(toml(tmp_path, f"[verifier]\n{text}\n"))


def test_max_rounds_below_min_rounds_is_refused(tmp_path: Path) -> None:
    msg = error_of(toml(tmp_path, "[verifier]\nmin_rounds = 8\nmax_rounds = 4\n"))
    assert "max_rounds 4 is below min_rounds 8" in msg


def test_the_verifiers_devices_are_those_named_or_every_visible_gpu() -> None:
    import torch

    from kz_stream.verify import VerifierConfig

    assert VerifierConfig(devices=[]).device_ids() == []  # the CPU path
    assert VerifierConfig(devices=[1, 0]).device_ids() == [1, 0]
    visible = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    assert VerifierConfig().device_ids() == visible


def test_a_validated_copy_keeps_what_the_user_set_marked_as_set() -> None:
    from kz_stream.config import LearnerSettings, validated_copy

    copy = validated_copy(LearnerSettings(lora_r=4), rounds=2)
    assert copy.model_fields_set == {"lora_r", "rounds"}
    with pytest.raises(ValueError, match="lora_r"):
        validated_copy(copy, lora_r=0)


def test_quiet_commands_log_warnings_unless_the_user_chose_a_level(tmp_path: Path) -> None:
    from kz_stream.cli import _settings

    assert _settings(None, quiet=True).log_level == "WARNING"
    assert _settings(None).log_level == "INFO"
    path = toml(tmp_path, 'log_level = "INFO"\n')
    assert _settings(path, quiet=True).log_level == "INFO"


def test_the_proposer_samples_cooler_than_the_coder_unless_told_otherwise() -> None:
    settings = Settings()
    assert settings.proposer.llm.temperature == 0.5
    assert settings.coder.llm.temperature == 1.0
    told = Settings.model_validate({"proposer": {"llm": {"temperature": 0.9}}})
    assert told.proposer.llm.temperature == 0.9


def test_each_roles_own_defaults_hold_where_its_llm_settings_leave_them_out(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The Proposer's temperature 0.5 and the Coder's cap of 1280 tokens are defaults: an
    ``llm`` table or variable that sets something else keeps them, and they do not count
    as the user's (``kz run`` warns only where it replaces the user's values)."""
    monkeypatch.setenv("KZ_CODER__LLM__TEMPERATURE", "0.7")
    settings = Settings.model_validate({"proposer": {"llm": {"max_tokens": 300}}})
    assert (settings.proposer.llm.temperature, settings.proposer.llm.max_tokens) == (0.5, 300)
    assert settings.coder.llm.max_tokens == 1280 and settings.coder.llm.temperature == 0.7
    assert "temperature" not in settings.proposer.llm.model_fields_set
    assert "max_tokens" not in settings.coder.llm.model_fields_set
    assert Settings.model_validate(
        {"coder": {"llm": {"max_tokens": 99}}}).coder.llm.max_tokens == 99


def test_cpus_is_a_list_of_cores_and_ranges() -> None:
    assert Settings(cpus="0-2,5").cpu_set == {0, 1, 2, 5}
    assert Settings(cpus="3").cpu_set == {3}
    assert Settings().cpu_set is None
    for bad in ("0-", "a", "1;2", "1,,2", "5-2"):
        with pytest.raises(ValueError):
            Settings(cpus=bad)


def test_services_run_on_the_cores_cpus_names_and_so_do_the_processes_they_start(
    tmp_path: Path,
) -> None:
    script = """
import asyncio, multiprocessing, os
from kz_stream.app import open_context
from kz_stream.config import load_settings, usable_cpus

def child(q):
    q.put(sorted(os.sched_getaffinity(0)))

async def main():
    async with open_context(load_settings()):
        print(sorted(os.sched_getaffinity(0)))
        print(usable_cpus())  # what pools are sized from
        q = multiprocessing.get_context("spawn").Queue()
        p = multiprocessing.get_context("spawn").Process(target=child, args=(q,))
        p.start(); print(q.get()); p.join()

if __name__ == "__main__":
    asyncio.run(main())
"""
    (tmp_path / "pin.py").write_text(script)
    core = max(os.sched_getaffinity(0))
    env = {**os.environ, "KZ_CPUS": str(core),
           "KZ_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path}/kz.sqlite3"}
    out = subprocess.run([sys.executable, str(tmp_path / "pin.py")], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:3] == [f"[{core}]", "1", f"[{core}]"]

    env["KZ_CPUS"] = "4096"
    out = subprocess.run([sys.executable, str(tmp_path / "pin.py")], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "cpus = 4096: cannot run on those cores here" in out.stderr


def test_a_kl_anchor_reaches_the_trainer_and_needs_lora(tmp_path: Path) -> None:
    settings = load_settings(toml(tmp_path, "[learner]\nkl_beta = 0.04\n"))
    assert settings.learner.trainer_options()["kl_beta"] == 0.04
    msg = error_of(toml(tmp_path, "[learner]\nkl_beta = 0.04\nfull_finetune = true\n"))
    assert "kl_beta needs LoRA" in msg


def test_a_run_id_longer_than_the_stores_column_is_refused_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL refuses a correlation id over 200 characters (SQLite keeps it): caught
    in the settings, not as every event of the run dead-lettered."""
    monkeypatch.setenv("KZ_RUN_ID", "r" * 201)
    msg = error_of(toml(tmp_path, ""))
    assert msg.startswith("run_id = 'rrr") and msg.endswith(
        "(environment variable KZ_RUN_ID): string should have at most 200 characters")
