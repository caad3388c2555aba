"""The verifier's CPU path: Triton through the interpreter, CUDA compile-checked, and the
cheats it can catch without a GPU."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any

import pytest

from kz_stream.events import KernelVerified
from kz_stream.testing.corpus.cheats import CHEATS, RUNTIME_CHECKS
from kz_stream.testing.corpus.cuda_honest import CUDA_HONEST
from kz_stream.testing.corpus.problems import PROBLEMS
from kz_stream.testing.corpus.triton_honest import TRITON_HONEST
from kz_stream.verify import Candidate, Problem, Status, Verifier, VerifierConfig
from kz_stream.verify._checks import interpreter_fault

# Every cheat the CPU path can catch (statically, or at run time through the interpreter).
CPU_CHEATS = [n for n, c in CHEATS.items() if c[4] == "cpu"]
# The run-time layer's cheats that need no GPU (the others use CUDA streams or builds).
RUNTIME = ["fallback_runtime", "fallback_alias", "thread_runtime", "monkeypatch_runtime",
           "monkeypatch_event", "tf32_flag"]


@pytest.mark.parametrize("name", ["relu", "softmax", "linear_relu"])
def test_honest_triton_correct(cpu_verifier: Verifier, name: str) -> None:
    v = cpu_verifier.verify_sync(Problem(PROBLEMS[name]), Candidate(TRITON_HONEST[name], "triton"))
    assert v.status is Status.CORRECT, (v.check, v.reason, v.details.get("traceback"))
    assert v.speedup is None and "timing" in v.unchecked
    assert v.max_rel_error is not None and v.max_rel_error < 1e-5
    assert v.hardware["mode"] == "cpu" and v.verifier_version


@pytest.mark.parametrize("name", CPU_CHEATS)
def test_cheat_caught(cpu_verifier: Verifier, name: str) -> None:
    problem, backend, src, checks, _ = CHEATS[name]
    v = cpu_verifier.verify_sync(Problem(PROBLEMS[problem]), Candidate(src, backend))  # type: ignore[arg-type]
    assert v.status in (Status.HACK, Status.INCORRECT), (name, v.status, v.reason)
    assert v.check in checks, (name, v.check, v.reason)


@pytest.mark.parametrize("name", RUNTIME)
def test_cheat_caught_at_run_time(cpu_verifier_runtime_only: Verifier, name: str) -> None:
    problem, backend, src, _, _ = CHEATS[name]
    v = cpu_verifier_runtime_only.verify_sync(Problem(PROBLEMS[problem]), Candidate(src, backend))  # type: ignore[arg-type]
    assert v.status is Status.HACK, (name, v.status, v.reason)
    assert v.check in RUNTIME_CHECKS[name], (name, v.check, v.reason)


def test_syntax_error_is_compile_error(cpu_verifier: Verifier) -> None:
    v = cpu_verifier.verify_sync(Problem(PROBLEMS["relu"]), Candidate("def (:", "triton"))
    assert v.status is Status.COMPILE_ERROR


def test_a_reply_without_model_new_fails_before_the_problem_is_prepared(
        cpu_verifier: Verifier) -> None:
    prose = "import triton\n\n\ndef add(x):\n    return x\n"  # parses; no ModelNew
    v = cpu_verifier.verify_sync(Problem(PROBLEMS["relu"]), Candidate(prose, "triton"))
    assert (v.status, v.check, v.reason) == (Status.RUNTIME_ERROR, "load",
                                             "load: source does not define ModelNew")
    assert "prepare_s" not in v.details  # no oracle, no worker


def test_the_interpreter_self_check_passes_on_a_sound_interpreter() -> None:
    # The worker's check, run as a CPU worker runs it (the interpreter is chosen at import).
    code = ("import os; os.environ['TRITON_INTERPRET'] = '1'\n"
            "from kz_stream.verify._worker import interpreter_defect\n"
            "print(repr(interpreter_defect()))\n")
    out = subprocess.run([sys.executable, "-c", code, "0", "cpu"], capture_output=True,
                         text=True, timeout=300, cwd=tempfile.mkdtemp())
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "None", out.stdout


def test_only_the_self_checks_own_error_is_the_hosts_fault() -> None:
    # As seen on the H200 host's CPU path (Triton 3.6, NumPy 2.5).
    defect = "TypeError: only 0-dimensional arrays can be converted to Python scalars"
    seen = ("run on input set 0 (own): TypeError: only 0-dimensional arrays can be "
            "converted to Python scalars")
    assert interpreter_fault(defect, seen)
    assert not interpreter_fault(defect, "run on input set 0 (own): IndexError: out of range")
    assert not interpreter_fault(None, seen) and not interpreter_fault("", seen)


def test_runtime_error(cpu_verifier: Verifier) -> None:
    src = TRITON_HONEST["relu"].replace(
        "y = torch.empty_like(x)", "y = torch.empty_like(x)\n        raise RuntimeError('boom')"
    )
    v = cpu_verifier.verify_sync(Problem(PROBLEMS["relu"]), Candidate(src, "triton"))
    assert v.status is Status.RUNTIME_ERROR and "boom" in (v.reason or "")


def test_hang_is_timeout() -> None:
    from kz_stream.verify import VerifierConfig

    v = Verifier(VerifierConfig(devices=[], call_timeout_s=5, prewarm=0))
    try:
        src = TRITON_HONEST["relu"].replace("x = x.contiguous()", "while True: pass")
        out = v.verify_sync(Problem(PROBLEMS["relu"]), Candidate(src, "triton"))
        assert out.status is Status.TIMEOUT, out.reason
    finally:
        v.close_sync()


def test_a_worker_over_its_host_memory_allowance_is_out_of_memory() -> None:
    """A candidate that holds more host memory than its allowance (the prepared problem's
    bytes and the margin) is stopped by the verifier's watch, not the host's OOM killer,
    and the verdict says so; an honest candidate under the same allowance passes."""
    from kz_stream.verify import VerifierConfig

    margin = 2 << 30
    v = Verifier(VerifierConfig(devices=[], prewarm=0, worker_host_margin_bytes=margin))
    try:
        problem = Problem(PROBLEMS["relu"])
        honest = v.verify_sync(problem, Candidate(TRITON_HONEST["relu"], "triton"))
        assert honest.status is Status.CORRECT, honest.reason
        hog = TRITON_HONEST["relu"].replace(  # 3 GiB of touched pages, kept
            "x = x.contiguous()",
            "_HELD.append(torch.ones(3 << 30, dtype=torch.uint8))\n        x = x.contiguous()"
        ).replace("class ModelNew", "_HELD = []\n\n\nclass ModelNew")
        out = v.verify_sync(problem, Candidate(hog, "triton"))
        assert out.status is Status.OUT_OF_MEMORY, out.reason
        assert "host memory: the worker held" in (out.reason or "")
        assert "allowance is 2.0 GiB" in (out.reason or "")
    finally:
        v.close_sync()


def test_verdict_payload_fields(cpu_verifier: Verifier) -> None:
    v = cpu_verifier.verify_sync(
        Problem(PROBLEMS["relu"]), Candidate(TRITON_HONEST["relu"], "triton")
    )
    assert v.status is Status.CORRECT and "timing" in v.unchecked
    # The payload accepts the verdict's fields.
    KernelVerified.model_validate({"kernel_id": "k", "module_id": "m", "group_id": "g",
                                   **v.to_dict()})


def test_stage_times_count_the_comparisons_and_kernelbench_rule(
        cpu_verifier: Verifier) -> None:
    v = cpu_verifier.verify_sync(
        Problem(PROBLEMS["relu"]), Candidate(TRITON_HONEST["relu"], "triton")
    )
    stages = v.details["stage_s"]
    # Outside the worker's requests, and a third of a 6.4 GB output's verdict on a GPU.
    assert stages["compare"] > 0 and stages["kernelbench_rule"] >= 0, stages
    # The worker's requests wait for the lane's shared lock, said apart from their stages.
    assert 0 <= stages["lock_wait"] < stages["run on input set 0 (small-normal)"], stages
    assert v.details["kernelbench_rule"] is True


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_cuda_compile_checked_without_gpu(cpu_verifier: Verifier) -> None:
    v = cpu_verifier.verify_sync(Problem(PROBLEMS["relu"]), Candidate(CUDA_HONEST["relu"], "cuda"))
    assert v.status is Status.UNCHECKED and v.check == "no_gpu", v.reason
    assert "compiles" in (v.reason or "") and "correctness" in v.unchecked


@pytest.mark.parametrize("slots", [1, 2])
async def test_candidates_share_a_device_up_to_its_slots(slots: int) -> None:
    # Checks of several candidates may overlap on one device (timing alone is exclusive);
    # with one slot the second candidate waits for the first's whole stage.
    from kz_stream.verify import VerifierConfig

    problem = Problem(PROBLEMS["relu"])
    async with Verifier(VerifierConfig(devices=[], candidates_per_gpu=slots)) as v:
        await v.verify(problem, Candidate(TRITON_HONEST["relu"], "triton"))  # prepares it
        seen: list[dict[str, Any]] = []
        samples = asyncio.gather(*(
            v.verify(problem, Candidate(f"# sample {i}\n{TRITON_HONEST['relu']}", "triton"))
            for i in range(2)))
        while not samples.done():  # what the verifier says it holds, as a timeline would
            seen.append(v.occupancy())
            await asyncio.sleep(0.02)
        both = await samples
        idle = v.occupancy()
    assert [d.status for d in both] == [Status.CORRECT, Status.CORRECT]
    # At most ``slots`` candidates in their GPU stage at once, and that many were.
    assert max(o["lanes"][0]["in_gpu_stage"] for o in seen) == slots
    assert max(o["problems_in_use"] for o in seen) == 1
    assert idle["problems_in_use"] == 0 and idle["problems_prepared"] == 1
    assert {k: idle["lanes"][0][k] for k in ("verifications", "in_gpu_stage", "oracles_busy",
                                              "room_holders", "room_waiting", "timing")} == {
        "verifications": 0, "in_gpu_stage": 0, "oracles_busy": 0, "room_holders": 0,
        "room_waiting": 0, "timing": False}
    waits = sorted(d.details["gpu_wait_s"] for d in both)
    # The CPU path has no device room to wait for: its stages hold none of it.
    assert all(d.details["room_wait_s"] < 0.05 and d.details["room_bytes"] == 0 for d in both)
    if slots == 2:
        assert waits[1] < 0.05, waits
    else:
        assert waits[0] < 0.05 and waits[1] >= min(d.details["seconds"] for d in both) / 4, waits


@pytest.mark.parametrize(("profiled", "name"), [
    ("at::cuda::(anonymous namespace)::spin_kernel(long)", "spin_kernel"),
    ("void relu_kernel<float>(float const*, float*, int)", "relu_kernel"),
    ("void (anonymous namespace)::scale(float*)", "scale"),
    ("add_kernel", "add_kernel"),
])
def test_profiled_kernel_names_lose_namespace_template_and_arguments(profiled: str,
                                                                     name: str) -> None:
    from kz_stream.verify._checks import _base_name

    assert _base_name(profiled) == name


async def test_close_stops_workers_that_are_still_starting() -> None:
    from kz_stream.verify import VerifierConfig

    v = Verifier(VerifierConfig(devices=[], prewarm=2))
    await v.__aenter__()
    spares = list(v._lanes[0].spares)  # just spawned: importing, not yet ready
    assert len(spares) == 2 and not any(c.ready for c in spares)
    await asyncio.wait_for(v.close(), timeout=60)
    assert not any(c.alive for c in spares)


async def test_a_verification_in_flight_at_close_ends_with_a_verdict() -> None:
    from kz_stream.verify import Verdict, VerifierConfig

    v = Verifier(VerifierConfig(devices=[], prewarm=1))
    await v.__aenter__()
    task = asyncio.create_task(v.verify(Problem(PROBLEMS["relu"]),
                                        Candidate(TRITON_HONEST["relu"], "triton")))
    lane = v._lanes[0]
    while not lane.busy and not task.done():  # noqa: ASYNC110 (no event to wait on)
        await asyncio.sleep(0.05)
    await asyncio.wait_for(v.close(), timeout=60)
    verdict = await asyncio.wait_for(task, timeout=300)
    assert isinstance(verdict, Verdict), verdict
    assert lane.closed and not lane.spares and not lane.oracles and not lane.oracles_busy


def _waits_for(marker_dir: str, me: str, other: str, within_s: float = 120) -> str:
    """A problem whose inputs are drawn only once ``other``'s are being drawn too."""
    return f'''import os, time
import torch


class Model(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x)


def get_inputs():
    open(os.path.join({marker_dir!r}, {me!r}), "w").close()
    deadline = time.monotonic() + {within_s}
    while not os.path.exists(os.path.join({marker_dir!r}, {other!r})):
        if time.monotonic() > deadline:
            raise RuntimeError("{me}: {other} was not prepared at the same time")
        time.sleep(0.05)
    return [torch.rand(64, 64)]


def get_init_inputs():
    return []
'''


