"""Chat prompts for the Proposer (API set -> KernelBench module) and the Coder (module ->
``ModelNew`` with CUDA ``load_inline`` or Triton kernels). The few-shot examples were
written for this project; tests check that the Proposer's examples pass module validation
and that the Triton example is correct under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from kz_stream.llm import ChatMessage
from kz_stream.modules._extraction import fence_code
from kz_stream.verify import Backend

__all__ = [
    "CODER_EXAMPLES",
    "CODER_EXAMPLE_MODULE",
    "PROPOSER_EXAMPLES",
    "coder_messages",
    "prompt_text",
    "proposer_messages",
]


PROPOSER_SYSTEM = """\
You write PyTorch modules for a GPU-kernel benchmark, in KernelBench format.

A module file defines:
- `class Model(nn.Module)` with `__init__` and `forward`;
- `get_inputs()`: a list of input tensors for `forward` (random, float32 unless an API
  needs integers);
- `get_init_inputs()`: a list of the arguments of `Model.__init__`.

Rules:
- Call every requested API at least once. Call no other torch operation, except elementwise
  arithmetic (+, -, *, /) and reshaping (view, reshape, permute, transpose, cat).
- The output must depend on every input and on the parameters: never return zeros, a
  constant, or an input unchanged.
- forward is deterministic: no dropout, no random numbers, no printing, no files, no network.
- Put sizes in module-level constants; keep inputs small enough to run in well under a
  second on a CPU (at most a few million elements).
- Reply with one ```python code block holding the whole file, and nothing else."""

PROPOSER_USER = "Write a new module that uses exactly these PyTorch APIs: {apis}."

_PROPOSER_EXAMPLE_1 = '''\
import torch
import torch.nn as nn

batch_size = 32
features = 512


class Model(nn.Module):
    """LayerNorm followed by a sigmoid gate computed from the normalised features."""

    def __init__(self, features: int):
        super().__init__()
        self.norm = nn.LayerNorm(features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return h * torch.sigmoid(h)


def get_inputs():
    return [torch.randn(batch_size, features)]


def get_init_inputs():
    return [features]
'''

_PROPOSER_EXAMPLE_2 = '''\
import torch
import torch.nn as nn

batch_size = 8
seq_len = 128
dim = 64


class Model(nn.Module):
    """Attention weights of queries over keys, pooled into one score per query."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        scores = torch.matmul(q, k.transpose(1, 2)) * self.scale
        weights = torch.softmax(scores, dim=-1)
        return torch.sum(weights * scores, dim=-1)


def get_inputs():
    return [torch.randn(batch_size, seq_len, dim), torch.randn(batch_size, seq_len, dim)]


def get_init_inputs():
    return [dim ** -0.5]
'''

# (API set, module) pairs shown to the Proposer as earlier turns of the chat.
PROPOSER_EXAMPLES: list[tuple[list[str], str]] = [
    (["torch.nn.LayerNorm", "torch.sigmoid"], _PROPOSER_EXAMPLE_1),
    (["torch.matmul", "torch.softmax", "torch.sum"], _PROPOSER_EXAMPLE_2),
]

CODER_SYSTEM = """\
You are an expert GPU kernel engineer. You are given a PyTorch module `Model` in KernelBench
format. Write `class ModelNew(nn.Module)` that computes the same function faster with {how}.

Output contract (a kernel that breaks it scores zero):
- `ModelNew.__init__` takes exactly the same arguments as `Model.__init__` (the values of
  `get_init_inputs()`), and `ModelNew.forward` takes exactly the same arguments as
  `Model.forward` (the tensors of `get_inputs()`) and returns the same output: same
  shape, same dtype, and values as accurate as `Model`'s own computation in that dtype.
  The check compares both with `Model` run in float64: your error may be at most 32 times
  `Model`'s own error (as a whole and per element, never under 16 machine epsilons), so
  TF32, bf16 or fp16 arithmetic on float32 data fails.
- It is checked on several input sets besides `get_inputs()` (sign-mixed, heavy-tailed,
  odd sizes such as 1023 for 1024, small shapes), each run twice: handle any size (mask
  the edges, hard-code no shape), give the same result every time, never modify an input,
  and never return an input or an earlier output.
- Create learnable parameters with the same nn modules, in the same order, as `Model`, so
  that the same random seed gives both the same weights.
- The arithmetic must happen in your own kernels{own}; torch may only allocate outputs,
  hold parameters and reshape.
- Inputs are CUDA float32 tensors unless `get_inputs()` says otherwise.
- Do not redefine `Model`, `get_inputs` or `get_init_inputs`.

Reply with one ```python code block holding the whole file (imports, kernel code, and
`class ModelNew`), and nothing else."""

_HOW: dict[Backend, tuple[str, str]] = {
    "cuda": (
        "custom CUDA kernels compiled with `torch.utils.cpp_extension.load_inline`",
        " (`__global__` functions launched from the C++ wrapper)",
    ),
    "triton": (
        "custom Triton kernels (`@triton.jit`)",
        " (`@triton.jit` functions launched from `forward`)",
    ),
}

CODER_USER = "Module:\n```python\n{module}```\nWrite `ModelNew` with {backend} kernels."

CODER_EXAMPLE_MODULE = """\
import torch
import torch.nn as nn

