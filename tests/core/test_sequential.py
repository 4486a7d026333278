"""The group-sequential design (aepo_core/sequential.py): boundaries against the published tables, decisions on
constructed seeds."""

from __future__ import annotations

import math

import pytest

from aepo_core.sequential import (
    Decision,
    Design,
    beta_spending,
    design_drift,
    futility_boundaries,
    information_fractions,
    normal_quantile,
    obf_spending,
    run_looks,
    seed_means,
    seeds_for_power,
    spending_boundaries,
    t_boundary,
    wave_seeds,
)

# Lan–DeMets O'Brien–Fleming-type, symmetric two-sided α = 0.05 (0.025 per side): DeMets & Lan (1994), Table 1;
# R ldbounds `bounds(t, iuse=c(1, 1), alpha=c(0.025, 0.025))`; gsDesign `gsDesign(k=3, test.type=2, sfu=sfLDOF)`.
THREE_LOOKS = [3.7103, 2.5114, 1.9930]
FIVE_LOOKS = [4.8769, 3.3569, 2.6803, 2.2898, 2.0310]


def test_boundaries_match_the_tables():
    assert spending_boundaries([1 / 3, 2 / 3, 1.0], 0.05) == pytest.approx(THREE_LOOKS, abs=1e-4)
    # ldbounds prints 3.3569 at the 2nd of 5 looks from its coarse grid (h = 0.05); adaptive quadrature of the same
    # exit probability (scipy, below) puts it at 3.35701, as this recursion does.
    assert spending_boundaries([0.2, 0.4, 0.6, 0.8, 1.0], 0.05) == pytest.approx(FIVE_LOOKS, abs=1.5e-4)


def test_one_look_is_the_fixed_test_and_spending_ends_at_alpha():
    assert spending_boundaries([1.0], 0.05) == pytest.approx([1.959964], abs=1e-5)
    assert obf_spending(1.0, 0.05) == pytest.approx(0.05, abs=1e-12)
    assert obf_spending(0.0, 0.05) == 0.0
    assert normal_quantile(0.975) == pytest.approx(1.959963985, abs=1e-9)


def test_second_boundary_spends_exactly_its_increment():
    scipy = pytest.importorskip("scipy")
    from scipy import integrate
    from scipy.stats import norm

    assert scipy
    t1, t2 = 0.2, 0.4
    b1, b2 = spending_boundaries([t1, t2, 1.0], 0.05)[:2]
    edge, sd = b2 * math.sqrt(t2), math.sqrt(t2 - t1)
    exit2, _ = integrate.quad(lambda u: norm.pdf(u, scale=math.sqrt(t1)) * (norm.cdf((-edge - u) / sd)
                                                                             + norm.sf((edge - u) / sd)),
                              -b1 * math.sqrt(t1), b1 * math.sqrt(t1), epsabs=1e-14)
    assert exit2 == pytest.approx(obf_spending(t2, 0.05) - obf_spending(t1, 0.05), abs=1e-8)


def test_design_validation_and_waves():
    assert information_fractions([2, 2, 2]) == pytest.approx([1 / 3, 2 / 3, 1.0])
    design = Design((2, 2, 2), (("aepo", "arpo"), ("aepo", "grpo"), ("arpo", "grpo")))
    assert design.arms == ("aepo", "arpo", "grpo") and design.alpha_per_comparison == pytest.approx(0.05 / 3)
    assert wave_seeds(design, [5, 6, 7, 8, 9, 10]) == [(5, 6), (7, 8), (9, 10)]
    assert "Bonferroni over 3" in design.describe()
    with pytest.raises(ValueError, match="first wave"):
        Design((1, 2), (("a", "b"),))
    with pytest.raises(ValueError, match="need 6 seeds"):
        wave_seeds(design, [0, 1, 2])
    with pytest.raises(ValueError, match="margin"):
        Design((2, 2), (("a", "b"),), margin=0.0)


def _runs(values: dict[str, dict[int, float]]) -> dict[str, dict[int, dict[str, float]]]:
    """Arm → seed → a run's per-question Pass@1 whose mean is the given value (two questions)."""
    return {arm: {s: {"q1": v, "q2": v} for s, v in by_seed.items()} for arm, by_seed in values.items()}


