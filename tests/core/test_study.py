"""The rollout study's per-group measures on hand-built trees (golden values) and its summaries."""

from __future__ import annotations

import math

import pytest

from aepo_core.rollout.stats import rollout_stats
from aepo_core.rollout.study import (
    GroupProfile,
    concentration,
    correlation_estimate,
    paired_difference,
    profile_group,
    summarize_mode,
)
from aepo_core.rollout.tree import Leaf, Node, RolloutTree, ToolEvent


def _tool(node_id: int, parent: int, query: str) -> Node:
    event = ToolEvent("search", query, True, None, 0.0, False, 10)
    return Node(node_id, parent, 0, "tool", [1, 2], text="<result>r</result>", tool=event)


def _model(node_id: int, parent: int | None, text: str, *, branched: bool = False, l_count: int = 0) -> Node:
    return Node(node_id, parent, 0, "model", [7] * 3, text=text, branched=branched, consecutive_branches=l_count)


def chain_tree() -> RolloutTree:
    """ARPO's pattern: one path branches at both of its tool steps (the second consecutively, l = 1).

    0 prompt → 1 → 2 tool → 3 (branched, l=0) → 4 tool → 5 (branched, l=1) answers Paris;
    fork 6 from 2 answers paris (same after normalization); fork 7 from 4 answers Rome;
    an independent global 8 → 9 tool → 10 answers nothing.
    """
    nodes = [
        Node(0, None, 0, "prompt", [9, 9]),
        _model(1, 0, "<search>capital france</search>"),
        _tool(2, 1, "capital  France"),
        _model(3, 2, "<search>france capital city</search>", branched=True),
        _tool(4, 3, "france capital city"),
        _model(5, 4, "<answer>\\boxed{Paris}</answer>", branched=True, l_count=1),
        _model(6, 2, "<answer>\\boxed{paris}</answer>"),
        _model(7, 4, "<answer>\\boxed{Rome}</answer>"),
        _model(8, 0, "<search>other</search>"),
        _tool(9, 8, "other"),
        _model(10, 9, "no answer"),
    ]
    leaves = [Leaf(0, [0, 1, 2, 3, 4, 5], "global", "answered", 2),
              Leaf(1, [0, 1, 2, 6], "branch", "answered", 1),
              Leaf(2, [0, 1, 2, 3, 4, 7], "branch", "answered", 2),
              Leaf(3, [0, 8, 9, 10], "global", "answered", 0)]
    return RolloutTree("q-chain", [9, 9], nodes, leaves, global_budget=2, h_root=1.5, h_tool=0.5)


def spread_tree() -> RolloutTree:
    """AEPO's intent: two global paths branch once each (l = 0 both times)."""
    nodes = [
        Node(0, None, 0, "prompt", [9]),
        _model(1, 0, "<search>a</search>"),
        _tool(2, 1, "a"),
        _model(3, 2, "<answer>x</answer>", branched=True),
        _model(4, 2, "<answer>x</answer>"),
        _model(5, 0, "<search>b</search>"),
        _tool(6, 5, "b"),
        _model(7, 6, "<answer>y</answer>", branched=True),
        _model(8, 6, "<answer>y</answer>"),
    ]
    leaves = [Leaf(0, [0, 1, 2, 3], "global", "answered", 1), Leaf(1, [0, 1, 2, 4], "branch", "answered", 1),
              Leaf(2, [0, 5, 6, 7], "global", "answered", 1), Leaf(3, [0, 5, 6, 8], "branch", "answered", 1)]
    return RolloutTree("q-spread", [9], nodes, leaves, global_budget=2, h_root=0.2, h_tool=1.2)


def test_a_chain_of_branches_is_concentrated_on_one_path():
    p = profile_group(chain_tree(), rewards=[1.0, 1.0, 0.0, 0.0], correct=[True, True, False, False])
    # Branch points {2, 4}; the original path and the fork from 4 both pass through both.
    assert (p.branch_points, p.top1_share, p.top3_share, p.max_branches_on_path) == (2, 1.0, 1.0, 2)
    assert p.consecutive == (0, 1)
    # ("capital france"), ("capital france", "france capital city") twice, ("other"): arguments normalized.
    assert p.distinct_tool_sequences == 3
    assert p.distinct_answers == 2  # paris (twice, case-normalized) and rome; the last leaf answered nothing
    assert p.correct == 2 and p.pass_at_k == 1.0 and p.mixed_rewards
    assert p.global_budget == 2 and p.entropy_gap == pytest.approx(1.0)
    assert p.model_tokens == 7 * 3  # 7 model nodes × 3 tokens, shared prefixes once


