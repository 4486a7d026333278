"""Scoring trees: rewards per leaf, group advantages, dynamic sampling."""

from __future__ import annotations

import pytest
from scripted_engine import EchoSearch, ScriptedEngine, Segment

from aepo_core.config import AlgorithmConfig, RewardConfig, RolloutConfig
from aepo_core.rewards import make_reward_fn
from aepo_core.rollout.scheduler import Question, RolloutScheduler
from aepo_core.scoring import score_trees


def answer_script(answers):
    """Leaf i (by seed order) answers answers[i % len]; every path searches once first."""

    def script(transcript, seed):
        if "<result>" not in transcript:
            return Segment("<think>look</think><search>q</search>", 1.0)
        ans = answers[seed % len(answers)]
        return Segment(f"<think>ok</think><answer>\\boxed{{{ans}}}</answer>", 1.0)

    return script


def rollout(answers, n_q=2, k=4):
    cfg = RolloutConfig(mode="independent", k=k, initial_rollouts=1, max_response_tokens=500)
    sched = RolloutScheduler(ScriptedEngine(answer_script(answers)), {"search": EchoSearch()}, cfg)
    return sched.run([Question(f"q{i}", [ord(c) for c in f"question {i}"]) for i in range(n_q)], seed=1).trees


def test_rewards_and_grpo_advantages():
    trees = rollout(["paris", "london"])
    golds = {"q0": ["Paris"], "q1": ["Paris"]}
    summary = score_trees(trees, golds, make_reward_fn(RewardConfig(required_tools=["search"])), AlgorithmConfig(),
                          max_response_tokens=500)
    for tree in trees:
        rewards = [leaf.reward for leaf in tree.leaves]
        assert set(rewards) <= {0.0, 1.1}
        for leaf in tree.leaves:
            assert leaf.reward_reason in ("correct", "wrong")
        if len(set(rewards)) > 1:
            pos = [lf.advantage for lf in tree.leaves if lf.reward > 0]
            neg = [lf.advantage for lf in tree.leaves if lf.reward == 0]
            assert min(pos) > 0 > max(neg)
            assert sum(lf.advantage for lf in tree.leaves) == pytest.approx(0.0, abs=1e-6)
    assert any(len({lf.reward for lf in t.leaves}) > 1 for t in trees)  # the advantage checks above ran
    acc = sum(lf.reward > 0 for t in trees for lf in t.leaves) / 8
    assert summary.metrics["rollout/accuracy"] == pytest.approx(acc)
    assert summary.metrics["rollout/format_error_rate"] == 0.0


def test_dynamic_sampling_flags_uniform_groups():
    trees = rollout(["paris"])
    summary = score_trees(trees, {"q0": ["Paris"], "q1": ["Rome"]}, make_reward_fn(RewardConfig()),
                          AlgorithmConfig(dynamic_sampling=True), max_response_tokens=500)
    assert summary.uninformative_questions == {"q0", "q1"}
    assert all(lf.advantage == 0.0 for t in trees for lf in t.leaves)


def test_missing_gold_is_named():
    trees = rollout(["x"], n_q=1)
    with pytest.raises(KeyError, match="q0"):
        score_trees(trees, {}, make_reward_fn(RewardConfig()), AlgorithmConfig(), 500)


def test_overlong_penalty_applies():
    trees = rollout(["paris"], n_q=1)
    summary = score_trees(trees, {"q0": ["Paris"]}, make_reward_fn(RewardConfig(required_tools=["search"])),
                          AlgorithmConfig(overlong_buffer=480, overlong_penalty=1.0), max_response_tokens=500)
    assert all(lf.reward < 1.1 for lf in trees[0].leaves)
    assert summary.metrics["rollout/reward_mean"] < 1.1
