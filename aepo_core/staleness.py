"""Bounded staleness (``train.max_staleness``): which weights sample which step, and how old an update's tokens are.

On-policy (s = 0), the rollouts of RL step j are sampled from the weights after update j − 1. With s > 0 they are
sampled from the weights after update

    v(j) = max(c(j), j − 1 − s),        c(j) = ⌊(j − 1) / every⌋ · every  (the last checkpoint step before j),

so the rollouts of steps j + 1 … j + s can be sampled while update j trains (verl's one-step-off-policy recipe is
s = 1; TRL's ``AsyncGRPOTrainer`` calls s ``max_staleness``). The schedule is a function of the config alone, never
of which call returned first, so a run repeats; and no rollout is sampled across a checkpoint (after checkpoint c
the next s + 1 rollouts all use version c), so a run resumed from checkpoint c samples exactly what the run that was
killed would have, with nothing but the checkpoint to restore. The price: after each checkpoint the s rollouts that
follow it run alone. An update of step j from version j − 1 then sees tokens

    staleness = (j − 1) − v(j) ≤ s  updates old,

which the update corrects to π_old by truncated importance sampling (:mod:`aepo_core.correction`).
"""

from __future__ import annotations

from collections.abc import Sequence

from aepo_core.rollout.tree import RolloutTree


def sampling_version(step: int, max_staleness: int, checkpoint_every: int) -> int:
    """v(step) of the module docstring: the number of updates behind the weights that sample RL step ``step``
    (≥ 1) under ``train.max_staleness`` = ``max_staleness`` and ``checkpoint.every`` = ``checkpoint_every``."""
    if step < 1 or max_staleness < 0 or checkpoint_every < 1:
        raise ValueError(f"step {step}, max_staleness {max_staleness}, checkpoint_every {checkpoint_every}")
    last_checkpoint = (step - 1) // checkpoint_every * checkpoint_every
    return max(last_checkpoint, step - 1 - max_staleness)


def due_steps(version: int, total_steps: int, max_staleness: int, checkpoint_every: int) -> list[int]:
    """The steps, in order, whose rollouts version ``version`` samples (v(j) = ``version``, j ≤ ``total_steps``):
    what to start once the trainer has made ``version`` updates. For s = 0 always [version + 1]; for s > 0 the
    s + 1 steps after a checkpoint (or the run's start) at a checkpoint version, else at most j = version + 1 + s."""
    last = min(total_steps, version + 1 + max_staleness)  # v(j) ≥ j − 1 − s
    return [j for j in range(version + 1, last + 1)
            if sampling_version(j, max_staleness, checkpoint_every) == version]


def staleness_metrics(trees: Sequence[RolloutTree], trainer_version: int) -> dict[str, float]:
    """How old the model tokens an update from ``trainer_version`` (updates made before it) trains on are, by the
    weight version each model segment carries (segments without one are left out; nothing when none has one):
    ``staleness_mean`` (token-weighted updates behind), ``staleness_max``, ``version_spread`` (newest − oldest
    version among the segments) and ``stale_token_share`` (the share sampled by weights older than
    ``trainer_version``)."""
    tokens: dict[int, int] = {}
    for tree in trees:
        for node in tree.nodes:
            if node.kind == "model" and node.weight_version is not None and node.weight_version.isdigit():
                version = int(node.weight_version)
                tokens[version] = tokens.get(version, 0) + len(node.token_ids)
    total = sum(tokens.values())
    if not total:
        return {}
    behind = {trainer_version - v: n for v, n in tokens.items()}
    return {
        "staleness_mean": sum(b * n for b, n in behind.items()) / total,
        "staleness_max": float(max(behind)),
        "version_spread": float(max(tokens) - min(tokens)),
        "stale_token_share": sum(n for b, n in behind.items() if b > 0) / total,
    }
