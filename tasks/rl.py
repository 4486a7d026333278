"""The verbs of one RL step: rollout, score, update, store; plus SFT, checkpoint and evaluate.

Heavy objects live in the :class:`~infra.run.runtime.PolicyRuntime` (policy, engine, tools, reward) and the
:class:`~infra.run.trainer.Trainer` (backend, optimizer, data order, step); these tasks never cache (their inputs are
live objects) and return typed values.  rollout/score/evaluate retry on transient errors; update never retries
blindly — a failed update fails the flow, and a re-run with ``resume`` continues from the last checkpoint.
Each task logs one line for people and attaches a :class:`~tasks.progress.Progress` event for machines.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from aepo_core.dynamic_sampling import FilledBatch
from aepo_core.rollout.scheduler import RolloutResult, derive_seed
from aepo_core.scoring import StepScores
from infra.data.rows import QuestionRow
from infra.judge import Verdict
from infra.run.evaluation import EvalReport, EvalSource, ResultsDir, evaluate_dataset, write_question_results
from infra.run.runtime import PolicyRuntime
from infra.run.sft import SFTReport, run_sft
from infra.run.trainer import Trainer
from infra.store import TrajectoryStore
from tasks.progress import Progress, report
from tasks.retry import transient_only


@task(name="rollout", task_run_name="rollout-step-{step}", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=1)
def rollout(runtime: PolicyRuntime, rows: Sequence[QuestionRow], step: int, attempt: int = 0, rank: int = 0
            ) -> RolloutResult:
    """Rollout trees of the step's questions (under data-parallel ranks: this ``rank``'s shard of them); the seed
    derives from (config seed, step), for the refill rounds of DAPO dynamic sampling (``attempt`` > 0) the attempt,
    and for ranks > 0 the rank (independent streams per shard)."""
    parts = (runtime.cfg.seed, "rollout", step) + ((attempt,) if attempt else ()) + ((f"rank{rank}",) if rank else ())
    result = runtime.sample(rows, runtime.cfg.rollout, derive_seed(*parts))
    report(get_run_logger(), Progress("rollout", done=step), "step %d rollout: %s", step, result.describe())
    return result


@task(name="score", task_run_name="score-step-{step}", cache_policy=NO_CACHE, retries=1)
def score(runtime: PolicyRuntime, result: RolloutResult, rows: Sequence[QuestionRow], step: int) -> StepScores:
    scores = runtime.score(result, rows)
    get_run_logger().info("step %d score: reward %.3f, accuracy %.3f", step, scores.metrics["rollout/reward_mean"],
                          scores.metrics["rollout/accuracy"])
    return scores


@task(name="update", task_run_name="update-step-{step}", cache_policy=NO_CACHE, retries=0)
def update(trainer: Trainer, batch: FilledBatch, step: int) -> dict[str, float]:
    """One policy update on the step's batch: the groups dynamic sampling kept."""
    metrics = trainer.update(batch.trees, batch.scores.leaves)
    report(get_run_logger(), Progress("update", done=step, total=trainer.total_steps),
           "step %d update: loss %.4f, grad norm %.3f, %.0f tok/s", step, metrics.get("train/loss", float("nan")),
           metrics.get("train/grad_norm", float("nan")), metrics.get("train/tokens_per_s", 0.0))
    return metrics


@task(name="store", task_run_name="store-step-{step}", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=1)
def store(trajectories: TrajectoryStore, run_id: str, step: int, batch: FilledBatch,
          questions: Mapping[str, QuestionRow]) -> list[str]:
    """Every tree the step sampled with its scores, its question (id → row: text, golds, dataset) and the advantages
    the update gave its leaves (None for a tree it left out) into the store."""
    paths = trajectories.write_step(run_id, step, batch.sampled_trees, batch.sampled_scores.leaves, questions,
                                    batch.update_advantages())
    get_run_logger().info("step %d stored %d trajectory parts", step, len(paths))
    return paths


@task(name="checkpoint", task_run_name="checkpoint-step-{trainer.step}", cache_policy=NO_CACHE, retries=1)
def checkpoint(trainer: Trainer) -> str:
    path = trainer.save()
    get_run_logger().info("checkpoint %s", path)
    return str(path)


@task(name="sft", task_run_name="sft", cache_policy=NO_CACHE, retries=0)
def sft(runtime: PolicyRuntime, rows: Sequence[QuestionRow]) -> SFTReport:
    result = run_sft(runtime, rows)
    get_run_logger().info("cold-start SFT: batch loss %.3f → %.3f over %d steps", result.loss_first_batch,
                          result.loss_last_batch, result.steps)
    return result


@task(name="evaluate", task_run_name="evaluate-{label}", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=1,
      retry_condition_fn=transient_only)
def evaluate(runtime: PolicyRuntime, dataset: str, label: str) -> EvalReport:
    """Evaluate the runtime's current policy on ``dataset`` (``label``: start, sft, stepN, final, eval)."""
    cfg = runtime.cfg
    result = evaluate_dataset(runtime, dataset, runtime.load_rows(dataset), cfg.eval, cfg.seed,
                              cfg.eval.batch_size or cfg.train.batch_size, traces=cfg.tracking.eval_traces)
    s = result.summary
    report(get_run_logger(), Progress("evaluate", name=result.key, label=label),
           "eval %s [%s]: pass@1 %.3f [%.3f, %.3f], pass@%d %.3f, %d questions", result.key, label, s.pass1.value,
           s.pass1.low, s.pass1.high, s.k, s.pass_k.value, s.questions)
    return result


@task(name="write_eval_results", task_run_name="write-eval-results-{stage}-{report.key}", cache_policy=NO_CACHE,
      retries=1)
def write_eval_results(runtime: PolicyRuntime, report: EvalReport, source: EvalSource, where: ResultsDir, stage: str,
                       verdicts: Mapping[str, Sequence[Verdict]] | None = None) -> str:
    """The per-question Parquet of one evaluated dataset (``aepo eval`` and evaluations during training alike;
    ``stage``: start, sft, stepN, final, eval); returns its location."""
    cfg = runtime.cfg
    written = write_question_results(report, cfg.eval.pass_k, source, where, cfg.storage, verdicts)
    get_run_logger().info("wrote %d question rows of %s to %s", len(report.outcomes), report.key, written)
    return written
