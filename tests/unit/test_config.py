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
    """No KZ_* variable from the caller's shell; load_settings' KZ_CONFIG_FILE is undone."""
    for name in list(os.environ):
        if name.upper().startswith("KZ_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("KZ_CONFIG_FILE", "")


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
