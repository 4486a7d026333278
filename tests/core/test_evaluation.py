"""Evaluation summaries: Pass@k against brute force, paired comparison of a run with itself."""

from __future__ import annotations

import itertools
import random

import pytest

from aepo_core.evaluation import (
    OverSeeds,
    QuestionOutcome,
    is_correct,
    paired_comparison,
    pooled_paired_comparison,
    summarize,
    summarize_by,
)
from aepo_core.interfaces import RewardResult


def outcome(qid, n, c, family="single_hop"):
    return QuestionOutcome(qid, "synthetic", family, n, c, c / n, c / n, 1.0, 0.0, 1.0)


def brute_pass_at_k(results: list[bool], k: int) -> float:
    subsets = list(itertools.combinations(results, k))
    return sum(any(s) for s in subsets) / len(subsets)


def test_pass_at_k_matches_brute_force_on_an_outcome_table():
    rng = random.Random(0)
    table = {f"q{i}": [rng.random() < 0.3 for _ in range(6)] for i in range(25)}
    outcomes = [outcome(q, 6, sum(r)) for q, r in table.items()]
    s = summarize(outcomes, k=3, n_resamples=200)
    assert s["pass@1"] == pytest.approx(sum(sum(r) / 6 for r in table.values()) / 25)
    assert s["pass@3"] == pytest.approx(sum(brute_pass_at_k(r, 3) for r in table.values()) / 25)
    assert s["pass@1_ci_low"] <= s["pass@1"] <= s["pass@1_ci_high"]
    assert s["pass@3"] >= s["pass@1"]


def test_by_family():
    outs = [outcome("a", 2, 2, "single_hop"), outcome("b", 2, 0, "compute")]
    by = summarize_by(outs, "family", k=2, n_resamples=50)
    assert by["single_hop"]["pass@1"] == 1.0 and by["compute"]["pass@1"] == 0.0


def test_paired_comparison_with_itself_is_zero():
    scores = {f"q{i}": random.Random(i).random() for i in range(30)}
    res = paired_comparison(scores, scores)
    assert res["diff"] == 0.0 and res["ci_low"] <= 0.0 <= res["ci_high"]
    better = {q: v + 0.5 for q, v in scores.items()}
    res = paired_comparison(better, scores)
    assert res["diff"] == pytest.approx(0.5) and res["ci_low"] > 0
    with pytest.raises(ValueError):
        paired_comparison({"a": 1.0}, {"b": 1.0})


def test_is_correct():
    assert is_correct(RewardResult(1.1, "correct", {"em": 1.0}))
    assert not is_correct(RewardResult(0.8, "partial", {"em": 0.0}))
    assert is_correct(RewardResult(1.0, "equivalent"))


def test_pooled_comparison_of_one_run_is_the_paired_comparison():
    rng = random.Random(3)
    a = {f"q{i}": rng.random() for i in range(40)}
    b = {f"q{i}": rng.random() for i in range(40)}
    pooled = pooled_paired_comparison([(a, b)], n_resamples=500, seed=7)
    single = paired_comparison(a, b, n_resamples=500, seed=7)
    assert (pooled["diff"], pooled["ci_low"], pooled["ci_high"]) == pytest.approx(
        (single["diff"], single["ci_low"], single["ci_high"]))
    assert pooled["runs"] == 1 and pooled["questions"] == 40


def test_pooled_comparison_weighs_runs_equally_and_keeps_them_as_strata():
    # run 1: 10 questions, each +1; run 2: 100 questions, each 0. Pooled by question it would read 10/110 = 0.09;
    # by run it is 0.5, and since each run's differences are constant no resample moves it (the runs are fixed).
    r1 = ({f"q{i}": 1.0 for i in range(10)}, {f"q{i}": 0.0 for i in range(10)})
    r2 = ({f"q{i}": 0.3 for i in range(100)}, {f"q{i}": 0.3 for i in range(100)})
    res = pooled_paired_comparison([r1, r2], n_resamples=200)
    assert res["diff"] == pytest.approx(0.5)
    assert res["ci_low"] == pytest.approx(0.5) and res["ci_high"] == pytest.approx(0.5)
    assert res["positive"] == 1 and res["runs"] == 2 and res["questions"] == 110


def test_pooled_comparison_interval_narrows_with_more_runs():
    rng = random.Random(0)

    def run() -> tuple[dict[str, float], dict[str, float]]:
        return ({f"q{i}": float(rng.random() < 0.4) for i in range(24)},
                {f"q{i}": float(rng.random() < 0.3) for i in range(24)})

    runs = [run() for _ in range(9)]
    one = pooled_paired_comparison(runs[:1], n_resamples=2000)
    nine = pooled_paired_comparison(runs, n_resamples=2000)
    width = lambda r: r["ci_high"] - r["ci_low"]  # noqa: E731
    assert width(nine) < 0.5 * width(one)  # ~1/3 for 9 equal strata
    assert nine["ci_low"] <= nine["diff"] <= nine["ci_high"]


def test_a_run_with_no_net_change_is_not_counted_as_gained():
    """Per-question Pass@1 in thirds (3 samples): 0 − 0, 0 − 1/3, 1 − 2/3 sums to 0, which floats read as
    +1.9e-17. A run whose final equals its SFT score gained nothing (the Zen 4 demo's seed 2 read as "gained")."""
    flat = ({"q0": 0.0, "q1": 0.0, "q2": 1.0}, {"q0": 0.0, "q1": 1 / 3, "q2": 2 / 3})
    up = ({"q0": 1.0}, {"q0": 0.0})
    res = pooled_paired_comparison([flat, up], n_resamples=100)
    assert res["positive"] == 1.0 and res["diff"] == pytest.approx(0.5)


def test_pooled_comparison_names_the_run_without_shared_questions():
    with pytest.raises(ValueError, match="pair 1"):
        pooled_paired_comparison([({"a": 1.0}, {"a": 0.0}), ({"a": 1.0}, {"b": 1.0})])
    with pytest.raises(ValueError, match="at least one"):
        pooled_paired_comparison([])


def test_over_seeds_is_a_student_t_interval_about_a_new_run() -> None:
    """Three seeds' gains +0.1, +0.2, +0.3: mean 0.2 ± t(0.975, 2) · 0.1 / √3 = ± 0.2484, so the interval holds 0
    although every seed gained; a stratified question bootstrap would not see that spread."""
    over = OverSeeds.of({2: 0.3, 0: 0.1, 1: 0.2})
    assert list(over.per_seed) == [0, 1, 2] and over.seeds == 3
    assert over.mean == pytest.approx(0.2)
    assert (over.low, over.high) == (pytest.approx(0.2 - 0.24841, abs=1e-4), pytest.approx(0.2 + 0.24841, abs=1e-4))
    assert over.sign == "0 in CI"
    assert OverSeeds.of({0: 0.5, 1: 0.52, 2: 0.51}).sign == "> 0"
    assert OverSeeds.of({0: -0.5, 1: -0.52}).sign == "< 0"
    one = OverSeeds.of({4: 0.1})
    assert one.sign == "one seed" and one.low is None and one.high is None  # JSON null, not NaN
    with pytest.raises(ValueError, match="at least one seed"):
        OverSeeds.of({})
