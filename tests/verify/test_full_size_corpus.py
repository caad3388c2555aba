"""The full-size corpus through the verifier.

On the CPU (Triton interpreter) every honest kernel is checked at its small size and must be
correct; all of them run in the default run (about 80 s on 2 cores). The copy-ReLU cheat
must fail there too (the sign-mixed input set catches it); the losses' 0-dim outputs are
compared like any other.

On a GPU (``gpu`` marker, skipped without CUDA) every honest kernel runs at KernelBench's
published size and must be correct with a measured speedup, and every cheat must be caught
by its expected check.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kz_stream.testing.corpus.full_size import (
    FULL_SIZE_CHEATS,
    FULL_SIZE_HONEST,
    FULL_SIZE_PROBLEMS,
    input_bytes,
)
from kz_stream.verify import Candidate, Problem, Status, Verdict, Verifier, VerifierConfig


def _show(v: Verdict) -> str:
    return repr((v.status, v.check, v.reason, v.details.get("traceback")))[:2000]


def _verify(verifier: Verifier, problem: str, source: str, full: bool) -> Verdict:
    return verifier.verify_sync(Problem(FULL_SIZE_PROBLEMS[problem].source(full)),
                                Candidate(source, "triton"))


def test_corpus_covers_every_problem_once() -> None:
    assert set(FULL_SIZE_HONEST) == set(FULL_SIZE_PROBLEMS)
    assert len(FULL_SIZE_HONEST) >= 22
    categories = {p.category for p in FULL_SIZE_PROBLEMS.values()}
    assert categories >= {"loss", "reduction", "softmax", "activation", "norm", "matmul",
                          "fused_level2", "block_level3", "tuple_output", "bool_output"}
    for problem, _, checks in FULL_SIZE_CHEATS.values():
        assert problem in FULL_SIZE_PROBLEMS and checks


@pytest.mark.parametrize("name", sorted(FULL_SIZE_PROBLEMS))
def test_templates_render_at_both_sizes(name: str) -> None:
    problem = FULL_SIZE_PROBLEMS[name]
    for full in (True, False):
        assert "$" not in problem.source(full)
    assert input_bytes(problem, full=True) > 16 * input_bytes(problem, full=False)
    if problem.category == "activation":  # the largest level-1 inputs
        assert input_bytes(problem) == 4096 * 393216 * 4


@pytest.mark.parametrize("name", sorted(FULL_SIZE_HONEST))
def test_honest_small_on_cpu(cpu_verifier: Verifier, name: str) -> None:
    v = _verify(cpu_verifier, name, FULL_SIZE_HONEST[name], full=False)
    assert v.status is Status.CORRECT, _show(v)
    assert v.hardware["mode"] == "cpu" and "timing" in v.unchecked


def test_copy_relu_fails_on_cpu(cpu_verifier: Verifier) -> None:
    problem, source, checks = FULL_SIZE_CHEATS["copy_relu"]
    v = _verify(cpu_verifier, problem, source, full=False)
    assert v.status is not Status.CORRECT, _show(v)
    assert v.check in checks.split("|"), _show(v)


@pytest.fixture(scope="module")
def gpu_verifier() -> Iterator[Verifier]:
    v = Verifier(VerifierConfig())
    yield v
    v.close_sync()


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(FULL_SIZE_HONEST))
def test_honest_full_on_gpu(gpu_verifier: Verifier, name: str) -> None:
    v = _verify(gpu_verifier, name, FULL_SIZE_HONEST[name], full=True)
    print(f"\nRESULT full {name}: {v.status.value} speedup={v.speedup} ci={v.speedup_ci} "
          f"rel={v.max_rel_error} t={v.details.get('seconds')}")
    # Where the time went (a 6.4 GB activation took 130-170 s on the H200, 2026-12-06).
    print(f"STAGES full {name}: {v.details.get('stage_s')} "
          f"prepare={v.details.get('prepare_phases')}")
    assert v.status is Status.CORRECT, _show(v)
    assert v.speedup is not None and v.speedup > 0


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(FULL_SIZE_CHEATS))
def test_cheat_full_on_gpu(gpu_verifier: Verifier, name: str) -> None:
    problem, source, checks = FULL_SIZE_CHEATS[name]
    v = _verify(gpu_verifier, problem, source, full=True)
    print(f"\nRESULT full cheat {name}: {v.status.value} {v.check}: {(v.reason or '')[:160]}")
    assert v.status is not Status.CORRECT, _show(v)
    assert v.check in checks.split("|"), _show(v)
