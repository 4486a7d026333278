"""Evaluation statistics: pass@k against brute force, bootstrap intervals, diversity."""

from __future__ import annotations

import math
from itertools import combinations

import numpy as np
import pytest

from aepo_core.metrics import (
    bootstrap_ci,
    distinct_sequences,
    holm_adjust,
    mean_pass_at_k,
    paired_bootstrap_diff,
    pass_at_k,
    student_t_quantile,
    t_interval,
    t_test_p,
)


def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """Fraction of all k-subsets of n samples (the first c correct) that contain a correct sample."""
    subsets = list(combinations(range(n), k))
    return sum(any(i < c for i in subset) for subset in subsets) / len(subsets)


@pytest.mark.parametrize(
    ("n", "c", "k"),
    [(1, 0, 1), (1, 1, 1), (5, 0, 1), (5, 1, 1), (5, 2, 3), (5, 3, 5), (6, 1, 5), (8, 3, 2), (10, 4, 4),
     (12, 6, 5), (12, 11, 1), (12, 12, 12)],
)
def test_pass_at_k_matches_enumeration(n: int, c: int, k: int) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k), abs=1e-12)


def test_pass_at_k_closed_forms() -> None:
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)  # pass@1 is the fraction correct
    assert pass_at_k(5, 1, 5) == 1.0
    assert pass_at_k(5, 0, 5) == 0.0
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6


