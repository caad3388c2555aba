"""Evaluation metrics as the field reports them: unbiased pass@k, fast_p and the
geometric-mean speedup of correct kernels with a bootstrap interval.

Definitions (``docs/evaluation.md`` says why each was chosen):

- pass@k of one problem with ``n`` samples, ``c`` of them correct, is Chen et al. (2021)'s
  unbiased estimator ``1 - C(n-c, k) / C(n, k)``; undefined (None) when ``n < k``. A
  suite's pass@k is the mean over its problems that have at least ``k`` samples.
- fast_p of one problem is the share of its samples that are correct *and* measured
  faster than eager PyTorch by more than ``p`` (speedup > p); a suite's fast_p is the mean
  over problems. With one sample per problem this is KernelBench's fast_p; with several it
  is the expected fast_p of one sample drawn per problem. fast_0 is the correct rate.
  A correct kernel with no measured speedup (no GPU) counts towards fast_0 only.
- The geometric-mean speedup pools every correct kernel with a measured speedup; its 95%
  interval is a percentile bootstrap that resamples problems (samples of one problem are
  not independent), seeded so reports are reproducible.
- Against ``torch.compile`` of the reference (``baseline="compile"``): the same estimators
  on each sample's ``speedup_vs_compile`` (the verifier's speedup over eager divided by the
  problem's compile speedup, both timed by it). A problem whose compiled baseline failed
  (``ProblemResult.compile_failed``) has no compiled baseline: it is left out of these
  metrics (not counted as slower). fast_1 vs compile is the mean over the other problems.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

__all__ = [
    "COMPILE_FAST_P",
    "FAST_P",
    "PASS_K",
    "Baseline",
    "ProblemResult",
    "SuiteMetrics",
    "fast_p",
    "geomean_speedup",
    "level_name",
    "pass_at_k",
    "summarize",
    "summarize_levels",
]

PASS_K: tuple[int, ...] = (1, 5, 10)
FAST_P: tuple[float, ...] = (0.0, 1.0, 1.5, 2.0)
# What a speedup is measured against: eager PyTorch (the verdict's speedup) or the
# reference under torch.compile (details.speedup_vs_compile).
Baseline = Literal["eager", "compile"]
# fast_p against the compiled reference is reported for this p.
COMPILE_FAST_P = 1.0


@dataclass(frozen=True)
class ProblemResult:
    """The verdicts of one problem's samples: correctness and speedup (None: not timed)."""

    problem_id: str
    level: int | None
    correct: tuple[bool, ...]
    speedups: tuple[float | None, ...]
    # KernelBench's own rule per sample (its allclose at 1e-2 on its own inputs); None
    # where the verdict came before any output (static scan, build, load).
    kernelbench: tuple[bool | None, ...] = ()
    # Speedup over the reference under torch.compile per sample (None: not measured);
    # missing trailing samples count as None.
    vs_compile: tuple[float | None, ...] = ()
    # The problem's compiled baseline failed and none was measured: no compiled baseline.
    compile_failed: bool = False

    @property
    def n(self) -> int:
        return len(self.correct)

    @property
    def c(self) -> int:
        return sum(self.correct)

    def speedups_against(self, baseline: Baseline = "eager") -> tuple[float | None, ...]:
        """Each sample's speedup over ``baseline`` (None: not measured)."""
        if baseline == "eager":
            return self.speedups
        return (*self.vs_compile[:self.n], *(None,) * (self.n - len(self.vs_compile)))


def pass_at_k(n: int, c: int, k: int) -> float | None:
    """Chen et al.'s unbiased pass@k for ``c`` correct of ``n`` samples; None if n < k.

    Computed as the product ``prod_{i=n-c+1}^{n} (1 - k/i)`` (their numerically stable
    form), which never forms the large binomials.
    """
    if k < 1 or c < 0 or c > n:
        raise ValueError(f"need k >= 1 and 0 <= c <= n (n={n}, c={c}, k={k})")
    if n < k:
        return None
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def fast_p(result: ProblemResult, p: float, baseline: Baseline = "eager") -> float:
    """The share of a problem's samples that are correct with a measured speedup over
    ``baseline`` > p (p = 0: correct, timed or not)."""
    if result.n == 0:
        return 0.0
    hits = sum(
        ok and (p == 0 or (s is not None and s > p))
        for ok, s in zip(result.correct, result.speedups_against(baseline), strict=True)
    )
    return hits / result.n


