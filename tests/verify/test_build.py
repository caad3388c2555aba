"""CUDA sources: extraction without running, the fast translation unit, and (slow) nvcc."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from kz_stream.verify.build import (
    Builder,
    InlineCall,
    _hide_host_code,
    _wrapper,
    extract_inline_calls,
    kernel_names,
)
from tests.verify.corpus.cuda_honest import CUDA_HONEST

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")


def test_extract_static() -> None:
    calls = extract_inline_calls(CUDA_HONEST["relu"])
    assert calls is not None and len(calls) == 1
    assert calls[0].name == "relu_ext" and calls[0].functions == ("relu_cuda",)
    assert kernel_names(calls[0].cuda_sources) == ["relu_kernel"]


def test_extract_gives_up_on_dynamic_sources() -> None:
    src = "from torch.utils.cpp_extension import load_inline\nimport os\n" \
          "m = load_inline(name='x', cpp_sources=os.environ['S'], functions=['f'])\n"
    assert extract_inline_calls(src) is None


def test_wrapper_widens_scalars() -> None:
    w = _wrapper("f", "torch::Tensor", "torch::Tensor x, float alpha, int n, bool flag")
    assert w is not None
    assert "double a1" in w and "int64_t a2" in w and "static_cast<float>(a1)" in w
    assert _wrapper("f", "torch::Tensor", "torch::Tensor x, float eps = 1e-5") is None


def test_host_code_hidden_from_device_pass() -> None:
    call = extract_inline_calls(CUDA_HONEST["relu"])[0]  # type: ignore[index]
    hidden = _hide_host_code(call.cuda_sources[0])
    assert hidden is not None
    # The kernel stays visible; the host wrapper and torch include do not.
    kernel_at = hidden.index("__global__ void relu_kernel")
    assert "#ifndef __CUDA_ARCH__" not in hidden[max(0, kernel_at - 25) : kernel_at]
    assert "#ifndef __CUDA_ARCH__\ntorch::Tensor relu_cuda" in hidden


def test_template_kernels_not_hidden() -> None:
    call = extract_inline_calls(CUDA_HONEST["softmax"])[0]  # type: ignore[index]
    assert _hide_host_code(call.cuda_sources[0]) is None


@pytest.mark.slow
@needs_nvcc
def test_compile_check_and_error(tmp_path: Path) -> None:
    """One honest compile (fast layout) and one broken source: nvcc's error comes back."""
    builder = Builder(tmp_path, link=False, jobs=2)
    call = extract_inline_calls(CUDA_HONEST["relu"])[0]  # type: ignore[index]
    ok = asyncio.run(builder.build(call))
    assert ok.ok and ok.layout == "fast", ok.log
    again = asyncio.run(builder.build(call))
    assert again.ok and again.cache_hit
    broken = InlineCall(name="b", cpp_sources=call.cpp_sources,
                        cuda_sources=(call.cuda_sources[0].replace("y[i] = v", "y[i] = w"),),
                        functions=call.functions)
    bad = asyncio.run(builder.build(broken))
    assert not bad.ok and "identifier \"w\" is undefined" in bad.log
    assert bad.attempts[-1] == "single:failed"
