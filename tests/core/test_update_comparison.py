"""Token classes, per-sample sums and the paired ratio bootstrap over questions within steps of the update-rule
comparison."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from aepo_core.config import AlgorithmConfig
from aepo_core.config_keys import ConfigError
from aepo_core.losses import high_entropy_threshold
from aepo_core.update_comparison import (
    QUANTITIES,
    TOKEN_CLASSES,
    SampleTokens,
    cluster_ratio_bootstrap,
    compare_rules,
    entropy_threshold,
    rule_algorithm,
    sample_sums,
    token_classes,
)


def test_token_classes_are_disjoint_and_skip_tool_results():
    mask = np.array([1, 1, 1, 0, 1])
    entropy = np.array([2.0, 0.1, 3.0, 9.0, 0.5])
    tool_call = np.array([True, False, False, False, False])
    assert token_classes(mask, entropy, tool_call, threshold=1.0).tolist() == [0, 2, 1, -1, 2]


def test_entropy_threshold_is_the_losses_quantile_over_every_model_token():
    rng = np.random.default_rng(3)
    ents = [rng.random(7), rng.random(5)]
    masks = [np.array([1, 1, 0, 1, 1, 1, 0]), np.array([1, 0, 1, 1, 1])]
    want = high_entropy_threshold(torch.tensor(np.concatenate(ents)), torch.tensor(np.concatenate(masks)), 0.2)
    assert entropy_threshold(ents, masks, 0.2) == pytest.approx(want)


def tokens(token_class, abs_weight, zeroed=None, active=None, change=None, kl=None, before=None, after=None):
    n = len(token_class)
    zeros = np.zeros(n)
    return SampleTokens(np.array(token_class, dtype=np.int8),
                        np.array(active if active is not None else [1] * n),
                        np.array(zeroed if zeroed is not None else [0] * n),
                        np.array(abs_weight, dtype=float),
                        np.array(change, dtype=float) if change is not None else zeros,
                        np.array(kl, dtype=float) if kl is not None else zeros,
                        np.array(before, dtype=float) if before is not None else zeros,
                        np.array(after, dtype=float) if after is not None else zeros)


def test_sample_sums_per_class():
    t = tokens([0, 1, 1, 2, -1], abs_weight=[1.0, 2.0, 3.0, 4.0, 100.0], zeroed=[0, 1, 0, 0, 1],
               change=[0.5, -1.0, 0.0, 0.25, 7.0], before=[1, 1, 1, 1, 1], after=[2, 1, 0, 1, 9])
    sums = sample_sums(t)
    assert sums["gradient_weight_share"][0].tolist() == [1.0, 5.0, 4.0]
    assert sums["gradient_weight_share"][1].tolist() == [10.0, 10.0, 10.0]  # the tool result's 100 is not counted
    assert sums["zeroed_share"][0].tolist() == [0.0, 1.0, 0.0]
    assert sums["zeroed_share"][1].tolist() == [1.0, 2.0, 1.0]
    assert sums["logprob_change"][0].tolist() == [0.5, -1.0, 0.25]
    assert sums["entropy_change"][0].tolist() == [1.0, -1.0, 0.0]
    assert set(sums) == set(QUANTITIES)


def test_compare_rules_golden_ratios_and_paired_differences():
    # Two samples; rule b zeroes the high-entropy token that rule a keeps.
    a = [tokens([1, 2], abs_weight=[3.0, 1.0]), tokens([1, 2, 2], abs_weight=[1.0, 1.0, 2.0])]
    b = [tokens([1, 2], abs_weight=[0.0, 1.0], zeroed=[1, 0]), tokens([1, 2, 2], abs_weight=[1.0, 1.0, 2.0])]
    rows = {(r.quantity, r.token_class, r.rule): r
            for r in compare_rules({"a": a, "b": b}, strata=[0, 0], clusters=["q1", "q2"], reference="a",
                                   n_resamples=500)}
    share_a = rows[("gradient_weight_share", "high_entropy", "a")]
    share_b = rows[("gradient_weight_share", "high_entropy", "b")]
    assert share_a.value == pytest.approx(4.0 / 8.0)  # (3 + 1) / (4 + 4)
    assert share_b.value == pytest.approx(1.0 / 5.0)  # (0 + 1) / (1 + 4)
    assert share_a.diff is None and share_b.diff == pytest.approx(1.0 / 5.0 - 0.5)
    # b never gives the class more weight (a draw of the second sample alone is a tie)
    assert share_b.diff_low <= share_b.diff <= share_b.diff_high == 0.0
    zeroed_b = rows[("zeroed_share", "high_entropy", "b")]
    assert zeroed_b.value == pytest.approx(0.5) and zeroed_b.tokens == 2
    tool = rows[("zeroed_share", "tool_call", "a")]
    assert math.isnan(tool.value) and tool.tokens == 0 and tool.diff is None  # an empty class is undefined, not 0


def test_identical_rules_differ_by_exactly_zero_on_every_resample():
    rng = np.random.default_rng(0)
    samples = [tokens(rng.integers(0, 3, 6), abs_weight=rng.random(6), kl=rng.random(6)) for _ in range(8)]
    rows = compare_rules({"a": samples, "b": samples}, strata=[0] * 4 + [1] * 4, clusters=[0, 0, 1, 2] * 2,
                         reference="a", n_resamples=200)
    for r in rows:
        if r.rule == "b" and r.diff is not None:
            assert (r.diff, r.diff_low, r.diff_high) == (0.0, 0.0, 0.0)
    assert {r.token_class for r in rows} == set(TOKEN_CLASSES)


def test_the_bootstrap_redraws_questions_within_each_stratum():
    # One question per stratum: every resample is the whole data, so the interval collapses onto the point.
    num, den = np.array([[1.0, 3.0]]), np.array([[2.0, 2.0]])
    point, boot = cluster_ratio_bootstrap(num, den, strata=[0, 1], clusters=[0, 0], n_resamples=100, seed=0)
    assert point.tolist() == [1.0] and np.all(boot == 1.0)
    # Two questions of one stratum: each resample draws n − 1 = 1 of them, whole (its leaves never apart).
    num, den = np.array([[1.0, 1.0, 3.0, 3.0]]), np.array([[2.0, 2.0, 2.0, 2.0]])
    _, pooled = cluster_ratio_bootstrap(num, den, strata=[0] * 4, clusters=["a", "a", "b", "b"], n_resamples=100,
                                        seed=0)
    assert set(pooled[:, 0].tolist()) == {0.5, 1.5}
    # The same labels in two strata are two questions; the draw is the same for every row (paired).
    rows = np.array([[1.0, 2.0, 3.0, 4.0], [2.0, 4.0, 6.0, 8.0]])
    _, boot = cluster_ratio_bootstrap(rows, np.ones((2, 4)), strata=[0, 0, 1, 1], clusters=[0, 1, 0, 1],
                                      n_resamples=100, seed=0)
    assert set(boot[:, 0].tolist()) == {2.0, 2.5, 3.0}  # (2|4 + 6|8) / 4: one question per step, doubled
    assert np.array_equal(boot[:, 1], 2 * boot[:, 0])


def test_compare_rules_refuses_rules_on_different_samples():
    one = [tokens([2], abs_weight=[1.0])]
    with pytest.raises(ValueError, match="one entry per sample"):
        compare_rules({"a": one, "b": one * 2}, strata=[0], clusters=[0], reference="a")
    with pytest.raises(ValueError, match="reference rule"):
        compare_rules({"a": one}, strata=[0], clusters=[0], reference="aepo")


def test_a_rule_is_its_loss_at_the_papers_defaults_on_the_runs_other_settings():
    run = AlgorithmConfig(loss="aepo", clip_high=0.25, entropy_advantage=True)  # dual_clip 3, token-mean
    dapo = rule_algorithm(run, "dapo")
    assert (dapo.loss, dapo.dual_clip, dapo.clip_high, dapo.entropy_advantage) == ("dapo", None, 0.25, True)
    gspo = rule_algorithm(run, "gspo@entropy_advantage=false")
    assert (gspo.loss_agg, gspo.entropy_advantage) == ("seq-mean-token-mean", False)
    assert rule_algorithm(run, "ppo_clip").dual_clip == 3.0
    with pytest.raises(ConfigError, match="update rule 'ppo'"):
        rule_algorithm(run, "ppo")
    with pytest.raises(ConfigError, match="clip_hihg"):
        rule_algorithm(run, "aepo@clip_hihg=0.3")


def test_the_runs_own_loss_is_the_runs_own_algorithm_section():
    # A run of aepo with its own dual-clip and aggregation: `--losses aepo` is that run's update, not aepo's defaults.
    run = AlgorithmConfig(loss="aepo", dual_clip=2.0, loss_agg="seq-mean-token-mean", clip_high=0.25)
    assert rule_algorithm(run, "aepo") == run
    assert rule_algorithm(run, " aepo ") == run
    dapo_run = AlgorithmConfig(loss="dapo", dual_clip=3.0)  # dual-clip on, which dapo's default is not
    assert rule_algorithm(dapo_run, "dapo") == dapo_run
    # Another loss, or the run's loss with settings after @: that loss at its paper's defaults.
    ppo = rule_algorithm(run, "ppo_clip")
    assert (ppo.dual_clip, ppo.loss_agg, ppo.clip_high) == (3.0, "token-mean", 0.25)
    gated = rule_algorithm(run, "aepo@clip_gate=high_entropy")
    assert (gated.dual_clip, gated.loss_agg, gated.clip_gate) == (3.0, "token-mean", "high_entropy")


def clustered_steps(rng: np.random.Generator, steps: int = 3, questions: int = 8, leaves: int = 12
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One rule's (num [1, S], den [1, S], step, question) per leaf of a simulated replay whose true ratio is 0: a
    leaf's per-token value is its question's effect u_q ~ N(0, 1) (shared prefixes, one advantage normalisation)
    plus its own e ~ N(0, 0.5²), over 10–59 tokens."""
    shape = (steps, questions, leaves)
    value = rng.normal(0.0, 1.0, (steps, questions, 1)) + rng.normal(0.0, 0.5, shape)
    den = rng.integers(10, 60, shape).astype(np.float64)
    step, question = np.indices(shape)[:2]
    return (den * value).reshape(1, -1), den.reshape(1, -1), step.ravel(), question.ravel()


def test_the_bootstrap_covers_the_truth_when_a_questions_leaves_are_correlated():
    # 200 replays of 3 steps × 8 questions × 12 leaves: a nominal 95% interval must hold the true ratio (0) in at
    # least 90% of them.  Redrawing leaves within steps, as if a step's 96 leaves were independent, held it in 53.5%.
    rng = np.random.default_rng(49)
    covered = []
    for seed in range(200):
        num, den, step, question = clustered_steps(rng)
        _, boot = cluster_ratio_bootstrap(num, den, strata=step, clusters=question, n_resamples=1000, seed=seed)
        low, high = np.quantile(boot[:, 0], [0.025, 0.975])
        covered.append(low <= 0.0 <= high)
    assert np.mean(covered) >= 0.90, np.mean(covered)
