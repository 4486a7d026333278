"""The evaluation flow: a checkpoint (or the configured model) on every evaluation dataset, tracked in MLflow.

Per dataset: n samples per question at the evaluation temperature → unbiased Pass@1 / Pass@k with bootstrap
95% CIs, EM, F1 and tool-use statistics, per dataset and per question family.  Optionally every final answer is
judged by an LLM (``eval.judge_url``, see :mod:`infra.judge`), and, with ``compare_to``, the per-question Pass@1
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

import logging
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from aepo_core.config import ExperimentConfig, StorageConfig
from aepo_core.evaluation import paired_comparison
from aepo_core.overrides import build_config
from flows.common import artifact_key, flow_runs_dir, rename_flow_run, run_origin
from infra.config_files import load_config
from infra.judge import LLMJudge, Verdict
from infra.run.checkpoints import checkpoint_config, checkpoint_source, find_checkpoint
from infra.run.evaluation import EvalReport, EvalSource, ResultsDir, read_question_results
from infra.run.records import check_eval_datasets, log_eval_traces
from infra.run.runtime import build_runtime
from infra.tracking.registry import RegisteredPolicy, fetch_registered, is_registered_model, link_model
from infra.tracking.run import Tracker
from tasks.rl import evaluate as evaluate_task
from tasks.rl import write_eval_results

log = logging.getLogger(__name__)

MODEL_CACHE = Path("cache") / "models"
"""Under the runs dir: the downloaded copies of registered policies, ``<name>/<version>/``."""

# ---------------------------------------------------------------------------------------------- parameters


def resolve_eval_config(config: ExperimentConfig | dict[str, Any] | str | None, checkpoint: Path | None,
                        overrides: Sequence[str] | None, datasets: Sequence[str] | None,
                        registered: RegisteredPolicy | None = None) -> ExperimentConfig:
    """The config to evaluate with: the given one (object, dict or YAML path), else the checkpoint's own (a
    registered policy's: its training run's), else the defaults; then the dotted overrides and the dataset list."""
    tree = _given_tree(config)
    if tree is None and registered is not None:
        tree = dict(registered.config)
    if tree is None:
        tree = checkpoint_config(checkpoint) if checkpoint is not None else {}
    cfg = build_config(tree, list(overrides or []), source="evaluate parameters")
    if datasets:
        cfg = build_config(cfg.to_dict(), {"eval.datasets": list(datasets)}, source="evaluate datasets")
    return cfg


def _given_tree(config: ExperimentConfig | dict[str, Any] | str | None) -> dict[str, Any] | None:
    """The given config (object, dict or YAML path) as a tree; None when none is given."""
    if isinstance(config, str):
        return load_config(config).to_dict()
    if isinstance(config, ExperimentConfig):
        return config.to_dict()
    return dict(config) if config is not None else None


def _locating_config(config: ExperimentConfig | dict[str, Any] | str | None, overrides: Sequence[str] | None
                     ) -> ExperimentConfig:
    """The config a checkpoint or registered policy is found with, before its own config is known: the given
    config (the defaults without one) with the ``storage.…`` and ``tracking.…`` overrides."""
    sets = [o for o in overrides or [] if o.startswith(("storage.", "tracking."))]
    return build_config(_given_tree(config) or {}, sets, source="evaluate storage")


def eval_storage(config: ExperimentConfig | dict[str, Any] | str | None, overrides: Sequence[str] | None
                 ) -> StorageConfig:
    """The storage a checkpoint is read with (e.g. ``storage.s3_endpoint_url``): :func:`_locating_config`'s."""
    return _locating_config(config, overrides).storage


def fetch_registered_policy(uri: str, config: ExperimentConfig | dict[str, Any] | str | None,
                            overrides: Sequence[str] | None, runs_dir: str | os.PathLike[str]) -> RegisteredPolicy:
    """A registered policy version (``models:/<name>/<version>``) from the registry of the given config's tracking
    URI (default: the runs dir's store), downloaded under ``<runs_dir>/cache/models``."""
    tracker = Tracker.from_config(_locating_config(config, overrides), runs_dir, system_metrics=False)
    return fetch_registered(tracker, uri, Path(runs_dir) / MODEL_CACHE)


