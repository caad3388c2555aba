"""The evaluation estimators against values computed by hand."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest

from kz_stream.evaluation import (
    ProblemResult,
    clustered_difference_in_se,
    difference_in_se,
    fast_p,
    geomean_speedup,
    pass_at_k,
    summarize,
    summarize_levels,
)


def problem(pid: str, level: int | None, *samples: tuple[bool, float | None]) -> ProblemResult:
    return ProblemResult(pid, level, tuple(c for c, _ in samples), tuple(s for _, s in samples))


def test_pass_at_k_hand_values() -> None:
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    # 1 - C(7,5)/C(10,5) = 1 - 21/252
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)
    assert pass_at_k(10, 3, 10) == 1.0  # fewer than k wrong samples: some draw is correct
    assert pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)  # 1 - C(2,2)/C(4,2)
    assert pass_at_k(5, 0, 1) == 0.0
    assert pass_at_k(5, 5, 5) == 1.0
    assert pass_at_k(5, 2, 10) is None  # n < k: undefined, not guessed
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)


def test_pass_at_k_is_stable_where_binomials_are_huge() -> None:
    n, c, k = 1000, 10, 100
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12)


def test_fast_p_counts_correct_and_faster_samples() -> None:
    r = problem("p", 1, (True, 0.5), (True, 1.2), (False, 3.0), (True, None))
    assert fast_p(r, 0) == 0.75  # correct rate, timed or not
    assert fast_p(r, 1) == 0.25  # only the correct 1.2x; the wrong 3.0x does not count
    assert fast_p(r, 1.5) == 0.0
    assert fast_p(r, 2) == 0.0


def test_geomean_speedup_and_seeded_bootstrap() -> None:
    a = problem("a", 1, (True, 0.5), (True, 2.0), (False, 9.0))
    b = problem("b", 1, (True, 4.0), (False, None))
    point, ci = geomean_speedup([a, b], seed=1)
    assert point == pytest.approx((0.5 * 2.0 * 4.0) ** (1 / 3))
    assert ci is not None and ci[0] <= point <= ci[1]
    # Resampling problems: the interval's ends are geomeans of a only (1.0) and b only (4.0).
    assert ci[0] == pytest.approx(1.0) and ci[1] == pytest.approx(4.0)
    assert geomean_speedup([a, b], seed=1) == (point, ci)  # same seed, same interval
    assert geomean_speedup([problem("c", 1, (True, None), (False, 2.0))]) == (None, None)


def test_summaries_per_level_and_overall() -> None:
    p1 = problem("1_A", 1, (True, 1.2), (False, None))
    p2 = problem("2_B", 1, (False, None), (False, None))
    p3 = problem("1_C", 2, (True, 2.5), (True, 0.8))
    levels = summarize_levels([p1, p2, p3])
    assert list(levels) == ["level 1", "level 2", "overall"]
    l1, l2, overall = levels["level 1"], levels["level 2"], levels["overall"]
    assert (l1.problems, l1.samples, l1.correct) == (2, 4, 1)
    assert l1.pass_at[1] == pytest.approx(0.25)  # mean of 1/2 and 0
    assert l1.pass_at[5] is None  # two samples cannot give pass@5
    assert l1.fast[1.0] == pytest.approx(0.25)
    assert l2.pass_at[1] == 1.0 and l2.fast[2.0] == pytest.approx(0.5)
    assert overall.pass_at[1] == pytest.approx((0.5 + 0 + 1) / 3)
    assert overall.fast[0.0] == pytest.approx((0.5 + 0 + 1) / 3)
    assert overall.fast[1.5] == pytest.approx((0 + 0 + 0.5) / 3)
    assert overall.geomean == pytest.approx((1.2 * 2.5 * 0.8) ** (1 / 3))
    assert overall.timed == 3
    d = overall.as_dict()
    assert d["pass@1"] == overall.pass_at[1] and d["fast_1.5"] == overall.fast[1.5]
    empty = summarize([])  # no problem judged yet: nothing is estimated, nothing is 0
    assert empty.problems == 0 and set(empty.fast.values()) == {None}
    assert empty.pass_at[1] is None and empty.geomean is None


def test_kernelbench_rule_counts_beside_the_hardened_verdict() -> None:
    results = [
        ProblemResult("a", 1, (True, False, False), (1.2, None, None), (True, True, None)),
        ProblemResult("b", 1, (False,), (None,), (False,)),
    ]
    m = summarize(results)
    assert m.kernelbench_correct == 2  # a's first two samples
    assert m.kernelbench_only == 1  # a's second: KernelBench's rule accepts, ours does not
    assert m.as_dict()["kernelbench_only"] == 1


def test_speedups_against_the_compiled_reference_by_hand() -> None:
    # a: correct kernels at 2.0x and 0.5x the compiled reference; its wrong 3.0x never counts.
    a = ProblemResult("a", 1, (True, True, False), (4.0, 1.0, 6.0), vs_compile=(2.0, 0.5, 3.0))
    # b: a correct 1.5x; its second sample has no entry (not timed): None.
    b = ProblemResult("b", 1, (True, False), (3.0, None), vs_compile=(1.5,))
    # c: its compiled baseline failed: left out of every vs-compile figure, not "slower".
    c = ProblemResult("c", 2, (True,), (2.0,), vs_compile=(None,), compile_failed=True)
    assert b.speedups_against("compile") == (1.5, None)
    assert fast_p(a, 1.0, "compile") == pytest.approx(1 / 3)  # only the correct 2.0x
    assert fast_p(a, 1.0) == pytest.approx(1 / 3)  # against eager: 4.0x (1.0x is not > 1)
    m = summarize([a, b, c])
    assert m.compile_timed == 3 and m.compile_failed == 1
    assert m.compile_geomean == pytest.approx((2.0 * 0.5 * 1.5) ** (1 / 3))
    assert m.fast_compile == pytest.approx((1 / 3 + 1 / 2) / 2)  # a and b; c left out
    # Resampling a and b: the interval's ends are geomeans of a only (1.0) and b only (1.5).
    assert m.compile_geomean_ci == pytest.approx((1.0, 1.5))
    # Against eager nothing changes: c counts there.
    assert m.geomean == pytest.approx((4.0 * 1.0 * 3.0 * 2.0) ** (1 / 4))
    assert m.fast[1.0] == pytest.approx((1 / 3 + 1 / 2 + 1) / 3)
    d = m.as_dict()
    assert d["fast_1_vs_compile"] == m.fast_compile
    assert d["geomean_speedup_vs_compile"] == m.compile_geomean
    assert d["geomean_speedup_vs_compile_ci"] == list(m.compile_geomean_ci or ())
    assert (d["timed_vs_compile"], d["compile_baseline_failed"]) == (3, 1)


def test_one_estimator_for_both_baselines() -> None:
    """The compiled baseline's geomean and interval are the eager code run on
    speedup_vs_compile: the same numbers for the same speedups, seed for seed."""
    runs = [((True, True, False), (2.0, 0.5, 3.0)), ((True, False), (1.5, None)),
            ((False,), (None,)), ((True, True), (0.8, 1.1))]
    on_compile = [ProblemResult(f"p{i}", 1, ok, (9.0,) * len(ok), vs_compile=s)
                  for i, (ok, s) in enumerate(runs)]
    as_eager = [ProblemResult(f"p{i}", 1, ok, s) for i, (ok, s) in enumerate(runs)]
    for seed in (0, 3):
        assert (geomean_speedup(on_compile, seed=seed, baseline="compile")
                == geomean_speedup(as_eager, seed=seed))
    assert summarize(on_compile).fast_compile == summarize(as_eager).fast[1.0]


def test_no_compiled_baseline_is_not_estimated() -> None:
    a = ProblemResult("a", 1, (True, False), (1.2, None), vs_compile=(0.9, None))
    off = summarize([a], compile_baseline=False)  # a run without --compile-baseline
    assert (off.fast_compile, off.compile_geomean, off.compile_geomean_ci) == (None, None, None)
    assert (off.compile_timed, off.compile_failed) == (0, 0)
    failed = ProblemResult("f", 1, (True,), (1.2,), compile_failed=True)
    only_failed = summarize([failed])  # every problem's baseline failed: nothing to average
    assert only_failed.fast_compile is None and only_failed.compile_geomean is None
    assert only_failed.compile_failed == 1
    # With the baseline on, a problem with no correct kernel counts as 0 (as in fast_p).
    none_correct = summarize([ProblemResult("n", 1, (False, False), (None, None)), a])
    assert none_correct.fast_compile == pytest.approx((0 + 0) / 2)
    assert none_correct.compile_geomean == pytest.approx(0.9)


def test_the_difference_of_two_pass_rates_in_binomial_standard_errors() -> None:
    # 9/42 against 6/81: (0.2143 - 0.0741) / sqrt(p1 q1 / 42 + p2 q2 / 81)
    p1, p2 = 9 / 42, 6 / 81
    se = math.sqrt(p1 * (1 - p1) / 42 + p2 * (1 - p2) / 81)
    assert difference_in_se(9, 42, 6, 81) == pytest.approx((p1 - p2) / se)
    assert difference_in_se(0, 10, 0, 10) is None  # no spread: no SE
    assert difference_in_se(1, 0, 1, 5) is None


def test_clustered_by_groups_of_one_it_is_the_binomial_with_a_small_sample_factor() -> None:
    treated = [(1, 1)] * 9 + [(1, 0)] * 33
    control = [(1, 1)] * 6 + [(1, 0)] * 75
    p1, p2 = 9 / 42, 6 / 81
    se = math.sqrt(p1 * (1 - p1) / 42 * 42 / 41 + p2 * (1 - p2) / 81 * 81 / 80)
    assert clustered_difference_in_se(treated, control) == pytest.approx((p1 - p2) / se)


def test_clustered_groups_that_pass_or_fail_whole_count_as_one_sample_each() -> None:
    # Four groups of four that pass or fail together carry four samples' worth of evidence,
    # not sixteen: the SE is the one of four kernels, and the difference shrinks in SE.
    whole = [(4, 4), (4, 0), (4, 0), (4, 0)]
    spread = [(4, 1)] * 4
    z_whole = clustered_difference_in_se(whole, [(4, 0)] * 4)
    z_binomial = difference_in_se(4, 16, 0, 16)
    assert z_binomial is not None and z_whole is not None
    # Per arm: p = 1/4, residuals (3, -1, -1, -1) -> sum 12; var = 4/3 * 12 / 16^2
    assert z_whole == pytest.approx(0.25 / math.sqrt(4 / 3 * 12 / 256))
    assert z_whole < z_binomial
    # Groups that each hold one pass of four vary not at all between groups.
    assert clustered_difference_in_se(spread, spread) is None


def test_clustered_with_under_two_groups_an_arm_has_no_standard_error() -> None:
    assert clustered_difference_in_se([(4, 2)], [(4, 1), (4, 0)]) is None
    assert clustered_difference_in_se([], [(4, 1), (4, 0)]) is None
