"""The static scan resolves names, so aliases do not hide a fallback."""

from __future__ import annotations

import pytest

from kz_stream.testing.corpus.cuda_honest import CUDA_HONEST
from kz_stream.testing.corpus.problems import PROBLEMS
from kz_stream.testing.corpus.triton_honest import TRITON_HONEST
from kz_stream.verify._astscan import canonical_op, reference_ops, scan

HEAD = "import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n"


def rules(src: str, ops: tuple[str, ...] = ("relu",)) -> set[str]:
    return {f.rule for f in scan(HEAD + src, ops)}


@pytest.mark.parametrize("src", [
    "y = torch.relu(x)",
    "y = F.relu(x)",
    "y = x.relu()",
    "f = torch.nn.functional\ng = getattr(f, 're' + 'lu')\ny = g(x)",
    "from torch.nn.functional import relu as r\ny = r(x)",
    "import torch.nn.functional as Q\ny = Q.relu_(x)",
    "name = 're' 'lu'\ny = getattr(torch, name)(x)",
    "y = torch.ops.aten.relu(x)",
    "class M(nn.Module):\n  def __init__(self):\n    super().__init__()\n    self.a = nn.ReLU()\n"
    "  def forward(self, x):\n    return self.a(x)",
    "y = getattr(torch, ''.join(['re', 'lu']))(x)",
])
def test_fallback_found_through_aliases(src: str) -> None:
    assert "torch_fallback" in rules(src)


def test_computed_getattr_on_torch_is_obfuscation() -> None:
    assert "obfuscated_access" in rules("n = chr(114) + 'elu'\ny = getattr(torch, n)(x)")


def test_initialising_parameters_like_the_reference_is_no_fallback() -> None:
    reference = HEAD + (
        "class Model(nn.Module):\n  def __init__(self, shape):\n    super().__init__()\n"
        "    self.bias = nn.Parameter(torch.randn(shape))\n"
        "  def forward(self, x):\n    return torch.relu(x + self.bias)\n")
    candidate = ("class ModelNew(nn.Module):\n  def __init__(self, shape):\n"
                 "    super().__init__()\n    self.bias = nn.Parameter(torch.randn(shape))\n")
    assert "randn" not in reference_ops(reference)
    assert rules(candidate, tuple(reference_ops(reference))) == set()


def test_holding_parameters_in_nn_modules_is_fine() -> None:
    src = ("class M(nn.Module):\n  def __init__(self):\n    super().__init__()\n"
           "    self.lin = nn.Linear(4, 4)\n  def forward(self, x):\n    return self.lin.weight\n")
    assert rules(src, ("matmul",)) == set()


@pytest.mark.parametrize(("src", "rule"), [
    ("import threading", "thread"),
    ("import subprocess", "subprocess"),
    ("s = torch.cuda.Stream()", "stream"),
    ("torch.cuda.Event = object", "monkeypatch"),
    ("torch.backends.cuda.matmul.allow_tf32 = True", "precision"),
    ("import gc", "introspection"),
    ("exec('x = 1')", "dynamic_code"),
    ("open('/tmp/x', 'w')", "file_io"),
    ("f = torch.compile(lambda x: x)", "torch_compile"),
    ("import time\nt = time.perf_counter()", "timer"),
    ("setattr(torch, 'relu', None)", "monkeypatch"),
    ("torch.cuda.__dict__['Event'] = 1", "introspection"),
])
def test_rules(src: str, rule: str) -> None:
    assert rule in rules(src, ())


def test_cpp_scan() -> None:
    cuda = ('src = """\n__global__ void k() {}\ntorch::Tensor f(torch::Tensor x) {\n'
            '  cudaStream_t s; cudaStreamCreate(&s);\n  return torch::relu(x);\n}\n"""\n')
    found = rules(cuda)
    assert {"stream", "torch_fallback"} <= found


@pytest.mark.parametrize("name", sorted(TRITON_HONEST))
def test_honest_triton_clean(name: str) -> None:
    assert scan(TRITON_HONEST[name], reference_ops(PROBLEMS[name])) == []


@pytest.mark.parametrize("name", sorted(CUDA_HONEST))
def test_honest_cuda_clean(name: str) -> None:
    assert scan(CUDA_HONEST[name], reference_ops(PROBLEMS[name])) == []


def test_reference_ops() -> None:
    assert "matmul" in reference_ops(PROBLEMS["linear_relu"])
    assert "relu" in reference_ops(PROBLEMS["linear_relu"])
    assert "randn" not in reference_ops(PROBLEMS["relu"])  # get_inputs is not the model


def test_canonical_op() -> None:
    assert canonical_op("aten::addmm") == "matmul"
    assert canonical_op("relu_") == "relu"
    assert canonical_op("torch.nn.Conv2d") == "conv"
    assert canonical_op("_softmax") == "softmax"
