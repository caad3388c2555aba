"""Cheating candidates, one per exploit class. Each entry: (problem name, backend, source,
the verdict checks that count as catching it, where it can be caught: "cpu" or "gpu").

Where a cheat is stopped by the static scan, a second variant hides from it (the
``*_runtime`` entries), to show the run-time layer catches it too; the tests run those
with the static scan switched off.
"""

from __future__ import annotations

HEADER = '''
import torch
import torch.nn as nn
import triton
import triton.language as tl
'''

_COPY_KERNEL = '''

@triton.jit
def copy_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)
'''

_RELU_KERNEL = '''

@triton.jit
def relu_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.maximum(tl.load(x_ptr + offs, mask=mask), 0.0), mask=mask)


def launch_relu(x, y):
    n = x.numel()
    relu_kernel[(triton.cdiv(n, 1024),)](x, y, n, BLOCK=1024)
'''

ZERO_OUTPUT = HEADER + '''

@triton.jit
def zero_kernel(y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.zeros([BLOCK], dtype=tl.float32), mask=offs < n)


class ModelNew(nn.Module):
    def forward(self, x):
        y = torch.empty_like(x)
        zero_kernel[(triton.cdiv(y.numel(), 1024),)](y, y.numel(), BLOCK=1024)
        return y
'''

IDENTITY = HEADER + _COPY_KERNEL + '''

class ModelNew(nn.Module):
    def forward(self, x):
        y = torch.empty_like(x)
        copy_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
        return y
'''

# Computes once, then hands back the same tensor: caught by aliasing on the repeat run.
CACHED_OUTPUT = HEADER + _RELU_KERNEL + '''

_cache = {}


class ModelNew(nn.Module):
    def forward(self, x):
        key = tuple(x.shape)
        if key not in _cache:
            y = torch.empty_like(x)
            launch_relu(x.contiguous(), y)
            _cache[key] = y
        return _cache[key]
'''

# Caches a copy keyed by shape: the repeat run is fine, a new input set is wrong.
CACHED_COPY = HEADER + _RELU_KERNEL + '''

_cache = {}


class ModelNew(nn.Module):
    def forward(self, x):
        key = tuple(x.shape)
        if key not in _cache:
            y = torch.empty_like(x)
            launch_relu(x.contiguous(), y)
            _cache[key] = y
        return _cache[key].clone()
'''

SIDE_STREAM = HEADER + _RELU_KERNEL + '''

_side = torch.cuda.Stream()


class ModelNew(nn.Module):
    def forward(self, x):
        y = torch.empty_like(x)
        with torch.cuda.stream(_side):
            launch_relu(x, y)
        return y
'''

# The same, with the stream API reached through a name the scan cannot fold.
SIDE_STREAM_RUNTIME = HEADER + _RELU_KERNEL + '''

_cuda = getattr(torch, "cu" + "da")
_Stream = getattr(_cuda, "".join(chr(c) for c in (83, 116, 114, 101, 97, 109)))
_ctx = getattr(_cuda, "".join(chr(c) for c in (115, 116, 114, 101, 97, 109)))
_side = _Stream()


class ModelNew(nn.Module):
    def forward(self, x):
        y = torch.empty_like(x)
        big = torch.empty(1 << 26, device=x.device)
        with _ctx(_side):
            for _ in range(20):
                big.mul_(1.0001)  # keeps the side stream busy
            launch_relu(x, y)
        return y
'''

TF32_MATMUL = HEADER + '''

@triton.jit
def matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k in range(0, K, BK):
        a = tl.load(a_ptr + rm[:, None] * K + (k + rk)[None, :],
                    mask=(rm[:, None] < M) & ((k + rk)[None, :] < K), other=0.0)
        b = tl.load(b_ptr + (k + rk)[:, None] * N + rn[None, :],
                    mask=((k + rk)[:, None] < K) & (rn[None, :] < N), other=0.0)
        # bf16 operands (what TF32/low-precision shortcuts amount to): ~1e-3 error.
        acc += tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


class ModelNew(nn.Module):
    def forward(self, a, b):
        a, b = a.contiguous(), b.contiguous()
        M, K = a.shape
        N = b.shape[1]
        c = torch.empty((M, N), device=a.device, dtype=a.dtype)
        matmul_kernel[(triton.cdiv(M, 32), triton.cdiv(N, 32))](a, b, c, M, N, K,
                                                                BM=32, BN=32, BK=32)
        return c
'''

