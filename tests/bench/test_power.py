"""bench.power: the closed-form power, the variance decomposition on data with known components, the cost model
and the CLI (results JSON; bad input → exit 2 naming the file or field)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from bench.power import (
    CostModel,
    FirstComparison,
    Plan,
    VarianceComponents,
    best_affordable,
    design_power,
    detectable_effect,
    estimate_components,
    main,
    min_seeds,
    read_first_comparison,
    se_of_difference,
    z_power,
)

Z975 = 1.959963984540054


def components(sigma2_q: float = 0.15, sigma2_seed: float = 0.001) -> VarianceComponents:
    return VarianceComponents(sigma2_q=sigma2_q, sigma2_seed=sigma2_seed, sigma2_seed_raw=2 * sigma2_seed + 0.001,
                              seed_df=10, n_questions=24, eval_samples=2, pairs=(("a", "b"),))


def synthetic(n_arms: int, n_seeds: int, n_q: int, sigma_e: float, sigma_seed: float, seed: int = 0,
              sigma_aq: float = 0.0, per_seed: bool = False,
              shared_seeds: bool = False) -> dict[str, object]:
    """A compare_algorithms result drawn from the module's model with no arm effect, p = u_q + v_{a,q} + w_{a,s} +
    e_{a,s,q}
    (``shared_seeds``: w_s the same for every arm, as seed-matched arms sharing their randomness); with
    ``per_seed`` also each run's per-question values."""
    rng = np.random.default_rng(seed)
    u = rng.normal(0.4, 0.3, n_q)
    questions = [f"q{i}" for i in range(n_q)]
    w_shared = rng.normal(0, sigma_seed, (n_seeds, 1))
    arms, per_question, by_seed_question = {}, {}, {}
    for a in range(n_arms):
        w = w_shared if shared_seeds else rng.normal(0, sigma_seed, (n_seeds, 1))
        v = rng.normal(0, sigma_aq, n_q)
        p = u + v + w + rng.normal(0, sigma_e, (n_seeds, n_q))
        name = f"arm{a}"
        per_question[name] = dict(zip(questions, p.mean(axis=0).tolist(), strict=True))
        by_seed_question[name] = {str(s): dict(zip(questions, p[s].tolist(), strict=True)) for s in range(n_seeds)}
        arms[name] = {"pass@1_by_seed": {str(s): float(p[s].mean()) for s in range(n_seeds)},
                      "rl_wall_s_per_run": 300.0 + 10 * a}
    data: dict[str, object] = {
        "arms": arms, "per_question_pass@1": per_question, "workers": 2, "wall_s": {"sft": 0.0, "sweep": None},
        "budget": {"rl_steps": 3, "questions_per_step": 4, "k": 4, "eval_samples": 2}}
    if per_seed:
        data["per_question_pass@1_by_seed"] = by_seed_question
    return data


def first_of(data: dict[str, object], run_wall_s: float = 480.0) -> FirstComparison:
    return read_first_comparison(data, run_wall_s)


# ------------------------------------------------------------------------------------------------ closed form
def test_power_is_one_half_when_the_effect_is_z_standard_errors() -> None:
    se = 0.02
    # Φ(0) plus the other tail Φ(−2z) = Φ(−3.92) = 4.43e-5
    assert z_power(Z975 * se, se) == pytest.approx(0.5 + 4.43e-5, abs=1e-6)
    assert z_power(0.0, se) == pytest.approx(0.05)  # no effect: the test's level
    assert z_power(-0.05, se) == z_power(0.05, se)
    assert z_power(detectable_effect(se, power=0.8), se) == pytest.approx(0.8, abs=1e-4)
    assert detectable_effect(1.0) == pytest.approx(Z975 + 0.8416212335729143)


def test_se_formula() -> None:
    assert se_of_difference(0.16, 0.0, 16, 1) == pytest.approx(0.1)
    assert se_of_difference(0.0, 0.005, 10, 4) == pytest.approx(math.sqrt(2 * 0.005 / 4))
    assert se_of_difference(0.12, 0.002, 30, 3) == pytest.approx(math.sqrt(0.12 / 90 + 0.004 / 3))
    with pytest.raises(ValueError, match="≥ 1 question"):
        se_of_difference(0.1, 0.0, 0, 3)


