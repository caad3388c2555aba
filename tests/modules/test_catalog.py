"""Mining the co-occurrence catalog, and the catalog shipped as package data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kz_stream.modules import ApiCatalog, default_catalog, mine_catalog, mine_files

LLAMA_LIKE = '''
import torch
from torch import nn
import torch.nn.functional as F


class FooMLP(nn.Module):
    """Copied under another model name below: must count once."""

    def __init__(self, config: "FooConfig"):
        super().__init__()
        self.up = nn.Linear(8, 8)
        self.down = nn.Linear(8, 8)

    def forward(self, x):
        return self.down(F.silu(self.up(x)))


class FooNorm(nn.Module):
    def forward(self, x):
        v = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(v + 1e-6)


def attention(q, k, v):
    w = torch.softmax(torch.matmul(q, k.transpose(-1, -2)), dim=-1)
    return torch.matmul(w, v)


class NotAModule:
    def helper(self):
        return torch.exp(1)
'''


def _write_models(root: Path) -> list[Path]:
    a = root / "modeling_foo.py"
    a.write_text(LLAMA_LIKE)
    b = root / "modeling_bar.py"
    b.write_text(LLAMA_LIKE.replace("Foo", "Bar").replace('"""Copied', '"""Also copied'))
    return [a, b]


def test_mine_files_counts_documents_and_dedups_copies(tmp_path: Path) -> None:
    cat = mine_files(_write_models(tmp_path), min_pair_count=1, min_triple_count=1)
    # Three documents per file, and the second file is a renamed copy of the first.
    assert cat.meta["documents"] == 6
    assert cat.meta["distinct_documents"] == 3
    assert cat.apis["torch.nn.Linear"] == 1
    assert cat.apis["torch.matmul"] == 1
    assert "torch.exp" not in cat.apis  # classes without forward are not model code
    assert cat.pairs[("torch.nn.Linear", "torch.nn.functional.silu")] == 1
    assert cat.pairs[("torch.mean", "torch.rsqrt")] == 1
    assert ("torch.matmul", "torch.softmax") in cat.pairs
    assert cat.triples == {}  # no document has three (pow is arithmetic, not an API)


def test_min_counts_prune(tmp_path: Path) -> None:
    cat = mine_files(_write_models(tmp_path), min_pair_count=2)
    assert cat.pairs == {}


def test_round_trip(tmp_path: Path) -> None:
    cat = mine_files(_write_models(tmp_path), min_pair_count=1, min_triple_count=1)
    path = cat.save(tmp_path / "cat.json")
    json.loads(path.read_text())  # valid JSON despite the line-per-row layout
    again = ApiCatalog.load(path)
    assert again.apis == cat.apis and again.pairs == cat.pairs and again.triples == cat.triples


def test_shipped_catalog() -> None:
    cat = default_catalog()
    assert cat.meta["packages"].keys() == {"transformers"}
    assert len(cat.apis) > 100 and len(cat.pairs) > 500 and len(cat.triples) > 500
    assert cat.apis["torch.nn.Linear"] == max(cat.apis.values())
    for pair in cat.pairs:
        assert list(pair) == sorted(pair) and set(pair) <= cat.apis.keys()
    for triple in cat.triples:
        assert list(triple) == sorted(triple) and set(triple) <= cat.apis.keys()
    assert all(c >= cat.meta["min_pair_count"] for c in cat.pairs.values())


@pytest.mark.slow
def test_mine_installed_transformers_subset() -> None:
    pytest.importorskip("transformers")
    cat = mine_catalog(
        ["transformers"],
        sources={"transformers": "models/llama/modeling_*.py"},
        min_pair_count=1,
        min_triple_count=1,
    )
    assert cat.meta["files"] == 1
    assert {"torch.nn.Linear", "torch.matmul", "torch.rsqrt"} <= cat.apis.keys()
