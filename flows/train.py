"""The training flow: optional cold-start SFT → RL steps → final evaluation, tracked in MLflow.

Each RL step: rollout → score → update → store → track, with a checkpoint every ``checkpoint.every`` steps and
an evaluation every ``eval.every`` steps.  Killing the flow and re-running it with ``resume=True`` continues
from the last complete checkpoint, in the same MLflow run, with the same data order and rollout seeds.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact
from prefect.context import get_run_context

from aepo_core.config import ExperimentConfig, build_config
from aepo_core.evaluation import paired_comparison
from infra.experiment import EvalReport, Experiment
from infra.plots import curves_figure, rollout_tree_figure
from infra.tracking import Tracker
from tasks.data import prepare_data, rows_from_dicts, source_fingerprint
from tasks.rl import checkpoint, evaluate, report_metrics, rollout, score, sft, store, update

log = logging.getLogger(__name__)

CURVE_METRICS = ("rollout/reward_mean", "rollout/accuracy", "train/entropy_mean", "rollout/delta_h_mean",
                 "rollout/branch_samples", "rollout/max_branches_per_path", "train/loss", "train/clip_frac_high")


def resolve_config(config: ExperimentConfig | dict[str, Any] | None, overrides: list[str] | None) -> ExperimentConfig:
    """The flow's pydantic parameter plus dotted overrides (the same path as the CLI's --set)."""
    tree = config.to_dict() if isinstance(config, ExperimentConfig) else dict(config or {})
    return build_config(tree, overrides or [], source="flow parameters")


def _flow_run_id() -> str | None:
    ctx = get_run_context()
    fr = getattr(ctx, "flow_run", None)
    return str(fr.id) if fr is not None else None


def _log_eval(tracker: Tracker, report: EvalReport, step: int, label: str, k: int) -> dict[str, float]:
    """Log one evaluation (metrics at ``step``, the full report as JSON); returns its summary."""
    tracker.log_metrics(report_metrics(report, k), step)
    tracker.log_dict({"summary": report.summary, "by_family": report.by_family,
                      "questions": [o.as_dict() for o in report.outcomes]},
                     f"eval/{label}/{report.dataset.replace(':', '_')}.json")
    return report.summary


def rollout_metrics(stats: dict[str, float]) -> dict[str, float]:
    names = {"leaves": "leaves", "global_samples": "global_samples", "branch_samples": "branch_samples",
             "fill_samples": "fill_samples", "max_branches_per_path": "max_branches_per_path",
             "branches_per_question": "branches_per_question", "tool_calls_mean": "tool_calls_mean",
             "tool_error_rate": "tool_error_rate", "tool_cache_hit_rate": "tool_cache_hit_rate",
             "h_root_mean": "h_root_mean", "h_tool_mean": "h_tool_mean", "delta_h_mean": "delta_h_mean",
             "distinct_tool_sequences": "distinct_tool_sequences", "tokens_generated": "tokens_generated",
             "wall_s": "wall_s", "generate_s": "generate_s", "tools_s": "tools_s",
             "global_budget_mean": "global_budget_mean", "response_tokens_mean": "response_tokens_mean"}
    return {f"rollout/{v}": stats[k] for k, v in names.items() if k in stats}


@flow(name="aepo-train", log_prints=True)
def train(
    config: ExperimentConfig | None = None,
    overrides: list[str] | None = None,
    resume: bool = False,
    runs_dir: str | None = None,
    run_name: str | None = None,
    parent_run_id: str | None = None,
    force_resume: bool = False,
) -> dict[str, Any]:
    """Train a policy with the configured algorithm; returns the final metrics and where everything went."""
    logger = get_run_logger()
    cfg = resolve_config(config, overrides)
    runs = Path(runs_dir or cfg.storage.runs_dir)
    runs.mkdir(parents=True, exist_ok=True)
    flow_run_id = _flow_run_id()

    rows = prepare_data(cfg.data.train, cfg.data.model_dump(mode="json"),
                        source_fingerprint(cfg.data.train, cfg.data.data_root))
    exp = Experiment(cfg, runs, run_name=run_name, train_rows=rows_from_dicts(rows))
    resumed_at = exp.resume(force=force_resume) if resume else None
    tracker = Tracker.from_config(cfg, runs)
    exp.run_id = tracker.start(cfg, run_name=exp.run_name, resume_run_id=exp.run_id, parent_run_id=parent_run_id,
                               flow_run_id=flow_run_id, tags={"runs_dir": str(runs)})
    tracker.log_config(cfg)
    total = exp.total_steps
    logger.info("run %s (MLflow %s): %d RL steps%s", exp.run_name, exp.run_id, total,
                f", resumed at step {resumed_at}" if resumed_at is not None else "")
    progress_id = create_progress_artifact(progress=100.0 * exp.step / total, key=None,
                                           description=f"RL steps of {exp.run_name}")
    evals: dict[str, dict[str, dict[str, float]]] = {}  # label (start, sft, stepN, final) → dataset → summary
    per_question: dict[str, dict[str, dict[str, float]]] = {}  # label → dataset → question → pass@1

    def run_eval(label: str, step: int) -> None:
        for ds in exp.eval_datasets():
            report = evaluate.with_options(timeout_seconds=cfg.train.eval_timeout_s)(exp, ds, label)
            evals.setdefault(label, {})[ds] = _log_eval(tracker, report, step, label, cfg.eval.pass_k)
            per_question.setdefault(label, {})[ds] = report.per_question_pass1

    status = "FAILED"
    comparisons: dict[str, dict[str, dict[str, float]]] = {}
    try:
        if resumed_at is None:
            if cfg.eval.at_start:
                run_eval("start", 0)
            if cfg.train.sft.enabled:
                tracker.log_metrics(sft(exp), 0)
                if cfg.eval.at_start:
                    run_eval("sft", 0)
        last_trees = None
        while exp.step < total:
            step = exp.step + 1
            t0 = time.perf_counter()
            batch = exp.next_batch()
            result = rollout.with_options(timeout_seconds=cfg.train.rollout_timeout_s,
                                          retries=cfg.train.task_retries)(exp, batch, step)
            summary = score(exp, result, batch, step)
            train_metrics = update.with_options(timeout_seconds=cfg.train.update_timeout_s)(exp, result, summary,
                                                                                             step)
            store(exp, result, step)
            metrics = {**rollout_metrics(result.stats), **summary.metrics, **train_metrics,
                       "step/wall_s": time.perf_counter() - t0}
            tracker.log_metrics(metrics, step)
            last_trees = result.trees
            if step % cfg.checkpoint.every == 0 or step == total:
                checkpoint(exp)
            if cfg.eval.every and step % cfg.eval.every == 0 and step < total:
                run_eval(f"step{step}", step)
            update_progress_artifact(progress_id, progress=100.0 * step / total,
                                     description=f"step {step}/{total}: reward "
                                     f"{summary.metrics['rollout/reward_mean']:.3f}")
        run_eval("final", exp.step)
        comparisons = _paired_vs_earlier(per_question, cfg)
        for name, by_ds in comparisons.items():
            tracker.log_metrics({f"eval/{ds.replace(':', '_')}/{name}_{key}": value
                                 for ds, c in by_ds.items() for key, value in c.items()}, exp.step)
        history = tracker.metric_history([m for m in CURVE_METRICS])
        tracker.log_figure(curves_figure({k: v for k, v in history.items() if v}, title=exp.run_name),
                           "plots/curves.png")
        if last_trees:
            tree = max(last_trees, key=lambda t: sum(n.branched for n in t.nodes))
            tracker.log_figure(rollout_tree_figure(tree, title=f"{tree.question_id} (step {exp.step})"),
                               "plots/rollout_tree.png")
            tracker.log_trajectory_sample(last_trees, max_rows=16, step=exp.step,
                                          questions={r.id: r.question for r in exp.train_rows})
        if cfg.tracking.log_model:
            tracker.log_model(exp.model, exp.tokenizer, name="policy")
        status = "FINISHED"
    finally:
        tracker.finish(status)
    result_info = {
        "run_id": exp.run_id, "run_name": exp.run_name, "steps": exp.step, "runs_dir": str(runs),
        "checkpoint_dir": str(exp.checkpoint_dir), "tracking_uri": tracker.tracking_uri,
        "trajectories": str(exp.store.uri), "final_eval": evals.get("final", {}), "evals": evals,
        "comparisons": comparisons,
    }
    create_markdown_artifact(key=None, markdown=summary_markdown(result_info, cfg),
                             description=f"summary of {exp.run_name}")
    return result_info


def _paired_vs_earlier(per_question: dict[str, dict[str, dict[str, float]]],
                       cfg: ExperimentConfig) -> dict[str, dict[str, dict[str, float]]]:
    """final − sft and final − start: per-question Pass@1 differences on the same questions, bootstrap CI."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    final = per_question.get("final", {})
    for earlier in ("sft", "start"):
        for ds, before in per_question.get(earlier, {}).items():
            if ds in final:
                out.setdefault(f"final_minus_{earlier}", {})[ds] = paired_comparison(
                    final[ds], before, n_resamples=cfg.eval.bootstrap_samples, seed=cfg.seed)
    return out


