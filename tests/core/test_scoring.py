"""Scoring trees: rewards per leaf, group advantages, dynamic sampling."""

from __future__ import annotations

import copy
import dataclasses
import itertools

import pytest
import torch
from scripted_engine import EchoSearch, ScriptedEngine, Segment

from aepo_core.advantages import informative_groups
from aepo_core.config import AlgorithmConfig, RewardConfig, RolloutConfig
from aepo_core.dynamic_sampling import fill_informative
from aepo_core.interfaces import ToolResult
from aepo_core.rewards import make_reward_fn
from aepo_core.rollout.scheduler import Question, RolloutScheduler
from aepo_core.scoring import LeafScore, StepScores, score_trees


def answer_script(answers):
    """The n-th answer the engine writes is answers[n % len] (a question's leaves answer in one round, in leaf
    order, so every group of k ≥ len(answers) gets them all); every path searches once first."""
    written = itertools.count()

    def script(transcript, seed):
        if "<result>" not in transcript:
            return Segment("<think>look</think><search>q</search>", 1.0)
        ans = answers[next(written) % len(answers)]
        return Segment(f"<think>ok</think><answer>\\boxed{{{ans}}}</answer>", 1.0)

    return script


def rollout(answers, n_q=2, k=4, first=0, script=None, search=None):
    cfg = RolloutConfig(mode="independent", k=k, initial_rollouts=1, max_response_tokens=500)
    sched = RolloutScheduler(ScriptedEngine(script or answer_script(answers)), {"search": search or EchoSearch()},
                             cfg)
    return sched.run([Question(f"q{i}", [ord(c) for c in f"question {i}"]) for i in range(first, first + n_q)],
                     seed=1).trees


class FixedSearch:
    """A search tool that always returns the same snippet."""

    name = "search"

    def __init__(self, text: str) -> None:
        self.text = text

    def __call__(self, argument: str) -> ToolResult:
        return ToolResult(self.text)


def search_then(final: str):
    """Search once, then write ``final`` (ending the trajectory with EOS)."""

    def script(transcript, seed):
        if "<result>" not in transcript:
            return Segment("<think>look</think><search>q</search>", 1.0)
        return Segment(final, 1.0, eos=True)

    return script


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


def test_informative_groups_are_counted_without_dynamic_sampling_too():
    """The metric counts the groups that carry a signal whether or not dynamic sampling drops the others (it was the
    number of groups when dynamic sampling was off: a flat 6 → 6 curve in the training comparison)."""
    trees = rollout(["paris", "london"], n_q=4)
    golds = {"q0": ["Paris"], "q1": ["Rome"], "q2": ["Paris", "London"], "q3": ["London"]}
    scores = score_trees(trees, golds, make_reward_fn(RewardConfig()), AlgorithmConfig(dynamic_sampling=False),
                         max_response_tokens=500)
    assert scores.uninformative_questions == frozenset()  # nothing dropped
    assert scores.metrics["rollout/informative_groups"] == 2.0  # q0 and q3


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


@pytest.mark.parametrize("kind", ["em", "f1", "math"])
def test_answer_only_in_a_tool_result_scores_nothing(kind):
    """The snippet says \\boxed{Paris}; the model never answers: the reward reads only the model's segments."""
    trees = rollout([], n_q=1, script=search_then("<think>no idea</think>"),
                    search=FixedSearch("Paris is the capital. \\boxed{Paris}"))
    assert "\\boxed{Paris}" in trees[0].text(trees[0].leaves[0])  # the transcript does hold it
    scores = score_trees(trees, {"q0": ["Paris"]}, make_reward_fn(RewardConfig(kind=kind)), AlgorithmConfig(), 500)
    assert [s.reward for s in scores.leaves[0]] == [0.0] * 4
    assert {s.reason for s in scores.leaves[0]} == {"no_answer"}
    assert scores.metrics["rollout/accuracy"] == 0.0


def test_overlong_penalty_counts_model_tokens_only():
    """A long search result fills the response budget; the model itself wrote little: no overlong penalty."""
    final = "<think>ok</think><answer>\\boxed{Paris}</answer>"
    trees = rollout([], n_q=1, script=search_then(final), search=FixedSearch("x" * 350))
    leaf = trees[0].leaves[0]
    model_tokens = sum(trees[0].loss_mask(leaf))
    assert len(trees[0].response_ids(leaf)) > 420 > 100 > model_tokens  # the tool result is what is long
    alg = AlgorithmConfig(overlong_buffer=100, overlong_penalty=1.0)
    scores = score_trees(trees, {"q0": ["Paris"]}, make_reward_fn(RewardConfig(required_tools=["search"])), alg, 500)
    assert [s.reward for s in scores.leaves[0]] == [pytest.approx(1.1)] * 4
    # … while a model that writes past max − buffer is penalized by its own tokens
    long_final = "<think>" + "y" * 420 + "</think><answer>\\boxed{Paris}</answer>"
    trees = rollout([], n_q=1, script=search_then(long_final), search=FixedSearch("short"))
    scores = score_trees(trees, {"q0": ["Paris"]}, make_reward_fn(RewardConfig(required_tools=["search"])), alg, 500)
    assert all(s.reward < 1.1 for s in scores.leaves[0])