@pytest.mark.skipif(not os.access("/dev/shm", os.W_OK), reason="no writable /dev/shm")
async def test_two_oracles_prepare_two_problems_at_once() -> None:
    # Each problem's inputs wait for the other's: with one oracle both would time out.
    from kz_stream.verify import VerifierConfig

    with tempfile.TemporaryDirectory(dir="/dev/shm") as marks:
        os.chmod(marks, 0o777)
        a, b = Problem(_waits_for(marks, "a", "b")), Problem(_waits_for(marks, "b", "a"))
        async with Verifier(VerifierConfig(devices=[], oracles=2)) as v:
            both = await asyncio.gather(v.inspect_problem(a), v.inspect_problem(b))
            lane = v._lanes[0]
            assert len(lane.oracles) == 2 and not lane.oracles_busy
    for info in both:
        assert "error" not in info, info
        assert info["input_sets"], info


@pytest.mark.skipif(not os.access("/dev/shm", os.W_OK), reason="no writable /dev/shm")
@pytest.mark.parametrize("each", [4, 8])
async def test_problems_that_do_not_fit_the_host_together_are_not_prepared_together(
        each: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # Two oracles, a budget of 10 bytes, and problems whose preparation holds ``each``:
    # two of 4 are prepared together; of two of 8 the second waits for the first, whose
    # inputs wait for the second's in vain.
    from kz_stream.verify import VerifierConfig

    with tempfile.TemporaryDirectory(dir="/dev/shm") as marks:
        os.chmod(marks, 0o777)
        a = Problem(_waits_for(marks, "a", "b", within_s=10))
        b = Problem(_waits_for(marks, "b", "a", within_s=10))
        async with Verifier(VerifierConfig(devices=[], oracles=2, host_budget_bytes=10)) as v:

            async def estimate(problem: Problem) -> int:
                return each

            monkeypatch.setattr(v, "_preparation_bytes", estimate)
            first, second = await asyncio.gather(v.inspect_problem(a), v.inspect_problem(b))
            assert v._host.held == 0 and not v._problems_in_use
    if each == 4:
        assert "error" not in first and "error" not in second, (first, second)
    else:
        assert "b was not prepared at the same time" in first["error"], first
        assert "error" not in second, second


def test_a_write_to_the_input_on_the_second_call_only_is_flagged(
        cpu_verifier_runtime_only: Verifier) -> None:
    """The repetitions of an input set share one upload; every call's inputs are checked
    against the copy taken before the first call."""
    later = TRITON_HONEST["relu"].replace(
        "        return y",
        "        self.calls = getattr(self, 'calls', 0) + 1\n"
        "        if self.calls == 2:\n"
        "            x.mul_(1.0000001)\n"
        "        return y")
    v = cpu_verifier_runtime_only.verify_sync(Problem(PROBLEMS["relu"]), Candidate(later, "triton"))
    assert v.status is not Status.CORRECT and v.check == "input_mutation", (v.check, v.reason)


# The name of the mapping that holds a tensor's bytes, from the worker's /proc/self/maps.
_MAPPING_OF = """
def _mapping_of(t):
    address = t.untyped_storage().data_ptr()
    for line in open('/proc/self/maps').read().splitlines():
        span, *rest = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in span.split('-'))
        if start <= address < end:
            return rest[4].strip() if len(rest) > 4 else ''
    return ''
"""


def test_shared_inputs_reach_each_worker_as_the_prepared_bytes() -> None:
    """With every input shared (a sealed file per input, mapped by each worker): an
    honest candidate sees its inputs mapped from the file and is correct; one that writes
    to its input changes only its own copy, so the next candidate's inputs are intact."""
    from kz_stream.verify import VerifierConfig

    # No static scan: the probe below reads a file, which the scan calls a hack.
    v = Verifier(VerifierConfig(devices=[], prewarm=0, input_share_min_bytes=1,
                                static_scan=False))
    try:
        problem = Problem(PROBLEMS["relu"])
        writer = TRITON_HONEST["relu"].replace(  # the right output, then its input wiped
            "        return y", "        x.fill_(-1.0)\n        return y")
        wrote = v.verify_sync(problem, Candidate(writer, "triton"))
        assert wrote.status is not Status.CORRECT and wrote.check == "input_mutation", (
            wrote.status, wrote.check, wrote.reason)
        mapped = TRITON_HONEST["relu"].replace(  # fails unless x is mapped from the file
            "        x = x.contiguous()",
            "        assert '/memfd:kz-sealed' in _mapping_of(x), 'copied'\n"
            "        x = x.contiguous()"
        ).replace("class ModelNew", _MAPPING_OF + "\n\nclass ModelNew")
        honest = v.verify_sync(problem, Candidate(mapped, "triton"))
        assert honest.status is Status.CORRECT, (honest.check, honest.reason)
    finally:
        v.close_sync()


async def test_a_loss_floor_counts_its_inputs_and_one_element() -> None:
    """The physical floor's bytes are what a kernel must move: a mean loss's result is a
    view of its elementwise buffer, which an honest fused kernel never writes (counting
    it judged an honest Huber loss `hack` / `physical_floor` on the H200)."""
    from kz_stream.testing.corpus.full_size import FULL_SIZE_PROBLEMS

    async with Verifier(VerifierConfig(devices=[])) as v:
        info = await v.inspect_problem(Problem(FULL_SIZE_PROBLEMS["huber_loss"].source(False)))
    assert "error" not in info, info
    assert info["moved_bytes"] == info["input_bytes"] + 4, info


OUTER = '''import torch
import torch.nn as nn

class Model(nn.Module):
    def forward(self, x):
        return x.unsqueeze(1) * x.unsqueeze(0)

def get_inputs():
    return [torch.randn(20000)]

def get_init_inputs():
    return []
'''

OUTER_TRITON = '''import torch
import torch.nn as nn
import triton
import triton.language as tl

@triton.jit
def outer_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr, COLS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
    a = tl.load(x_ptr + rows, mask=rows < n, other=0.0)
    b = tl.load(x_ptr + cols, mask=cols < n, other=0.0)
    mask = (rows[:, None] < n) & (cols[None, :] < n)
    tl.store(y_ptr + rows[:, None] * n + cols[None, :], a[:, None] * b[None, :], mask=mask)

class ModelNew(nn.Module):
    def forward(self, x):
        n = x.numel()
        y = torch.empty((n, n), device=x.device, dtype=x.dtype)
        # Column tiles: a GPU's Triton takes at most 2**20 elements in a block.
        outer_kernel[(triton.cdiv(n, 64), triton.cdiv(n, 1024))](x, y, n, BLOCK=64,
                                                                 COLS=1024)
        return y
'''


def test_a_workers_big_outputs_come_as_sealed_files(cpu_verifier: Verifier,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # An outer product: at the CPU path's sets (an eighth of the length) 25 MB of output,
    # past the 16 MiB from which a worker writes an output into a sealed memory file.
    from kz_stream.verify import _ipc

    checked: list[int] = []
    real = _ipc._check_sealed

    def counted(fd: int, size: int) -> None:
        checked.append(size)
        real(fd, size)

    first = cpu_verifier.verify_sync(Problem(OUTER), Candidate(OUTER_TRITON, "triton"))
    assert first.status is Status.CORRECT, (first.status, first.reason)
    monkeypatch.setattr(_ipc, "_check_sealed", counted)  # the problem is prepared by now
    again = cpu_verifier.verify_sync(Problem(OUTER),
                                     Candidate(OUTER_TRITON + "# again\n", "triton"))
    assert again.status is Status.CORRECT, (again.status, again.reason)
    # Each a worker's output of one of the sets (2501 or 2499 long), through its guard.
    assert checked and {n * n * 4 for n in (2501, 2499)} >= set(checked), checked
