"""Loading KernelBench-format suites that the test writes."""

from __future__ import annotations

from pathlib import Path

import pytest

from kz_stream.evaluation import load_suite, problem_interface_error

PROBLEM = """\
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return torch.relu(x) * {scale}


def get_inputs():
    return [torch.randn(16, 32)]


def get_init_inputs():
    return []
"""


def write(folder: Path, name: str, text: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(text)


def test_level_folder_in_kernelbench_order(tmp_path: Path) -> None:
    level = tmp_path / "level1"
    for name in ("10_Ten.py", "2_Two.py", "1_One.py"):
        write(level, name, PROBLEM.format(scale=2))
    write(level, "__init__.py", "")
    write(level, "3_Broken.py", "import torch\n\ndef get_inputs():\n    return []\n")
    suite = load_suite(level)
    assert [p.problem_id for p in suite.problems] == ["level1/1_One", "level1/2_Two",
                                                      "level1/10_Ten"]
    assert {p.level for p in suite.problems} == {1}
    assert suite.problems[0].source == PROBLEM.format(scale=2)
    [(path, why)] = suite.skipped
    assert path.name == "3_Broken.py" and "Model" in why and "get_init_inputs" in why
    assert [p.name for p in load_suite(level, match="1*").problems] == ["1_One", "10_Ten"]
    assert [p.name for p in load_suite(level, limit=1).problems] == ["1_One"]


def test_level_option_and_root_of_levels(tmp_path: Path) -> None:
    write(tmp_path / "mine", "1_A.py", PROBLEM.format(scale=1))
    assert load_suite(tmp_path / "mine").problems[0].problem_id == "1_A"
    assert load_suite(tmp_path / "mine", level=3).problems[0].problem_id == "level3/1_A"
    root = tmp_path / "KernelBench"
    write(root / "level2", "1_B.py", PROBLEM.format(scale=2))
    write(root / "level1", "1_A.py", PROBLEM.format(scale=1))
    assert [p.problem_id for p in load_suite(root).problems] == ["level1/1_A", "level2/1_B"]


def test_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_suite(tmp_path / "absent")
    write(tmp_path / "empty", "notes.py", "x = 1\n")
    with pytest.raises(ValueError, match="no KernelBench-format problems"):
        load_suite(tmp_path / "empty")
    assert problem_interface_error("def (:\n") is not None
    assert problem_interface_error(PROBLEM.format(scale=1)) is None
    # Two folders of one level under a root: one id twice, which would share kernels.
    for folder in ("level1", "old_level1"):
        write(tmp_path / "twice" / folder, "1_A.py", PROBLEM.format(scale=1))
    with pytest.raises(ValueError, match=r"1 problem ids stand twice .* \(level1/1_A, "):
        load_suite(tmp_path / "twice")


def test_generation_fills_a_local_models_batch() -> None:
    from kz_stream.evaluation import EvalOptions

    # One sample per problem: 128 problems at once make a batch of 128, not of 14.
    assert EvalOptions(run_id="r", samples=1, batch_size=128,
                       concurrency=14).generation_slots == 128
    # Ten samples per problem: 64 problems already fill a batch of 640.
    assert EvalOptions(run_id="r", samples=10, batch_size=640,
                       concurrency=64).generation_slots == 64
    assert EvalOptions(run_id="r", samples=10, batch_size=8,
                       concurrency=4).generation_slots == 4
    assert EvalOptions(run_id="r", samples=3, batch_size=8,
                       concurrency=1).generation_slots == 3
