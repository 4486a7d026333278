"""Evaluation summaries: Pass@k against brute force, paired comparison of a run with itself."""

from __future__ import annotations

import itertools
import random

import pytest

from aepo_core.evaluation import QuestionOutcome, is_correct, paired_comparison, summarize, summarize_by
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
