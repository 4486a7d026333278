"""The comparison's verbs: select the runs, compare them, log the comparison to the sweep's parent run.

Reading MLflow (a tracking server over HTTP) may fail for a moment, so each retries on a transient error; a user's
mistake (no such sweep, run, arm or dataset: :class:`~infra.run.compare.ComparisonError`) fails at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from infra.run.compare import (
    AlgorithmComparison,
    Selection,
    compare_runs,
    comparison_figures,
    find_runs,
    log_comparison,
)
from tasks.retry import transient_only


@task(name="select-runs", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2, retry_condition_fn=transient_only)
def select_runs(tracking_uri: str, sweep: str | None, run_ids: Sequence[str], arms: Sequence[str] | None,
                seeds: Sequence[int] | None) -> Selection:
    """The sweep's finished runs (by file, parent run id or name), or the runs named by id; these arms and seeds."""
    selection = find_runs(tracking_uri, sweep, run_ids, arms, seeds)
    get_run_logger().info("comparing %d runs: %s", len(selection.runs), ", ".join(selection.arms))
    return selection


@task(name="compare-runs", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2, retry_condition_fn=transient_only)
def compare(selection: Selection, workdir: Path, dataset: str | None, baseline: str | None) -> AlgorithmComparison:
    """The arms over seeds and their seed-matched pairs (:func:`~infra.run.compare.compare_runs`)."""
    comparison = compare_runs(selection, workdir, dataset, baseline)
    get_run_logger().info("compared %d arms on %s: %s", len(comparison.arms), comparison.dataset, "; ".join(
        f"{a.name} Pass@1 {a.pass1_over_seeds.mean:.3f} ({a.pass1_over_seeds.seeds} seeds)" for a in comparison.arms))
    return comparison


@task(name="log-comparison", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2)
def log(comparison: AlgorithmComparison, out_dir: Path, title: str, run_id: str | None) -> tuple[list[Path], list[str]]:
    """The figures under ``out_dir``; with ``run_id`` (the sweep's parent run), the tables and figures logged there.
    Returns (figures, artifact paths logged)."""
    figures = comparison_figures(comparison, out_dir, title)
    logged = log_comparison(comparison, run_id, figures) if run_id else []
    get_run_logger().info("comparison figures in %s%s", out_dir, f"; logged to MLflow run {run_id}" if run_id else "")
    return figures, logged
