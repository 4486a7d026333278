"""What every flow shares: its config parameter resolved with overrides, and the flow run it runs in."""

from __future__ import annotations

from typing import Any

from prefect.context import FlowRunContext

from aepo_core.config import ExperimentConfig, build_config


def resolve_config(config: ExperimentConfig | dict[str, Any] | None, overrides: list[str] | None) -> ExperimentConfig:
    """The flow's pydantic parameter plus dotted overrides (the same path as the CLI's --set)."""
    tree = config.to_dict() if isinstance(config, ExperimentConfig) else dict(config or {})
    return build_config(tree, overrides or [], source="flow parameters")


def flow_run_id() -> str | None:
    """The Prefect flow run this code runs in (tagged on the MLflow run); None outside a flow."""
    ctx = FlowRunContext.get()
    return str(ctx.flow_run.id) if ctx is not None and ctx.flow_run is not None else None