def _correct_log_speedups(result: ProblemResult, baseline: Baseline = "eager") -> list[float]:
    return [
        math.log(s)
        for ok, s in zip(result.correct, result.speedups_against(baseline), strict=True)
        if ok and s is not None and s > 0
    ]


def geomean_speedup(
    results: Sequence[ProblemResult], *, resamples: int = 2000, seed: int = 0,
    baseline: Baseline = "eager",
) -> tuple[float | None, tuple[float, float] | None]:
    """The geometric mean speedup over ``baseline`` of correct, timed kernels and its 95%
    bootstrap interval (problems resampled with replacement); (None, None) when there is
    none. Against the compiled reference, problems whose compiled baseline failed are left
    out (they have none)."""
    if baseline == "compile":
        results = [r for r in results if not r.compile_failed]
    logs = [_correct_log_speedups(r, baseline) for r in results]
    pooled = [x for xs in logs for x in xs]
    if not pooled:
        return None, None
    point = math.exp(sum(pooled) / len(pooled))
    sums = np.array([sum(xs) for xs in logs])
    counts = np.array([len(xs) for xs in logs])
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(results), size=(resamples, len(results)))
    total, count = sums[picks].sum(axis=1), counts[picks].sum(axis=1)
    means = total[count > 0] / count[count > 0]  # a resample with no correct kernel has none
    lo, hi = np.percentile(means, [2.5, 97.5])
    return point, (math.exp(float(lo)), math.exp(float(hi)))


@dataclass(frozen=True)
class SuiteMetrics:
    """The metrics of a set of problems (a level, or the whole suite)."""

    problems: int
    samples: int
    correct: int
    timed: int  # correct kernels with a measured speedup
    kernelbench_correct: int = 0  # samples KernelBench's rule accepts
    kernelbench_only: int = 0  # ... that the hardened verdict rejects
    pass_at: dict[int, float | None] = field(default_factory=dict)
    fast: dict[float, float | None] = field(default_factory=dict)  # None: no problem
    geomean: float | None = None
    geomean_ci: tuple[float, float] | None = None
    # Against the reference under torch.compile (None: no compiled baseline in the run).
    compile_timed: int = 0  # correct kernels with a speedup vs compile
    compile_failed: int = 0  # problems whose compiled baseline failed (left out)
    fast_compile: float | None = None  # fast_1 vs compile
    compile_geomean: float | None = None
    compile_geomean_ci: tuple[float, float] | None = None

    def as_dict(self) -> dict[str, object]:
        """A JSON-ready dict (keys ``pass@k``, ``fast_p``)."""
        return {
            "problems": self.problems,
            "samples": self.samples,
            "correct": self.correct,
            "timed": self.timed,
            "kernelbench_correct": self.kernelbench_correct,
            "kernelbench_only": self.kernelbench_only,
            **{f"pass@{k}": v for k, v in self.pass_at.items()},
            **{f"fast_{p:g}": v for p, v in self.fast.items()},
            "geomean_speedup": self.geomean,
            "geomean_speedup_ci": list(self.geomean_ci) if self.geomean_ci else None,
            "timed_vs_compile": self.compile_timed,
            "compile_baseline_failed": self.compile_failed,
            f"fast_{COMPILE_FAST_P:g}_vs_compile": self.fast_compile,
            "geomean_speedup_vs_compile": self.compile_geomean,
            "geomean_speedup_vs_compile_ci": (list(self.compile_geomean_ci)
                                              if self.compile_geomean_ci else None),
        }


