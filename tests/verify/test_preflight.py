"""A Triton candidate's first look: decisive load and constructor errors are verdicts before
the problem is prepared; anything else goes on to the full verification."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kz_stream.testing.corpus.problems import PROBLEMS
from kz_stream.testing.corpus.triton_honest import TRITON_HONEST
from kz_stream.verify import Candidate, Problem, Status, Verifier, VerifierConfig

HEAD = "import torch\nimport torch.nn as nn\nimport triton\nimport triton.language as tl\n"


@pytest.fixture(scope="module")
def verifier() -> Iterator[Verifier]:
    v = Verifier(VerifierConfig(devices=[], prewarm=0, preflight="on"))
    yield v
    v.close_sync()


@pytest.mark.parametrize(("source", "check", "error"), [
    # The reference class is not in the candidate's file (the warm start did this on
    # KernelBench level 1).
    ("class ModelNew(nn.Module):\n    def __init__(self, in_f, out_f):\n"
     "        super().__init__()\n        self.inner = Model(in_f, out_f)\n"
     "    def forward(self, x):\n        return x\n",
     "construct", "NameError: name 'Model' is not defined"),
    ("class ModelNew(nn.Module):\n    def __init__(self, in_f, out_f, scale):\n"
     "        super().__init__()\n    def forward(self, x):\n        return x\n",
     "construct", "missing 1 required positional argument: 'scale'"),
    ("x = tl.log_density\nclass ModelNew(nn.Module):\n    pass\n",
     "load", "has no attribute 'log_density'"),
    ("class ModelNew(nn.Module):\n    def __init__(self, in_f, out_f):\n"
     "        super().__init__()\n        self.w = nn.Parameter(torch.empty(out_f, in_f))\n",
     "run", 'missing the required "forward" function'),
])
def test_decisive_errors_are_verdicts_without_preparing_the_problem(
        verifier: Verifier, source: str, check: str, error: str) -> None:
    v = verifier.verify_sync(Problem(PROBLEMS["linear_relu"]), Candidate(HEAD + source, "triton"))
    assert (v.status, v.check) == (Status.RUNTIME_ERROR, check), (v.check, v.reason)
    assert error in (v.reason or "") and "before the problem was prepared" in (v.reason or "")
    assert "prepare_s" not in v.details and v.details["preflight_s"] > 0


def test_a_device_dependent_error_is_left_to_the_full_verification(verifier: Verifier) -> None:
    # Fails on the meta device only because of where it runs: not decided early.
    source = HEAD + ("class ModelNew(nn.Module):\n    def __init__(self, in_f, out_f):\n"
                     "        super().__init__()\n        self.k = torch.ones(2).sum().item()\n"
                     "    def forward(self, x):\n        return x\n")
    v = verifier.verify_sync(Problem(PROBLEMS["linear_relu"]), Candidate(source, "triton"))
    assert "prepare_s" in v.details  # it went on to the problem's preparation
    assert v.status is not Status.CORRECT


def test_an_honest_candidate_passes_the_preflight_once_per_problem(
        verifier: Verifier) -> None:
    first, second = (verifier.verify_sync(Problem(PROBLEMS["relu"]),
                                          Candidate(TRITON_HONEST["relu"], "triton"))
                     for _ in range(2))
    assert first.status is second.status is Status.CORRECT, (first.reason, second.reason)
    assert first.details["preflight_s"] > 0 and "prepare_s" in first.details
    assert "preflight_s" not in second.details  # the problem is prepared: nothing to save
