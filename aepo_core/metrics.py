"""Evaluation statistics: unbiased pass@k, bootstrap confidence intervals, rollout diversity.

The published harness never computed pass@k; here it is the unbiased estimator of Chen et al. (2021), and
every reported mean can come with a percentile-bootstrap interval (paired when two runs answered the same
questions).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence

import numpy as np

Statistic = Callable[[np.ndarray], float]

DEFAULT_RESAMPLES = 1000  # EvalConfig.bootstrap_samples
DEFAULT_CONFIDENCE = 0.95


def _check_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples, drawn without replacement from n of which c are correct,
    is correct: 1 − C(n−c, k)/C(n, k).

    Computed as 1 − Π_{i=n−c+1}^{n} (1 − k/i), which avoids the huge binomials.
    """
    for name, value in (("n", n), ("c", c), ("k", k)):
        _check_int(name, value)
    if not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0  # every k-subset contains a correct sample
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def mean_pass_at_k(correct_counts: Sequence[int], n: int, k: int) -> float:
    """Mean pass@k over questions, each sampled n times with ``correct_counts[q]`` correct samples."""
    if len(correct_counts) == 0:
        raise ValueError("mean_pass_at_k needs at least one question")
    return float(np.mean([pass_at_k(n, int(c), k) for c in correct_counts]))


def _mean(values: np.ndarray) -> float:
    return float(np.mean(values))


def bootstrap_ci(
    values: Sequence[float] | np.ndarray,
    *,
    n_resamples: int = DEFAULT_RESAMPLES,
    confidence: float = DEFAULT_CONFIDENCE,
    seed: int = 0,
    statistic: Statistic = _mean,
) -> tuple[float, float, float]:
    """(point, low, high): ``statistic`` of ``values`` and its percentile-bootstrap interval.

    Resampling uses ``numpy.random.default_rng(seed)``, so the interval is reproducible for a seed.
    """
    arr = np.asarray(values, dtype=float)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"bootstrap_ci needs a non-empty 1-D sequence, got shape {arr.shape}")
    if n_resamples < 1:
        raise ValueError(f"n_resamples must be >= 1, got {n_resamples}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    rng = np.random.default_rng(seed)
    indices = rng.integers(0, arr.size, size=(n_resamples, arr.size))
    stats = np.array([statistic(arr[row]) for row in indices], dtype=float)
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(stats, [tail, 1.0 - tail])
    return float(statistic(arr)), float(low), float(high)


def paired_bootstrap_diff(
    a: Sequence[float] | np.ndarray,
    b: Sequence[float] | np.ndarray,
    *,
    n_resamples: int = DEFAULT_RESAMPLES,
    confidence: float = DEFAULT_CONFIDENCE,
    seed: int = 0,
    statistic: Statistic = _mean,
) -> tuple[float, float, float]:
    """(point, low, high) of ``statistic(a − b)`` for two runs scored on the same questions (same order).

    Resampling questions (not runs) keeps the pairing, which removes the per-question difficulty from the
    variance; an interval excluding 0 means the runs differ at that confidence.
    """
    arr_a = np.asarray(a, dtype=float)
    arr_b = np.asarray(b, dtype=float)
    if arr_a.shape != arr_b.shape:
        raise ValueError(f"paired runs must score the same questions: shapes {arr_a.shape} vs {arr_b.shape}")
    return bootstrap_ci(arr_a - arr_b, n_resamples=n_resamples, confidence=confidence, seed=seed,
                        statistic=statistic)


def distinct_sequences(seqs: Iterable[Sequence[Hashable]]) -> int:
    """Number of distinct tool-call sequences in a group (a diversity measure of the rollouts)."""
    return len({tuple(seq) for seq in seqs})
