"""Pre-monitoring budget and entropy-balanced branching rules (AEPO.md §3–4)."""

from __future__ import annotations

import random

import pytest

from aepo_core.rollout.branching import (
    arpo_branch_decision,
    branch_decision,
    consecutive_branch_count,
    consecutive_branch_penalty,
)
from aepo_core.rollout.budget import (
    budget_band,
    fixed_budget,
    global_budget,
    mean_tool_entropy,
    official_global_budget,
    official_tool_entropy,
)

GAMMA, TAU, LAM = 0.2, 0.5, 0.05


def test_global_budget_closed_form_and_boundaries():
    assert global_budget(12, 1.0, 1.0, 0.5) == 6  # σ(0) = ½
    assert global_budget(12, 3.0, 1.0, 0.5) == 9  # 12·σ(1) = 8.77 → 9
    assert global_budget(12, 1.0, 3.0, 0.5) == 3  # 12·σ(−1) = 3.23 → 3
    assert global_budget(1, 0.0, 50.0, 0.5) == 1  # k = 1: always one global sample
    assert global_budget(1, 50.0, 0.0, 0.5) == 1
    assert global_budget(12, 1000.0, 0.0, 0.5) == 12  # H_root ≫ H̄_tool: all global, no overflow
    assert global_budget(12, 0.0, 1000.0, 0.5) == 1  # never fewer than one (the probe)
    assert global_budget(5, 1.0, 1.0, 0.5) == 3  # 2.5 rounds half-up
    with pytest.raises(ValueError):
        global_budget(0, 1.0, 1.0, 0.5)


def test_official_budget_rule_truncates_and_adds_one():
    """The published code's m = min(k, int(k·σ) + 1): ~0.5 above the rounded rule on average, never below 1."""
    assert official_global_budget(12, 1.0, 1.0, 0.5) == 7  # int(6) + 1 (rounded rule: 6)
    assert official_global_budget(12, 3.0, 1.0, 0.5) == 9  # int(8.77) + 1 (rounded: 9)
    assert official_global_budget(12, 1.0, 3.0, 0.5) == 4  # int(3.23) + 1 (rounded: 3)
    assert official_global_budget(12, 1000.0, 0.0, 0.5) == 12  # capped at k
    assert official_global_budget(12, 0.0, 1000.0, 0.5) == 1
    rng = random.Random(0)
    gaps = [rng.uniform(-6, 6) for _ in range(20_000)]
    mean_excess = sum(official_global_budget(12, g, 0.0, 0.5) - global_budget(12, g, 0.0, 0.5) for g in gaps) / 20_000
    assert 0.4 < mean_excess < 0.6
    assert official_tool_entropy(1.0, [2.0, 3.0]) == 2.0  # the first segment counts
    assert official_tool_entropy(1.0, []) == 1.0


def test_budget_band_is_where_the_rule_gives_m():
    """The gap H_root − H̄_tool for which a rule gives m: at the demo's k = 4, β = 0.5 the paper's rule gives m = 2
    for any gap within ±2·logit(5/8) = ±1.02 nats, at the paper's k = 12 within ±0.33 (m = 6); the published rule
    splits at 0.  Checked against the rules themselves at random gaps, for both rules and several k and β."""
    low, high = budget_band(4, 0.5, 2)
    assert low == pytest.approx(-1.0217, abs=1e-4) and high == pytest.approx(1.0217, abs=1e-4)
    assert budget_band(12, 0.5, 6) == pytest.approx((-0.3341, 0.3341), abs=1e-4)
    assert budget_band(4, 0.5, 1)[0] == float("-inf") and budget_band(4, 0.5, 4)[1] == float("inf")
    assert budget_band(4, 0.5, 3, "official") == pytest.approx((0.0, 2.1972), abs=1e-4)  # 4σ ∈ [2, 3)
    rng = random.Random(0)
    for rule, rule_fn in (("paper", global_budget), ("official", official_global_budget)):
        for k in (1, 2, 4, 5, 8, 12):
            for beta in (0.25, 0.5, 2.0):
                for _ in range(300):
                    gap = rng.uniform(-12, 12)
                    m = rule_fn(k, gap, 0.0, beta)
                    low, high = budget_band(k, beta, m, rule)
                    assert low <= gap < high, (rule, k, beta, gap, m, low, high)
    with pytest.raises(ValueError):
        budget_band(4, 0.5, 5)
    with pytest.raises(ValueError):
        budget_band(4, 0.0, 2)


