"""The rollout study's one verb: sample a chunk of questions in one mode at one k, score and profile every group."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from aepo_core.config import RolloutConfig
from aepo_core.rollout.scheduler import derive_seed
from aepo_core.rollout.study import GroupProfile, profile_group
from infra.data.rows import QuestionRow
from infra.run.runtime import PolicyRuntime
from infra.run.study import ArmCost


@dataclass(frozen=True)
class ChunkProfiles:
    """A chunk's groups, profiled, and what sampling them cost."""

    profiles: list[GroupProfile]
    cost: ArmCost


@task(name="study-chunk", task_run_name="study-{label}-chunk-{chunk}", cache_policy=NO_CACHE, retries=2,
      retry_delay_seconds=2)
def study_chunk(runtime: PolicyRuntime, rows: Sequence[QuestionRow], rollout: RolloutConfig, seed: int, chunk: int,
                label: str) -> ChunkProfiles:
    """Rollout trees of ``rows`` under ``rollout``, scored, one profile per question. The seed derives from
    (``seed``, chunk index) only, not from the mode or k: the same question meets the same random streams in every
    arm (paired seeds)."""
    result = runtime.sample(rows, rollout, derive_seed(seed, "study", chunk))
    scores = runtime.score(result, rows)
    profiles = [profile_group(tree, [s.reward for s in leaf_scores], [s.correct for s in leaf_scores])
                for tree, leaf_scores in zip(result.trees, scores.leaves, strict=True)]
    s = result.stats
    cost = ArmCost(s["wall_s"], s["generate_s"], s["tools_s"], s["tokens_generated"])
    get_run_logger().info("study %s chunk %d: %d questions, %d leaves, %.0f tokens in %.1f s, accuracy %.3f", label,
                          chunk, len(rows), int(s["leaves"]), s["tokens_generated"], s["wall_s"],
                          scores.metrics["rollout/accuracy"])
    return ChunkProfiles(profiles, cost)
