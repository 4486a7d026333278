"""Scoring a step's rollout trees: rewards per leaf, then group advantages (AEPO.md §5, §7).

Fills ``Leaf.reward``, ``reward_reason`` and ``advantage`` in place and returns the step's rollout metrics.
A group is all leaves of one question.  With DAPO dynamic sampling, groups whose rewards are all equal carry
no learning signal; their questions are returned so the update can leave them out (no refill here: the
rollout budget of the step is fixed).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from aepo_core.advantages import compute_advantages, informative_groups, soft_overlong_penalty
from aepo_core.config import AlgorithmConfig
from aepo_core.interfaces import RewardFn
from aepo_core.rollout.tree import RolloutTree

# Tool events that are notices from the scheduler, not calls that reached a tool.
NOTICE_EVENTS = frozenset({"limit", "invalid"})


@dataclass(frozen=True)
class ScoreSummary:
    metrics: dict[str, float]
    uninformative_questions: frozenset[str]


def score_trees(
    trees: Sequence[RolloutTree],
    golds: Mapping[str, Sequence[str]],
    reward_fn: RewardFn,
    alg: AlgorithmConfig,
    max_response_tokens: int,
) -> ScoreSummary:
    rewards: list[float] = []
    groups: list[int] = []
    correct: list[float] = []
    format_errors: list[float] = []
    for gi, tree in enumerate(trees):
        if tree.question_id not in golds:
            raise KeyError(f"no gold answer for question {tree.question_id!r}")
        for leaf in tree.leaves:
            tools = [e.name for e in tree.tool_events(leaf) if e.name not in NOTICE_EVENTS]
            res = reward_fn(tree.text(leaf), golds[tree.question_id], tools)
            score = res.score
            if alg.overlong_buffer > 0:
                length = torch.tensor([len(tree.response_ids(leaf))])
                score += float(soft_overlong_penalty(length, max_response_tokens, alg.overlong_buffer,
                                                     alg.overlong_penalty)[0])
            leaf.reward, leaf.reward_reason = score, res.reason
            rewards.append(score)
            groups.append(gi)
            format_errors.append(1.0 - float(res.details.get("format_ok", 1.0)))
            correct.append(float(res.details.get("em", 1.0 if res.reason in ("correct", "equivalent") else 0.0)))
    r = torch.tensor(rewards, dtype=torch.float64)
    g = torch.tensor(groups, dtype=torch.long)
    adv = compute_advantages(alg.advantage, r, g, alg.adv_eps) if rewards else r
    keep = informative_groups(r, g) if rewards else torch.zeros(0, dtype=torch.bool)
    uninformative: set[str] = set()
    i = 0
    for tree in trees:
        for leaf in tree.leaves:
            leaf.advantage = float(adv[i])
            if alg.dynamic_sampling and not bool(keep[i]):
                uninformative.add(tree.question_id)
            i += 1
    n = max(1, len(rewards))
    metrics = {
        "rollout/reward_mean": sum(rewards) / n,
        "rollout/reward_std": float(r.std()) if len(rewards) > 1 else 0.0,
        "rollout/accuracy": sum(correct) / n,
        "rollout/format_error_rate": sum(format_errors) / n,
        "rollout/advantage_abs_mean": float(adv.abs().mean()) if rewards else 0.0,
        "rollout/informative_groups": float(sum(1 for t in trees if t.question_id not in uninformative))
        if alg.dynamic_sampling else float(len(trees)),
        "rollout/questions_all_correct": float(
            sum(1 for t in trees if all(not math.isnan(lf.reward) and lf.reward >= 1.0 for lf in t.leaves))
        ),
    }
    return ScoreSummary(metrics, frozenset(uninformative))
