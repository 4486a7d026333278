"""Group-sequential comparison of training arms over seeds (issue 52, item 4): a sweep runs its seeds in waves and
stops — or drops an arm — once the planned comparisons are decided.

**Looks.** Seeds run in waves (e.g. ``[2, 2, 2]``); look k follows wave k with n_k seeds per arm so far, at the
information fraction t_k = n_k / N_max (the variance of a seed-mean difference is ∝ 1/n).

**Spending.** Lan & DeMets (1983) alpha spending with the O'Brien–Fleming-type function
α₁(t) = 2 − 2Φ(z_{1−α₁/2} / √t) on each side at α₁ = α/2 (symmetric two-sided, :func:`obf_spending`): the
look-k boundary b_k is the z with
P(|Z_1| < b_1, …, |Z_{k−1}| < b_{k−1}, |Z_k| ≥ b_k) = α(t_k) − α(t_{k−1}) under H0, Z_k = S(t_k)/√t_k for a
standard Brownian motion S. That joint probability is computed by the recursive numerical integration of
Armitage, McPherson & Rowe (1969) (Jennison & Turnbull 2000, ch. 19): the sub-density of S(t_k) on the
continuation region is the previous one convolved with the N(0, t_k − t_{k−1}) increment (Simpson's rule on a grid).
Reference values (the R package ldbounds / Reboussin et al. 2000, also gsDesign ``sfLDOF``), two-sided α = 0.05:
3 equal looks 3.7103, 2.5114, 1.9930; 5 equal looks 4.8769, 3.3569, 2.6803, 2.2898, 2.0310
(tests/core/test_sequential.py checks both to 1e-4).

**Statistic.** Per comparison A − B and seed s: D_s = mean over the questions both arms answered of
Pass@1_A − Pass@1_B, i.e. the difference of the two runs' Pass@1 on common questions (seed-matched: seed s of A
against seed s of B). At look k: the estimate D̄ (mean over the n_k seeds), its standard error and
T = D̄ / SE. With 2–6 seeds a z with an estimated variance is anticonservative (the variance estimate has 1–5
degrees of freedom), so the design is **t-based**: each look's z boundary b_k is turned into the Student-t
boundary of the same nominal level, c_k = t_{df}^{-1}(Φ(b_k)) (Jennison & Turnbull 2000, §3.8: "the same nominal
significance level at each analysis"), with

- ``variance="paired"`` (default): SE² = s²_D / n, df = n − 1 (s²_D the variance of D_s over seeds): no assumption
  beyond independent seeds; a look at 2 seeds (df = 1) can only stop on an overwhelming difference;
- ``variance="pooled"``: the seed × arm residual variance σ̂²_e of the arms still running (a two-way layout,
  df = (n − 1)(m − 1) for m arms), SE² = 2σ̂²_e / n: more degrees of freedom, assuming every pair of arms has the
  same per-seed variance of its difference (false where two arms share more per seed than a third).

Under H0 the t statistic does not depend on σ, so the simulated error rates (``bench/sequential.py``) hold at any
σ, not only the pilot's.

**Known σ from a pilot** (``variance="pilot"``): σ, the SD of one seed's paired difference D_s, is stated in
advance (the powered sweep's 0.0963, ``bench/results/power_claims_powered.json``); each look is then a z test,
Z_k = D̄_k/(σ/√n_k), against the z boundaries themselves (no df penalty), and the information n/σ² fixes the
maximum seeds N_max ≥ (η·σ/Δ)² for power 1 − β at the planned effect Δ (:func:`seeds_for_power`). Its error rates
hold at the stated σ only: a true σ 1.5× the pilot's raises the family-wise error to ≈ 0.2 (bench/README.md).

**Futility** (``futility="obf"`` or ``"pocock"``): the error-spending test with an inner wedge of Jennison &
Turnbull (2000, §7.3): stop for efficacy if |Z_k| ≥ b_k, for futility if |Z_k| < a_k, a_K = b_K. The efficacy
boundaries are the α-spending ones above, computed ignoring futility (*non-binding*: the type I error holds even if
a futility stop is overridden); the a_k spend β by the Lan–DeMets O'Brien–Fleming-type β(t) = 2 − 2Φ(z_{1−β/2}/√t)
or the Pocock-type β·ln(1 + (e − 1)t) (:func:`beta_spending`, gsDesign's ``sfLDOF``/``sfLDPocock``) at the drift
η = Δ·√N_max/σ (:func:`futility_boundaries`), and :func:`design_drift` solves for the η with a_K = b_K at type II
error β. With a t statistic a_k becomes the t of the same nominal level, as b_k does (that keeps α, not β: at
df 1–3 it stops true effects too often, bench/README.md).

**Several comparisons.** The family-wise error over the C planned comparisons is kept by a **Bonferroni split**:
each comparison is its own group-sequential test at α/C. Holm's step-down over group-sequential tests (α recycling,
Maurer & Bretz 2013) is more powerful, but a comparison's boundaries would then change with the others' decisions,
and a wrong look on one arm would shift the tests of the others; the Bonferroni split needs no assumption on how
the comparisons (which share arms) correlate, and each comparison's looks are a function of its own data.

**Equivalence.** A comparison stops as *equivalent* when its repeated confidence interval D̄ ± c_k·SE lies within
(−margin, +margin). The RCIs use the same boundaries as the test, so they cover the true difference at every look
simultaneously with probability ≥ 1 − α/C (Jennison & Turnbull 1989): a difference of at least the margin is
declared equivalent with probability ≤ α/C. It *differs* when |T| ≥ c_k (the RCI excludes 0). A comparison
undecided at the last look is *undecided-at-max*. A decided comparison is not looked at again; an arm runs the
next wave while one of its comparisons is undecided, and the sweep stops when none is.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Literal

import numpy as np

from aepo_core.metrics import student_t_quantile

Variance = Literal["paired", "pooled", "pilot"]
GRID = 1201  # points of the integration grid per look (odd: Simpson); 601 moves the 5-look boundaries by < 1e-6


def normal_cdf(z: float) -> float:
    """Φ(z) = ½·erfc(−z/√2)."""
    return 0.5 * math.erfc(-z / math.sqrt(2.0))


def normal_quantile(p: float) -> float:
    """Φ^{-1}(p), by bisection on :func:`normal_cdf` to 1e-13 (exact to double precision for 1e-300 < p < 1)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"normal_quantile needs 0 < p < 1, got {p}")
    low, high = -40.0, 40.0
    while high - low > 1e-13:
        mid = 0.5 * (low + high)
        low, high = (mid, high) if normal_cdf(mid) < p else (low, mid)
    return 0.5 * (low + high)