def summary_markdown(info: dict[str, Any], cfg: ExperimentConfig) -> str:
    lines = [
        f"# {info['run_name']}",
        "",
        f"- algorithm: `{cfg.algorithm.loss}`, rollout mode `{cfg.rollout.mode}`, seed {cfg.seed}",
        f"- RL steps: {info['steps']}",
        f"- MLflow run: `{info['run_id']}` at `{info['tracking_uri']}` "
        f"(`mlflow ui --backend-store-uri {info['tracking_uri']}`)",
        f"- checkpoints: `{info['checkpoint_dir']}`",
        f"- trajectories: `{info['trajectories']}`",
        "",
        "| stage | dataset | pass@1 | 95% CI | pass@k | tool calls/q | answered |",
        "|---|---|---|---|---|---|---|",
    ]
    k = cfg.eval.pass_k
    for stage, by_ds in info["evals"].items():
        for ds, s in by_ds.items():
            lines.append(f"| {stage} | {ds} | {s['pass@1']:.3f} | [{s['pass@1_ci_low']:.3f}, {s['pass@1_ci_high']:.3f}]"
                         f" | {s[f'pass@{k}']:.3f} | {s['tool_calls_per_question']:.2f} | {s['answered_rate']:.2f} |")
    for name, by_ds in info.get("comparisons", {}).items():
        for ds, c in by_ds.items():
            lines.append(f"\n- {name.replace('_', ' ')} on {ds}: pass@1 {c['diff']:+.3f} "
                         f"[{c['ci_low']:+.3f}, {c['ci_high']:+.3f}] over {c['questions']:.0f} questions (paired)")
    return "\n".join(lines)
