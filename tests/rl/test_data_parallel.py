"""The learner data-parallel: one step on two processes (torchrun, gloo on the CPU) trains
on the same groups as one process would, with the same loss and the same LoRA update."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kz_stream.testing.data_parallel import NCCL_ENV, compare, make_groups, run

ROOT = Path(__file__).resolve().parents[2]

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


def test_a_failed_policy_write_fails_every_process_and_the_next_save_works(
        tmp_path: Path) -> None:
    """The main process writes the policy; when it cannot, every process gets an error
    (none waits for ever), and the processes stay in step for the next save."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = tmp_path / "outcome"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "tests.rl.save_policy_worker", str(out), str(blocker / "policies"),
           str(tmp_path / "policies")]
    env = dict(os.environ, **NCCL_ENV, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    main, other = (json.loads(Path(f"{out}-{rank}.json").read_text()) for rank in (0, 1))
    assert main[0].startswith(("NotADirectoryError", "FileExistsError")), main
    assert other[0].startswith("RuntimeError: the main process could not write"), other
    assert main[1] == other[1] == "saved"