def test_no_tool_calls_means_h_tool_is_h_root():
    assert mean_tool_entropy(1.7, []) == 1.7
    assert mean_tool_entropy(1.7, [float("nan")]) == 1.7
    assert mean_tool_entropy(1.7, [1.0, 2.0]) == 1.5
    assert global_budget(12, 1.7, mean_tool_entropy(1.7, []), 0.5) == 6


def test_fixed_budget_is_clamped():
    assert fixed_budget(12, 6) == 6
    assert fixed_budget(4, 6) == 4
    assert fixed_budget(4, 0) == 1


def test_penalty_reaches_zero_at_one_over_lambda():
    assert consecutive_branch_penalty(0, LAM) == 1.0
    assert consecutive_branch_penalty(10, LAM) == pytest.approx(0.5)
    assert consecutive_branch_penalty(20, LAM) == 0.0
    assert consecutive_branch_penalty(25, LAM) == 0.0
    assert consecutive_branch_penalty(3, 0.5) == 0.0
    d = branch_decision(0.99, 10.0, 20, gamma=GAMMA, tau=TAU, lam=LAM)
    assert not d.branch and d.score == 0.0 and d.reason == "penalized"


def test_branch_rule_values():
    d = branch_decision(0.45, 0.5, 0, gamma=GAMMA, tau=TAU, lam=LAM)
    assert d.branch and d.score == pytest.approx(0.55) and d.reason == "branch"
    d = branch_decision(0.45, 0.5, 2, gamma=GAMMA, tau=TAU, lam=LAM)
    assert d.score == pytest.approx(0.55 * 0.9) and not d.branch and d.reason == "penalized"
    d = branch_decision(0.1, -1.0, 0, gamma=GAMMA, tau=TAU, lam=LAM)
    assert not d.branch and d.reason == "below_tau"
    assert branch_decision(0.5, 0.0, 0, gamma=GAMMA, tau=TAU, lam=LAM).branch  # ≥ τ branches


def test_arpo_is_the_lambda_zero_case():
    rng = random.Random(0)
    for _ in range(200):
        u, dh, l = rng.random(), rng.uniform(-3, 3), rng.randrange(0, 30)
        assert arpo_branch_decision(u, dh, gamma=GAMMA, tau=TAU) == branch_decision(
            u, dh, l, gamma=GAMMA, tau=TAU, lam=0.0
        )


def test_consecutive_count_along_a_path():
    assert consecutive_branch_count([]) == 0
    assert consecutive_branch_count([True, True, False]) == 0
    assert consecutive_branch_count([False, True, True]) == 2
    assert consecutive_branch_count([True, False, True, True, True]) == 3


def test_determinism_with_a_seeded_generator():
    def run(seed):
        rng = random.Random(seed)
        history: list[bool] = []
        for dh in [0.3, 1.0, -0.2, 2.0, 0.0, 0.7]:
            d = branch_decision(rng.random(), dh, consecutive_branch_count(history), gamma=GAMMA, tau=TAU, lam=0.3)
            history.append(d.branch)
        return history

    assert run(7) == run(7)
    assert any(run(s) != run(7) for s in range(8, 20))


def branch_rate(delta_h: float, consecutive: int, lam: float, n: int = 20_000, seed: int = 0) -> float:
    rng = random.Random(seed)
    decide = lambda u: branch_decision(u, delta_h, consecutive, gamma=GAMMA, tau=TAU, lam=lam).branch  # noqa: E731
    hits = sum(decide(rng.random()) for _ in range(n))
    return hits / n


def test_branch_rate_rises_with_delta_h_and_falls_with_l():
    rates_dh = [branch_rate(dh, 0, LAM) for dh in (-2.0, -1.0, 0.0, 1.0, 2.0)]
    assert all(a < b for a, b in zip(rates_dh, rates_dh[1:]))
    # Closed form at l = 0: P(u ≥ τ − γΔH) = 1 − (τ − γΔH).
    assert rates_dh[2] == pytest.approx(0.5, abs=0.02)
    assert rates_dh[4] == pytest.approx(0.9, abs=0.02)
    rates_l = [branch_rate(1.0, l, 0.1) for l in (0, 1, 2, 3, 10)]
    assert all(a > b for a, b in zip(rates_l, rates_l[1:]))
    assert rates_l[-1] == 0.0
    # ARPO (λ = 0) does not care about l.
    assert branch_rate(1.0, 0, 0.0) == branch_rate(1.0, 5, 0.0)