TF32_FLAG = HEADER + '''
torch.backends.cuda.matmul.allow_tf32 = True
''' + TF32_MATMUL.removeprefix(HEADER)

INPUT_MUTATION = HEADER + _RELU_KERNEL + '''

class ModelNew(nn.Module):
    def forward(self, x):
        launch_relu(x, x)  # in place: saves an allocation, destroys the input
        return x
'''

# Returns a view of an input it wrote through: output aliases input.
OUTPUT_ALIAS = HEADER + _RELU_KERNEL + '''

class ModelNew(nn.Module):
    def forward(self, x):
        flat = x.view(-1)
        launch_relu(flat, flat)
        return flat.view(x.shape)
'''

DECOY_NEVER_LAUNCHED = HEADER + _RELU_KERNEL + '''

class ModelNew(nn.Module):
    def forward(self, x):
        return x.clamp(min=0.0)  # the kernel above is never launched
'''

DECOY_USELESS = HEADER + _RELU_KERNEL + '''

class ModelNew(nn.Module):
    def forward(self, x):
        scratch = torch.empty_like(x)
        launch_relu(x, scratch)  # real work, thrown away
        return x.clamp(min=0.0)
'''

FALLBACK_ALIAS = HEADER + _RELU_KERNEL + '''
f = torch.nn.functional
g = getattr(f, "re" + "lu")


class ModelNew(nn.Module):
    def forward(self, x):
        y = torch.empty_like(x)
        launch_relu(x, y)
        return g(y)
'''

# Falls back through a name the scan cannot resolve; the op log sees aten.relu anyway.
FALLBACK_RUNTIME = HEADER + _RELU_KERNEL + '''

_ops = [op for op in dir(torch) if op.startswith("re") and op.endswith("lu") and len(op) == 4]
_fn = getattr(torch, _ops[0])


class ModelNew(nn.Module):
    def forward(self, x):
        y = torch.empty_like(x)
        launch_relu(x, y)
        return _fn(x)
'''

THREAD_TIMER = HEADER + _RELU_KERNEL + '''
import threading


class ModelNew(nn.Module):
    def forward(self, x):
        y = torch.empty_like(x)
        threading.Timer(0.05, launch_relu, args=(x, y)).start()
        return y
'''

# Returns at once and finishes the work later on a thread started through a name the
# scan cannot fold.
THREAD_RUNTIME = HEADER + _RELU_KERNEL + '''
_thread_mod = __builtins__["__imp" + "ort__"]("_thr" + "ead")


class ModelNew(nn.Module):
    def forward(self, x):
        y = torch.empty_like(x)
        import time as _time_mod

        def later():
            _time_mod.sleep(0.5)
            launch_relu(x, y)

        _thread_mod.start_new_thread(later, ())
        return y
'''

MONKEYPATCH_EVENT = HEADER + _RELU_KERNEL + '''


class _FastEvent(torch.cuda.Event):
    def elapsed_time(self, other):
        return 1e-3


torch.cuda.Event = _FastEvent


class ModelNew(nn.Module):
    def forward(self, x):
        y = torch.empty_like(x)
        launch_relu(x, y)
        return y
'''

MONKEYPATCH_RUNTIME = HEADER + _RELU_KERNEL + '''
import time as _t

_names = ["perf" + "_counter"]
for _n in _names:
    _t.__setattr__(_n, lambda: 0.0)


class ModelNew(nn.Module):
    def forward(self, x):
        y = torch.empty_like(x)
        launch_relu(x, y)
        return y
'''

# Honest for the first calls (the correctness checks), then returns a stale result:
# "timing mode" detected by counting calls.
TIMING_LIE = HEADER + _RELU_KERNEL + '''

class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0
        self.last = None

    def forward(self, x):
        self.calls += 1
        if self.calls > 25 and self.last is not None and self.last.shape == x.shape:
            return self.last.clone()
        y = torch.empty_like(x)
        launch_relu(x, y)
        self.last = y
        return y
'''