def test_branches_spread_over_paths_have_a_low_top1_share():
    p = profile_group(spread_tree(), rewards=[0.0] * 4, correct=[False] * 4)
    assert (p.branch_points, p.top1_share, p.top3_share, p.max_branches_on_path) == (2, 0.5, 1.0, 1)
    assert p.consecutive == (0, 0)
    assert not p.mixed_rewards and p.pass_at_k == 0.0 and p.distinct_answers == 2


def test_concentration_without_branches_is_undefined_and_top3_counts_shared_points_once():
    n, top1, top3, most = concentration([frozenset(), frozenset()])
    assert n == 0 and most == 0 and math.isnan(top1) and math.isnan(top3)
    # 5 points; the top-3 paths {1,2,3}, {1,2}, {4} cover 4 of them (1 and 2 counted once).
    per_leaf = [frozenset({1, 2}), frozenset({1, 2, 3}), frozenset({4}), frozenset({5}), frozenset()]
    assert concentration(per_leaf) == (5, 3 / 5, 4 / 5, 3)


def test_profile_rejects_scores_not_aligned_with_the_leaves():
    with pytest.raises(ValueError, match="q-chain: 4 leaves but 3 rewards"):
        profile_group(chain_tree(), rewards=[1.0, 0.0, 0.0], correct=[True, False, False])


def test_rollout_stats_log_the_branch_shares():
    stats, _ = rollout_stats([chain_tree(), spread_tree()])
    assert stats["branch_top1_share"] == pytest.approx(0.75)
    assert stats["branch_top3_share"] == pytest.approx(1.0)


def _profile(qid: str, top1: float, mixed: bool, gap: float, m: int) -> GroupProfile:
    return GroupProfile(qid, 4, 2, top1, 1.0, 2, (0, 1), 2, 1, 1, mixed, m, gap, 10)


def test_summaries_pair_questions_by_id_and_leave_undefined_values_out():
    a = [_profile(f"q{i}", 1.0, True, float(i), i) for i in range(20)]
    b = [_profile(f"q{i}", 0.5 if i else math.nan, i % 2 == 0, float(i), 3) for i in reversed(range(20))]
    diff = paired_difference(a, b, "top1_share", n_resamples=200)
    assert diff.n == 19 and diff.mean == pytest.approx(0.5) and diff.excludes_zero()
    inf = paired_difference(a, b, "informative", n_resamples=200)
    assert inf.mean == pytest.approx(0.5) and inf.n == 20
    s = summarize_mode(b, n_resamples=200)
    assert s.estimates["top1_share"].n == 19 and s.estimates["informative"].mean == pytest.approx(0.5)
    assert s.consecutive_histogram == {0: 20, 1: 20}
    assert s.estimates["consecutive_branch_share"].mean == pytest.approx(0.5)
    assert math.isnan(s.budget_correlation.mean)  # m constant: r undefined
    corr = summarize_mode(a, n_resamples=200).budget_correlation
    assert corr.mean == pytest.approx(1.0) and corr.n == 20


def test_correlation_ci_brackets_a_noisy_linear_relation():
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=200)
    y = x + rng.normal(size=200)
    est = correlation_estimate(list(x), list(y), n_resamples=300, seed=1)
    assert est.low < 1 / math.sqrt(2) < est.high and est.excludes_zero()


# ---------------------------------------------------------------- the paper's own quantities (issue 26 §5)
def _step(node_id: int, parent: int, h: float, reason: str = "", l_count: int = 0) -> Node:
    """A model segment with segment entropy ``h`` and the branch decision ``reason`` taken at it."""
    return Node(node_id, parent, 0, "model", [7] * 3, text="<search>x</search>", segment_entropy=h,
                branch_reason=reason, branched=reason == "branch", consecutive_branches=l_count)


