"""The verifier on a GPU: honest kernels pass with a speedup, every cheat is caught.

Run on the H200 (results recorded in docs/verifier.md); skipped without CUDA.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kz_stream.testing.corpus.cheats import CHEATS, RUNTIME_CHECKS
from kz_stream.testing.corpus.cuda_honest import CUDA_HONEST
from kz_stream.testing.corpus.problems import PROBLEMS
from kz_stream.testing.corpus.triton_honest import TRITON_HONEST
from kz_stream.verify import Candidate, Problem, Status, Verifier, VerifierConfig

pytestmark = pytest.mark.gpu



@pytest.fixture(scope="module")
def gpu_verifier() -> Iterator[Verifier]:
    v = Verifier(VerifierConfig())
    yield v
    v.close_sync()


@pytest.fixture(scope="module")
def gpu_verifier_runtime_only() -> Iterator[Verifier]:
    v = Verifier(VerifierConfig(static_scan=False))
    yield v
    v.close_sync()


def _show(v: object) -> str:
    return repr(v)[:1500]


@pytest.mark.parametrize("name", sorted(TRITON_HONEST))
def test_honest_triton(gpu_verifier: Verifier, name: str) -> None:
    v = gpu_verifier.verify_sync(Problem(PROBLEMS[name]), Candidate(TRITON_HONEST[name], "triton"))
    print(f"\nRESULT triton {name}: {v.status.value} speedup={v.speedup} ci={v.speedup_ci} "
          f"rel={v.max_rel_error} share={v.details.get('own_device_share')} "
          f"t={v.details.get('seconds')}")
    assert v.status is Status.CORRECT, _show(v)
    assert v.speedup is not None and v.speedup_ci is not None
    assert v.speedup_ci[0] <= v.speedup <= v.speedup_ci[1]


@pytest.mark.parametrize("name", sorted(CUDA_HONEST))
def test_honest_cuda(gpu_verifier: Verifier, name: str) -> None:
    v = gpu_verifier.verify_sync(Problem(PROBLEMS[name]), Candidate(CUDA_HONEST[name], "cuda"))
    print(f"\nRESULT cuda {name}: {v.status.value} speedup={v.speedup} ci={v.speedup_ci} "
          f"rel={v.max_rel_error} builds={v.details.get('builds')} t={v.details.get('seconds')}")
    assert v.status is Status.CORRECT, _show(v)
    assert v.speedup is not None


@pytest.mark.parametrize("name", sorted(CHEATS))
def test_cheat(gpu_verifier: Verifier, name: str) -> None:
    problem, backend, src, checks, _ = CHEATS[name]
    v = gpu_verifier.verify_sync(Problem(PROBLEMS[problem]), Candidate(src, backend))  # type: ignore[arg-type]
    print(f"\nRESULT cheat {name}: {v.status.value} {v.check}: {(v.reason or '')[:120]}")
    assert v.status in (Status.HACK, Status.INCORRECT), _show(v)
    assert v.check in checks, _show(v)


@pytest.mark.parametrize("name", sorted(RUNTIME_CHECKS))
def test_cheat_runtime_layer(gpu_verifier_runtime_only: Verifier, name: str) -> None:
    problem, backend, src, _, _ = CHEATS[name]
    v = gpu_verifier_runtime_only.verify_sync(Problem(PROBLEMS[problem]),
                                              Candidate(src, backend))  # type: ignore[arg-type]
    print(f"\nRESULT runtime {name}: {v.status.value} {v.check}: {(v.reason or '')[:120]}")
    assert v.status in (Status.HACK, Status.INCORRECT), _show(v)
    assert v.check in RUNTIME_CHECKS[name], _show(v)


def test_timed_calls_rotate_output_blocks() -> None:
    """Each timed call writes a different output block, as it reads a different input set;
    without rotation the allocator hands every call the same block."""
    import torch

    from kz_stream.verify._timing import L2Flusher, timed_calls

    sets = [[torch.randn(1 << 16, device="cuda")] for _ in range(4)]
    seen: dict[bool, set[int]] = {True: set(), False: set()}
    for rotate in (True, False):
        def call(args: object, rotate: bool = rotate) -> torch.Tensor:
            out = torch.relu(args[0])  # type: ignore[index]
            seen[rotate].add(out.data_ptr())
            return out

        timed_calls(call, sets, 12, L2Flusher(torch.device("cuda")), rotate_outputs=rotate)
    assert len(seen[True]) >= len(sets)
    assert len(seen[False]) == 1


def test_timed_calls_hold_at_most_a_gibibyte_of_outputs() -> None:
    """Big outputs are not held to rotate blocks: both sides would need the memory."""
    import torch

    from kz_stream.verify._timing import L2Flusher, timed_calls

    sets = [[torch.randn(1, device="cuda")] for _ in range(4)]
    seen: set[int] = set()

    def call(args: object) -> torch.Tensor:
        out = torch.empty(600 << 20, dtype=torch.uint8, device="cuda")  # 600 MiB
        seen.add(out.data_ptr())
        return out

    timed_calls(call, sets, 8, L2Flusher(torch.device("cuda")))
    assert len(seen) == 2  # one held (4 would be 2.4 GiB), one new
