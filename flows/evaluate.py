"""The evaluation flow: a checkpoint (or the configured model) on every evaluation dataset, tracked in MLflow.

Per dataset: n samples per question at the evaluation temperature → unbiased Pass@1 / Pass@k with bootstrap
95% CIs, EM, F1 and tool-use statistics, per dataset and per question family.  Optionally every final answer is
judged by an LLM (``eval.judge_url``, see :mod:`tasks.judge`), and, with ``compare_to``, the per-question Pass@1
is compared with a previous evaluation on the same questions (mean difference with a paired bootstrap CI).

Outputs:

- an MLflow run of its own (tag ``kind=eval``, the checkpoint and its training run in tags), with the metrics
  ``eval/<dataset key>/…`` at the checkpoint's step, the per-question files and a JSON summary as artifacts;
- per-question results as Parquet, ``<runs_dir>/eval/<run name>/<dataset key>.parquet`` (written atomically), or
  under ``storage.evaluations_uri`` (``s3://…``: written locally under ``<runs_dir>/cache/eval/``, then one PUT), with
  the columns of :data:`~infra.run.evaluation.QUESTION_SCHEMA` (evaluations during training write the same files,
  see :mod:`flows.train`); a later evaluation's ``compare_to`` points at this file or directory;
- a Prefect table artifact with one row per dataset and per (dataset, family).
"""

from __future__ import annotations

import uuid
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact

from aepo_core.config import ExperimentConfig
from aepo_core.evaluation import EvalSummary
from flows.common import artifact_key, flow_runs_dir, rename_flow_run, run_origin
from infra.run.evaluation import EvalReport, EvalResult, ResultsDir, check_comparable, read_question_results
from infra.run.parameters import given_config
from infra.run.policy_source import eval_storage, locate_policy, start_side_run
from infra.run.records import check_eval_datasets, log_eval_traces
from infra.run.runtime import build_runtime
from tasks.judge import judge
from tasks.rl import evaluate as evaluate_task
from tasks.rl import write_eval_results

__all__ = ["EvalResult", "evaluate"]


def _table_rows(report: EvalReport, k: int, judge_acc: float | None) -> list[dict[str, Any]]:
    def row(family: str, s: EvalSummary) -> dict[str, Any]:
        return {"dataset": report.key, "family": family, "questions": s.questions,
                "pass@1": round(s.pass1.value, 4),
                "pass@1 95% CI": f"[{s.pass1.low:.3f}, {s.pass1.high:.3f}]",
                f"pass@{k}": round(s.pass_k.value, 4), "em": round(s.em, 4), "f1": round(s.f1, 4),
                "tool calls/q": round(s.tool_calls_per_question, 3), "answered": round(s.answered_rate, 3),
                "judge": round(judge_acc, 4) if judge_acc is not None and family == "all" else None}

    return [row("all", report.summary)] + [row(fam or "-", s) for fam, s in report.by_family.items()]


@flow(name="aepo-evaluate", log_prints=True)
def evaluate(
    config: ExperimentConfig | dict[str, Any] | str | None = None,
    checkpoint: str | None = None,
    overrides: list[str] | None = None,
    runs_dir: str | None = None,
    datasets: list[str] | None = None,
    compare_to: str | None = None,
    run_name: str | None = None,
) -> EvalResult:
    """Evaluate a checkpoint (None: the configured model; ``models:/<name>/<version>``: a registered policy, with
    the system prompt it carries) on every dataset; returns summaries and file paths."""
    logger = get_run_logger()
    given = given_config(config)
    located = flow_runs_dir(runs_dir, eval_storage(given, overrides).runs_dir)
    policy = locate_policy(given, checkpoint, overrides, datasets, located)
    cfg = policy.cfg
    previous = read_question_results(compare_to, cfg.storage) if compare_to else None
    runs = flow_runs_dir(runs_dir, cfg.storage.runs_dir)
    runs.mkdir(parents=True, exist_ok=True)

    runtime = build_runtime(cfg, runs, run_name)
    with runtime:  # stops a managed vLLM server however the flow ends
        step = (loaded := policy.load(runtime)).step
        name = run_name or f"{cfg.name}-eval-step{step}-{uuid.uuid4().hex[:6]}"
        eval_sets = runtime.eval_datasets()
        check_comparable(eval_sets, previous, compare_to)
        inputs = check_eval_datasets(runtime)
        rename_flow_run(name)

        tracker = start_side_run(cfg, runs, name, runtime.numerics, policy.eval_tags(loaded, compare_to), run_origin(
            "flows/evaluate.py:evaluate",
            f"AEPO evaluation of {policy.describe()} (step {step}) on {', '.join(eval_sets)}."))
        run_id = tracker.run_id
        results = ResultsDir.of(cfg.storage, runs, name)  # the local copy is what MLflow logs
        logger.info("evaluating %s (step %d) on %s → MLflow run %s, results in %s", policy.describe(), step,
                    ", ".join(eval_sets), run_id, results.uri)
        result = EvalResult(run_id, name, policy.source, step, str(runs), results.uri,
                            tracker.tracking_uri, cfg.eval.pass_k)
        table: list[dict[str, Any]] = []
        with tracker:
            tracker.log_datasets(inputs)
            policy.link(tracker)
            for ds in eval_sets:
                report = evaluate_task.with_options(timeout_seconds=cfg.train.eval_timeout_s)(runtime, ds, "eval")
                verdicts = judge(cfg.eval.judge_url, cfg.eval.judge_model, report) if cfg.eval.judge_url else None
                result.files[report.key] = write_eval_results(runtime, report, result.source, results, "eval",
                                                              verdicts)
                metrics = result.record(report, verdicts, previous, cfg.eval, cfg.seed)
                if report.key in result.compare:
                    logger.info("paired Pass@1 vs %s on %s: %s", compare_to, ds, result.comparisons[report.key].line(4))
                tracker.log_metrics(metrics, step)
                log_eval_traces(tracker, report, step, "eval")
                table.extend(_table_rows(report, cfg.eval.pass_k, result.judge.get(report.key)))
            tracker.log_artifact(results.local, "eval")
            tracker.log_dict(result.summary_json(compare_to), "eval/summary.json")
    create_table_artifact(table=table, key=artifact_key("eval", name),
                          description=f"evaluation {name} of {policy.describe()}")
    return result
