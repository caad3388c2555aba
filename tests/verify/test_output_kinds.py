"""Outputs of every kind are compared (0-dim losses, integer indices), and a verdict says
which input sets it rests on: one that rests on too few is not "correct"."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kz_stream.verify import Candidate, Problem, Status, Verifier, VerifierConfig

HEADER = "import torch\nimport torch.nn as nn\nimport triton\nimport triton.language as tl\n"

HINGE = '''import torch
import torch.nn as nn

class Model(nn.Module):
    def forward(self, predictions, targets):
        return torch.mean(torch.clamp(1 - predictions * targets, min=0))

def get_inputs():
    return [torch.rand(4096), torch.randint(0, 2, (4096,)).float() * 2 - 1]

def get_init_inputs():
    return []
'''

HINGE_TRITON = HEADER + '''
@triton.jit
def hinge_kernel(p_ptr, t_ptr, out_ptr, n, BLOCK: tl.constexpr):
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < n
        p = tl.load(p_ptr + offs, mask=m, other=0.0)
        t = tl.load(t_ptr + offs, mask=m, other=0.0)
        acc += tl.where(m, tl.maximum(1.0 - p * t, 0.0), 0.0)
    tl.store(out_ptr, tl.sum(acc, axis=0) / n)


class ModelNew(nn.Module):
    def forward(self, predictions, targets):
        p, t = predictions.contiguous(), targets.contiguous()
        out = torch.empty((), device=p.device, dtype=p.dtype)
        hinge_kernel[(1,)](p, t, out, p.numel(), BLOCK=1024)
        return out
'''

ARGMAX = '''import torch
import torch.nn as nn

class Model(nn.Module):
    def forward(self, x):
        return torch.argmax(x, dim=1)

def get_inputs():
    return [torch.randn(64, 300)]

def get_init_inputs():
    return []
'''

ARGMAX_TRITON = HEADER + '''
@triton.jit
def argmax_kernel(x_ptr, out_ptr, cols, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride + offs, mask=offs < cols, other=float("-inf"))
    tl.store(out_ptr + row, tl.argmax(x, axis=0).to(tl.int64))


class ModelNew(nn.Module):
    def forward(self, x):
        x = x.contiguous()
        rows, cols = x.shape
        out = torch.empty(rows, device=x.device, dtype=torch.int64)
        argmax_kernel[(rows,)](x, out, cols, x.stride(0), BLOCK=triton.next_power_of_2(cols))
        return out
'''

# A reference that cannot take heavy-tailed inputs: that input set is dropped. (Outputs
# above malloc's mmap threshold on the CPU path: a small freed output can be handed back
# with its right values still in it, and the decoy check would call the kernel a decoy.)
PICKY = '''import torch
import torch.nn as nn

class Model(nn.Module):
    def forward(self, x):
        if float(x.abs().max()) > 12:
            raise ValueError("out of range")
        return torch.tanh(x)

def get_inputs():
    return [torch.randn(2048, 2048)]

def get_init_inputs():
    return []
'''

TANH_TRITON = HEADER + '''
@triton.jit
def tanh_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m)
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    tl.store(y_ptr + offs, tl.where(x < 0, -t, t), mask=m)


class ModelNew(nn.Module):
    def forward(self, x):
        x = x.contiguous()
        y = torch.empty_like(x)
        tanh_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
        return y
'''


@pytest.fixture(scope="module")
def strict_verifier() -> Iterator[Verifier]:
    v = Verifier(VerifierConfig(devices=[], prewarm=1, min_input_sets=3))
    yield v
    v.close_sync()


def test_a_zero_dim_loss_is_compared(cpu_verifier: Verifier) -> None:
    v = cpu_verifier.verify_sync(Problem(HINGE), Candidate(HINGE_TRITON, "triton"))
    assert v.status is Status.CORRECT, (v.check, v.reason, v.details.get("traceback"))
    wrong = HINGE_TRITON.replace("/ n)", "/ (n + 1))")
    v = cpu_verifier.verify_sync(Problem(HINGE), Candidate(wrong, "triton"))
    assert v.status is Status.INCORRECT and v.check == "rel_norm", (v.check, v.reason)


def test_integer_outputs_are_compared_exactly(cpu_verifier: Verifier) -> None:
    v = cpu_verifier.verify_sync(Problem(ARGMAX), Candidate(ARGMAX_TRITON, "triton"))
    assert v.status is Status.CORRECT, (v.check, v.reason, v.details.get("traceback"))
    argmin = ARGMAX_TRITON.replace("tl.argmax(x,", "tl.argmin(x,").replace(
        'other=float("-inf")', 'other=float("inf")')
    v = cpu_verifier.verify_sync(Problem(ARGMAX), Candidate(argmin, "triton"))
    assert v.status is Status.INCORRECT and v.check in ("rel_norm", "elementwise"), v.reason


def test_a_verdict_lists_its_input_sets(cpu_verifier: Verifier) -> None:
    v = cpu_verifier.verify_sync(Problem(PICKY), Candidate(TANH_TRITON, "triton"))
    assert v.status is Status.CORRECT, (v.check, v.reason)
    labels = [s["label"] for s in v.details["input_sets"]]
    assert "small-heavy" not in labels and len(labels) >= 2
    dropped = v.details["input_sets_dropped"]
    assert [d["label"] for d in dropped] == ["small-heavy"]
    assert "out of range" in dropped[0]["reason"]


def test_too_few_input_sets_is_not_correct(strict_verifier: Verifier) -> None:
    v = strict_verifier.verify_sync(Problem(PICKY), Candidate(TANH_TRITON, "triton"))
    assert v.status is Status.UNCHECKED and v.check == "input_sets", (v.check, v.reason)
    assert "small-heavy" in (v.reason or "")