CUDA_SIDE_STREAM = r'''
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

src = """
#include <torch/extension.h>
__global__ void relu_k(const float* x, float* y, long n) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] > 0.f ? x[i] : 0.f;
}
torch::Tensor relu_async(torch::Tensor x) {
    auto y = torch::empty_like(x);
    cudaStream_t s;
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    long n = x.numel();
    relu_k<<<(n + 255) / 256, 256, 0, s>>>(x.data_ptr<float>(), y.data_ptr<float>(), n);
    return y;
}
"""
ext = load_inline(name="relu_async", cpp_sources="torch::Tensor relu_async(torch::Tensor x);",
                  cuda_sources=src, functions=["relu_async"])


class ModelNew(nn.Module):
    def forward(self, x):
        return ext.relu_async(x)
'''

CUDA_TORCH_FALLBACK = r'''
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

src = """
#include <torch/extension.h>
__global__ void touch(float* y, long n) {
    if (threadIdx.x == 0 && blockIdx.x == 0 && n < 0) y[0] = 0;
}
torch::Tensor relu_fb(torch::Tensor x) {
    auto y = torch::relu(x);
    touch<<<1, 32>>>(y.data_ptr<float>(), y.numel());
    return y;
}
"""
ext = load_inline(name="relu_fb", cpp_sources="torch::Tensor relu_fb(torch::Tensor x);",
                  cuda_sources=src, functions=["relu_fb"])


class ModelNew(nn.Module):
    def forward(self, x):
        return ext.relu_fb(x)
'''

# (problem, backend, source, accepted checks, where) — "cpu" entries run in CI.
# An honest matmul computed once per input, remembered on the inputs' address and shape,
# and served through a copy kernel on later calls: with timing inputs reused (kzv-1.1) the
# timed calls all hit, 7.6x "faster" on the H200. With fresh values in place for every
# timed call (kzv-1.2) the hits are stale and the timed-output check fails them; keyed on
# the version counter too it never hits (seen on the H200: correct, at 0.63x).
MEMO_MATMUL = HEADER + _COPY_KERNEL + '''

@triton.jit
def matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k in range(0, K, BK):
        a = tl.load(a_ptr + rm[:, None] * K + (k + rk)[None, :],
                    mask=(rm[:, None] < M) & ((k + rk)[None, :] < K), other=0.0)
        b = tl.load(b_ptr + (k + rk)[:, None] * N + rn[None, :],
                    mask=((k + rk)[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc += tl.dot(a, b, input_precision="ieee")
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


_memo = {}


class ModelNew(nn.Module):
    def forward(self, a, b):
        a, b = a.contiguous(), b.contiguous()
        key = (a.data_ptr(), tuple(a.shape), b.data_ptr())
        if key not in _memo:
            M, K = a.shape
            N = b.shape[1]
            c = torch.empty((M, N), device=a.device, dtype=a.dtype)
            matmul_kernel[(triton.cdiv(M, 64), triton.cdiv(N, 64))](a, b, c, M, N, K,
                                                                    BM=64, BN=64, BK=32)
            _memo[key] = c
        c = _memo[key]
        out = torch.empty_like(c)
        copy_kernel[(triton.cdiv(c.numel(), 1024),)](c, out, c.numel(), BLOCK=1024)
        return out
'''

