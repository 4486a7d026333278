"""What every flow shares: its config parameter resolved with overrides, and the flow run it runs in."""

from __future__ import annotations

from typing import Any

from prefect.context import FlowRunContext

from aepo_core.config import ExperimentConfig, build_config
from infra.evaluation import EvalReport
from infra.runtime import PolicyRuntime
from infra.tracking import RankTracker, Tracker


def resolve_config(config: ExperimentConfig | dict[str, Any] | None, overrides: list[str] | None) -> ExperimentConfig:
    """The flow's pydantic parameter plus dotted overrides (the same path as the CLI's --set)."""
    tree = config.to_dict() if isinstance(config, ExperimentConfig) else dict(config or {})
    return build_config(tree, overrides or [], source="flow parameters")


def flow_run_id() -> str | None:
    """The Prefect flow run this code runs in (tagged on the MLflow run); None outside a flow."""
    ctx = FlowRunContext.get()
    return str(ctx.flow_run.id) if ctx is not None and ctx.flow_run is not None else None


def check_eval_datasets(runtime: PolicyRuntime) -> None:
    """Read every evaluation dataset once before the MLflow run is created: a bad row (a user error) then fails the
    flow before any run exists, instead of leaving a FAILED run behind after the training it followed."""
    for spec in runtime.eval_datasets():
        runtime.load_rows(spec)


def log_eval_traces(tracker: Tracker | RankTracker, report: EvalReport, step: int, label: str) -> None:
    """The evaluation's kept samples (``tracking.eval_traces`` first questions) as MLflow traces at ``step``,
    labelled ``<label>/<dataset key>`` (``final/synthetic_test``)."""
    if report.traced is not None:
        tracker.log_rollout_traces(report.traced.trees, report.traced.scores, step=step, kind="eval",
                                   label=f"{label}/{report.key}", questions=report.traced.questions)