def test_a_clear_difference_stops_at_the_second_look_and_drops_the_arms():
    design = Design((2, 2, 2), (("a", "b"),))
    noise = [0.01, -0.01, 0.012, -0.008]
    per_q = _runs({"a": {s: 0.6 + noise[s] for s in range(4)}, "b": {s: 0.3 - noise[s] / 2 for s in range(4)}})
    out = run_looks(design, per_q, [0, 1, 2, 3, 4, 5])
    assert [look.index for look in out.looks] == [1, 2]
    first, second = out.looks[0].comparisons[0], out.looks[1].comparisons[0]
    # look 1: 2 seeds, df 1: the boundary t_1^{-1}(Φ(3.71)) ≈ 3.1e3 is out of reach
    assert first.decision is Decision.CONTINUE and first.df == 1 and first.boundary > 1000
    assert second.decision is Decision.DIFFER and second.estimate == pytest.approx(0.3 + 1.5 * sum(noise) / 4)
    assert out.stopped and out.active_arms() == ()


def test_equivalence_and_undecided_and_an_arm_dropped():
    design = Design((2, 2), (("a", "b"), ("a", "c")), margin=0.05)
    base = [0.50, 0.52, 0.49, 0.51]
    per_q = _runs({"a": dict(enumerate(base)), "b": {s: v + 0.001 * (-1) ** s for s, v in enumerate(base)},
                   "c": {s: v + 0.1 * (-1) ** s for s, v in enumerate(base)}})
    partial = run_looks(design, {arm: {s: r[s] for s in (0, 1)} for arm, r in per_q.items()}, [0, 1, 2, 3])
    assert [c.decision for c in partial.looks[0].comparisons] == [Decision.CONTINUE, Decision.CONTINUE]
    out = run_looks(design, per_q, [0, 1, 2, 3])
    decided = out.decisions()
    assert decided[("a", "b")].decision is Decision.EQUIVALENT  # RCI 0 ± t_3 · 0.0005: inside ±0.05
    assert decided[("a", "c")].decision is Decision.UNDECIDED  # estimate 0, but seeds swing ±0.1
    assert decided[("a", "c")].low < -0.05


def test_looks_wait_for_a_complete_wave_and_decided_arms_run_no_more():
    design = Design((2, 2, 2), (("a", "b"), ("b", "c")))
    per_q = _runs({"a": {0: 0.9, 1: 0.91, 2: 0.9, 3: 0.905}, "b": {0: 0.1, 1: 0.12, 2: 0.1, 3: 0.102},
                   "c": {0: 0.1, 1: 0.3, 2: 0.2}})  # c lacks seed 3: look 2 cannot be taken
    out = run_looks(design, per_q, [0, 1, 2, 3, 4, 5])
    assert len(out.looks) == 1 and set(out.active_arms()) == {"a", "b", "c"}
    per_q["c"][3] = {"q1": 0.15, "q2": 0.15}
    out = run_looks(design, per_q, [0, 1, 2, 3, 4, 5])
    assert out.decisions()[("a", "b")].decision is Decision.DIFFER
    assert out.active_arms() == ("b", "c")  # a's one comparison is decided: a is dropped
    for arm, s, v in (("b", 4, 0.1), ("b", 5, 0.1), ("c", 4, 0.2), ("c", 5, 0.15)):
        per_q[arm][s] = {"q1": v, "q2": v}
    final = run_looks(design, per_q, [0, 1, 2, 3, 4, 5])
    assert final.looks[2].arms == ("b", "c") and [c.a for c in final.looks[2].comparisons] == ["b"]
    assert final.stopped and final.as_dict()["stopped"] is True


def test_pooled_variance_has_more_degrees_of_freedom():
    design = Design((2, 2), (("a", "b"), ("a", "c"), ("b", "c")), variance="pooled")
    per_q = _runs({"a": {0: 0.5, 1: 0.55}, "b": {0: 0.4, 1: 0.42}, "c": {0: 0.3, 1: 0.36}})
    look = run_looks(design, per_q, [0, 1, 2, 3]).looks[0]
    assert [c.df for c in look.comparisons] == [2, 2, 2]  # (n − 1)(m − 1) = 1 · 2


