"""The command line: settings given on it are validated before anything starts."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from kz_stream.cli import app


@pytest.mark.parametrize(("args", "named"), [
    (["--lora-r", "0"], "--lora-r"),
    (["--rounds", "-1"], "--rounds"),
    (["--groups-per-step", "0"], "--groups-per-step"),
    (["--learning-rate", "0"], "--learning-rate"),
    (["--steps-per-turn", "-2"], "--steps-per-turn"),
    (["--role", "critic"], "critic"),
])
def test_train_rejects_an_impossible_setting_naming_the_option(
        args: list[str], named: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def started(*_: object) -> None:
        raise AssertionError("the learner started with an impossible setting")

    monkeypatch.setattr("kz_stream.app.run_named_services", started)
    result = CliRunner().invoke(app, ["train", *args])
    assert result.exit_code == 1, result.output  # the CLI's one-line error
    assert named in result.output
