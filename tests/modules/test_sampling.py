"""Seeded API-set sampling: reproducible, inside the pool, tilted by the frontier, with a
floor of exploration."""

from __future__ import annotations

from collections import Counter

import pytest

from kz_stream.events import FrontierUpdated
from kz_stream.modules import ApiCatalog, ApiSetSampler, Frontier, default_catalog, parse_pair_key

SMALL = ApiCatalog(
    apis={"a": 10, "b": 10, "c": 5, "d": 1},
    pairs={("a", "b"): 100, ("a", "c"): 10, ("c", "d"): 1},
    triples={("a", "b", "c"): 4, ("a", "c", "d"): 1},
)


def test_same_seed_same_sets_and_sets_come_from_the_pools() -> None:
    a = ApiSetSampler(seed=7).sample_many(50)
    b = ApiSetSampler(seed=7).sample_many(50)
    c = ApiSetSampler(seed=8).sample_many(50)
    assert a == b and a != c
    cat = default_catalog()
    for s in a:
        assert len(s) in (2, 3) and s == sorted(s)
        assert tuple(s) in (cat.pairs if len(s) == 2 else cat.triples)
    assert {len(s) for s in a} == {2, 3}


def test_distribution_without_frontier_follows_tempered_counts() -> None:
    s = ApiSetSampler(SMALL, exploration=0.0, count_exponent=1.0)
    p = s.probabilities(2)
    assert p[("a", "b")] == pytest.approx(100 / 111)
    assert sum(p.values()) == pytest.approx(1.0)


def test_frontier_tilts_mass_and_exploration_keeps_a_floor() -> None:
    eps = 0.2
    s = ApiSetSampler(SMALL, exploration=eps, count_exponent=1.0, frontier_strength=50.0)
    before = s.probabilities(2)
    s.frontier = Frontier({"d": 1.0}, {frozenset({"c", "d"}): 1.0})
    after = s.probabilities(2)
    assert after[("c", "d")] > 5 * before[("c", "d")]
    assert min(after.values()) >= eps / 3 - 1e-12
    # Sampling agrees with the exact distribution.
    counts = Counter(tuple(x) for x in s.sample_many(4000, size=2))
    assert counts[("c", "d")] / 4000 == pytest.approx(after[("c", "d")], abs=0.04)


def test_frontier_from_event_reads_pair_keys_in_any_order() -> None:
    event = FrontierUpdated(
        frontier_version=3,
        weak_apis={"a": 0.5},
        weak_pairs={"d+c": 0.8},
        slow_apis={"a": 0.2, "b": 1.0},
    )
    f = Frontier.from_event(event, slow_weight=0.5)
    assert f.version == 3
    assert f.api_weights == {"a": pytest.approx(0.6), "b": 0.5}
    assert f.pair_weights == {frozenset({"c", "d"}): 0.8}
    assert f.score(["c", "d"]) == pytest.approx(0.8)
    assert parse_pair_key("x|y") == frozenset({"x", "y"})


def test_size_weights_and_pool() -> None:
    s = ApiSetSampler(SMALL, seed=1, size_weights={3: 1.0})
    assert all(len(x) == 3 for x in s.sample_many(20))
    assert s.pool(2) == [("a", "b"), ("a", "c"), ("c", "d")]
    with pytest.raises(ValueError):
        ApiSetSampler(ApiCatalog(apis={}, pairs={}, triples={}))
