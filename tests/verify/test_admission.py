"""Admission rejects degenerate reference modules and admits real ones."""

from __future__ import annotations

import asyncio

import pytest

from kz_stream.testing.corpus.degenerate import DEGENERATE
from kz_stream.testing.corpus.problems import PROBLEMS
from kz_stream.verify._admission import admission_check


@pytest.mark.parametrize("reason", sorted(DEGENERATE))
def test_degenerate_rejected(reason: str) -> None:
    result = admission_check(DEGENERATE[reason], timeout_s=120)
    assert not result.admitted
    assert result.reason == reason, result.detail


@pytest.mark.parametrize("name", ["relu", "row_sum", "linear_relu", "layernorm",
                                  "conv1d_depthwise"])
def test_real_modules_admitted(name: str) -> None:
    result = admission_check(PROBLEMS[name], timeout_s=120)
    assert result.admitted, (result.reason, result.detail)


def test_an_integer_answer_is_admitted_and_a_constant_index_is_not() -> None:
    from kz_stream.testing.corpus.degenerate import CONSTANT_INDEX, ROW_ARGMAX

    admitted = admission_check(ROW_ARGMAX, timeout_s=120)
    assert admitted.admitted, (admitted.reason, admitted.detail)
    constant = admission_check(CONSTANT_INDEX, timeout_s=120)
    assert not constant.admitted and constant.reason == "constant", constant.detail


def test_timeout() -> None:
    src = PROBLEMS["relu"].replace("return torch.relu(x)",
                                   "import time\n        time.sleep(100)\n        return x")
    result = admission_check(src, timeout_s=3)
    assert not result.admitted and result.reason == "timeout"


GROUP_NORM = '''import torch
import torch.nn as nn

class Model(nn.Module):
    def __init__(self, channels, groups):
        super().__init__()
        self.norm = nn.GroupNorm(groups, channels)
    def forward(self, x):
        return self.norm(x)

def get_inputs():
    return [torch.rand(64, 64, 32, 32)]

def get_init_inputs():
    return [64, 8]
'''

FLOAT32_INSIDE = '''import torch
import torch.nn as nn

class Model(nn.Module):
    def forward(self, x):
        return torch.mm(x, torch.ones(x.shape[1], 4))

def get_inputs():
    return [torch.randn(64, 32)]

def get_init_inputs():
    return []
'''

FLOAT32_ONLY = '''import torch
import torch.nn as nn

class Model(nn.Module):
    def forward(self, x):
        if x.dtype != torch.float32:
            raise TypeError("float32 inputs only")
        return x * 2

def get_inputs():
    return [torch.randn(64, 32)]

def get_init_inputs():
    return []
'''

ABS_OF_RAND = '''import torch
import torch.nn as nn

class Model(nn.Module):
    def forward(self, x):
        return torch.abs(x)

def get_inputs():
    return [torch.rand(64, 64)]

def get_init_inputs():
    return []
'''


def test_scaling_keeps_the_module_valid() -> None:
    # Scaled with its init integers, 64 channels become 9, which 8 groups do not divide:
    # admission scales less instead of blaming the module.
    result = admission_check(GROUP_NORM, timeout_s=120)
    assert result.admitted, (result.reason, result.detail)
    assert result.detail.endswith("at scaled-down shapes"), result.detail  # 16 MB of input
    small = admission_check(ABS_OF_RAND, timeout_s=120)  # 16 KB
    assert small.admitted and "scaled" not in small.detail, small.detail


BIG_RELU = GROUP_NORM.replace("self.norm(x)", "torch.relu(x)").replace(
    "self.norm = nn.GroupNorm(groups, channels)", "pass").replace(
    "torch.rand(64, 64, 32, 32)", "torch.randn(400, 1024, 1024)")


@pytest.mark.gpu
def test_a_module_past_the_devices_bound_is_checked_at_scaled_down_shapes() -> None:
    # 1.6 GB of input: at its own shapes admission would hold about 16 times that.
    result = admission_check(BIG_RELU, device="cuda", timeout_s=300)
    assert result.admitted, (result.reason, result.detail)
    assert result.detail.endswith("on cuda at scaled-down shapes"), result.detail


OUTER = """import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, a, b):
        return torch.outer(a, b)


def get_inputs():
    return [torch.randn(2048), torch.randn(2048)]


def get_init_inputs():
    return []
"""


