"""CUDA sources: extraction without running, the fast translation unit, and (slow) nvcc."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kz_stream.testing.corpus.cuda_honest import CUDA_HONEST
from kz_stream.verify._build import Builder
from kz_stream.verify._extract import InlineCall, extract_inline_calls
from kz_stream.verify._rewrite import hide_host_code, kernel_names, wrapper

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
    w = wrapper("f", "torch::Tensor", "torch::Tensor x, float alpha, int n, bool flag")
    assert w is not None
    assert "double a1" in w and "int64_t a2" in w and "static_cast<float>(a1)" in w
    assert wrapper("f", "torch::Tensor", "torch::Tensor x, float eps = 1e-5") is None


def test_host_code_hidden_from_device_pass() -> None:
    call = extract_inline_calls(CUDA_HONEST["relu"])[0]  # type: ignore[index]
    hidden = hide_host_code(call.cuda_sources[0])
    assert hidden is not None
    # The kernel stays visible; the host wrapper and torch include do not.
    kernel_at = hidden.index("__global__ void relu_kernel")
    assert "#ifndef __CUDA_ARCH__" not in hidden[max(0, kernel_at - 25) : kernel_at]
    assert "#ifndef __CUDA_ARCH__\ntorch::Tensor relu_cuda" in hidden


def test_template_kernels_instantiated_for_the_device_pass() -> None:
    call = extract_inline_calls(CUDA_HONEST["softmax"])[0]  # type: ignore[index]
    hidden = hide_host_code(call.cuda_sources[0])
    assert hidden is not None
    # AT_DISPATCH_FLOATING_TYPES launches softmax_rows<scalar_t> for float and double; the
    # device pass cannot see that launch, so both instances are referenced where it can.
    tail = hidden[hidden.rindex("#endif") :]
    assert "(void)&softmax_rows<float>;" in tail and "(void)&softmax_rows<double>;" in tail


@pytest.mark.parametrize(
    ("launch", "expected"),
    [
        ("k<float, 256><<<1, 1>>>(x);", ["k<float, 256>"]),
        ("k<float, BLOCK><<<1, 1>>>(x);", ["k<float, BLOCK>"]),  # a top-level constant
        ("AT_DISPATCH_FLOATING_TYPES_AND_HALF(t, \"n\", [&] { k<scalar_t, 1><<<1, 1>>>(x); });",
         None),  # at::Half needs the torch headers the device pass does not see
        ("const int b = 128; k<float, b><<<1, 1>>>(x);", None),  # a local constant
    ],
)
def test_template_instances_named_or_given_up(launch: str, expected: list[str] | None) -> None:
    src = ("#include <torch/extension.h>\nconstexpr int BLOCK = 128;\n"
           "template <typename T, int B> __global__ void k(T* x) { x[threadIdx.x] *= B; }\n"
           f"void f(torch::Tensor t) {{ float* x = t.data_ptr<float>(); {launch} }}\n")
    hidden = hide_host_code(src)
    if expected is None:
        assert hidden is None
    else:
        assert hidden is not None
        assert all(f"(void)&{inst};" in hidden for inst in expected)


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


@pytest.mark.slow
@needs_nvcc
def test_a_cancelled_caller_leaves_a_shared_build_running(tmp_path: Path) -> None:
    """Two callers share one build; the first one's cancellation does not reach the other."""
    builder = Builder(tmp_path, link=False, jobs=2)
    call = extract_inline_calls(CUDA_HONEST["relu"])[0]  # type: ignore[index]

    async def two_callers() -> tuple[asyncio.Task[Any], Any]:
        first = asyncio.create_task(builder.build(call))
        second = asyncio.create_task(builder.build(call))
        await asyncio.sleep(0.5)  # both wait on the one build now
        first.cancel()
        return first, await second

    first, result = asyncio.run(two_callers())
    assert first.cancelled()
    assert result.ok and not result.cache_hit, result.log


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # the process ended meanwhile
        if text in args:
            found.append(args)
    return found


@pytest.mark.slow
@needs_nvcc
def test_a_build_no_one_waits_for_is_stopped_with_its_compilers(tmp_path: Path) -> None:
    builder = Builder(tmp_path, link=False, jobs=2)
    call = extract_inline_calls(CUDA_HONEST["relu"])[0]  # type: ignore[index]

    async def cancel_the_only_caller() -> list[str]:
        caller = asyncio.create_task(builder.build(call))
        for _ in range(100):  # until a compiler runs
            await asyncio.sleep(0.1)
            if _processes_mentioning(str(tmp_path)):
                break
        assert _processes_mentioning(str(tmp_path)), "no compiler started"
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        await asyncio.sleep(0.5)  # the build task's own cancellation runs
        return _processes_mentioning(str(tmp_path))

    assert asyncio.run(cancel_the_only_caller()) == []
    assert builder._inflight == {}


@pytest.mark.slow
@needs_nvcc
def test_template_kernel_instances_are_in_the_device_code(tmp_path: Path) -> None:
    """The fast layout of an AT_DISPATCH template kernel holds SASS for float and double."""
    triton = pytest.importorskip("triton")
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cuobjdump.is_file():
        pytest.skip("no cuobjdump in the triton package")
    builder = Builder(tmp_path, link=False, jobs=1)
    call = extract_inline_calls(CUDA_HONEST["softmax"])[0]  # type: ignore[index]
    unit = builder._fast_unit(call, hide=True)
    assert unit is not None
    text, ns, _ = unit
    (tmp_path / "t.cu").write_text(text)
    subprocess.run([builder.toolchain.nvcc, *builder._nvcc_flags(call, ns), "-c",
                    str(tmp_path / "t.cu"), "-o", str(tmp_path / "t.o")], check=True)
    sass = subprocess.run([str(cuobjdump), "-sass", str(tmp_path / "t.o")],
                          capture_output=True, text=True, check=True).stdout
    functions = {line.split(":")[1].strip() for line in sass.splitlines() if "Function :" in line}
    assert functions == {"_Z12softmax_rowsIfEvPKT_PS0_i", "_Z12softmax_rowsIdEvPKT_PS0_i"}


def test_extract_reads_top_level_bindings_only() -> None:
    head = "from torch.utils.cpp_extension import load_inline\nflags = ['-O3']\n"
    call = "m = load_inline(name='x', cpp_sources='', cuda_sources='k', extra_cuda_cflags=flags)\n"
    inside = head + "def f():\n    flags = ['-G']\n    return flags\n" + call
    calls = extract_inline_calls(inside)
    assert calls is not None and calls[0].extra_cuda_cflags == ("-O3",)
    # A rebinding the reader cannot follow sends the caller to recording (by running it).
    assert extract_inline_calls(head + "flags += ['-G']\n" + call) is None
    assert extract_inline_calls(head + "for flags in [['-G']]:\n    pass\n" + call) is None


def test_build_key_includes_the_extension_name() -> None:
    # load_inline compiles the name in and names the module by it: a build of "a" cannot
    # serve a call named "b".
    a = InlineCall(name="a", cpp_sources=(), cuda_sources=("k",), functions=("f",))
    b = InlineCall(name="b", cpp_sources=(), cuda_sources=("k",), functions=("f",))
    assert a.key != b.key
