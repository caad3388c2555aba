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
    # Its timing sets past its checks' came from the timing room, given back at its end.
    assert v.details["timing_room_bytes"] >= 0
    assert gpu_verifier.occupancy()["lanes"][0]["timing_room_bytes"] == 0


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


# ---- the compiled baseline (VerifierConfig.compiled_baseline) ------------------------------


@pytest.fixture(scope="module")
def gpu_verifier_compiled() -> Iterator[Verifier]:
    v = Verifier(VerifierConfig(compiled_baseline=True))
    yield v
    v.close_sync()


def test_compiled_baseline_on_an_honest_triton_kernel(gpu_verifier_compiled: Verifier) -> None:
    """The first timed candidate of a problem has the reference compiled and timed against
    eager; the next candidate of the problem gets the same (cached) baseline."""
    name = "gelu_scale"  # init args (the scale) and a fusion for Inductor
    problem, candidate = Problem(PROBLEMS[name]), Candidate(TRITON_HONEST[name], "triton")
    v = gpu_verifier_compiled.verify_sync(problem, candidate)
    d = v.details
    print(f"\nRESULT compiled baseline {name}: {v.status.value} speedup={v.speedup} "
          f"compile_speedup={d.get('compile_speedup')} ci={d.get('compile_speedup_ci')} "
          f"vs_compile={d.get('speedup_vs_compile')} timing={d.get('timing')} "
          f"baseline={d.get('compiled_baseline')} error={d.get('compiled_baseline_error')} "
          f"stage_s={d.get('stage_s')}")
    assert v.status is Status.CORRECT, _show(v)
    assert "compiled_baseline_error" not in d, d.get("compiled_baseline_error")
    assert d["timing"]["compiled_reference_ms"] > 0
    assert d["compile_speedup"] > 0
    lo, hi = d["compile_speedup_ci"]
    assert 0 < lo <= hi
    assert v.speedup is not None and d["speedup_vs_compile"] > 0
    assert d["speedup_vs_compile"] == pytest.approx(v.speedup / d["compile_speedup"])
    again = gpu_verifier_compiled.verify_sync(problem, candidate)
    assert again.status is Status.CORRECT, _show(again)
    assert again.details["compile_speedup"] == d["compile_speedup"]  # measured once
    assert again.details["timing"]["compiled_reference_ms"] == d["timing"]["compiled_reference_ms"]


def test_compiled_baseline_failure_keeps_the_verdict() -> None:
    """A reference torch.compile refuses (here: a mode it does not know) leaves the verdict
    and its speedup over eager as they are, with compiled_baseline_error beside them."""
    v = Verifier(VerifierConfig(compiled_baseline=True, compile_mode="no-such-mode"))
    try:
        r = v.verify_sync(Problem(PROBLEMS["relu"]), Candidate(TRITON_HONEST["relu"], "triton"))
    finally:
        v.close_sync()
    print(f"\nRESULT compiled baseline failure: {r.status.value} speedup={r.speedup} "
          f"error={r.details.get('compiled_baseline_error')}")
    assert r.status is Status.CORRECT, _show(r)
    assert r.speedup is not None and r.speedup_ci is not None
    assert "no-such-mode" in r.details["compiled_baseline_error"]
    assert "speedup_vs_compile" not in r.details and "compile_speedup" not in r.details
    assert "compiled_reference_ms" not in r.details["timing"]


def test_workers_hand_big_outputs_over_by_device_handle() -> None:
    """With ``output_handles``, an outer product's 1.6 GB output goes from worker to
    verifier device to device, and the verdict is the same."""
    from tests.verify.test_verifier_cpu import OUTER, OUTER_TRITON

    v = Verifier(VerifierConfig(output_handles=True))
    try:
        first = v.verify_sync(Problem(OUTER), Candidate(OUTER_TRITON, "triton"))
    finally:
        v.close_sync()
    print(f"\nRESULT handles: {first.status.value} speedup={first.speedup} "
          f"by handle={first.details.get('outputs_by_handle')} "
          f"stage_s={first.details.get('stage_s')}")
    assert first.status is Status.CORRECT, _show(first)
    assert first.details["outputs_by_handle"] > 0


def test_a_verifier_with_no_room_for_an_output_by_handle_says_it_is_its_own_failure() -> None:
    """When the verifier's process cannot hold its copy of an output that came by handle
    (here its own allocator is capped under the outer product's 1.6 GB), the verdict is
    ``infra_error`` / ``device_memory`` (retried, then given up), never the candidate's."""
    import torch

    from tests.verify.test_verifier_cpu import OUTER, OUTER_TRITON

    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((1 << 30) / total, 0)
    v = Verifier(VerifierConfig(output_handles=True))
    try:
        r = v.verify_sync(Problem(OUTER), Candidate(OUTER_TRITON, "triton"))
    finally:
        v.close_sync()
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
    print(f"\nRESULT handle copy without room: {r.status.value} {r.check}: "
          f"{(r.reason or '')[:200]}")
    assert (r.status, r.check) == (Status.INFRA_ERROR, "device_memory"), _show(r)
    assert "verifier's copy" in (r.reason or ""), _show(r)