def test_seed_means_use_the_questions_every_arm_answered():
    per_q = {"a": {0: {"q1": 1.0, "q2": 0.0, "q3": 1.0}}, "b": {0: {"q1": 0.5, "q2": 0.5}}}
    assert seed_means(per_q, ["a", "b"], 0) == {"a": 0.5, "b": 0.5}
    assert seed_means(per_q, ["a", "b"], 1) is None


# --- futility (β spending) and the pilot σ -----------------------------------------------------------------------

def test_beta_spending_forms():
    assert beta_spending(1.0, 0.2, "obf") == pytest.approx(0.2, abs=1e-12)
    assert beta_spending(1.0, 0.2, "pocock") == pytest.approx(0.2, abs=1e-12)
    assert beta_spending(0.5, 0.2, "pocock") == pytest.approx(0.2 * math.log(1 + (math.e - 1) / 2))
    assert beta_spending(0.5, 0.2, "obf") < beta_spending(0.5, 0.2, "pocock")  # OBF spends less early
    assert beta_spending(0.99, 0.2, "none") == 0.0 and beta_spending(0.0, 0.2, "obf") == 0.0


def test_one_look_drift_is_the_fixed_sample_formula():
    # K = 1: η = z_{1−α/2} + z_{1−β} (the fixed design; the wrong-sign tail Φ(−η − z) < 1e-5 moves it by < 1e-4)
    assert design_drift([1.0], 0.05, 0.2, "obf") == pytest.approx(1.959964 + 0.841621, abs=1e-4)
    assert design_drift([1.0], 0.05, 0.1, "none") == pytest.approx(1.959964 + 1.281552, abs=1e-4)


def test_futility_spends_beta_exactly_and_meets_the_last_efficacy_boundary():
    """A high-precision check by adaptive quadrature (scipy), independent of the grid recursion: at the solved
    drift the type II error is β, each interim futility boundary spends its increment of β(t), a_K = b_K, and
    futility costs information (η above the efficacy-only design's; OBF-type less than Pocock-type)."""
    pytest.importorskip("scipy")
    from scipy import integrate
    from scipy.stats import norm

    ts, alpha, beta = [0.5, 1.0], 0.05, 0.2
    bounds = spending_boundaries(ts, alpha)
    eta = design_drift(ts, alpha, beta, "obf")
    (a1, a2), spent = futility_boundaries(ts, bounds, beta, eta, "obf", grid=1201)
    assert a2 == bounds[1] and spent == pytest.approx(beta, abs=1e-6)
    # look 1: P(|Z_1| < a_1) at mean η√t_1
    m1 = eta * math.sqrt(ts[0])
    assert norm.cdf(a1 - m1) - norm.cdf(-a1 - m1) == pytest.approx(beta_spending(0.5, beta, "obf"), abs=1e-8)
    # look 2: ∫ over a_1 ≤ |z_1| < b_1 of P(|Z_2| < b_2 | z_1), S_2 = S_1 + N(η/2, 1/2)
    r1, sd = math.sqrt(ts[0]), math.sqrt(0.5)

    def stay(s1: float) -> float:
        dens = norm.pdf(s1, loc=eta * ts[0], scale=r1)
        return dens * (norm.cdf((bounds[1] - s1 - eta / 2) / sd) - norm.cdf((-bounds[1] - s1 - eta / 2) / sd))

    parts = [integrate.quad(stay, lo * r1, hi * r1, epsabs=1e-13)[0] for lo, hi in
             ((-bounds[0], -a1), (a1, bounds[0]))]
    assert beta_spending(0.5, beta, "obf") + sum(parts) == pytest.approx(beta, abs=1e-6)
    plain, pocock = design_drift(ts, alpha, beta, "none"), design_drift(ts, alpha, beta, "pocock")
    assert plain < eta < pocock


