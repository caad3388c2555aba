"""The learner data-parallel: one step on two processes (torchrun, gloo on the CPU) trains
on the same groups as one process would, with the same loss and the same LoRA update."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from benchmarks.bench_learner_multigpu import compare, make_groups, run

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]


@pytest.mark.parametrize("groups_n", [4, 3])  # 3: one process gets a filler group
def test_two_processes_take_the_step_one_process_takes(tmp_path: Path, groups_n: int) -> None:
    args = argparse.Namespace(model="tiny", model_dir=None, device="cpu", timed_steps=0,
                              micro_rows=4)
    groups = tmp_path / "groups.json"
    groups.write_text(json.dumps(make_groups("tiny", None, "cpu", groups_n, 4, 2)))

    results = {n: run(n, args, str(groups), tmp_path) for n in (1, 2)}

    assert results[2]["processes"] == 2 and len(results[2]["loss_per_process"]) == 2
    assert results[1]["samples"] == results[2]["samples"] == groups_n * 4
    diff = compare(results, tmp_path)[2]
    assert diff["loss_abs_diff"] < 1e-5, diff
    assert diff["grad_norm_rel_diff"] < 1e-4, diff
    assert diff["update_rel_diff"] < 1e-3, diff
    assert results[1]["grad_norm"] > 0  # the step did train
