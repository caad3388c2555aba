"""Timing helpers that need no GPU: the flush settings and what a held output costs."""

from __future__ import annotations

import pytest
import torch

from kz_stream.verify import Verifier, VerifierConfig
from kz_stream.verify._timing import _held_bytes, check_flush


def test_a_held_output_costs_its_whole_storage_once() -> None:
    base = torch.empty(1000, dtype=torch.float32)
    assert _held_bytes(base[:10]) == 4000  # a view keeps its whole base alive
    assert _held_bytes((base[:10], base[10:20])) == 4000  # one storage, counted once
    assert _held_bytes({"a": base, "b": [torch.empty(5, dtype=torch.int64)], "n": 3}) == 4040


@pytest.mark.parametrize(("mode", "factor"), [("flush", 2), ("read", 0)])
def test_an_impossible_flush_is_refused_when_the_verifier_is_made(mode: str, factor: int) -> None:
    with pytest.raises(ValueError, match="flush"):
        check_flush(mode, factor)
    with pytest.raises(ValueError, match="flush"):
        Verifier(VerifierConfig(l2_flush=mode, l2_flush_factor=factor))  # type: ignore[arg-type]
