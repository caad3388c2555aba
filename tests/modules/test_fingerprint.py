"""Module fingerprints (API set and input specs): an evaluation problem fingerprinted
without being proposed gets the fingerprint validation gives the same module, whatever
its names, parameters or the order of its calls and inputs."""

from __future__ import annotations

from kz_stream.modules import (
    InputSpec,
    ModuleFingerprint,
    fingerprint_modules,
    validate_with_fingerprint,
)

TIMEOUT_S = 120.0

PROBLEM = """\
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, features, out_features):
        super().__init__()
        self.linear = nn.Linear(features, out_features)

    def forward(self, x, scale):
        return torch.sigmoid(self.linear(x)).transpose(0, 1) * scale


def get_inputs():
    return [torch.randn(16, 64), torch.rand(32, 16, dtype=torch.float64)]


def get_init_inputs():
    return [64, 32]
"""
APIS = ("torch.nn.Linear", "torch.sigmoid")  # transpose and * are layout and arithmetic
INPUTS = (InputSpec("float32", (16, 64)), InputSpec("float64", (32, 16)))

# Renamed, re-parametrised and reordered: the same problem in other code.
REWRITTEN = """\
import torch
import torch.nn.functional as F
from torch import nn

B, D = 16, 64


class Model(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.proj = nn.Linear(d_in, d_out, bias=False)

    def forward(self, weight, inp):
        return weight * F.sigmoid(self.proj(inp)).t().double()


def get_inputs():
    return [torch.rand(2 * B, B, dtype=torch.float64), torch.randn(B, D)]


def get_init_inputs():
    return [D, 2 * B]
"""


def test_a_problem_and_a_rewritten_copy_have_one_fingerprint() -> None:
    expected = ModuleFingerprint(apis=APIS, inputs=INPUTS)
    assert fingerprint_modules([PROBLEM, REWRITTEN], timeout_s=TIMEOUT_S) == [expected] * 2
    # Validation's own run of the proposal gives the same value.
    validation, fingerprint = validate_with_fingerprint(REWRITTEN, list(APIS),
                                                        timeout_s=TIMEOUT_S)
    assert validation.valid, validation
    assert fingerprint == expected
    assert str(expected) == ("APIs {torch.nn.Linear, torch.sigmoid} on inputs "
                             "float32[16, 64], float64[32, 16]")


def test_inputs_that_cannot_be_made_on_the_meta_device_are_made_for_real() -> None:
    numpy_inputs = PROBLEM.replace(
        "return [torch.randn(16, 64), torch.rand(32, 16, dtype=torch.float64)]",
        "return [torch.from_numpy(torch.randn(16, 64).numpy()),\n"
        "            torch.rand(32, 16, dtype=torch.float64), 3]",
    )
    failing = PROBLEM.replace("def get_inputs():\n",
                              "def get_inputs():\n    raise RuntimeError('no inputs')\n")
    broken = PROBLEM.replace("def forward(self, x, scale):", "def forward(self, x, scale:")
    found = fingerprint_modules([numpy_inputs, failing, broken], timeout_s=TIMEOUT_S)
    assert found[0] == ModuleFingerprint(apis=APIS, inputs=(*INPUTS, InputSpec("int")))
    assert found[1:] == [None, None]


def test_other_shapes_or_other_apis_are_other_fingerprints() -> None:
    other_shapes = PROBLEM.replace("torch.randn(16, 64)", "torch.randn(8, 64)")
    other_apis = PROBLEM.replace("torch.sigmoid(", "torch.tanh(")
    a, b, c = fingerprint_modules([PROBLEM, other_shapes, other_apis], timeout_s=TIMEOUT_S)
    assert a is not None and b is not None and c is not None
    assert a.apis == b.apis and a.inputs != b.inputs
    assert a.inputs == c.inputs and c.apis == ("torch.nn.Linear", "torch.tanh")