batch_size = 64
dim = 4096


class Model(nn.Module):
    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x) * self.scale


def get_inputs():
    return [torch.randn(batch_size, dim)]


def get_init_inputs():
    return [2.0]
"""

_CODER_EXAMPLE_CUDA = '''\
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

cuda_source = r"""
#include <torch/extension.h>

__global__ void relu_scale_kernel(const float* __restrict__ x, float* __restrict__ out,
                                  float scale, int64_t n) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < n) {
        float v = x[i];
        out[i] = (v > 0.0f ? v : 0.0f) * scale;
    }
}

torch::Tensor relu_scale(torch::Tensor x, double scale) {
    TORCH_CHECK(x.is_cuda() && x.scalar_type() == torch::kFloat32, "expected CUDA float32");
    auto xc = x.contiguous();
    auto out = torch::empty_like(xc);
    const int64_t n = xc.numel();
    const int threads = 256;
    const int blocks = (int)((n + threads - 1) / threads);
    relu_scale_kernel<<<blocks, threads>>>(xc.data_ptr<float>(), out.data_ptr<float>(),
                                           (float)scale, n);
    return out;
}
"""

cpp_source = "torch::Tensor relu_scale(torch::Tensor x, double scale);"

relu_scale_ext = load_inline(
    name="relu_scale_ext",
    cpp_sources=cpp_source,
    cuda_sources=cuda_source,
    functions=["relu_scale"],
    verbose=False,
)


class ModelNew(nn.Module):
    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return relu_scale_ext.relu_scale(x, self.scale)
'''

_CODER_EXAMPLE_TRITON = """\
import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def relu_scale_kernel(x_ptr, out_ptr, scale, n_elements, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(axis=0)
    offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask)
    y = tl.maximum(x, 0.0) * scale
    tl.store(out_ptr + offsets, y, mask=mask)


class ModelNew(nn.Module):
    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        n = x.numel()
        grid = (triton.cdiv(n, 1024),)
        relu_scale_kernel[grid](x, out, self.scale, n, BLOCK_SIZE=1024)
        return out
"""

CODER_EXAMPLES: dict[Backend, str] = {"cuda": _CODER_EXAMPLE_CUDA, "triton": _CODER_EXAMPLE_TRITON}


def proposer_messages(api_set: Sequence[str], *, few_shot: bool = True) -> list[ChatMessage]:
    """The Proposer's chat: system rules, worked examples, then the requested API set."""
    messages: list[ChatMessage] = [{"role": "system", "content": PROPOSER_SYSTEM}]
    if few_shot:
        for apis, module in PROPOSER_EXAMPLES:
            messages.append({"role": "user", "content": PROPOSER_USER.format(apis=", ".join(apis))})
            messages.append({"role": "assistant", "content": fence_code(module)})
    messages.append({"role": "user", "content": PROPOSER_USER.format(apis=", ".join(api_set))})
    return messages


def coder_messages(
    module_source: str, backend: Backend, *, few_shot: bool = True
) -> list[ChatMessage]:
    """The Coder's chat: the output contract, a worked example, then the module."""
    if backend not in _HOW:
        raise ValueError(f"unknown backend {backend!r}")
    how, own = _HOW[backend]
    label = "CUDA" if backend == "cuda" else "Triton"
    messages: list[ChatMessage] = [
        {"role": "system", "content": CODER_SYSTEM.format(how=how, own=own)}
    ]
    if few_shot:
        messages.append(
            {
                "role": "user",
                "content": CODER_USER.format(module=CODER_EXAMPLE_MODULE, backend=label),
            }
        )
        messages.append({"role": "assistant", "content": fence_code(CODER_EXAMPLES[backend])})
    module = module_source if module_source.endswith("\n") else module_source + "\n"
    messages.append({"role": "user", "content": CODER_USER.format(module=module, backend=label)})
    return messages


def prompt_text(messages: Sequence[ChatMessage]) -> str:
    """A chat as one string for event payloads (``ModuleProposed.prompt``): compact JSON."""
    return json.dumps(list(messages), ensure_ascii=False, separators=(",", ":"))
