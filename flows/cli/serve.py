"""``aepo serve``: the train / evaluate / sweep deployments served from this process against a Prefect server."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from flows.cli.environment import prepare_environment
from flows.cli.inputs import RunsOpt, healthy, load_checked_config, resolve_runs_dir
from flows.cli.render import fail, out


def serve(
    runs_dir: RunsOpt = None,
    config: Annotated[Path, typer.Option("--config", "-c", help="Default config of the train/evaluate "
                                         "deployments.")] = Path("configs/tiny.yaml"),
    sweep_file: Annotated[Path, typer.Option("--sweep", help="Sweep file of the scheduled sweep deployment.")
                          ] = Path("configs/sweeps/tiny.yaml"),
    cron: Annotated[str, typer.Option("--cron", help="Schedule the sweep deployment (cron, e.g. '0 3 * * 1': Mondays "
                                       "03:00; each firing a new dated sweep). Default: no schedule.")] = "",
    api_url: Annotated[str, typer.Option("--api-url", envvar="PREFECT_API_URL", help="Prefect server API.")
                       ] = "http://127.0.0.1:4200/api",
) -> None:
    """Serve the train / evaluate / sweep deployments from this process (no work pool needed; Ctrl-C stops).

    \b
    Examples:
      aepo ui &   # a Prefect server at 127.0.0.1:4200
      PREFECT_API_URL=http://127.0.0.1:4200/api aepo serve
    """
    load_checked_config(config, [])
    if not sweep_file.is_file():
        fail(f"sweep file not found: {sweep_file}")
    runs = resolve_runs_dir(runs_dir)
    if not healthy(api_url):
        fail(f"no Prefect server at {api_url}: start one with `aepo ui --runs-dir {runs}` (or `prefect server "
             "start`), or pass --api-url", code=1)
    os.environ["PREFECT_API_URL"] = api_url
    prepare_environment(runs)
    from prefect import serve as prefect_serve

    from flows.serve import build_deployments

    deployments = build_deployments(runs, config, sweep_file, cron or None)
    out().print(f"serving {', '.join(d.name for d in deployments)} against {api_url}; runs dir {runs}; "
                f"trigger them from the UI or `prefect deployment run 'aepo-train/{deployments[0].name}'`")
    prefect_serve(*deployments)