def test_power_grows_with_questions_seeds_and_effect_and_falls_with_noise() -> None:
    comp = components()
    by_q = [design_power(comp, 0.05, n, 3) for n in (10, 30, 100, 300)]
    by_s = [design_power(comp, 0.05, 50, s) for s in (2, 4, 8, 16)]
    by_d = [design_power(comp, d, 50, 5) for d in (0.01, 0.03, 0.05, 0.1)]
    by_noise = [design_power(components(sigma2_seed=v), 0.05, 50, 5) for v in (0.0, 0.001, 0.004)]
    for seq in (by_q, by_s, by_d):
        assert all(b > a for a, b in consecutive(seq)), seq
    assert all(b < a for a, b in consecutive(by_noise)), by_noise
    # more questions cannot average the seed term away: the power is capped by 2σ²_seed/n_s
    cap = z_power(0.05, math.sqrt(2 * comp.sigma2_seed / 3))
    assert design_power(comp, 0.05, 10**6, 3) == pytest.approx(cap, abs=1e-3)
    assert design_power(comp, 0.05, 50, 5, pessimistic=True) < design_power(comp, 0.05, 50, 5)


def consecutive(seq: list[float]) -> list[tuple[float, float]]:
    return list(zip(seq, seq[1:], strict=False))


def test_min_seeds_is_the_first_design_reaching_the_target() -> None:
    comp = components(sigma2_seed=0.0)
    s = min_seeds(comp, 0.05, 0.8, 56)
    assert s is not None and design_power(comp, 0.05, 56, s) >= 0.8 > design_power(comp, 0.05, 56, s - 1)
    # n_q·n_s ≥ σ²_q·((z + z_0.8)/Δ)² when σ²_seed = 0
    assert s == math.ceil(comp.sigma2_q * ((Z975 + 0.8416212335729143) / 0.05) ** 2 / 56)
    assert min_seeds(components(sigma2_seed=0.5), 0.05, 0.8, 56) is None  # beyond MAX_SEEDS


def test_closed_form_matches_monte_carlo() -> None:
    """Simulated comparisons under the model (two arms, seed shifts, run × question noise) reject H0 as often as
    the closed form says."""
    rng = np.random.default_rng(7)
    sigma2_q, sigma2_seed, n_q, n_s, delta, sims = 0.12, 0.0015, 40, 4, 0.06, 4000
    se = se_of_difference(sigma2_q, sigma2_seed, n_q, n_s)
    expected = z_power(delta, se)
    sigma_e = math.sqrt(sigma2_q / 2)  # per arm: the paired difference of one seed pair has variance σ²_q

    def arm(mu: float) -> np.ndarray:
        w = rng.normal(0, math.sqrt(sigma2_seed), (sims, n_s, 1))
        return (mu + w + rng.normal(0, sigma_e, (sims, n_s, n_q))).mean(axis=(1, 2))

    d = arm(delta) - arm(0.0)
    mc = float(np.mean(np.abs(d) / se > Z975))
    assert 0.3 < expected < 0.9
    assert mc == pytest.approx(expected, abs=0.03)


# ------------------------------------------------------------------------------------------------ estimates
def test_decomposition_recovers_known_components() -> None:
    sigma_e, sigma_seed = 0.25, 0.04
    first = first_of(synthetic(n_arms=30, n_seeds=5, n_q=400, sigma_e=sigma_e, sigma_seed=sigma_seed))
    comp = estimate_components(first, list(first.per_question))
    assert comp.sigma2_q == pytest.approx(2 * sigma_e**2, rel=0.05)
    assert comp.sigma2_seed == pytest.approx(sigma_seed**2, rel=0.35)
    # the raw pooled variance also holds the questions' noise of each run's Pass@1: σ²_seed + σ²_e/n_q
    assert comp.sigma2_seed_raw - comp.sigma2_seed == pytest.approx(comp.sigma2_q / 800)
    assert comp.seed_df == 30 * 4 and comp.n_questions == 400 and len(comp.pairs) == 30 * 29 // 2


def test_seed_averaging_is_accounted_for() -> None:
    """The per-question values are means over S seeds: σ̂²_q must not depend on S."""
    est = [estimate_components(f, list(f.per_question)).sigma2_q
           for f in (first_of(synthetic(12, s, 300, 0.3, 0.0, seed=s)) for s in (2, 4, 8))]
    assert est == pytest.approx([0.18] * 3, rel=0.1)


