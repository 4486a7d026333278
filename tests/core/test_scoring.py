"""Scoring trees: rewards per leaf, group advantages, dynamic sampling."""

from __future__ import annotations

import copy
import dataclasses

import pytest
from scripted_engine import EchoSearch, ScriptedEngine, Segment

from aepo_core.config import AlgorithmConfig, RewardConfig, RolloutConfig
from aepo_core.rewards import make_reward_fn
from aepo_core.rollout.scheduler import Question, RolloutScheduler
from aepo_core.scoring import LeafScore, StepScores, score_trees


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
    scores = score_trees(trees, golds, make_reward_fn(RewardConfig(required_tools=["search"])), AlgorithmConfig(),
                         max_response_tokens=500)
    assert [len(ts) for ts in scores.leaves] == [len(t.leaves) for t in trees]  # aligned with the trees
    for tree_scores in scores.leaves:
        rewards = [s.reward for s in tree_scores]
        assert set(rewards) <= {0.0, 1.1}
        for s in tree_scores:
            assert s.reason in ("correct", "wrong")
        if len(set(rewards)) > 1:
            pos = [s.advantage for s in tree_scores if s.reward > 0]
            neg = [s.advantage for s in tree_scores if s.reward == 0]
            assert min(pos) > 0 > max(neg)
            assert sum(s.advantage for s in tree_scores) == pytest.approx(0.0, abs=1e-6)
    assert any(len({s.reward for s in ts}) > 1 for ts in scores.leaves)  # the advantage checks above ran
    acc = sum(s.reward > 0 for ts in scores.leaves for s in ts) / 8
    assert scores.metrics["rollout/accuracy"] == pytest.approx(acc)
    assert scores.metrics["rollout/format_error_rate"] == 0.0
    assert scores.uninformative_questions == frozenset()  # dynamic sampling is off: every group is kept
    assert scores.kept(trees) == (list(trees), list(scores.leaves))


def test_dynamic_sampling_flags_uniform_groups():
    trees = rollout(["paris"])
    scores = score_trees(trees, {"q0": ["Paris"], "q1": ["Rome"]}, make_reward_fn(RewardConfig()),
                         AlgorithmConfig(dynamic_sampling=True), max_response_tokens=500)
    assert scores.uninformative_questions == {"q0", "q1"}
    assert all(s.advantage == 0.0 for ts in scores.leaves for s in ts)
    assert scores.kept(trees) == ([], [])
    assert scores.metrics["rollout/informative_groups"] == 0.0


def test_kept_drops_exactly_the_uninformative_groups():
    trees = rollout(["paris", "london"], n_q=4)
    # q0, q3: some leaves right, some wrong; q1: all wrong; q2: all right.
    golds = {"q0": ["Paris"], "q1": ["Rome"], "q2": ["Paris", "London"], "q3": ["London"]}
    scores = score_trees(trees, golds, make_reward_fn(RewardConfig()), AlgorithmConfig(dynamic_sampling=True),
                         max_response_tokens=500)
    by_question = {t.question_id: {s.reward for s in ts} for t, ts in zip(trees, scores.leaves, strict=True)}
    assert scores.uninformative_questions == {q for q, rs in by_question.items() if len(rs) == 1}
    assert scores.uninformative_questions == {"q1", "q2"}  # the script really made the groups described
    kept_trees, kept_scores = scores.kept(trees)
    expected = [i for i, t in enumerate(trees) if t.question_id not in scores.uninformative_questions]
    assert [id(t) for t in kept_trees] == [id(trees[i]) for i in expected]  # the same tree objects, in order
    assert kept_scores == [scores.leaves[i] for i in expected]
    assert scores.metrics["rollout/informative_groups"] == float(len(expected))
    with pytest.raises(ValueError, match="scores for 4 trees, but 2 trees given"):
        scores.kept(trees[:2])


def test_scoring_does_not_mutate_the_trees():
    trees = rollout(["paris", "london"])
    before = [dataclasses.asdict(t) for t in trees]
    snapshot = copy.deepcopy(trees)
    scores = score_trees(trees, {"q0": ["Paris"], "q1": ["Paris"]},
                         make_reward_fn(RewardConfig(required_tools=["search"])),
                         AlgorithmConfig(dynamic_sampling=True, overlong_buffer=480), max_response_tokens=500)
    assert [dataclasses.asdict(t) for t in trees] == before and trees == snapshot
    assert isinstance(scores, StepScores) and all(isinstance(s, LeafScore) for ts in scores.leaves for s in ts)
    with pytest.raises(dataclasses.FrozenInstanceError):
        scores.leaves[0][0].reward = 2.0  # type: ignore[misc]


def test_missing_gold_is_named():
    trees = rollout(["x"], n_q=1)
    with pytest.raises(KeyError, match="q0"):
        score_trees(trees, {}, make_reward_fn(RewardConfig()), AlgorithmConfig(), 500)


def test_overlong_penalty_applies():
    trees = rollout(["paris"], n_q=1)
    scores = score_trees(trees, {"q0": ["Paris"]}, make_reward_fn(RewardConfig(required_tools=["search"])),
                         AlgorithmConfig(overlong_buffer=480, overlong_penalty=1.0), max_response_tokens=500)
    assert all(s.reward < 1.1 for s in scores.leaves[0])
    assert scores.metrics["rollout/reward_mean"] < 1.1
