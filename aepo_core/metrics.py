"""Evaluation statistics: unbiased pass@k, bootstrap and Student-t confidence intervals, the one-sample t-test
with Holm's correction for several comparisons, rollout diversity.

The published harness never computed pass@k; here it is the unbiased estimator of Chen et al. (2021), and
every reported mean can come with a percentile-bootstrap interval (paired when two runs answered the same
questions).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence

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


def _incomplete_beta(x: float, a: float, b: float) -> float:
    """The regularized incomplete beta function I_x(a, b), by its continued fraction (modified Lentz), evaluated on
    the side of the symmetry I_x(a, b) = 1 − I_{1−x}(b, a) where it converges fast."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    if x > (a + 1.0) / (a + b + 2.0):
        return 1.0 - _incomplete_beta(1.0 - x, b, a)
    log_front = a * math.log(x) + b * math.log1p(-x) - (math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b))
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),  # the even, then the odd term
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return math.exp(log_front) * h / a


def student_t_cdf(t: float, df: int) -> float:
    """P(T ≤ t) for Student's t with ``df`` degrees of freedom: 1 − ½·I_{df/(df+t²)}(df/2, ½) for t ≥ 0, and by
    symmetry below 0."""
    tail = 0.5 * _incomplete_beta(df / (df + t * t), df / 2.0, 0.5)
    return 1.0 - tail if t >= 0 else tail


def student_t_quantile(q: float, df: int) -> float:
    """The t with P(T ≤ t) = q for Student's t with ``df`` ≥ 1 degrees of freedom (bisection on the CDF to 1e-10;
    e.g. 2.7764 for q = 0.975, df = 4)."""
    _check_int("df", df)
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df}")
    if not 0.0 < q < 1.0:
        raise ValueError(f"q must be in (0, 1), got {q}")
    if q < 0.5:
        return -student_t_quantile(1.0 - q, df)
    low, high = 0.0, 1.0
    while student_t_cdf(high, df) < q:
        low, high = high, 2.0 * high
    while high - low > 1e-10 * max(1.0, high):
        mid = 0.5 * (low + high)
        low, high = (mid, high) if student_t_cdf(mid, df) < q else (low, mid)
    return 0.5 * (low + high)


def t_interval(values: Sequence[float] | np.ndarray, *, confidence: float = DEFAULT_CONFIDENCE
               ) -> tuple[float, float, float]:
    """(mean, low, high): the mean of n independent values (e.g. one per training seed) and its Student-t interval
    mean ± t_{(1+confidence)/2, n−1} · s / √n, s the sample standard deviation. It is about a new draw of what the
    values are draws of (a new training run), which a bootstrap over 3–5 seeds cannot give (it has too few distinct
    resamples and undercovers). One value: its mean and NaN bounds."""
    arr = np.asarray(values, dtype=float)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"t_interval needs a non-empty 1-D sequence, got shape {arr.shape}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    mean = float(arr.mean())
    if arr.size == 1:
        return mean, math.nan, math.nan
    half = student_t_quantile((1.0 + confidence) / 2.0, arr.size - 1) * float(arr.std(ddof=1)) / math.sqrt(arr.size)
    return mean, mean - half, mean + half


def t_test_p(values: Sequence[float] | np.ndarray) -> float:
    """Two-sided p-value of the one-sample t-test of mean 0: 2·P(T_{n−1} ≥ |t|), t = mean / (s / √n) (e.g. seed-matched
    differences, one per seed). NaN for one value; with no spread, 1.0 if every value is 0, else 0.0."""
    arr = np.asarray(values, dtype=float)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"t_test_p needs a non-empty 1-D sequence, got shape {arr.shape}")
    if arr.size == 1:
        return math.nan
    sd = float(arr.std(ddof=1))
    mean = float(arr.mean())
    if sd == 0.0:
        return 1.0 if mean == 0.0 else 0.0
    t = abs(mean) / (sd / math.sqrt(arr.size))
    return min(1.0, 2.0 * (1.0 - student_t_cdf(t, arr.size - 1)))


def holm_adjust(p_values: Mapping[str, float]) -> dict[str, float]:
    """Holm's step-down adjustment of m p-values tested together (family-wise error ≤ α when each adjusted p is
    compared to α): sorted ascending p₍₁₎ ≤ … ≤ p₍ₘ₎, adjusted p₍ᵢ₎ = min(1, max_{j ≤ i} (m − j + 1)·p₍ⱼ₎). NaN
    entries (untestable) are kept as NaN and not counted in m."""
    finite = sorted(((p, k) for k, p in p_values.items() if not math.isnan(p)), key=lambda pk: pk[0])
    m = len(finite)
    out = {k: math.nan for k, p in p_values.items() if math.isnan(p)}
    running = 0.0
    for i, (p, k) in enumerate(finite):
        running = max(running, min(1.0, (m - i) * p))
        out[k] = running
    return {k: out[k] for k in p_values}


def distinct_sequences(seqs: Iterable[Sequence[Hashable]]) -> int:
    """Number of distinct tool-call sequences in a group (a diversity measure of the rollouts)."""
    return len({tuple(seq) for seq in seqs})
