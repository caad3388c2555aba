"""The AST API resolver: aliases, canonical names, tensor methods, plumbing."""

from __future__ import annotations

from kz_stream.modules import canonical_api, find_api_calls, is_neutral

SOURCE = """
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn import LayerNorm as LN
from torch import matmul as mm

ACT = nn.GELU


class Model(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.ln = LN(d)
        self.act = ACT()
        self.drop = nn.Dropout(0.1)
        self.blocks = nn.ModuleList([torch.nn.modules.conv.Conv1d(d, d, 1)])

    def forward(self, x, y):
        h = self.ln(self.lin(x))
        a = F.softmax(h @ y.transpose(-1, -2), dim=-1)
        b = mm(a, y).relu_()
        c = torch.sum(b, dim=1).view(-1)
        d = x.softmax(-1) + F.gelu(c).exp()
        e = d.to(torch.float32).size(0) + torch.zeros(3).sum()
        z = [1, 2]
        z.append(3)
        s = "a,b".split(",")
        self.helper(x)
        return d
"""


def test_aliases_and_canonical_names() -> None:
    use = find_api_calls(SOURCE)
    assert set(use.apis) == {
        "torch.nn.Linear",
        "torch.nn.LayerNorm",
        "torch.nn.GELU",
        "torch.nn.Conv1d",
        "torch.softmax",  # F.softmax and x.softmax() are one API
        "torch.matmul",  # `@` and `mm` (an alias of torch.matmul)
        "torch.relu",  # relu_ is relu
        "torch.sum",
        "torch.exp",
        "torch.nn.functional.gelu",  # no torch.gelu, so it keeps its path
    }
    assert set(use.neutral) == {"torch.transpose", "torch.Tensor.view"}


def test_plumbing_is_not_an_api() -> None:
    for path in (
        "torch.zeros",
        "torch.randn",
        "torch.nn.Dropout",
        "torch.nn.ModuleList",
        "torch.nn.init.normal_",
        "torch.Tensor.size",
        "torch.Tensor.to",
        "torch.float32",
        "torch.no_grad",
    ):
        assert canonical_api(path) is None, path


def test_ambiguous_methods_are_not_tensor_methods() -> None:
    # `.add()` could be a set's, `.split()` a string's, `.apply()` a module's.
    use = find_api_calls("s = set()\ns.add(1)\nx = 'a'.split()\nm.apply(f)\nt.sigmoid()\n")
    assert use.apis == ["torch.sigmoid"]


def test_neutral_classification() -> None:
    assert is_neutral("torch.transpose")
    assert is_neutral("torch.cat")
    assert is_neutral("torch.mul")
    assert not is_neutral("torch.softmax")