def test_informative_groups_tolerates_float_noise():
    """Twelve rewards of 1.1 have an float std of ~2e-16: the group is uniform, not informative."""
    rewards = torch.tensor([1.1] * 12 + [0.0] * 6 + [1.0] * 6, dtype=torch.float64)
    groups = torch.tensor([0] * 12 + [1] * 12)
    assert informative_groups(rewards, groups).tolist() == [False] * 12 + [True] * 12
    assert not informative_groups(rewards.float(), groups)[:12].any()


def test_dynamic_sampling_filters_on_accuracy_not_the_shaped_reward():
    """Partial F1 against nothing correct: the rewards differ but no leaf is correct, so the group is dropped."""
    trees = rollout(["paris france", "london"], n_q=1)
    scores = score_trees(trees, {"q0": ["Paris"]}, make_reward_fn(RewardConfig(required_tools=["search"])),
                         AlgorithmConfig(dynamic_sampling=True), max_response_tokens=500)
    assert len({s.reward for s in scores.leaves[0]}) == 2  # shaped rewards differ (F1 0.67 + bonus vs 0)
    assert {s.reason for s in scores.leaves[0]} == {"partial", "wrong"}
    assert scores.uninformative_questions == {"q0"}
    assert scores.metrics["rollout/informative_groups"] == 0.0


def _scripted_rounds(plan, calls, alg):
    """round ``attempt`` → trees of 4 questions; ``plan[attempt]`` (a set) names the informative ones."""

    def sample_round(attempt):
        calls.append(attempt)
        first = 4 * attempt
        trees = rollout(["paris", "london"], n_q=4, first=first)
        golds = {f"q{first + i}": (["Paris"] if i in plan[attempt] else ["Rome"]) for i in range(4)}
        return trees, score_trees(trees, golds, make_reward_fn(RewardConfig()), alg, 500)

    return sample_round


def test_fill_informative_refills_to_the_batch_size():
    calls = []
    alg = AlgorithmConfig(dynamic_sampling=True, dynamic_sampling_max_tries=5)
    filled = fill_informative(_scripted_rounds([{0}, {1, 3}, {0, 1, 2, 3}], calls, alg), batch_size=3, alg=alg)
    assert calls == [0, 1]  # stopped as soon as the batch was full
    assert [t.question_id for t in filled.trees] == ["q0", "q5", "q7"]  # informative, in sampling order
    assert filled.scores.uninformative_questions == frozenset()
    assert filled.scores.kept(filled.trees) == (filled.trees, list(filled.scores.leaves))
    assert [t.question_id for t in filled.sampled_trees] == [f"q{i}" for i in range(8)]  # everything, for the store
    assert len(filled.sampled_scores.leaves) == 8
    assert filled.scores.metrics["rollout/dynamic_sampling_tries"] == 2.0
    assert filled.scores.metrics["rollout/informative_groups"] == 3.0
    assert filled.scores.metrics["rollout/sampled_groups"] == 8.0
    for tree_scores in filled.scores.leaves:  # GRPO advantages within each kept group
        assert sum(s.advantage for s in tree_scores) == pytest.approx(0.0, abs=1e-6)
        assert len({s.reward for s in tree_scores}) == 2
    # more informative groups than needed: exactly batch_size are used
    calls.clear()
    filled = fill_informative(_scripted_rounds([{0}, {0, 1, 2, 3}], calls, alg), batch_size=3, alg=alg)
    assert calls == [0, 1] and [t.question_id for t in filled.trees] == ["q0", "q4", "q5"]


def test_fill_informative_gives_up_after_max_tries():
    calls = []
    alg = AlgorithmConfig(dynamic_sampling=True, dynamic_sampling_max_tries=2)
    filled = fill_informative(_scripted_rounds([set(), {2}, {0, 1, 2, 3}], calls, alg), batch_size=4, alg=alg)
    assert calls == [0, 1]
    assert [t.question_id for t in filled.trees] == ["q6"]
    assert filled.scores.metrics["rollout/dynamic_sampling_tries"] == 2.0
    assert filled.scores.metrics["rollout/informative_groups"] == 1.0


def test_fill_informative_without_dynamic_sampling_is_one_round_kept_whole():
    calls = []
    alg = AlgorithmConfig(dynamic_sampling=False, dynamic_sampling_max_tries=5)
    filled = fill_informative(_scripted_rounds([set()], calls, alg), batch_size=4, alg=alg)
    assert calls == [0]
    assert [t.question_id for t in filled.trees] == ["q0", "q1", "q2", "q3"]
    assert filled.scores.leaves == filled.sampled_scores.leaves  # the round's own scores, unchanged