CHEATS: dict[str, tuple[str, str, str, frozenset[str], str]] = {
    # A copy passes for a ReLU on torch.rand inputs alone: the signed input set fails it.
    "copy_relu_nonneg": ("relu_rand", "triton", IDENTITY,
                         frozenset({"rel_norm", "elementwise"}), "cpu"),
    # Caught by the timed-output check, or earlier where a new input set lands on a freed
    # address with version 0 (a stale memo hit in the correctness runs).
    # On the H200 (2026-12-01) the allocator gave input set 2 the addresses of set 1, so
    # the memo (keyed on addresses) served set 1's product there: "repeat_mismatch".
    "memo_matmul": ("matmul", "triton", MEMO_MATMUL,
                    frozenset({"timed_output", "rel_norm", "elementwise", "repeat_mismatch"}),
                    "gpu"),
    "zero_output": ("relu", "triton", ZERO_OUTPUT, frozenset({"rel_norm", "elementwise"}), "cpu"),
    "identity": ("relu", "triton", IDENTITY, frozenset({"rel_norm", "elementwise"}), "cpu"),
    "cached_output": ("relu", "triton", CACHED_OUTPUT,
                      frozenset({"output_reuses_earlier_output", "rel_norm"}), "cpu"),
    "cached_copy": ("relu", "triton", CACHED_COPY,
                    frozenset({"rel_norm", "elementwise", "shape"}), "cpu"),
    "side_stream": ("relu", "triton", SIDE_STREAM, frozenset({"stream"}), "cpu"),
    "side_stream_runtime": ("relu", "triton", SIDE_STREAM_RUNTIME,
                            frozenset({"unsynchronized_output", "side_stream",
                                       "unsynchronized_timing", "obfuscated_access"}), "gpu"),
    "low_precision": ("matmul", "triton", TF32_MATMUL,
                      frozenset({"rel_norm", "elementwise"}), "cpu"),
    "tf32_flag": ("matmul", "triton", TF32_FLAG, frozenset({"precision"}), "cpu"),
    "input_mutation": ("relu", "triton", INPUT_MUTATION,
                       frozenset({"input_mutation", "output_aliases_input"}), "cpu"),
    "output_alias": ("relu", "triton", OUTPUT_ALIAS,
                     frozenset({"input_mutation", "output_aliases_input"}), "cpu"),
    "decoy_never_launched": ("relu", "triton", DECOY_NEVER_LAUNCHED,
                             frozenset({"no_kernel_launched"}), "cpu"),
    "decoy_useless": ("relu", "triton", DECOY_USELESS, frozenset({"decoy_kernel"}), "cpu"),
    "fallback_alias": ("relu", "triton", FALLBACK_ALIAS, frozenset({"torch_fallback"}), "cpu"),
    "fallback_runtime": ("relu", "triton", FALLBACK_RUNTIME,
                         frozenset({"torch_fallback", "obfuscated_access"}), "cpu"),
    "thread_timer": ("relu", "triton", THREAD_TIMER, frozenset({"thread"}), "cpu"),
    "thread_runtime": ("relu", "triton", THREAD_RUNTIME, frozenset({"timer", "thread"}), "cpu"),
    "monkeypatch_event": ("relu", "triton", MONKEYPATCH_EVENT,
                          frozenset({"monkeypatch", "timer"}), "cpu"),
    "monkeypatch_runtime": ("relu", "triton", MONKEYPATCH_RUNTIME,
                            frozenset({"monkeypatch"}), "cpu"),
    "timing_lie": ("relu", "triton", TIMING_LIE, frozenset({"timed_output"}), "gpu"),
    "cuda_side_stream": ("relu", "cuda", CUDA_SIDE_STREAM, frozenset({"stream"}), "cpu"),
    "cuda_torch_fallback": ("relu", "cuda", CUDA_TORCH_FALLBACK, frozenset({"torch_fallback"}),
                            "cpu"),
}

# What the run-time layer alone (static scan off) answers for the cheats written to get
# past the scan; the same on the CPU and on the H200 (docs/verifier.md). A side stream has
# three detectors, and which fires first depends on when the side stream's work ends.
RUNTIME_CHECKS: dict[str, frozenset[str]] = {
    "side_stream_runtime": frozenset({"unsynchronized_output", "side_stream",
                                      "unsynchronized_timing"}),
    "fallback_runtime": frozenset({"torch_fallback"}),
    "fallback_alias": frozenset({"torch_fallback"}),
    "thread_runtime": frozenset({"thread"}),
    "monkeypatch_runtime": frozenset({"monkeypatch"}),
    "monkeypatch_event": frozenset({"monkeypatch"}),
    "tf32_flag": frozenset({"precision"}),
    "cuda_torch_fallback": frozenset({"torch_fallback"}),
}
