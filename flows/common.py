"""What every flow shares: its config parameter resolved with overrides, and the flow run it runs in."""

from __future__ import annotations

from typing import Any

from prefect.context import FlowRunContext

from aepo_core.config import ExperimentConfig, build_config
from infra.runtime import PolicyRuntime


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