def test_a_duplicated_arm_is_one_training_not_two() -> None:
    data = synthetic(n_arms=3, n_seeds=3, n_q=50, sigma_e=0.2, sigma_seed=0.02)
    data["arms"]["copy"] = data["arms"]["arm0"]  # type: ignore[index]
    data["per_question_pass@1"]["copy"] = data["per_question_pass@1"]["arm0"]  # type: ignore[index]
    first = first_of(data)
    with_copy = estimate_components(first, ["arm0", "arm1", "arm2", "copy"])
    without = estimate_components(first, ["arm0", "arm1", "arm2"])
    assert with_copy == without and ("arm0", "copy") not in with_copy.pairs


def test_two_way_separates_the_arm_question_effect() -> None:
    sigma_e, sigma_aq, sigma_seed = 0.25, 0.08, 0.04
    data = synthetic(n_arms=12, n_seeds=8, n_q=300, sigma_e=sigma_e, sigma_seed=sigma_seed, sigma_aq=sigma_aq,
                     per_seed=True)
    first = first_of(data)
    comp = estimate_components(first, list(first.per_question))
    assert comp.method == "two-way" and comp.seed_df == 66 * 7
    assert comp.sigma2_q == pytest.approx(2 * sigma_e**2, rel=0.05)
    assert comp.sigma2_aq == pytest.approx(2 * sigma_aq**2, rel=0.25)
    assert comp.sigma2_seed == pytest.approx(sigma_seed**2, rel=0.35)
    # the seed-averaged estimate cannot tell the arm × question effect from noise: it lands in σ²_q, scaled by S
    del data["per_question_pass@1_by_seed"]
    averaged = estimate_components(first_of(data), list(first.per_question))
    assert averaged.method == "seed-averaged" and averaged.sigma2_aq == 0.0
    assert averaged.sigma2_q == pytest.approx(2 * sigma_e**2 + 8 * 2 * sigma_aq**2, rel=0.1)
    # …which makes it optimistic about seeds: with σ²_aq, more seeds stop helping at σ²_aq/n_q
    assert design_power(comp, 0.05, 50, 1000) < design_power(averaged, 0.05, 50, 1000)


def test_two_way_credits_seed_matched_arms_with_their_shared_randomness() -> None:
    """Arms whose seed s shares its run-level shift (same data order and sampling seeds): that shift cancels in
    a seed-matched difference; pooling each arm's spread across seeds counts it."""
    data = synthetic(n_arms=10, n_seeds=6, n_q=200, sigma_e=0.2, sigma_seed=0.05, per_seed=True, shared_seeds=True)
    first = first_of(data)
    paired = estimate_components(first, list(first.per_question))
    assert paired.sigma2_seed == pytest.approx(0.0, abs=2e-4)
    del data["per_question_pass@1_by_seed"]
    assert estimate_components(first_of(data), list(first.per_question)).sigma2_seed > 0.001


def test_two_way_needs_two_common_seeds() -> None:
    data = synthetic(n_arms=3, n_seeds=1, n_q=30, sigma_e=0.2, sigma_seed=0.0, per_seed=True)
    data["arms"]["arm0"]["pass@1_by_seed"]["1"] = 0.5  # type: ignore[index]
    assert estimate_components(first_of(data), ["arm0", "arm1", "arm2"]).method == "seed-averaged"


# ------------------------------------------------------------------------------------------------ cost
def test_affordable_design_fits_the_budget_and_grows_with_it() -> None:
    comp = components(sigma2_q=0.147, sigma2_seed=0.0)
    cost = CostModel(trajectory_s=7.8, eval_sample_s=2.2)
    plan = Plan(arms=3, steps=10, questions_per_step=4, k=4, samples=2, workers=2)
    assert plan.hours(cost, 100, 5) == pytest.approx(3 * 5 * (10 * 16 * 7.8 + 100 * 2 * 2.2) / 2 / 3600)
    designs = [best_affordable(comp, cost, plan, h, 0.05, max_questions=280) for h in (2, 6, 24)]
    assert all(d is not None for d in designs)
    for h, d in zip((2, 6, 24), designs, strict=True):
        assert d.hours <= h + 1e-9 and d.n_questions <= 280
        assert d.power == pytest.approx(design_power(comp, 0.05, d.n_questions, d.n_seeds))
    assert [d.power_pessimistic for d in designs] == sorted(d.power_pessimistic for d in designs)
    assert best_affordable(comp, cost, plan, 0.1, 0.05, max_questions=280) is None  # not even 2 seeds fit


