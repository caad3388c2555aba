"""Decoy ablation must not inherit right values from freed memory: an output the disabled
kernel would have written is filled, so an honest kernel is never called a decoy."""

from __future__ import annotations

import random
import subprocess
import sys

from kz_stream.verify import Candidate, Problem, Status, Verifier
from kz_stream.warmstart.synth import synthesize
from kz_stream.warmstart.teacher import lower

NEW_MEMORY = """
import torch
from kz_stream.verify._harness import uninitialized_is_nan
right = torch.randn(32, 128)
del right  # a freed block of the output's size, holding values
with uninitialized_is_nan():
    out = torch.empty(32, 128)
    ints = torch.empty(4, dtype=torch.int64)
assert out.isnan().all(), out
assert (ints == torch.iinfo(torch.int64).max).all(), ints
assert not torch.are_deterministic_algorithms_enabled()  # restored afterwards
print("ok")
"""


def test_new_outputs_during_ablation_are_filled_not_inherited() -> None:
    done = subprocess.run([sys.executable, "-c", NEW_MEMORY], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]


def test_an_honest_small_softmax_is_correct_not_a_decoy(cpu_verifier: Verifier) -> None:
    # The teacher's softmax on 32 x 128 was judged decoy_kernel once in 444 CPU verdicts.
    module = synthesize(["torch.softmax"], random.Random(0)).source
    module = module.replace("batch_size = ", "batch_size = 32  # ").replace(
        "features = ", "features = 128  # ")
    verdicts = [cpu_verifier.verify_sync(Problem(module), Candidate(lower(module), "triton"))
                for _ in range(3)]
    assert [v.status for v in verdicts] == [Status.CORRECT] * 3, [v.reason for v in verdicts]