def test_futility_is_non_binding_the_efficacy_boundaries_ignore_it():
    plain = Design((2, 2, 2), (("a", "b"),))
    futile = Design((2, 2, 2), (("a", "b"),), futility="obf", delta=0.1, sigma=0.1)
    assert futile.z_boundaries() == plain.z_boundaries()
    lows = futile.futility_z_boundaries()
    assert 0 < lows[0] < lows[1] < lows[2] == futile.z_boundaries()[2] and plain.futility_z_boundaries() == [0] * 3


def test_pilot_seeds_come_from_the_power_requirement():
    # the powered sweep's σ_D 0.0963 at Δ 0.121, α 0.05/3, power 0.8: fixed z needs (2.394 + 0.842)² (σ/Δ)² = 6.63
    assert sum(seeds_for_power(1, 0.0963, 0.121, 0.05 / 3, 0.2, "none")) == 7
    waves = seeds_for_power(2, 0.0963, 0.121, 0.05 / 3, 0.2, "obf")
    assert waves == (2, 2, 2, 2)
    design = Design(waves, (("a", "b"),), alpha=0.05 / 3, variance="pilot", futility="obf", delta=0.121,
                    sigma=0.0963)
    assert design.planned_power() >= 0.8
    with pytest.raises(ValueError, match=r"needs ≥ 7\.23 seeds"):
        Design((2, 2, 2), (("a", "b"),), alpha=0.05 / 3, variance="pilot", futility="obf", delta=0.121, sigma=0.0963)
    with pytest.raises(ValueError, match="sigma must be > 0 with variance: pilot"):
        Design((2, 2), (("a", "b"),), variance="pilot", delta=0.1)
    with pytest.raises(ValueError, match="delta must be > 0 with futility: pocock"):
        Design((2, 2), (("a", "b"),), futility="pocock", sigma=0.1)


def test_pilot_looks_use_z_with_the_stated_sigma():
    design = Design((1, 1), (("a", "b"),), variance="pilot", delta=0.3, sigma=0.1, power=0.8)
    per_q = _runs({"a": {0: 0.55, 1: 0.5}, "b": {0: 0.3, 1: 0.3}})
    first = run_looks(design, per_q, [0, 1]).looks[0].comparisons[0]
    assert first.df is None and first.se == pytest.approx(0.1) and first.boundary == design.z_boundaries()[0]
    assert first.statistic == pytest.approx(2.5) and first.decision is Decision.CONTINUE  # b_1 = 2.797
    second = run_looks(design, per_q, [0, 1]).looks[1].comparisons[0]
    assert second.decision is Decision.DIFFER  # z = 0.225/(0.1/√2) = 3.18 ≥ 1.977
    assert t_boundary(2.0, None) == 2.0 and t_boundary(-0.3, 4) == 0.0


def test_a_futility_stop_ends_a_comparison_and_drops_its_arms():
    # two equal arms: |T| tiny at look 1 → futile under futility, continue without
    per_q = _runs({"a": {0: 0.50, 1: 0.60}, "b": {0: 0.501, 1: 0.598}})
    kw = {"variance": "pilot", "delta": 0.2, "sigma": 0.1}
    futile = run_looks(Design((2, 2, 2), (("a", "b"),), futility="obf", **kw), per_q, list(range(6)))
    (c,) = futile.looks[0].comparisons
    assert c.decision is Decision.FUTILE and c.futility_boundary > abs(c.statistic) and futile.stopped
    plain = run_looks(Design((2, 2, 2), (("a", "b"),), **kw), per_q, list(range(6)))
    assert plain.looks[0].comparisons[0].decision is Decision.CONTINUE and plain.active_arms() == ("a", "b")
    # the t version converts a_k to the t of the same nominal level
    t_design = Design((2, 2, 2), (("a", "b"),), futility="pocock", delta=0.2, sigma=0.1)
    (tc,) = run_looks(t_design, per_q, list(range(6))).looks[0].comparisons
    assert tc.futility_boundary == pytest.approx(t_boundary(t_design.futility_z_boundaries()[0], 1))