def paper_tree() -> RolloutTree:
    """Global A: 1 (H 1) → 2 → 3 (H 2, branch) → 4 → 5 (H 3, penalized at l = 1) → 6 → 7 (H 0.5, below τ)
    → 8 → 9 (H 4, branch); forks: 10 from 2 (H 1.5), 11 from 8 (H 1.1).
    Global B: 12 (H 2) → 13 → 14 (H 3, budget full) ; fork 15 from 13 (an earlier decision made it; H 2.5).

    ΔH = H − H_init (1 on A's paths, 2 on B's): 3: 1, 5: 2, 7: −0.5, 9: 3, 10: 0.5, 11: 0.1, 14: 1, 15: 0.5;
    the median is 0.75, so the high-entropy tool steps are 3, 5, 9 and 14.  Tool steps with a tool step before
    them on their path: 5 (before it 3: high), 7 (5: high), 9 (7: low), 11 (7: low); of them high: 5 and 9, one
    after a high step → 1 of 2, against a chance level of 2 of 4.  (With ΔH > 0 as the test, 5, 9 and 11 would
    be high.)  Tool steps 3, 10, 14, 15 have no tool step before them.  Branch samples per global root: A 2, B 1.
    Decisions with the budget open: l = 0: 3 (branch), 7 (below τ), 9 (branch); l = 1: 5 (penalized)."""
    nodes = [Node(0, None, 0, "prompt", [9])]
    nodes += [_step(1, 0, 1.0), _tool(2, 1, "a"), _step(3, 2, 2.0, "branch"), _tool(4, 3, "b"),
              _step(5, 4, 3.0, "penalized", 1), _tool(6, 5, "c"), _step(7, 6, 0.5, "below_tau"), _tool(8, 7, "d"),
              _step(9, 8, 4.0, "branch"), _step(10, 2, 1.5, "fork"), _step(11, 8, 1.1, "fork"),
              _step(12, 0, 2.0), _tool(13, 12, "e"), _step(14, 13, 3.0, "budget_full"), _step(15, 13, 2.5, "fork")]
    leaves = [Leaf(0, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9], "global", "answered", 2),
              Leaf(1, [0, 1, 2, 10], "branch", "answered", 1),
              Leaf(2, [0, 1, 2, 3, 4, 5, 6, 7, 8, 11], "branch", "answered", 2),
              Leaf(3, [0, 12, 13, 14], "global", "answered", 0),
              Leaf(4, [0, 12, 13, 15], "branch", "answered", 1)]
    return RolloutTree("q-paper", [9], nodes, leaves, global_budget=2, h_root=1.0, h_tool=2.0)


def test_the_papers_rollout_quantities_on_a_hand_built_tree():
    p = profile_group(paper_tree(), rewards=[0.0] * 5, correct=[False] * 5)
    assert (p.high_entropy_steps, p.high_entropy_after_high) == (2, 1)
    assert (p.steps_after_tool, p.steps_after_high) == (4, 2)
    assert p.branch_samples_by_root == (2, 1)
    assert p.penalized == 1
    assert p.open_decisions_by_l == (3, 1) and p.branches_by_l == (2, 0)
    s = summarize_mode([p], n_resamples=50)
    assert s.estimates["consecutive_high_entropy_share"].mean == pytest.approx(1 / 2)
    assert s.estimates["consecutive_high_entropy_chance"].mean == pytest.approx(2 / 4)
    assert s.estimates["branch_samples_top1_root"].mean == pytest.approx(2 / 3)
    assert s.estimates["branch_samples_top2_root"].mean == pytest.approx(1.0)
    assert s.estimates["penalized"].mean == 1.0
    assert s.branch_rate_by_l[0].mean == pytest.approx(2 / 3) and s.branch_rate_by_l[1].mean == 0.0


def test_branch_rate_by_l_pools_decisions_over_questions():
    """P(branch | l, budget open) = Σ branches / Σ open decisions over the questions (a question with one decision
    weighs one decision), with a bootstrap CI over questions."""
    a = profile_group(paper_tree(), rewards=[0.0] * 5, correct=[False] * 5)
    b = profile_group(spread_tree(), rewards=[0.0] * 4, correct=[False] * 4)  # no decision reasons set: none
    s = summarize_mode([a, a, b], n_resamples=50)
    assert s.branch_rate_by_l[0].mean == pytest.approx(4 / 6) and s.branch_rate_by_l[0].n == 2


def test_every_step_logs_what_the_rollout_mechanisms_acted_on():
    """Issue 53 §2, from rollout_stats on every RL step: the hand-built tree's one penalized decision, its
    consecutive high-entropy steps (1 of 2) against their chance level (2 of 4), and m's spread over the questions
    (2 and 5): the same counts as the rollout study's, summed over the batch's trees."""
    import dataclasses

    from aepo_core.rollout.stats import rollout_stats

    other = dataclasses.replace(paper_tree(), question_id="q-other", global_budget=5)
    stats, _ = rollout_stats([paper_tree(), other])
    assert stats["penalized_per_question"] == 1.0
    assert stats["consecutive_high_entropy_share"] == pytest.approx(2 / 4)  # (1 + 1) of (2 + 2)
    assert stats["consecutive_high_entropy_chance"] == pytest.approx(4 / 8)
    assert (stats["global_budget_min"], stats["global_budget_max"]) == (2.0, 5.0)
    assert stats["global_budget_std"] == pytest.approx(1.5)
    empty, _ = rollout_stats([])
    assert math.isnan(empty["consecutive_high_entropy_share"]) and empty["penalized_per_question"] == 0.0