def obf_spending(t: float, alpha: float) -> float:
    """Two-sided type I error spent by information fraction t (α(0) = 0, α(1) = α) under the Lan–DeMets
    O'Brien–Fleming-type function applied to each side at α/2, as the reference tables do (DeMets & Lan 1994,
    ldbounds, gsDesign ``sfLDOF``): per side α₁(t) = 2 − 2Φ(z_{1−α₁/2}/√t) with α₁ = α/2, so in all
    α(t) = 2·(2 − 2Φ(z_{1−α/4}/√t)).

    (The same function applied once to the two-sided total, 2 − 2Φ(z_{1−α/2}/√t), spends more early: at 3 equal
    looks and α = 0.05 its boundaries are 3.395, 2.407, 2.015 instead of the tables' 3.710, 2.511, 1.993.)"""
    if t <= 0.0:
        return 0.0
    side = alpha / 2.0
    return 2.0 * (2.0 - 2.0 * normal_cdf(normal_quantile(1.0 - side / 2.0) / math.sqrt(min(t, 1.0))))


def information_fractions(waves: Sequence[int]) -> list[float]:
    """t_k = n_k / N_max for waves of seeds: [2, 2, 2] → [1/3, 2/3, 1]."""
    if not waves or any(w < 1 for w in waves):
        raise ValueError(f"waves must be positive seed counts, got {list(waves)}")
    total, run, out = sum(waves), 0, []
    for w in waves:
        run += w
        out.append(run / total)
    return out