# ------------------------------------------------------------------------------------------------ CLI
def test_cli_writes_the_estimate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = synthetic(n_arms=3, n_seeds=3, n_q=24, sigma_e=0.3, sigma_seed=0.03)
    data["arms"] = {("aepo", "arpo", "grpo")[i]: a for i, a in enumerate(data["arms"].values())}  # type: ignore[union-attr]
    data["per_question_pass@1"] = {("aepo", "arpo", "grpo")[i]: a  # type: ignore[union-attr]
                                   for i, a in enumerate(data["per_question_pass@1"].values())}
    src, out = tmp_path / "first.json", tmp_path / "out" / "power.json"
    src.write_text(json.dumps(data))
    assert main(["--input", str(src), "--out", str(out), "--delta", "0.1", "--hours", "6"]) == 0
    result = json.loads(out.read_text())
    comp = estimate_components(first_of(data), ["aepo", "arpo", "grpo"])
    assert result["components"]["sigma2_q"] == pytest.approx(comp.sigma2_q)
    assert result["components"]["sigma_seed_raw"] == pytest.approx(math.sqrt(comp.sigma2_seed_raw))
    row = next(r for r in result["table"] if r["n_questions"] == 56 and r["n_seeds"] == 5)
    assert row["power"] == pytest.approx(design_power(comp, 0.1, 56, 5))
    assert {r["n_questions"] for r in result["min_seeds"]} >= {24, 56}
    assert result["affordable"]["6h"]["hours"] <= 6
    assert result["cost"]["trajectory_s"] == pytest.approx(310.0 / 48)  # mean of 300, 310, 320 s over 3·4·4
    assert "σ²_q" in capsys.readouterr().out


def test_cli_bad_input_exits_2_naming_the_file_or_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.json"
    assert main(["--input", str(missing), "--out", str(tmp_path / "o.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(missing) in err
    data = synthetic(n_arms=3, n_seeds=2, n_q=10, sigma_e=0.2, sigma_seed=0.0)
    del data["arms"]["arm1"]["pass@1_by_seed"]  # type: ignore[index]
    src = tmp_path / "first.json"
    src.write_text(json.dumps(data))
    assert main(["--input", str(src), "--out", str(tmp_path / "o.json"), "--arms", "arm0", "arm1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(src) in err and "arms.arm1.pass@1_by_seed" in err
    src.write_text("{not json")
    assert main(["--input", str(src), "--out", str(tmp_path / "o.json")]) == 2
    assert not (tmp_path / "o.json").exists()


def test_a_reanalysed_comparison_costs_its_runs_measured_phases() -> None:
    """``compare_algorithms --analyse-only`` writes no sweep wall time (``wall_s.per_run`` None): a run's cost is then
    its arms' measured phases (SFT + evaluations + rollouts + updates, mean over arms), not the first comparison's
    480 s, which is less than an 8-step run's RL alone and made every evaluation free (c_eval 0)."""
    data = synthetic(n_arms=2, n_seeds=2, n_q=24, sigma_e=0.3, sigma_seed=0.03)
    for i, arm in enumerate(data["arms"].values()):  # type: ignore[union-attr]
        arm["rl_wall_s_per_run"] = 700.0
        arm["phases_s"] = {"sft": 0.0, "eval": 240.0 + 20 * i, "rollout": 300.0, "update": 400.0,
                           "scoring_pass": 100.0, "steps": 8}
    data["wall_s"] = {"sft": 0.0, "sweep": None, "per_run": None}
    first = read_first_comparison(data)
    assert first.run_wall_s == pytest.approx(950.0)  # (940 + 960) / 2
    data["wall_s"] = {"sft": 0.0, "sweep": 1800.0, "per_run": 900.0}  # a sweep timed in this run: its wall
    assert read_first_comparison(data).run_wall_s == pytest.approx(1800.0)  # × 2 workers
    for arm in data["arms"].values():  # type: ignore[union-attr]
        del arm["phases_s"]
    data["wall_s"] = {"sft": 0.0, "sweep": None, "per_run": None}
    assert read_first_comparison(data).run_wall_s == pytest.approx(480.0)  # results from before the phases
