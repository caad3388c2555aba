"""Seeded sampling of 2- and 3-API sets from the catalog, tilted toward the frontier.

For a pool of sets ``S`` of one size (the catalog's pairs or triples) the probability of
``s`` is::

    p(s) = (1 - ε) · q(s) + ε / |S|
    q(s) ∝ count(s)^τ · (1 + λ · f(s))
    f(s) = mean over a in s of w_api(a) + sum over pairs {a, b} ⊂ s of w_pair({a, b})

``τ < 1`` flattens the heavy head of the co-occurrence counts (nn.Linear is everywhere),
``λ`` is how hard the frontier pulls, and ``ε`` is the exploration floor: every set in the
pool keeps at least ``ε / |S|`` probability whatever the frontier says. With the same seed,
catalog and sequence of frontiers, the samples are the same.
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kz_stream.modules._catalog import ApiCatalog, default_catalog

if TYPE_CHECKING:
    from kz_stream.events import FrontierUpdated

__all__ = ["ApiSetSampler", "Frontier", "parse_pair_key"]


def parse_pair_key(key: str) -> frozenset[str]:
    """Parses ``"a+b"`` (or ``"a|b"``), in any order, into a set of APIs."""
    sep = "+" if "+" in key else "|"
    return frozenset(p.strip() for p in key.split(sep) if p.strip())


@dataclass(frozen=True)
class Frontier:
    """Weakness weights (typically 0..1): per API and per API pair."""

    api_weights: Mapping[str, float] = field(default_factory=dict)
    pair_weights: Mapping[frozenset[str], float] = field(default_factory=dict)
    version: int = 0

    @classmethod
    def from_event(cls, event: FrontierUpdated, *, slow_weight: float = 0.5) -> Frontier:
        """Builds the tilt from ``FrontierUpdated``: weakness plus ``slow_weight`` x slowness
        (a speed-aware frontier: APIs the Coder gets right but slow also attract modules)."""
        apis: dict[str, float] = dict(event.weak_apis)
        for api, w in event.slow_apis.items():
            apis[api] = apis.get(api, 0.0) + slow_weight * w
        pairs = {parse_pair_key(k): float(w) for k, w in event.weak_pairs.items()}
        return cls(apis, pairs, event.frontier_version)

    def score(self, api_set: Sequence[str]) -> float:
        """``f(s)``: mean API weakness plus the weakness of every pair inside the set."""
        if not api_set:
            return 0.0
        total = sum(self.api_weights.get(a, 0.0) for a in api_set) / len(api_set)
        if self.pair_weights:
            for a, b in itertools.combinations(api_set, 2):
                total += self.pair_weights.get(frozenset((a, b)), 0.0)
        return max(0.0, total)


class ApiSetSampler:
    """Draws API sets (sorted lists of canonical names) of size 2 or 3."""

    def __init__(
        self,
        catalog: ApiCatalog | None = None,
        *,
        seed: int = 0,
        exploration: float = 0.1,
        count_exponent: float = 0.5,
        frontier_strength: float = 4.0,
        size_weights: Mapping[int, float] | None = None,
        frontier: Frontier | None = None,
    ) -> None:
        if not 0.0 <= exploration <= 1.0:
            raise ValueError("exploration must be in [0, 1]")
        catalog = catalog or default_catalog()
        self._pools: dict[int, list[tuple[str, ...]]] = {}
        self._base: dict[int, list[float]] = {}
        by_size: dict[int, dict[tuple[str, ...], int]] = {
            2: dict(catalog.pairs.items()),
            3: dict(catalog.triples.items()),
        }
        for size, counts in by_size.items():
            if counts:
                keys = sorted(counts)
                self._pools[size] = keys
                self._base[size] = [float(counts[k]) ** count_exponent for k in keys]
        if not self._pools:
            raise ValueError("the catalog has no pairs or triples")
        weights = dict(size_weights or {2: 0.5, 3: 0.5})
        self._sizes = [s for s in sorted(weights) if s in self._pools and weights[s] > 0]
        if not self._sizes:
            raise ValueError("no pool for the requested sizes")
        self._size_cum = list(itertools.accumulate(weights[s] for s in self._sizes))
        self._rng = random.Random(seed)
        self._eps = exploration
        self._lambda = frontier_strength
        self._cum: dict[int, list[float]] = {}
        self.frontier = frontier or Frontier()

    @property
    def frontier(self) -> Frontier:
        return self._frontier

    @frontier.setter
    def frontier(self, frontier: Frontier) -> None:
        self._frontier = frontier
        self._cum = {}  # recomputed lazily per size

    def pool(self, size: int) -> list[tuple[str, ...]]:
        """Every set of this size that can be drawn (the paper's 2-API / 3-API lists)."""
        return list(self._pools[size])

    def _weights(self, size: int) -> list[float]:
        f = self._frontier
        return [
            b * (1.0 + self._lambda * f.score(k))
            for k, b in zip(self._pools[size], self._base[size], strict=True)
        ]

    def probabilities(self, size: int) -> dict[tuple[str, ...], float]:
        """The exact distribution ``p(s)`` over this size's pool."""
        w = self._weights(size)
        total = sum(w)
        n = len(w)
        return {
            k: (1 - self._eps) * wi / total + self._eps / n
            for k, wi in zip(self._pools[size], w, strict=True)
        }

    def sample(self, size: int | None = None) -> list[str]:
        """Draws one API set; ``size`` None picks 2 or 3 by ``size_weights``."""
        if size is None:
            r = self._rng.random() * self._size_cum[-1]
            size = self._sizes[bisect.bisect_right(self._size_cum, r)]
        pool = self._pools.get(size)
        if pool is None:
            raise ValueError(f"no API sets of size {size} in the catalog")
        if self._rng.random() < self._eps:
            return list(pool[self._rng.randrange(len(pool))])
        cum = self._cum.get(size)
        if cum is None:
            cum = self._cum[size] = list(itertools.accumulate(self._weights(size)))
        i = bisect.bisect_right(cum, self._rng.random() * cum[-1])
        return list(pool[min(i, len(pool) - 1)])

    def sample_many(self, k: int, size: int | None = None) -> list[list[str]]:
        return [self.sample(size) for _ in range(k)]
