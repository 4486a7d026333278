"""DAPO dynamic sampling (AEPO.md §7): a step's batch filled with informative groups, round by round.

A group whose leaves are all right or all wrong carries no learning signal (:meth:`StepScores.kept` leaves it out);
:class:`InformativeBatch` takes sampled rounds until the batch holds ``batch_size`` informative groups, and hands out
what the update uses (the kept groups, advantages over exactly them) and what the store keeps (every sampled tree).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from aepo_core.advantages import compute_advantages
from aepo_core.config import AlgorithmConfig
from aepo_core.rollout.scheduler import RolloutResult
from aepo_core.rollout.tree import RolloutTree
from aepo_core.scoring import LeafScore, StepScores


@dataclass(frozen=True)
class FilledBatch:
    """A step's sampling rounds (:class:`InformativeBatch`): what the update uses and what was sampled."""

    trees: list[RolloutTree]  # the groups the update uses: informative ones, in sampling order, at most batch_size
    scores: StepScores  # their scores (advantages over exactly these groups); metrics: first round's plus refill's
    sampled_trees: list[RolloutTree]  # every tree of every round (the step's trajectories, for the store)
    sampled_scores: StepScores  # their scores, aligned with sampled_trees (each round's own advantages)
    tries: int  # sampling rounds made
    rollouts: tuple[RolloutResult, ...] = ()
    """Each round's rollout (its statistics: the step's tokens count all of them)."""

    def update_advantages(self) -> list[tuple[float, ...] | None]:
        """Aligned with ``sampled_trees``: the advantages the update gives each tree's leaves, None for a tree it
        leaves out (what the store keeps so that the update can be replayed)."""
        used = {id(t): tuple(s.advantage for s in ts) for t, ts in zip(self.trees, self.scores.leaves, strict=True)}
        return [used.get(id(t)) for t in self.sampled_trees]

    @property
    def sampled(self) -> RolloutResult:
        """Every tree of the step with the first round's statistics (the batch as drawn from the data order): what
        the store and the step's views show."""
        return dataclasses.replace(self.rollouts[0], trees=self.sampled_trees)

    def metrics(self) -> dict[str, float]:
        """The step's ``rollout/…`` metrics: the first round's rollout statistics and the update batch's scores."""
        return {**self.rollouts[0].metrics(), **self.scores.metrics}


def max_rounds(alg: AlgorithmConfig) -> int:
    """The most sampling rounds a step makes: ``alg.dynamic_sampling_max_tries`` with dynamic sampling, else 1."""
    return alg.dynamic_sampling_max_tries if alg.dynamic_sampling else 1


class InformativeBatch:
    """DAPO dynamic sampling, one round at a time: :meth:`add` sampled rounds while :meth:`wants_more` (until
    ``batch_size`` informative groups or ``alg.dynamic_sampling_max_tries`` rounds; one round when dynamic sampling is
    off: every group is kept), then :meth:`filled`.

    The update's groups are the first ``batch_size`` informative ones; their advantages are recomputed over exactly
    those groups (only batch-level estimators such as ``reinforce_pp_baseline`` change).  Metrics:
    ``rollout/dynamic_sampling_tries``, ``rollout/informative_groups`` (groups in the update) and
    ``rollout/sampled_groups``, on top of the first round's (the batch as drawn from the data order).
    """

    def __init__(self, batch_size: int, alg: AlgorithmConfig) -> None:
        self.batch_size, self.alg = batch_size, alg
        self.max_tries = max_rounds(alg)
        self.rounds: list[tuple[RolloutResult, StepScores]] = []
        self.kept: list[tuple[RolloutTree, tuple[LeafScore, ...]]] = []

    @property
    def tries(self) -> int:
        """Rounds sampled so far (the next round's ``attempt``: its seeds derive from it)."""
        return len(self.rounds)

    def wants_more(self) -> bool:
        return self.tries < self.max_tries and len(self.kept) < self.batch_size

    def add(self, result: RolloutResult, scores: StepScores) -> None:
        """One sampled round and its scores."""
        self.rounds.append((result, scores))
        kept_trees, kept_scores = scores.kept(result.trees)
        self.kept.extend(zip(kept_trees, kept_scores, strict=True))

    def filled(self) -> FilledBatch:
        alg, kept = self.alg, self.kept[: self.batch_size]
        rewards = torch.tensor([s.reward for _, ts in kept for s in ts], dtype=torch.float64)
        groups = torch.tensor([gi for gi, (_, ts) in enumerate(kept) for _ in ts], dtype=torch.long)
        adv = compute_advantages(alg.advantage, rewards, groups, alg.adv_eps) if len(rewards) else rewards
        adv_iter = iter(adv.tolist())
        leaves = tuple(tuple(dataclasses.replace(s, advantage=next(adv_iter)) for s in ts) for _, ts in kept)
        sampled_trees = [t for result, _ in self.rounds for t in result.trees]
        metrics = {
            **self.rounds[0][1].metrics,
            "rollout/dynamic_sampling_tries": float(self.tries),
            "rollout/informative_groups": float(len(kept)),
            "rollout/sampled_groups": float(len(sampled_trees)),
        }
        sampled = StepScores(tuple(ts for _, scores in self.rounds for ts in scores.leaves), metrics,
                             frozenset().union(*(scores.uninformative_questions for _, scores in self.rounds)))
        return FilledBatch([t for t, _ in kept], StepScores(leaves, metrics, frozenset()), sampled_trees, sampled,
                           self.tries, tuple(result for result, _ in self.rounds))


SampleRound = Callable[[int], tuple[Sequence[RolloutTree], StepScores]]
"""``attempt`` (0, 1, …) → the trees of the next questions and their scores (seeds derive from the attempt)."""


def fill_informative(sample_round: SampleRound, batch_size: int, alg: AlgorithmConfig) -> FilledBatch:
    """:class:`InformativeBatch` filled by calling ``sample_round`` with each round's attempt."""
    batch = InformativeBatch(batch_size, alg)
    while batch.wants_more():
        trees, scores = sample_round(batch.tries)
        batch.add(RolloutResult(list(trees), {}, {}), scores)
    return batch.filled()
