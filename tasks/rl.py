"""The verbs of one RL step: rollout, score, update, store; plus SFT, checkpoint and evaluate.

Heavy objects live in the :class:`~infra.experiment.Experiment`; these tasks never cache (their inputs are
live objects) and return metrics dicts or paths.  rollout/score/evaluate retry on transient errors; update
never retries blindly — a failed update fails the flow, and a re-run with ``resume`` continues from the last
checkpoint.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from aepo_core.rollout.scheduler import RolloutResult
from aepo_core.scoring import ScoreSummary
from infra.data.rows import QuestionRow
from infra.experiment import EvalReport, Experiment


@task(name="rollout", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=1)
def rollout(exp: Experiment, rows: Sequence[QuestionRow], step: int) -> RolloutResult:
    result = exp.rollout(rows, step)
    s = result.stats
    get_run_logger().info(
        "step %d rollout: %d questions, %d leaves (%d global, %d branch), %.0f tokens in %.1f s",
        step, s["questions"], s["leaves"], s["global_samples"], s["branch_samples"], s["tokens_generated"],
        s["wall_s"],
    )
    return result


@task(name="score", cache_policy=NO_CACHE, retries=1)
def score(exp: Experiment, result: RolloutResult, rows: Sequence[QuestionRow], step: int) -> ScoreSummary:
    summary = exp.score(result, rows)
    get_run_logger().info("step %d score: reward %.3f, accuracy %.3f", step,
                          summary.metrics["rollout/reward_mean"], summary.metrics["rollout/accuracy"])
    return summary


@task(name="update", cache_policy=NO_CACHE, retries=0)
def update(exp: Experiment, result: RolloutResult, summary: ScoreSummary, step: int) -> dict[str, float]:
    metrics = exp.update(result, summary)
    get_run_logger().info("step %d update: loss %.4f, grad norm %.3f, %.0f tok/s", step,
                          metrics.get("train/loss", float("nan")), metrics.get("train/grad_norm", float("nan")),
                          metrics.get("train/tokens_per_s", 0.0))
    return metrics


@task(name="store", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=1)
def store(exp: Experiment, result: RolloutResult, step: int) -> list[str]:
    paths = exp.store_step(step, result)
    get_run_logger().info("step %d stored %d trajectory parts", step, len(paths))
    return paths


@task(name="checkpoint", cache_policy=NO_CACHE, retries=1)
def checkpoint(exp: Experiment) -> str:
    path = exp.save()
    get_run_logger().info("checkpoint %s", path)
    return str(path)


@task(name="sft", cache_policy=NO_CACHE, retries=0)
def sft(exp: Experiment) -> dict[str, float]:
    metrics = exp.sft()
    get_run_logger().info("cold-start SFT: batch loss %.3f → %.3f over %d steps", metrics["sft/loss_first_batch"],
                          metrics["sft/loss_last_batch"], metrics["sft/steps"])
    return metrics


@task(name="evaluate", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=1)
def evaluate(exp: Experiment, dataset: str, label: str) -> EvalReport:
    report = exp.evaluate(dataset)
    k = exp.cfg.eval.pass_k
    s = report.summary
    get_run_logger().info("eval %s [%s]: pass@1 %.3f [%.3f, %.3f], pass@%d %.3f, %d questions", dataset, label,
                          s["pass@1"], s["pass@1_ci_low"], s["pass@1_ci_high"], k, s[f"pass@{k}"], s["questions"])
    return report


def report_metrics(report: EvalReport, k: int) -> dict[str, Any]:
    """eval/<dataset>/… metric names of one report."""
    name = report.dataset.replace(":", "_")
    return {f"eval/{name}/{key}": value for key, value in report.summary.items()}