_ERFC = np.frompyfunc(math.erfc, 1, 1)


def _phi_cdf(x: np.ndarray) -> np.ndarray:
    return 0.5 * _ERFC(-x / math.sqrt(2.0)).astype(float)


def _simpson(low: float, high: float, n: int = GRID) -> tuple[np.ndarray, np.ndarray]:
    """Grid points and Simpson weights on [low, high] (n odd)."""
    x = np.linspace(low, high, n)
    w = np.ones(n)
    w[1:-1:2], w[2:-1:2] = 4.0, 2.0
    return x, w * (high - low) / (3.0 * (n - 1))


def _exit(edge: float, x: np.ndarray, mass: np.ndarray, sd: float) -> float:
    """P(|S_k| ≥ edge and on the grid before): Σ mass(u)·[Φ((−edge − u)/sd) + Φ((u − edge)/sd)]."""
    return float(np.sum(mass * (_phi_cdf((-edge - x) / sd) + _phi_cdf((x - edge) / sd))))


def spending_boundaries(fractions: Sequence[float], alpha: float) -> list[float]:
    """Two-sided z boundaries b_1..b_K of the Lan–DeMets O'Brien–Fleming-type design at ``fractions``.

    Recursion on the score scale S_k = Z_k·√t_k (independent N(0, Δ_k) increments, Δ_k = t_k − t_{k−1}): f_1 is the
    N(0, t_1) density; the exit probability at look k, ∫_{|u|<b_{k−1}√t_{k−1}} f_{k−1}(u)·
    [Φ((−b√t_k − u)/√Δ_k) + Φ((u − b√t_k)/√Δ_k)] du, is set to α(t_k) − α(t_{k−1}) by bisection on b; then
    f_k(s) = ∫ f_{k−1}(u)·φ((s − u)/√Δ_k)/√Δ_k du on |s| < b_k√t_k."""
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    ts = list(fractions)
    if not ts or any(b <= a for a, b in zip([0.0, *ts], ts, strict=False)) or ts[-1] > 1.0 + 1e-12:
        raise ValueError(f"information fractions must increase in (0, 1], got {ts}")
    bounds = [normal_quantile(1.0 - obf_spending(ts[0], alpha) / 2.0)]
    x, w = _simpson(-bounds[0] * math.sqrt(ts[0]), bounds[0] * math.sqrt(ts[0]))
    dens = np.exp(-x * x / (2.0 * ts[0])) / math.sqrt(2.0 * math.pi * ts[0])
    for k in range(1, len(ts)):
        sd = math.sqrt(ts[k] - ts[k - 1])
        target = obf_spending(ts[k], alpha) - obf_spending(ts[k - 1], alpha)
        mass = w * dens
        low, high = 0.0, 40.0
        while high - low > 1e-10:
            mid = 0.5 * (low + high)
            low, high = (mid, high) if _exit(mid * math.sqrt(ts[k]), x, mass, sd) > target else (low, mid)
        bounds.append(0.5 * (low + high))
        y, wy = _simpson(-bounds[k] * math.sqrt(ts[k]), bounds[k] * math.sqrt(ts[k]))
        kernel = np.exp(-((y[:, None] - x[None, :]) / sd) ** 2 / 2.0) / (sd * math.sqrt(2.0 * math.pi))
        dens, x, w = kernel @ mass, y, wy
    return bounds


Futility = Literal["none", "obf", "pocock"]
DESIGN_GRID = 401  # points per interval while solving the futility design (the densities are smooth; 1201: < 1e-7)