def resolve_checkpoint(path: str | os.PathLike[str] | None, storage: StorageConfig | None = None,
                       runs_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """A checkpoint directory (``step-NNNNNN``), a run's checkpoint folder or a run name's holding one run (its
    newest complete checkpoint), local or remote (``s3://…``, read through a verified copy under
    ``<runs_dir>/cache/checkpoints``): a local directory."""
    return find_checkpoint(path, storage, runs_dir) if path is not None else None


# ---------------------------------------------------------------------------------------------- tasks


@task(name="judge", task_run_name="judge-{dataset}", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=2)
def judge_answers(url: str, model: str | None, dataset: str,
                  items: list[tuple[str, list[str], str | None]]) -> list[Verdict]:
    """Every final answer through the LLM judge (verdicts in input order)."""
    judge = LLMJudge(url, model)
    verdicts = judge.judge_many(items)
    counts: dict[str, int] = {}
    for v in verdicts:
        counts[v.verdict] = counts.get(v.verdict, 0) + 1
    get_run_logger().info("judge %s on %s: %d answers, %s", judge.url, dataset, len(items), counts)
    return verdicts


# ---------------------------------------------------------------------------------------------- helpers


def _table_rows(report: EvalReport, k: int, judge_acc: float | None) -> list[dict[str, Any]]:
    def row(family: str, s: dict[str, float]) -> dict[str, Any]:
        return {"dataset": report.key, "family": family, "questions": int(s["questions"]),
                "pass@1": round(s["pass@1"], 4),
                "pass@1 95% CI": f"[{s['pass@1_ci_low']:.3f}, {s['pass@1_ci_high']:.3f}]",
                f"pass@{k}": round(s[f"pass@{k}"], 4), "em": round(s["em"], 4), "f1": round(s["f1"], 4),
                "tool calls/q": round(s["tool_calls_per_question"], 3), "answered": round(s["answered_rate"], 3),
                "judge": round(judge_acc, 4) if judge_acc is not None and family == "all" else None}

    return [row("all", report.summary)] + [row(fam or "-", s) for fam, s in report.by_family.items()]


# ---------------------------------------------------------------------------------------------- the flow


@dataclass(frozen=True)
class EvalResult:
    """What an evaluation produced and where it went; per-dataset fields are keyed by the dataset key
    (:func:`~infra.data.loaders.dataset_key`: ``synthetic_test``)."""

    run_id: str
    run_name: str
    checkpoint: str | None
    checkpoint_step: int
    runs_dir: str
    results_dir: str
    tracking_uri: str
    pass_k: int
    files: dict[str, str] = field(default_factory=dict)
    summary: dict[str, dict[str, float]] = field(default_factory=dict)
    by_family: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    judge: dict[str, float] = field(default_factory=dict)
    compare: dict[str, dict[str, float]] = field(default_factory=dict)


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
    given = eval_storage(config, overrides)
    located = flow_runs_dir(runs_dir, given.runs_dir)
    registered = (fetch_registered_policy(checkpoint, config, overrides, located)
                  if checkpoint is not None and is_registered_model(checkpoint) else None)
    ckpt = resolve_checkpoint(checkpoint if registered is None else None, given, located)
    source = registered.uri if registered is not None else checkpoint_source(checkpoint, ckpt)
    cfg = resolve_eval_config(config, ckpt, overrides, datasets, registered)
    previous = read_question_results(compare_to, cfg.storage) if compare_to else None
    runs = flow_runs_dir(runs_dir, cfg.storage.runs_dir)
    runs.mkdir(parents=True, exist_ok=True)

    runtime = build_runtime(cfg, runs, run_name)
    with runtime:  # stops a managed vLLM server however the flow ends
        state = runtime.load_checkpoint_weights(ckpt) if ckpt is not None else None
        if registered is not None:
            runtime.load_policy_weights(registered.local_dir, registered.step, registered.protocol)
        step = state.step if state is not None else registered.step if registered is not None else 0
        trained_by = state.run_id if state is not None else registered.run_id if registered is not None else None
        name = run_name or f"{cfg.name}-eval-step{step}-{uuid.uuid4().hex[:6]}"
        eval_sets = runtime.eval_datasets()
        if not eval_sets:
            raise ValueError("nothing to evaluate: set eval.datasets (or data.validation)")
        if previous is not None and not set(previous) & set(eval_sets):
            raise ValueError(f"compare_to {compare_to} holds datasets {sorted(previous)}, none of {eval_sets}")
        inputs = check_eval_datasets(runtime)
        rename_flow_run(name)

        tracker = Tracker.from_config(cfg, runs, system_metrics=False)
        tags = {"kind": "eval", "checkpoint": source or "", "checkpoint_step": step,
                "source_run_id": trained_by or "", "compare_to": compare_to or ""}
        what = source or cfg.model.name
        run_id = tracker.start(cfg, run_name=name, tags={**tags, **runtime.numerics.tags()},
                               params=runtime.numerics.params(), origin=run_origin(
            "flows/evaluate.py:evaluate", f"AEPO evaluation of {what} (step {step}) on {', '.join(eval_sets)}."))
        results = ResultsDir.of(cfg.storage, runs, name)  # the local copy is what MLflow logs
        logger.info("evaluating %s (step %d) on %s → MLflow run %s, results in %s", source or cfg.model.name, step,
                    ", ".join(eval_sets), run_id, results.uri)
        result = EvalResult(run_id, name, source, step, str(runs), results.uri,
                            tracker.tracking_uri, cfg.eval.pass_k)
        table: list[dict[str, Any]] = []
        with tracker:
            tracker.log_datasets(inputs)
            if registered is not None:
                link_model(tracker, registered)
            for ds in eval_sets:
                report = evaluate_task.with_options(timeout_seconds=cfg.train.eval_timeout_s)(runtime, ds, "eval")
                metrics = report.metrics()
                verdicts = None
                if cfg.eval.judge_url:
                    verdicts = _judge(cfg.eval.judge_url, cfg.eval.judge_model, report)
                    result.judge[report.key] = _judge_pass1(verdicts)
                    metrics[f"eval/{report.key}/judge_pass@1"] = result.judge[report.key]
                source_info = EvalSource(run_id, name, result.checkpoint, step)
                result.files[report.key] = write_eval_results(runtime, report, source_info, results, "eval",
                                                              verdicts)
                if previous is not None and ds in previous:
                    cmp = paired_comparison(report.per_question_pass1, previous[ds],
                                            n_resamples=cfg.eval.bootstrap_samples, seed=cfg.seed)
                    result.compare[report.key] = cmp
                    metrics.update({f"compare/{report.key}/pass@1_{key}": v for key, v in cmp.items()})
                    logger.info("paired Pass@1 vs %s on %s: %+.4f [%.4f, %.4f] over %d questions", compare_to, ds,
                                cmp["diff"], cmp["ci_low"], cmp["ci_high"], int(cmp["questions"]))
                tracker.log_metrics(metrics, step)
                log_eval_traces(tracker, report, step, "eval")
                result.summary[report.key], result.by_family[report.key] = report.summary, report.by_family
                table.extend(_table_rows(report, cfg.eval.pass_k, result.judge.get(report.key)))
            tracker.log_artifact(results.local, "eval")
            tracker.log_dict({"summary": result.summary, "by_family": result.by_family, "judge_pass@1": result.judge,
                              "compare": result.compare, "compare_to": compare_to}, "eval/summary.json")
    create_table_artifact(table=table, key=artifact_key("eval", name),
                          description=f"evaluation {name} of {source or cfg.model.name}")
    return result


def _judge(url: str, model: str | None, report: EvalReport) -> dict[str, list[Verdict]]:
    """Every sample's final answer through the LLM judge: per question, one verdict per sample."""
    answers, questions = report.answers, report.questions
    items = [(questions[q].question, list(questions[q].golds), a) for q in answers for a in answers[q]]
    flat = judge_answers(url, model, report.key, items)
    verdicts, pos = {}, 0
    for q, samples in answers.items():
        verdicts[q] = flat[pos: pos + len(samples)]
        pos += len(samples)
    return verdicts


def _judge_pass1(verdicts: dict[str, list[Verdict]]) -> float:
    """Mean over questions of the share of samples the judge called correct."""
    return sum(sum(v.correct for v in vs) / len(vs) for vs in verdicts.values()) / len(verdicts)
