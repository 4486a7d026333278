"""What every flow shares: its config parameter resolved with overrides, its runs dir, and the flow run it runs in
(the origin its MLflow run records)."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from prefect.client.orchestration import get_client
from prefect.context import FlowRunContext
from prefect.runtime import flow_run

from aepo_core.config_keys import ConfigError
from infra.run.parameters import resolve_config
from infra.run.preflight import resolve_runs_dir
from infra.run.records import RunOrigin

Logger = logging.Logger | logging.LoggerAdapter[Any]
"""What ``get_run_logger()`` returns: the flows' logger."""


def flow_runs_dir(given: str | None, configured: str) -> Path:
    """A flow's runs dir, decided as the CLI decides it (:func:`~infra.run.preflight.resolve_runs_dir`)."""
    return resolve_runs_dir(given, configured)


def flow_run_id() -> str | None:
    """The Prefect flow run this code runs in (tagged on the MLflow run); None outside a flow."""
    ctx = FlowRunContext.get()
    return str(ctx.flow_run.id) if ctx is not None and ctx.flow_run is not None else None


UI_PREFECT_PORT = 4200
"""The port of the Prefect server ``aepo ui`` starts by default (its ``--prefect-port``)."""


def prefect_ui_base() -> str:
    """Where the Prefect UI showing this process's flow runs is: ``PREFECT_UI_URL``; else the server of
    ``PREFECT_API_URL`` without its ``/api``; else (the CLI's temporary API server, which has no UI and dies with
    the run) ``aepo ui``'s on this machine, which serves the same database (``<runs>/prefect``)."""
    from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL

    if PREFECT_UI_URL.value():
        return str(PREFECT_UI_URL.value()).rstrip("/")
    api = str(PREFECT_API_URL.value() or "").rstrip("/")
    if api.endswith("/api"):
        return api.removesuffix("/api")
    return f"http://127.0.0.1:{UI_PREFECT_PORT}"


def flow_run_url(run_id: str) -> str:
    """The Prefect UI page of flow run ``run_id``."""
    return f"{prefect_ui_base()}/runs/flow-run/{run_id}"


def run_origin(source_name: str, description: str) -> RunOrigin:
    """The origin an MLflow run records: ``source_name`` (the flow's entrypoint), ``description``, and the Prefect
    flow run this code runs in, with its UI URL (:func:`flow_run_url`; before, a run under the CLI's temporary
    API server had none)."""
    run_id = flow_run_id()
    return RunOrigin(source_name, description, run_id, flow_run_url(run_id) if run_id is not None else None)


def artifact_key(kind: str, name: str) -> str:
    """A Prefect artifact key (lowercase letters, digits and dashes): ``<kind>-<name>``; an artifact with a key is
    listed on Prefect's Artifacts page, with its earlier versions (a resumed run's, a re-run sweep's)."""
    return f"{kind}-{re.sub(r'[^a-z0-9-]+', '-', name.lower()).strip('-') or 'run'}"


def train_flow_run_name() -> str:
    """The name of an ``aepo-train`` flow run: its MLflow run's (:meth:`ExperimentConfig.run_name_for` of the
    flow's parameters), so both UIs list the run under one name. A config that does not build names the flow
    run ``aepo-train``: the flow itself then fails with the config error."""
    params = flow_run.parameters
    try:
        cfg = resolve_config(params.get("config"), params.get("overrides"))
    except ConfigError:
        return "aepo-train"
    return cfg.run_name_for(params.get("run_name"))


def rename_flow_run(name: str) -> None:
    """Give the current flow run ``name`` (an evaluation's MLflow run name is known only once its checkpoint is
    read, after the flow run started); nothing outside a flow."""
    run_id = flow_run_id()
    if run_id is not None:
        with get_client(sync_client=True) as client:
            client.update_flow_run(run_id, name=name)