def beta_spending(t: float, beta: float, futility: Futility) -> float:
    """Type II error spent by information fraction t (β(0) = 0, β(1) = β), Lan & DeMets (1983) forms as gsDesign's
    ``sfLDOF`` / ``sfLDPocock`` (Jennison & Turnbull 2000, §7.3):

    - ``obf``: β(t) = 2 − 2Φ(z_{1−β/2}/√t) (O'Brien–Fleming-type: almost nothing early);
    - ``pocock``: β(t) = β·ln(1 + (e − 1)·t) (Pocock-type: spends early, so the null stops sooner);
    - ``none``: β(t) = 0 for t < 1 (no futility stop before the last look)."""
    if t <= 0.0:
        return 0.0
    t = min(t, 1.0)
    if futility == "obf":
        return 2.0 - 2.0 * normal_cdf(normal_quantile(1.0 - beta / 2.0) / math.sqrt(t))
    if futility == "pocock":
        return beta * math.log(1.0 + (math.e - 1.0) * t)
    return beta if t >= 1.0 else 0.0


def _region(low: float, high: float, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Simpson points and weights on {low ≤ |s| < high} (low ≤ 0: the interval (−high, high))."""
    if low <= 0.0:
        return _simpson(-high, high, n)
    (xl, wl), (xh, wh) = _simpson(-high, -low, n), _simpson(low, high, n)
    return np.concatenate([xl, xh]), np.concatenate([wl, wh])


def _inside(edge: float, x: np.ndarray, mass: np.ndarray, mean: float, sd: float) -> float:
    """P(|S_k| < edge and on the grid before) = Σ mass(u)·[Φ((edge − u − m)/sd) − Φ((−edge − u − m)/sd)], m the
    drift of the increment."""
    if edge <= 0.0:
        return 0.0
    return float(np.sum(mass * (_phi_cdf((edge - x - mean) / sd) - _phi_cdf((-edge - x - mean) / sd))))


def _bisect(f, target: float, low: float, high: float, tol: float = 1e-9) -> float:
    """The x in [low, high] with f(x) = target for an increasing f (bisection)."""
    while high - low > tol:
        mid = 0.5 * (low + high)
        low, high = (mid, high) if f(mid) < target else (low, mid)
    return 0.5 * (low + high)


def futility_boundaries(fractions: Sequence[float], bounds: Sequence[float], beta: float, drift: float,
                        futility: Futility, grid: int = DESIGN_GRID) -> tuple[list[float], float]:
    """Non-binding futility boundaries a_1..a_K (z scale; a_K = b_K) of a two-sided test with an inner wedge
    (Jennison & Turnbull 2000, §7.3, error spending): stop for efficacy if |Z_k| ≥ b_k, for futility if |Z_k| < a_k.

    The efficacy boundaries ``bounds`` come from α spending alone (:func:`spending_boundaries`), so the type I error
    holds whether or not a futility stop is obeyed (*non-binding*). Under the alternative θ with ``drift``
    η = θ·√I_max the score S_k = Z_k√t_k has independent N(η·Δ_k, Δ_k) increments; a_k solves

        P_η(a_j ≤ |Z_j| < b_j for j < k, |Z_k| < a_k) = β(t_k) − β(t_{k−1})   (β(t): :func:`beta_spending`)

    by bisection (a_k = 0 when nothing is to be spent, a_k = b_k when even that spends less), with the sub-density
    of S_k recursed as in :func:`spending_boundaries` on the two intervals of the continuation region. Returns
    (a_1..a_K, the type II error at η: Σ_k P_η(stop for futility at k), a_K = b_K included)."""
    ts, last = list(fractions), len(fractions) - 1
    x, mass, t_prev = np.zeros(1), np.ones(1), 0.0
    lows, spent = [], 0.0
    for k, (t, b) in enumerate(zip(ts, bounds, strict=True)):
        sd, mean, root = math.sqrt(t - t_prev), drift * (t - t_prev), math.sqrt(t)
        if k == last:
            lows.append(b)
            spent += _inside(b * root, x, mass, mean, sd)
            break
        target = beta_spending(t, beta, futility) - beta_spending(t_prev, beta, futility)
        accept = lambda a, x=x, mass=mass, mean=mean, sd=sd, root=root: _inside(a * root, x, mass, mean, sd)  # noqa: E731
        a = 0.0 if target <= 0.0 else (b if accept(b) <= target else _bisect(accept, target, 0.0, b))
        lows.append(a)
        spent += accept(a)
        y, wy = _region(a * root, b * root, grid)
        kernel = np.exp(-((y[:, None] - x[None, :] - mean) / sd) ** 2 / 2.0) / (sd * math.sqrt(2.0 * math.pi))
        x, mass, t_prev = y, wy * (kernel @ mass), t
    return lows, spent


def design_drift(fractions: Sequence[float], alpha: float, beta: float, futility: Futility) -> float:
    """The drift η = θ·√I_max at which the design (α-spending efficacy boundaries, β-spending futility ones, a_K =
    b_K) has type II error β: bisection on η (the type II error falls as η grows). A fixed design (one look) gives
    η = z_{1−α/2} + z_{1−β}; the ratio (η/(z_{1−α/2} + z_{1−β}))² is the inflation factor of the maximum information
    over the fixed design's (Jennison & Turnbull 2000, §7.2.2)."""
    bounds = spending_boundaries(fractions, alpha)
    return _bisect(lambda eta: -futility_boundaries(fractions, bounds, beta, eta, futility)[1], -beta, 0.0, 20.0,
                   1e-7)


def seeds_for_power(wave: int, sigma: float, delta: float, alpha: float, beta: float, futility: Futility,
                    max_waves: int = 30) -> tuple[int, ...]:
    """The fewest equal waves of ``wave`` seeds whose maximum N_max reaches power 1 − β at the effect ``delta``
    with a known σ of a seed's paired difference: the information at n seeds is n/σ², so N_max ≥ (η·σ/Δ)² with η
    from :func:`design_drift` at the waves' fractions (η depends on the number of looks: solved per K)."""
    for k in range(1, max_waves + 1):
        waves = (wave,) * k
        if wave * k >= (design_drift(information_fractions(waves), alpha, beta, futility) * sigma / delta) ** 2:
            return waves
    raise ValueError(f"no design of up to {max_waves} waves of {wave} seeds reaches power {1 - beta:g} at {delta:g}")


class Decision(str, Enum):
    CONTINUE = "continue"
    DIFFER = "differ"
    EQUIVALENT = "equivalent"
    FUTILE = "futile"
    UNDECIDED = "undecided-at-max"


@functools.lru_cache(maxsize=64)
def _efficacy(fractions: tuple[float, ...], alpha: float) -> tuple[float, ...]:
    return tuple(spending_boundaries(fractions, alpha))


@functools.lru_cache(maxsize=64)
def _futility(fractions: tuple[float, ...], alpha: float, beta: float, drift: float, futility: Futility
              ) -> tuple[tuple[float, ...], float]:
    lows, spent = futility_boundaries(fractions, _efficacy(fractions, alpha), beta, drift, futility)
    return tuple(lows), spent


@functools.lru_cache(maxsize=64)
def _drift(fractions: tuple[float, ...], alpha: float, beta: float, futility: Futility) -> float:
    return design_drift(fractions, alpha, beta, futility)


@dataclass(frozen=True)
class Design:
    """A group-sequential design: seeds per wave, two-sided family-wise α, the planned comparisons (a, b) of arms
    (a − b), the equivalence margin (None: no equivalence stop), how a difference's variance is known or estimated
    (``pilot``: σ, the SD of one seed's paired difference, stated in advance; ``paired``/``pooled``: estimated, t),
    and the futility rule (β spending for the effect ``delta`` at power ``power``; ``none``: no futility stop)."""

    waves: tuple[int, ...]
    comparisons: tuple[tuple[str, str], ...]
    alpha: float = 0.05
    margin: float | None = None
    variance: Variance = "paired"
    futility: Futility = "none"
    delta: float | None = None
    sigma: float | None = None
    power: float = 0.8

    def __post_init__(self) -> None:
        information_fractions(self.waves)
        if self.variance != "pilot" and self.waves[0] < 2:
            raise ValueError(f"the first wave needs at least 2 seeds (a variance to estimate), got {self.waves[0]}")
        if not 0.0 < self.alpha < 1.0:
            raise ValueError(f"alpha must be in (0, 1), got {self.alpha}")
        if not self.comparisons or any(a == b for a, b in self.comparisons):
            raise ValueError(f"comparisons must be pairs of two different arms, got {list(self.comparisons)}")
        if self.margin is not None and not self.margin > 0.0:
            raise ValueError(f"margin must be > 0, got {self.margin}")
        if not 0.0 < self.power < 1.0:
            raise ValueError(f"power must be in (0, 1), got {self.power}")
        needs = "variance: pilot" if self.variance == "pilot" else f"futility: {self.futility}"
        if self.variance == "pilot" or self.futility != "none":
            for name, value in (("delta", self.delta), ("sigma", self.sigma)):
                if value is None or not value > 0.0:
                    raise ValueError(f"{name} must be > 0 with {needs} (the planned effect and the pilot's σ of a "
                                     f"seed's paired difference), got {value}")
        if self.variance == "pilot" and self.drift < self.required_drift():
            need = (self.required_drift() * (self.sigma or 0.0) / (self.delta or 1.0)) ** 2
            raise ValueError(f"waves {list(self.waves)} give {self.max_seeds} seeds; the pilot σ {self.sigma:g} needs "
                             f"≥ {need:.2f} seeds per arm for power {self.power:g} at delta {self.delta:g}")

    @property
    def max_seeds(self) -> int:
        return sum(self.waves)

    @property
    def arms(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(arm for pair in self.comparisons for arm in pair))

    @property
    def alpha_per_comparison(self) -> float:
        """Bonferroni: α / C."""
        return self.alpha / len(self.comparisons)

    @property
    def fractions(self) -> tuple[float, ...]:
        return tuple(information_fractions(self.waves))

    @property
    def drift(self) -> float:
        """η = Δ·√I_max at the planned effect, I_max = N_max/σ² (0 without a planned effect)."""
        return (self.delta or 0.0) * math.sqrt(self.max_seeds) / self.sigma if self.sigma else 0.0

    def required_drift(self) -> float:
        """The η at which this design's looks have power ``power`` (:func:`design_drift`)."""
        return _drift(self.fractions, self.alpha_per_comparison, 1.0 - self.power, self.futility)

    def z_boundaries(self) -> list[float]:
        return list(_efficacy(self.fractions, self.alpha_per_comparison))

    def futility_z_boundaries(self) -> list[float]:
        """a_1..a_K (:func:`futility_boundaries` at the design's drift; a_K = b_K); zeros without futility."""
        if self.futility == "none":
            return [0.0] * len(self.waves)
        return list(_futility(self.fractions, self.alpha_per_comparison, 1.0 - self.power, self.drift,
                              self.futility)[0])

    def planned_power(self) -> float | None:
        """Power of the z test at ``delta`` when σ is the pilot's (None without a planned effect)."""
        if self.delta is None or self.sigma is None:
            return None
        return 1.0 - _futility(self.fractions, self.alpha_per_comparison, 1.0 - self.power, self.drift,
                               self.futility)[1]

    def describe(self) -> str:
        """The design in one line (the final table's caption)."""
        margin = f"equivalence within ±{self.margin:g} (repeated CIs)" if self.margin else "no equivalence stop"
        stat = (f"seed-matched z (pilot σ {self.sigma:g} of a seed's paired difference)" if self.variance == "pilot"
                else f"seed-matched t ({self.variance} variance)")
        futile = ("no futility stop" if self.futility == "none" else
                  f"non-binding {self.futility} β-spending futility for Δ = {self.delta:g} at power {self.power:g} "
                  f"(z {', '.join(f'{a:.3f}' for a in self.futility_z_boundaries())})")
        return (f"group-sequential: waves {list(self.waves)} seeds (max {self.max_seeds}), Lan–DeMets O'Brien–"
                f"Fleming spending, two-sided α = {self.alpha:g} family-wise (Bonferroni over {len(self.comparisons)}"
                f" comparisons: {self.alpha_per_comparison:.4g} each), {stat}, {margin}, {futile}; z boundaries "
                f"{', '.join(f'{b:.3f}' for b in self.z_boundaries())}")


@dataclass(frozen=True)
class ComparisonLook:
    """One comparison a − b at one look: the estimate D̄ and its standard error over ``seeds`` seeds, T = D̄/SE,
    the efficacy boundary c_k (t with ``df`` degrees of freedom; z when df is None, σ known) and the z boundary
    it comes from, the futility boundary f_k (0: none), the repeated CI D̄ ± c_k·SE, and the decision (CONTINUE,
    DIFFER, EQUIVALENT, FUTILE, UNDECIDED at the last look)."""

    a: str
    b: str
    seeds: int
    estimate: float
    se: float
    df: int | None
    statistic: float
    boundary: float
    z_boundary: float
    futility_boundary: float
    low: float
    high: float
    decision: Decision


@dataclass(frozen=True)
class Look:
    """Look k (1-based) after wave k: the seeds per arm so far, the information fraction, the arms that ran the
    wave, and the comparisons still open before it (a decided comparison is not looked at again)."""

    index: int
    seeds: tuple[int, ...]
    fraction: float
    arms: tuple[str, ...]
    comparisons: tuple[ComparisonLook, ...]


@dataclass(frozen=True)
class SequentialOutcome:
    """The looks taken so far (a pure function of the finished cells) and what they decided."""

    design: Design
    looks: tuple[Look, ...]

    def decisions(self) -> dict[tuple[str, str], ComparisonLook | None]:
        """Each comparison's deciding look (the last one it was looked at); None before its first look."""
        out: dict[tuple[str, str], ComparisonLook | None] = dict.fromkeys(self.design.comparisons)
        for look in self.looks:
            for c in look.comparisons:
                out[(c.a, c.b)] = c
        return out

    def open_comparisons(self) -> list[tuple[str, str]]:
        return [pair for pair, c in self.decisions().items() if c is None or c.decision is Decision.CONTINUE]

    def active_arms(self) -> tuple[str, ...]:
        """The arms that run the next wave: those of a comparison still open (none once stopped)."""
        if len(self.looks) == len(self.design.waves):
            return ()
        return tuple(arm for arm in self.design.arms if any(arm in pair for pair in self.open_comparisons()))

    @property
    def stopped(self) -> bool:
        return not self.active_arms()

    def as_dict(self) -> dict[str, object]:
        design = {**asdict(self.design), "z_boundaries": self.design.z_boundaries(),
                  "futility_z_boundaries": self.design.futility_z_boundaries(),
                  "planned_power": self.design.planned_power(), "description": self.design.describe()}
        looks = [{**asdict(look), "comparisons": [{**asdict(c), "decision": c.decision.value}
                                                  for c in look.comparisons]} for look in self.looks]
        return {"design": design, "looks": looks, "stopped": self.stopped, "active_arms": list(self.active_arms())}


def wave_seeds(design: Design, seeds: Sequence[int]) -> list[tuple[int, ...]]:
    """The seeds of each wave, in the sweep's seed order: waves [2, 2] of seeds [0, 1, 2, 3] → (0, 1), (2, 3)."""
    if len(seeds) != design.max_seeds:
        raise ValueError(f"waves {list(design.waves)} need {design.max_seeds} seeds, got {len(seeds)}")
    out, start = [], 0
    for w in design.waves:
        out.append(tuple(seeds[start:start + w]))
        start += w
    return out


def seed_means(per_question: Mapping[str, Mapping[int, Mapping[str, float]]], arms: Sequence[str], seed: int
               ) -> dict[str, float] | None:
    """Arm → its run's mean Pass@1 at ``seed`` over the questions every arm of ``arms`` answered at that seed (so a
    difference of two arms is the mean of their per-question differences); None when an arm lacks the seed."""
    runs = [per_question.get(arm, {}).get(seed) for arm in arms]
    if any(r is None for r in runs):
        return None
    common = set.intersection(*(set(r) for r in runs if r is not None))
    if not common:
        raise ValueError(f"seed {seed}: arms {list(arms)} answered no question in common")
    return {arm: sum(r[q] for q in common) / len(common) for arm, r in zip(arms, runs, strict=True) if r is not None}


def t_boundary(z: float, df: int | None) -> float:
    """The boundary of the same nominal level as the z boundary ``z``: t_df^{-1}(Φ(z)) (Jennison & Turnbull 2000,
    §3.8), z itself when σ is known (df None), 0 for z ≤ 0 (a futility boundary that stops nothing)."""
    if z <= 0.0:
        return 0.0
    return z if df is None else student_t_quantile(normal_cdf(z), df)


def _compare(design: Design, a: str, b: str, values: np.ndarray, names: Sequence[str], k: int, z: float,
             z_futile: float) -> ComparisonLook:
    """One comparison at look k from ``values`` (seeds × arms ``names`` running at this look): DIFFER if
    |T| ≥ c_k, else EQUIVALENT if the RCI lies within ±margin, else FUTILE if |T| < f_k, else CONTINUE
    (UNDECIDED at the last look)."""
    n, m = values.shape
    diff = values[:, names.index(a)] - values[:, names.index(b)]
    estimate = float(diff.mean())
    df: int | None
    if design.variance == "pilot":
        df, var = None, (design.sigma or 0.0) ** 2 / n
    elif design.variance == "paired":
        df, var = n - 1, float(diff.var(ddof=1)) / n
    else:
        resid = values - values.mean(axis=0) - values.mean(axis=1, keepdims=True) + values.mean()
        df = (n - 1) * (m - 1)
        var = 2.0 * float((resid ** 2).sum()) / df / n
    se = math.sqrt(var)
    c, f = t_boundary(z, df), min(t_boundary(z_futile, df), t_boundary(z, df))
    statistic = estimate / se if se > 0 else (0.0 if estimate == 0 else math.copysign(math.inf, estimate))
    low, high = estimate - c * se, estimate + c * se
    if abs(statistic) >= c:
        decision = Decision.DIFFER
    elif design.margin is not None and -design.margin < low and high < design.margin:
        decision = Decision.EQUIVALENT
    elif abs(statistic) < f:
        decision = Decision.FUTILE
    elif k == len(design.waves) - 1:
        decision = Decision.UNDECIDED
    else:
        decision = Decision.CONTINUE
    return ComparisonLook(a, b, n, estimate, se, df, statistic, c, z, f, low, high, decision)


def run_looks(design: Design, per_question: Mapping[str, Mapping[int, Mapping[str, float]]],
              seeds: Sequence[int]) -> SequentialOutcome:
    """Every look the finished cells allow: ``per_question[arm][seed]`` is that run's question → Pass@1 (runs not
    finished are absent). Look k is taken once every arm still running has all the seeds of waves 1..k; the looks
    stop at the first wave that is incomplete, so the outcome depends on the finished cells alone (a resumed sweep
    re-decides nothing differently)."""
    bounds, futile = design.z_boundaries(), design.futility_z_boundaries()
    waves = wave_seeds(design, seeds)
    looks: list[Look] = []
    so_far: list[int] = []
    outcome = SequentialOutcome(design, ())
    for k, wave in enumerate(waves):
        arms, so_far = outcome.active_arms(), [*so_far, *wave]
        if not arms:
            break
        rows = [seed_means(per_question, arms, s) for s in so_far]
        if any(r is None for r in rows):
            break
        values = np.array([[r[arm] for arm in arms] for r in rows if r is not None])
        compared = tuple(_compare(design, a, b, values, arms, k, bounds[k], futile[k])
                         for a, b in outcome.open_comparisons())
        looks.append(Look(k + 1, tuple(so_far), len(so_far) / design.max_seeds, arms, compared))
        outcome = SequentialOutcome(design, tuple(looks))
    return outcome
