"""Scoring a step's rollout trees: rewards per leaf, then group advantages (AEPO.md §5, §7).

:func:`score_trees` leaves the trees as they are and returns a :class:`StepScores`: one :class:`LeafScore` per
leaf, aligned with the trees, and the step's rollout metrics.  A group is all leaves of one question.  With DAPO
dynamic sampling, groups whose leaves are all correct or all incorrect carry no learning signal; their questions
are returned so the update can leave them out (:meth:`StepScores.kept`), and
:class:`aepo_core.dynamic_sampling.InformativeBatch` samples further rounds of questions until the batch is full of
informative groups.

Rewards read the answer only from what the model wrote (:func:`model_text`), never from a tool result, and the
soft overlong penalty counts model tokens only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from aepo_core.advantages import compute_advantages, informative_groups, soft_overlong_penalty
from aepo_core.config import AlgorithmConfig
from aepo_core.evaluation import is_correct
from aepo_core.interfaces import RewardFn
from aepo_core.rollout.tree import Leaf, RolloutTree


@dataclass(frozen=True)
class LeafScore:
    """The score of one leaf (trajectory) of a rollout tree."""

    reward: float  # shaped reward: the reward function's score plus the soft overlong penalty (if enabled)
    reason: str  # the reward function's reason (``correct``, ``wrong``, …)
    advantage: float  # trajectory-level advantage of the leaf within its group (its question's leaves)
    correct: bool  # the answer is right (aepo_core.evaluation.is_correct of the reward function's result)


@dataclass(frozen=True)
class StepScores:
    """What scoring one step's trees yields; the trees themselves are not changed."""

    # [tree index][leaf index]: the score of each leaf, aligned with the trees scored (and their leaves' order).
    leaves: tuple[tuple[LeafScore, ...], ...]
    # The step's ``rollout/...`` metrics (reward mean/std, accuracy, format errors, advantages, groups).
    metrics: dict[str, float]
    # DAPO dynamic sampling: questions whose groups carry no learning signal, to leave out of the update
    # (always empty when dynamic sampling is off).
    uninformative_questions: frozenset[str]

    def kept(self, trees: Sequence[RolloutTree]) -> tuple[list[RolloutTree], list[tuple[LeafScore, ...]]]:
        """The trees (and their scores) that go into the update: uninformative groups dropped.

        ``trees`` are the trees these scores were computed from, in the same order.
        """
        check_aligned(trees, self.leaves)
        pairs = [(t, s) for t, s in zip(trees, self.leaves, strict=True)
                 if t.question_id not in self.uninformative_questions]
        return [t for t, _ in pairs], [s for _, s in pairs]


def check_aligned(trees: Sequence[RolloutTree], scores: Sequence[Sequence[LeafScore]]) -> None:
    """Raise ``ValueError`` unless ``scores`` holds one sequence per tree and one score per leaf of that tree."""
    if len(scores) != len(trees):
        raise ValueError(f"scores for {len(scores)} trees, but {len(trees)} trees given")
    for ti, (tree, tree_scores) in enumerate(zip(trees, scores, strict=True)):
        if len(tree_scores) != len(tree.leaves):
            raise ValueError(f"trees[{ti}] (question {tree.question_id}) has {len(tree.leaves)} leaves but "
                             f"{len(tree_scores)} scores")


def model_text(tree: RolloutTree, leaf: Leaf) -> str:
    """What the model wrote on ``leaf``'s path: its segments without the prompt and the tool results."""
    return "".join(n.text for n in tree.path(leaf) if n.kind == "model")


def score_trees(
    trees: Sequence[RolloutTree],
    golds: Mapping[str, Sequence[str]],
    reward_fn: RewardFn,
    alg: AlgorithmConfig,
    max_response_tokens: int,
) -> StepScores:
    """Reward every leaf, then compute group advantages and the step's metrics (the trees are not modified)."""
    rewards: list[float] = []
    reasons: list[str] = []
    groups: list[int] = []
    correct: list[float] = []
    format_errors: list[float] = []
    for gi, tree in enumerate(trees):
        if tree.question_id not in golds:
            raise KeyError(f"no gold answer for question {tree.question_id!r}")
        for leaf in tree.leaves:
            tools = [e.name for e in tree.tool_events(leaf) if not e.is_notice]
            res = reward_fn(tree.text(leaf), golds[tree.question_id], tools, model_text=model_text(tree, leaf))
            score = res.score
            if alg.overlong_buffer > 0:
                length = torch.tensor([sum(tree.loss_mask(leaf))])  # model tokens: tool results are not the model's
                score += float(soft_overlong_penalty(length, max_response_tokens, alg.overlong_buffer,
                                                     alg.overlong_penalty)[0])
            rewards.append(score)
            reasons.append(res.reason)
            groups.append(gi)
            format_errors.append(1.0 - float(res.details.get("format_ok", 1.0)))
            correct.append(float(is_correct(res)))
    r = torch.tensor(rewards, dtype=torch.float64)
    g = torch.tensor(groups, dtype=torch.long)
    adv = compute_advantages(alg.advantage, r, g, alg.adv_eps) if rewards else r
    # DAPO filters on accuracy: a group whose shaped rewards differ but whose leaves are all wrong is uniform.
    acc = torch.tensor(correct, dtype=torch.float64)
    keep = informative_groups(acc, g) if rewards else torch.zeros(0, dtype=torch.bool)
    uninformative: set[str] = set()  # groups without a signal (dropped from the update under dynamic sampling)
    leaves: list[tuple[LeafScore, ...]] = []
    i = 0
    for tree in trees:
        tree_scores = []
        for _ in tree.leaves:
            tree_scores.append(LeafScore(rewards[i], reasons[i], float(adv[i]), bool(correct[i])))
            if not bool(keep[i]):
                uninformative.add(tree.question_id)
            i += 1
        leaves.append(tuple(tree_scores))
    n = max(1, len(rewards))
    metrics = {
        "rollout/reward_mean": sum(rewards) / n,
        "rollout/reward_std": float(r.std()) if len(rewards) > 1 else 0.0,
        "rollout/accuracy": sum(correct) / n,
        "rollout/format_error_rate": sum(format_errors) / n,
        "rollout/advantage_abs_mean": float(adv.abs().mean()) if rewards else 0.0,
        # Groups whose leaves are not all right or all wrong, whether or not dynamic sampling drops the others.
        "rollout/informative_groups": float(sum(1 for t in trees if t.question_id not in uninformative)),
        "rollout/questions_all_correct": float(
            sum(1 for ts in leaves if all(not math.isnan(s.reward) and s.reward >= 1.0 for s in ts))
        ),
    }
    return StepScores(tuple(leaves), metrics, frozenset(uninformative) if alg.dynamic_sampling else frozenset())
