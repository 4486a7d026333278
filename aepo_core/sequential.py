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

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Literal

import numpy as np

from aepo_core.metrics import student_t_quantile

Variance = Literal["paired", "pooled"]
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


class Decision(str, Enum):
    CONTINUE = "continue"
    DIFFER = "differ"
    EQUIVALENT = "equivalent"
    UNDECIDED = "undecided-at-max"


@dataclass(frozen=True)
class Design:
    """A group-sequential design: seeds per wave, two-sided family-wise α, the planned comparisons (a, b) of arms
    (a − b), the equivalence margin (None: no equivalence stop) and how a difference's variance is estimated."""

    waves: tuple[int, ...]
    comparisons: tuple[tuple[str, str], ...]
    alpha: float = 0.05
    margin: float | None = None
    variance: Variance = "paired"

    def __post_init__(self) -> None:
        information_fractions(self.waves)
        if self.waves[0] < 2:
            raise ValueError(f"the first wave needs at least 2 seeds (a variance to estimate), got {self.waves[0]}")
        if not 0.0 < self.alpha < 1.0:
            raise ValueError(f"alpha must be in (0, 1), got {self.alpha}")
        if not self.comparisons or any(a == b for a, b in self.comparisons):
            raise ValueError(f"comparisons must be pairs of two different arms, got {list(self.comparisons)}")
        if self.margin is not None and not self.margin > 0.0:
            raise ValueError(f"margin must be > 0, got {self.margin}")

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

    def z_boundaries(self) -> list[float]:
        return spending_boundaries(information_fractions(self.waves), self.alpha_per_comparison)

    def describe(self) -> str:
        """The design in one line (the final table's caption)."""
        margin = f"equivalence within ±{self.margin:g} (repeated CIs)" if self.margin else "no equivalence stop"
        return (f"group-sequential: waves {list(self.waves)} seeds (max {self.max_seeds}), Lan–DeMets O'Brien–"
                f"Fleming spending, two-sided α = {self.alpha:g} family-wise (Bonferroni over {len(self.comparisons)}"
                f" comparisons: {self.alpha_per_comparison:.4g} each), seed-matched t ({self.variance} variance), "
                f"{margin}; z boundaries {', '.join(f'{b:.3f}' for b in self.z_boundaries())}")


@dataclass(frozen=True)
class ComparisonLook:
    """One comparison a − b at one look: the estimate D̄ and its standard error over ``seeds`` seeds, T = D̄/SE,
    the t boundary c_k (``df`` degrees of freedom) and the z boundary it comes from, the repeated CI D̄ ± c_k·SE,
    and the decision (CONTINUE, DIFFER, EQUIVALENT, UNDECIDED at the last look)."""

    a: str
    b: str
    seeds: int
    estimate: float
    se: float
    df: int
    statistic: float
    boundary: float
    z_boundary: float
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
                  "description": self.design.describe()}
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


def _compare(design: Design, a: str, b: str, values: np.ndarray, names: Sequence[str], k: int, z: float
             ) -> ComparisonLook:
    """One comparison at look k from ``values`` (seeds × arms ``names`` running at this look)."""
    n, m = values.shape
    diff = values[:, names.index(a)] - values[:, names.index(b)]
    estimate = float(diff.mean())
    if design.variance == "paired":
        df, var = n - 1, float(diff.var(ddof=1)) / n
    else:
        resid = values - values.mean(axis=0) - values.mean(axis=1, keepdims=True) + values.mean()
        df = (n - 1) * (m - 1)
        var = 2.0 * float((resid ** 2).sum()) / df / n
    se = math.sqrt(var)
    c = student_t_quantile(normal_cdf(z), df)
    statistic = estimate / se if se > 0 else (0.0 if estimate == 0 else math.copysign(math.inf, estimate))
    low, high = estimate - c * se, estimate + c * se
    if abs(statistic) >= c:
        decision = Decision.DIFFER
    elif design.margin is not None and -design.margin < low and high < design.margin:
        decision = Decision.EQUIVALENT
    elif k == len(design.waves) - 1:
        decision = Decision.UNDECIDED
    else:
        decision = Decision.CONTINUE
    return ComparisonLook(a, b, n, estimate, se, df, statistic, c, z, low, high, decision)


def run_looks(design: Design, per_question: Mapping[str, Mapping[int, Mapping[str, float]]],
              seeds: Sequence[int]) -> SequentialOutcome:
    """Every look the finished cells allow: ``per_question[arm][seed]`` is that run's question → Pass@1 (runs not
    finished are absent). Look k is taken once every arm still running has all the seeds of waves 1..k; the looks
    stop at the first wave that is incomplete, so the outcome depends on the finished cells alone (a resumed sweep
    re-decides nothing differently)."""
    bounds = design.z_boundaries()
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
        compared = tuple(_compare(design, a, b, values, arms, k, bounds[k]) for a, b in outcome.open_comparisons())
        looks.append(Look(k + 1, tuple(so_far), len(so_far) / design.max_seeds, arms, compared))
        outcome = SequentialOutcome(design, tuple(looks))
    return outcome