def test_a_module_whose_outputs_pass_the_bound_is_checked_at_scaled_down_shapes() -> None:
    # 16 KB of inputs, 16 MB of output (48 MB kept with its float64 copy): it is the
    # outputs that fill the device (KernelBench level 1, 63: 1 GB in, 8.5 GB out).
    result = admission_check(OUTER, timeout_s=120)
    assert result.admitted, (result.reason, result.detail)
    assert result.detail.endswith("at scaled-down shapes"), result.detail


def test_a_generator_the_meta_device_cannot_run_is_still_checked() -> None:
    # Its outputs' size is unknown (counted as a float32 output as large as the inputs).
    reads = OUTER.replace("return [torch.randn(2048), torch.randn(2048)]",
                          "n = int(torch.randint(2040, 2048, ()).item())\n"
                          "    return [torch.randn(n), torch.randn(n)]")
    result = admission_check(reads, timeout_s=120)
    assert result.admitted, (result.reason, result.detail)


@pytest.mark.gpu
def test_a_convolution_with_large_outputs_is_admitted_on_the_gpu() -> None:
    # KernelBench level 1, 63, at its published size: 1 GB in, 8.5 GB out. At full size
    # its admission needed more than an H100's 80 GB (2026-12-06).
    conv = GROUP_NORM.replace("self.norm(x)", "self.conv(x)").replace(
        "self.norm = nn.GroupNorm(groups, channels)",
        "self.conv = nn.Conv2d(channels, groups, 3)").replace(
        "torch.rand(64, 64, 32, 32)", "torch.rand(16, 16, 1024, 1024)").replace(
        "return [64, 8]", "return [16, 128]")
    result = admission_check(conv, device="cuda", timeout_s=300)
    assert result.admitted, (result.reason, result.detail)
    assert result.detail.endswith("on cuda at scaled-down shapes"), result.detail


def test_a_module_that_makes_float32_tensors_in_its_forward_is_checked_in_float64() -> None:
    # KernelBench 3/35's LSTM draws its hidden state in float32 in its forward: it was
    # "not checkable here" until the float64 run upcast what the forward makes.
    result = admission_check(FLOAT32_INSIDE, timeout_s=120)
    assert result.admitted, (result.reason, result.detail)


def test_a_module_without_float64_cannot_be_checked_here() -> None:
    result = admission_check(FLOAT32_ONLY, timeout_s=120)
    assert not result.admitted and result.reason == "not_checkable_here", result.detail
    assert "float64" in result.detail and not result.out_of_memory


def test_a_float64_run_out_of_memory_is_no_room_not_a_module_without_float64() -> None:
    result = admission_check(OOM_IN_FLOAT64, timeout_s=120)
    assert not result.admitted and result.reason == "not_checkable_here", result.detail
    assert result.detail.startswith("the check does not fit"), result.detail
    assert result.out_of_memory  # a verifier tries it again with the device to itself


@pytest.mark.gpu
async def test_on_a_gpu_a_check_waits_for_the_devices_room_and_retries_alone() -> None:
    from kz_stream.verify import Problem, Verifier, VerifierConfig

    async with Verifier(VerifierConfig(prewarm=0)) as v:
        lane = v._lanes[0]
        await lane.room.acquire(lane.room.limit)  # candidates' stages fill the room
        check = asyncio.create_task(
            v.admission(Problem(PROBLEMS["relu_rand"], "relu"), timeout_s=300))
        for _ in range(600):  # its sizes come from a sandboxed child first
            if lane.room.waiting:
                break
            await asyncio.sleep(0.1)
        assert lane.room.waiting == 1 and not check.done()
        lane.room.release(lane.room.limit)
        admitted = await asyncio.wait_for(check, 300)
        assert admitted.admitted, admitted.detail
        assert admitted.phase_s["room"] > 0 and "alone" not in admitted.phase_s
        full = await v.admission(Problem(OOM_IN_FLOAT64, "oom"), timeout_s=300)
        assert full.out_of_memory and "alone" in full.phase_s
        assert lane.room.held == 0


def test_non_negative_inputs_are_checked_with_both_signs() -> None:
    # On torch.rand inputs alone |x| is x; inputs of both signs tell them apart.
    assert admission_check(ABS_OF_RAND, timeout_s=120).admitted
    assert admission_check(PROBLEMS["relu_rand"], timeout_s=120).admitted


OOM_IN_FLOAT64 = """
import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        if x.dtype == torch.float64:  # as a device full of others' memory would
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 GiB")
        return x * 2 + 1


def get_inputs():
    return [torch.randn(64)]


def get_init_inputs():
    return []
"""