def summarize(
    results: Sequence[ProblemResult],
    *,
    ks: Iterable[int] = PASS_K,
    ps: Iterable[float] = FAST_P,
    seed: int = 0,
    compile_baseline: bool = True,
) -> SuiteMetrics:
    """pass@k, fast_p and geomean speedup over ``results`` (means over problems), and,
    unless the run had no ``compile_baseline``, fast_1 and the geomean against the
    compiled reference over the problems whose compiled baseline did not fail."""
    pass_at: dict[int, float | None] = {}
    for k in ks:
        values = [v for r in results if (v := pass_at_k(r.n, r.c, k)) is not None]
        pass_at[k] = sum(values) / len(values) if values else None
    fast = {p: (sum(fast_p(r, p) for r in results) / len(results) if results else None)
            for p in ps}
    geo, ci = geomean_speedup(results, seed=seed)
    with_compile = [r for r in results if not r.compile_failed] if compile_baseline else []
    fast_compile = (sum(fast_p(r, COMPILE_FAST_P, "compile") for r in with_compile)
                    / len(with_compile) if with_compile else None)
    compile_geo, compile_ci = geomean_speedup(with_compile, seed=seed, baseline="compile")
    return SuiteMetrics(
        problems=len(results),
        samples=sum(r.n for r in results),
        correct=sum(r.c for r in results),
        timed=sum(len(_correct_log_speedups(r)) for r in results),
        kernelbench_correct=sum(bool(k) for r in results for k in r.kernelbench),
        kernelbench_only=sum(bool(k) and not ok for r in results
                             for ok, k in zip(r.correct, r.kernelbench, strict=False)),
        pass_at=pass_at,
        fast=fast,
        geomean=geo,
        geomean_ci=ci,
        compile_timed=sum(len(_correct_log_speedups(r, "compile")) for r in with_compile),
        compile_failed=sum(r.compile_failed for r in results) if compile_baseline else 0,
        fast_compile=fast_compile,
        compile_geomean=compile_geo,
        compile_geomean_ci=compile_ci,
    )


def level_name(level: int | None) -> str:
    """A level's row name in reports."""
    return f"level {level}" if level is not None else "no level"


def summarize_levels(
    results: Sequence[ProblemResult], *, seed: int = 0, compile_baseline: bool = True
) -> Mapping[str, SuiteMetrics]:
    """Metrics per level (``"level N"``, in level order) and ``"overall"``."""
    levels = sorted({r.level for r in results}, key=lambda v: (v is None, v or 0))
    out: dict[str, SuiteMetrics] = {}
    for level in levels:
        out[level_name(level)] = summarize([r for r in results if r.level == level], seed=seed,
                                           compile_baseline=compile_baseline)
    out["overall"] = summarize(results, seed=seed, compile_baseline=compile_baseline)
    return out


def difference_in_se(c1: int, n1: int, c2: int, n2: int) -> float | None:
    """(p1 - p2) / SE of two binomial pass rates, c of n each; None when SE is 0."""
    if not (n1 and n2):
        return None
    p1, p2 = c1 / n1, c2 / n2
    se = math.sqrt(p1 * (1 - p1) / n1 + p2 * (1 - p2) / n2)
    return (p1 - p2) / se if se > 0 else None


def clustered_difference_in_se(treated: list[tuple[int, int]],
                               control: list[tuple[int, int]]) -> float | None:
    """(p1 - p2) / SE with each arm's pass rate a ratio over clusters, (kernels, correct)
    per cluster: the kernels of one group share a module and a prompt, so they are not
    independent, and the binomial SE understates the spread. Each arm's SE is the
    cluster-robust (ratio-estimator) one; None when an arm has under two clusters or
    the SE is 0."""

    def rate_and_var(clusters: list[tuple[int, int]]) -> tuple[float, float] | None:
        m = len(clusters)
        n = sum(k for k, _ in clusters)
        if m < 2 or not n:
            return None
        p = sum(c for _, c in clusters) / n
        resid = sum((c - p * k) ** 2 for k, c in clusters)
        return p, resid * m / ((m - 1) * n * n)

    a, b = rate_and_var(treated), rate_and_var(control)
    if a is None or b is None or a[1] + b[1] <= 0:
        return None
    return (a[0] - b[0]) / math.sqrt(a[1] + b[1])