def test_pass_at_k_is_stable_for_large_n() -> None:
    # C(1000, 500) overflows a float; the product form does not
    value = pass_at_k(1000, 1, 500)
    assert value == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("n", "c", "k", "message"),
    [(5, 6, 1, "0 <= c <= n"), (5, -1, 1, "0 <= c <= n"), (5, 2, 0, "1 <= k <= n"), (5, 2, 6, "1 <= k <= n"),
     (5.0, 2, 1, "integer")],
)
def test_pass_at_k_validation(n: int, c: int, k: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        pass_at_k(n, c, k)


def test_mean_pass_at_k() -> None:
    assert mean_pass_at_k([0, 5, 2], n=5, k=1) == pytest.approx((0.0 + 1.0 + 0.4) / 3)
    with pytest.raises(ValueError, match="at least one"):
        mean_pass_at_k([], n=5, k=1)


def test_bootstrap_ci_contains_point_and_is_deterministic() -> None:
    values = np.random.default_rng(7).normal(loc=0.3, scale=1.0, size=200)
    point, low, high = bootstrap_ci(values, seed=3)
    assert point == pytest.approx(float(np.mean(values)))
    assert low < point < high
    assert bootstrap_ci(values, seed=3) == (point, low, high)
    assert bootstrap_ci(values, seed=4) != (point, low, high)


def test_bootstrap_ci_narrows_with_lower_confidence() -> None:
    values = [0.0, 1.0] * 50
    _, low95, high95 = bootstrap_ci(values, confidence=0.95)
    _, low50, high50 = bootstrap_ci(values, confidence=0.5)
    assert low95 < low50 < 0.5 < high50 < high95


def test_bootstrap_ci_constant_data_and_statistic() -> None:
    assert bootstrap_ci([2.0, 2.0, 2.0]) == (2.0, 2.0, 2.0)
    point, low, high = bootstrap_ci([1.0, 2.0, 3.0, 100.0], statistic=lambda a: float(np.median(a)))
    assert point == 2.5
    assert 1.0 <= low <= point <= high <= 100.0


def test_bootstrap_ci_validation() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        bootstrap_ci([])
    with pytest.raises(ValueError, match="confidence"):
        bootstrap_ci([1.0], confidence=1.0)
    with pytest.raises(ValueError, match="n_resamples"):
        bootstrap_ci([1.0], n_resamples=0)


def test_paired_bootstrap_diff() -> None:
    a = np.random.default_rng(1).random(50)
    assert paired_bootstrap_diff(a, a) == (0.0, 0.0, 0.0)
    point, low, high = paired_bootstrap_diff(a + 0.1, a)
    assert point == pytest.approx(0.1)
    assert low == pytest.approx(0.1) and high == pytest.approx(0.1)  # a constant shift has no variance
    b = np.random.default_rng(2).random(50)
    point, low, high = paired_bootstrap_diff(a, b, seed=5)
    assert point == pytest.approx(float(np.mean(a - b)))
    assert low <= point <= high
    with pytest.raises(ValueError, match="same questions"):
        paired_bootstrap_diff([1.0, 2.0], [1.0])


def test_distinct_sequences() -> None:
    group = [["search", "python"], ("search", "python"), ["python", "search"], [], [], ["search"]]
    assert distinct_sequences(group) == 4
    assert distinct_sequences([]) == 0


@pytest.mark.parametrize(("df", "q", "expected"), [
    # Student's t quantiles (tables of Fisher & Yates; R's qt to 4 decimals)
    (1, 0.975, 12.7062), (2, 0.975, 4.3027), (4, 0.975, 2.7764), (9, 0.975, 2.2622), (30, 0.975, 2.0423),
    (4, 0.95, 2.1318), (10, 0.995, 3.1693), (1, 0.75, 1.0), (4, 0.5, 0.0), (4, 0.025, -2.7764)])
def test_student_t_quantile_matches_tables(df: int, q: float, expected: float) -> None:
    assert student_t_quantile(q, df) == pytest.approx(expected, abs=2e-4)


def test_student_t_quantile_tends_to_the_normal_and_refuses_bad_input() -> None:
    assert student_t_quantile(0.975, 100_000) == pytest.approx(1.95996, abs=1e-4)
    for q, df in ((0.0, 4), (1.0, 4), (0.5, 0), (0.5, 1.5)):
        with pytest.raises(ValueError):
            student_t_quantile(q, df)  # type: ignore[arg-type]


def test_t_interval_over_seeds() -> None:
    # five seeds' values: mean 0.5, sd 0.1 → half-width t(0.975, 4) · 0.1 / √5 = 0.12416
    vals = [0.4, 0.45, 0.5, 0.55, 0.6]
    sd = float(np.std(vals, ddof=1))
    mean, low, high = t_interval(vals)
    assert mean == pytest.approx(0.5)
    assert (high - low) / 2 == pytest.approx(2.7764 * sd / np.sqrt(5), rel=1e-4)
    assert t_interval(vals, confidence=0.5)[2] - 0.5 < high - 0.5  # narrower at lower confidence
    assert t_interval([0.3, 0.3, 0.3]) == (pytest.approx(0.3), pytest.approx(0.3), pytest.approx(0.3))
    one = t_interval([0.7])  # one seed: the mean, no interval
    assert one[0] == pytest.approx(0.7) and np.isnan(one[1]) and np.isnan(one[2])
    with pytest.raises(ValueError, match="non-empty"):
        t_interval([])


@pytest.mark.parametrize(("values", "expected"), [
    # two-sided one-sample t-tests against 0 (R's t.test(x)$p.value / scipy.stats.ttest_1samp, to 6 decimals)
    ([0.1, 0.3, -0.05, 0.2], 0.162733),
    ([-0.147, -0.036, -0.067, -0.067], 0.044427),
    ([1.0, 2.0], 0.204833),
])
def test_t_test_p_matches_the_reference(values: list[float], expected: float) -> None:
    assert t_test_p(values) == pytest.approx(expected, abs=1e-6)
    assert t_test_p([-v for v in values]) == pytest.approx(expected, abs=1e-6)  # two-sided


def test_t_test_p_edge_cases() -> None:
    assert math.isnan(t_test_p([0.3]))  # one seed: untestable
    assert t_test_p([0.0, 0.0, 0.0]) == 1.0 and t_test_p([0.2, 0.2]) == 0.0  # no spread
    with pytest.raises(ValueError):
        t_test_p([])


def test_holm_adjust_steps_down_and_stays_monotone() -> None:
    # sorted 0.005, 0.01, 0.03, 0.04 → ×4, ×3, ×2, ×1 = 0.02, 0.03, 0.06, 0.04 → running max 0.02, 0.03, 0.06, 0.06
    got = holm_adjust({"a": 0.01, "b": 0.04, "c": 0.03, "d": 0.005})
    assert list(got) == ["a", "b", "c", "d"]  # the input's order
    assert got == pytest.approx({"a": 0.03, "b": 0.06, "c": 0.06, "d": 0.02})
    assert holm_adjust({"x": 0.6, "y": 0.7}) == pytest.approx({"x": 1.0, "y": 1.0})  # capped at 1
    nan_kept = holm_adjust({"x": math.nan, "y": 0.02, "z": 0.04})  # m = 2: the NaN is not a test
    assert math.isnan(nan_kept["x"]) and nan_kept["y"] == pytest.approx(0.04) and nan_kept["z"] == pytest.approx(0.04)
    assert holm_adjust({}) == {}
