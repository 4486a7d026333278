"""``aepo ui``: the MLflow tracking server and the Prefect server (UIs and APIs) for this machine or, with
``--host 0.0.0.0``, for workers on others; Ctrl-C or SIGTERM stops both. The MLflow server's options are
:mod:`infra.tracking.server`'s; here: where the servers listen, their processes, and what is printed."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from aepo_core.config import TrackingConfig
from flows.cli.environment import prefect_home, server_environment
from flows.cli.inputs import RunsOpt, exits, resolve_runs_dir
from flows.cli.render import err, fail, out, where_table

if TYPE_CHECKING:
    from infra.run.services import UIServers


def ui(
    runs_dir: RunsOpt = None,
    host: Annotated[str, typer.Option("--host", help="Interface both servers listen on: 127.0.0.1 (this machine "
                                      "only) or 0.0.0.0 (workers on other machines can log to them).")
                    ] = "127.0.0.1",
    prefect_port: Annotated[int, typer.Option("--prefect-port", min=1, max=65535)] = 4200,
    mlflow_port: Annotated[int, typer.Option("--mlflow-port", min=1, max=65535)] = 5000,  # tracking.UI_MLFLOW_PORT
    backend_store_uri: Annotated[str | None, typer.Option(
        "--backend-store-uri", help="MLflow's database: sqlite:///path/mlflow.db or postgresql://user:password@host"
                                    ":5432/db (default: <runs dir>/mlflow.db).")] = None,
    artifacts_destination: Annotated[str | None, typer.Option(
        "--artifacts-destination", help="Where the MLflow server stores the artifacts its clients send it: a "
                                        "directory or s3://bucket/prefix (default: <runs dir>/mlartifacts).")] = None,
    s3_endpoint_url: Annotated[str | None, typer.Option(
        "--s3-endpoint-url", help="S3-compatible endpoint of an s3:// destination (MinIO, …): the server's "
                                  "MLFLOW_S3_ENDPOINT_URL.")] = None,
    no_prefect: Annotated[bool, typer.Option("--no-prefect", help="Start the MLflow server only.")] = False,
    startup_timeout: Annotated[float, typer.Option("--startup-timeout", help="Seconds to wait for each server.")
                               ] = 180,
) -> None:
    """Start the MLflow tracking server and the Prefect server (UIs and APIs); Ctrl-C or SIGTERM stops both.

    Workers on other machines log to them with --host 0.0.0.0: their runs set tracking.tracking_uri to the
    printed MLflow URL, their Prefect clients PREFECT_API_URL to the printed API URL. Artifacts go through the
    MLflow server to --artifacts-destination, so the workers need no access to it.

    \b
    Examples:
      aepo ui --runs-dir runs
      aepo ui --host 0.0.0.0 --artifacts-destination s3://bucket/mlartifacts
    """
    from infra.run.services import plan_ui  # (imports Prefect: after the options are read)

    rdir = resolve_runs_dir(runs_dir)
    ui_servers = exits(plan_ui)(rdir, host, mlflow_port, None if no_prefect else prefect_port, backend_store_uri,
                                artifacts_destination, s3_endpoint_url, lambda api: server_environment(rdir, api))
    if not no_prefect:
        prefect_home(rdir).mkdir(parents=True, exist_ok=True)
    console = out()
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # `kill` stops the servers too (finally)
    try:
        with console.status(f"starting {' and '.join(ui_servers.names)}…"):
            exits(ui_servers.start)(startup_timeout)
        _print_where(ui_servers, rdir)
        while not ui_servers.dead():
            time.sleep(1.0)
        fail(f"{', '.join(ui_servers.dead())} server exited (logs in {ui_servers.logs})", code=1)
    except KeyboardInterrupt:
        console.print("stopping…")
    finally:
        ui_servers.stop()
        signal.signal(signal.SIGTERM, previous)


def _print_where(ui_servers: UIServers, rdir: Path) -> None:
    """Where the servers are, how workers use them, and what is open to whom."""
    console = out()
    console.print(where_table([
        ("open", ui_servers.landing_url(TrackingConfig().experiment)),
        ("MLflow", f"{ui_servers.mlflow_url}   ({ui_servers.stores()})"),
        *([("Prefect", ui_servers.prefect_url)] if ui_servers.prefect_url else []),
        ("runs dir", str(rdir)),
        ("server logs", str(ui_servers.logs)),
    ]))
    console.print(f"Workers {'on this machine' if ui_servers.local_only else 'and clients'} use them with:\n"
                  f"  --set tracking.tracking_uri={ui_servers.mlflow_url}   (or tracking.tracking_uri in the config / "
                  "the sweep file's overrides; `aepo runs --tracking-uri` reads them)"
                  + (f"\n  export PREFECT_API_URL={ui_servers.prefect_url}/api" if ui_servers.prefect_url else ""))
    if ui_servers.local_only:
        console.print(f"(listening on {ui_servers.host} only: --host 0.0.0.0 lets workers on other machines in)")
    else:
        err().print("[yellow]warning:[/] the servers have no authentication: whoever reaches "
                    f"{ui_servers.public} can read and write the runs")
        for exp in ui_servers.local_artifact_experiments():
            err().print(f"[yellow]warning:[/] experiment {escape(exp)} keeps its artifacts on a local path: "
                        "runs of other machines would write them to their own disks (use another "
                        "tracking.experiment)", soft_wrap=True)
    console.print("Ctrl-C stops the servers")
