"""``kz_stream.testing`` is what the tests and the benchmarks share: its API is pinned, and
neither the tests nor the benchmarks import the other."""

from __future__ import annotations

import re
from pathlib import Path

import kz_stream.testing as testing
import kz_stream.testing.corpus as corpus

ROOT = Path(__file__).resolve().parents[2]


def test_all_is_pinned() -> None:
    assert testing.__all__ == ["corpus", "data_parallel", "tiny"]
    assert corpus.__all__ == ["cheats", "cuda_honest", "degenerate", "full_size", "hostile",
                              "problems", "triton_honest"]


def test_the_corpora_load_without_torch_or_the_tests() -> None:
    from kz_stream.testing.corpus.problems import PROBLEMS
    from kz_stream.testing.corpus.triton_honest import TRITON_HONEST

    assert set(TRITON_HONEST) <= set(PROBLEMS)


def test_tests_and_benchmarks_do_not_import_each_other() -> None:
    pairs = [("benchmarks", "tests"), ("tests", "benchmarks"), ("kz_stream", "tests"),
             ("kz_stream", "benchmarks")]
    for folder, other in pairs:
        pattern = re.compile(rf"^\s*(from|import) {other}(\.|\s)", re.M)
        hits = [str(p.relative_to(ROOT)) for p in (ROOT / folder).rglob("*.py")
                if pattern.search(p.read_text())]
        assert not hits, f"{folder} imports {other}: {hits}"
