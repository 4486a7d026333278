"""The comparison flow (``aepo compare``; deployment ``compare``): a sweep's arms over seeds and their seed-matched
pairs, as :mod:`infra.run.compare` computes them, from the runs already in MLflow (nothing is trained).

Which runs: a sweep by its file, its parent run id or its name (its FINISHED children under the newest parent run),
or any set of runs by id. Outputs:

- the figures (``entropy_over_training.png``, ``training_curves.png``, ``curves_by_tokens.png``) under
  ``<runs_dir>/compare/<sweep name>/``;
- on the sweep's parent MLflow run: the arm, pair and curve tables as MLflow tables (``compare/*.json``), the whole
  comparison (``compare/comparison.json``) and the figures (``training_curves/``); a set of runs named by id has no
  parent, so its comparison stays in the flow's result and artifacts;
- Prefect table artifacts ``compare-<name>-arms`` and ``compare-<name>-pairs`` (the flow run's Artifacts tab).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from prefect import flow
from prefect.artifacts import create_table_artifact

from flows.common import artifact_key, flow_runs_dir, rename_flow_run
from infra.run.compare import DEFAULT_BASELINE, AlgorithmComparison
from infra.run.preflight import reading_tracking_uri
from tasks.compare import compare as compare_task
from tasks.compare import log, select_runs

COMPARE_DIR = "compare"
"""Under the runs dir: one folder of figures per compared sweep (``runs`` for a set of runs named by id)."""


@dataclass(frozen=True)
class CompareResult:
    """A comparison and where it went."""

    comparison: AlgorithmComparison
    name: str  # the sweep's name, else "runs"
    figures: list[str] = field(default_factory=list)
    logged_to: str | None = None  # the MLflow run the tables and figures were logged to
    artifacts: list[str] = field(default_factory=list)


@flow(name="aepo-compare")
def compare(sweep: str | None = None, run_ids: list[str] | None = None, runs_dir: str | None = None,
            tracking_uri: str | None = None, dataset: str | None = None, arms: list[str] | None = None,
            seeds: list[int] | None = None, baseline: str | None = DEFAULT_BASELINE,
            log_to_parent: bool = True) -> CompareResult:
    """Compare a sweep (``sweep``: its file, parent run id or name) or the runs ``run_ids``, on ``dataset`` (default:
    the first every run evaluated), these ``arms`` and ``seeds`` only where given; each arm against ``baseline`` per
    question. ``log_to_parent``: log the tables and figures to the sweep's parent run."""
    runs = flow_runs_dir(runs_dir, "runs")
    uri = tracking_uri or reading_tracking_uri(runs, None)
    selection = select_runs(uri, sweep, list(run_ids or []), arms, seeds)
    name = selection.sweep_name or "runs"
    rename_flow_run(f"compare-{name}")
    with tempfile.TemporaryDirectory() as tmp:
        comparison = compare_task(selection, Path(tmp), dataset, baseline)
    parent = selection.parent_run_id if log_to_parent else None
    figures, logged = log(comparison, runs / COMPARE_DIR / name, name, parent)
    create_table_artifact(table=comparison.arm_records(), key=artifact_key("compare", f"{name}-arms"),
                          description=f"{name}: arms over seeds on {comparison.dataset} (Pass@1 with a Student-t "
                          "95% interval over seeds)")
    if comparison.pairs:
        create_table_artifact(table=comparison.pair_records(), key=artifact_key("compare", f"{name}-pairs"),
                              description=f"{name}: seed-matched paired differences a − b (t over seeds, Holm over "
                              "the pairs)")
    return CompareResult(comparison, name, [str(f) for f in figures], parent, logged)
