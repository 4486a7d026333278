"""Evaluating the policy on one dataset: n samples per question → unbiased Pass@1 / Pass@k with bootstrap CIs.

A plain function of a :class:`~infra.runtime.PolicyRuntime`: it needs no training data and no trainer, so the
train flow's in-run evaluations and ``aepo eval`` of a checkpoint run the same code.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from aepo_core.config import EvalConfig, RolloutConfig
from aepo_core.evaluation import QuestionOutcome, is_correct, summarize, summarize_by
from aepo_core.interfaces import RewardFn, RewardResult, SamplingParams
from aepo_core.rewards import predicted_answer
from aepo_core.rollout.scheduler import derive_seed
from aepo_core.rollout.tree import RolloutTree
from aepo_core.scoring import LeafScore, model_text
from infra.data.loaders import dataset_key
from infra.data.rows import QuestionRow
from infra.runtime import PolicyRuntime


@dataclass(frozen=True)
class TracedSamples:
    """The samples of an evaluation's first questions, kept to be logged as MLflow traces: their trees, each
    sample's reward and reason (advantage NaN: evaluation computes none), and the questions' texts by id."""

    trees: list[RolloutTree]
    scores: list[list[LeafScore]]
    questions: dict[str, str]


@dataclass(frozen=True)
class EvalReport:
    """One dataset's evaluation.

    ``dataset`` is the spec as configured and ``key`` its name in metrics, files and tables
    (:func:`~infra.data.loaders.dataset_key`); ``summary`` holds Pass@1 / Pass@k with CIs, EM, F1 and tool use
    over questions, ``by_family`` the same per question family; ``per_question_pass1`` and ``answers`` (each
    sample's final answer, None when it gave none) are keyed by question id.
    """

    dataset: str
    key: str
    summary: dict[str, float]
    by_family: dict[str, dict[str, float]]
    outcomes: list[QuestionOutcome]
    per_question_pass1: dict[str, float] = field(default_factory=dict)
    answers: dict[str, list[str | None]] = field(default_factory=dict)
    traced: TracedSamples | None = None

    def metrics(self) -> dict[str, float]:
        """``eval/<key>/<summary name>``: the names under which MLflow records this report."""
        return {f"eval/{self.key}/{name}": value for name, value in self.summary.items()}


def eval_rollout_config(rollout: RolloutConfig, ev: EvalConfig) -> RolloutConfig:
    """The rollout config of evaluation: ``eval.n_samples`` independent samples per question at the evaluation
    sampling (no branching: Pass@k needs independent samples)."""
    return rollout.model_copy(update={"mode": "independent", "k": ev.n_samples,
                                      "initial_rollouts": min(rollout.initial_rollouts, ev.n_samples),
                                      "temperature": ev.temperature, "top_p": ev.top_p})


def evaluate_dataset(runtime: PolicyRuntime, dataset: str, rows: Sequence[QuestionRow], ev: EvalConfig,
                     seed: int, batch_size: int, traces: int = 0) -> EvalReport:
    """Sample ``ev.n_samples`` answers per row in batches of ``batch_size`` questions and summarize them; the
    samples of the first ``traces`` questions are kept in the report (:class:`TracedSamples`).

    Seeds derive from (seed, dataset, batch start), so an evaluation repeats exactly for the same weights.
    """
    rows = list(rows)[: ev.max_questions] if ev.max_questions else list(rows)
    rollout = eval_rollout_config(runtime.cfg.rollout, ev)
    outcomes: list[QuestionOutcome] = []
    answers: dict[str, list[str | None]] = {}
    traced = TracedSamples([], [], {})
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        result = runtime.sample(chunk, rollout, derive_seed(seed, "eval", dataset, start),
                                SamplingParams(ev.temperature, ev.top_p, 0))
        for row, tree in zip(chunk, result.trees, strict=True):
            rewards = leaf_rewards(row, tree, runtime.reward_fn)
            outcomes.append(question_outcome(dataset, row, tree, rewards))
            answers[row.id] = [predicted_answer(model_text(tree, leaf)) for leaf in tree.leaves]
            if len(traced.trees) < traces:
                traced.trees.append(tree)
                traced.scores.append([LeafScore(r.score, r.reason, math.nan) for r in rewards])
                traced.questions[row.id] = row.question
    summary = summarize(outcomes, ev.pass_k, n_resamples=ev.bootstrap_samples, seed=seed)
    by_family = summarize_by(outcomes, "family", ev.pass_k, n_resamples=ev.bootstrap_samples, seed=seed)
    pass1 = {o.question_id: o.correct / o.n for o in outcomes}
    key = dataset_key(dataset, among=runtime.eval_datasets())  # unique among the datasets evaluated together
    return EvalReport(dataset, key, summary, by_family, outcomes, pass1, answers, traced if traces else None)


def leaf_rewards(row: QuestionRow, tree: RolloutTree, reward_fn: RewardFn) -> list[RewardResult]:
    """Each sample's reward (tool calls without the scheduler's notices)."""
    out = []
    for leaf in tree.leaves:
        events = [e for e in tree.tool_events(leaf) if not e.is_notice]
        out.append(reward_fn(tree.text(leaf), list(row.golds), [e.name for e in events],
                             model_text=model_text(tree, leaf)))
    return out


def question_outcome(dataset: str, row: QuestionRow, tree: RolloutTree, rewards: Sequence[RewardResult]
                     ) -> QuestionOutcome:
    """One question's samples (``rewards``: :func:`leaf_rewards`): how many are correct, mean EM / F1, tool calls,
    tool errors, answered share."""
    correct = em = f1 = calls = errors = answered = 0.0
    n_calls = 0
    for leaf, res in zip(tree.leaves, rewards, strict=True):
        events = [e for e in tree.tool_events(leaf) if not e.is_notice]
        correct += is_correct(res)
        em += res.details.get("em", float(is_correct(res)))
        f1 += res.details.get("f1", float(is_correct(res)))
        calls += len(events)
        n_calls += len(events)
        errors += sum(1 for e in events if not e.ok)
        answered += leaf.status == "answered"
    n = len(tree.leaves)
    return QuestionOutcome(row.id, dataset, row.family, n, int(correct), em / n, f1 / n, calls / n,
                           errors / n_calls if n_calls else 0.0, answered / n)
