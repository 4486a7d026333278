"""``aepo runs``: the newest MLflow runs of an experiment in a table (name, kind, status, algorithm, final Pass@1,
reward)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Annotated

import typer
from rich import box
from rich.table import Table

from flows.cli.inputs import RunsOpt, TrackingOpt, reading_tracking_uri, resolve_runs_dir
from flows.cli.render import fmt, out


def _first_metric(metrics: Mapping[str, float], pattern: re.Pattern[str]) -> float | None:
    for key, value in metrics.items():
        if pattern.match(str(key)) and value is not None and not (isinstance(value, float) and math.isnan(value)):
            return float(value)
    return None


def runs(
    runs_dir: RunsOpt = None,
    experiment: Annotated[str, typer.Option("--experiment", "-e", help="MLflow experiment.")] = "aepo",
    limit: Annotated[int, typer.Option("--limit", "-n", help="Newest N runs.")] = 30,
    tracking_uri: TrackingOpt = None,
) -> None:
    """Table of MLflow runs: name, kind, status, algorithm, final Pass@1 and reward."""
    rdir = resolve_runs_dir(runs_dir)
    uri = reading_tracking_uri(rdir, tracking_uri)
    assert uri is not None
    from infra.tracking.run_index import newest_runs

    found = newest_runs(uri, experiment, limit)
    table = Table(title=f"MLflow runs in {experiment!r} at {uri}", title_justify="left", box=box.SIMPLE_HEAD,
                  pad_edge=False)
    for col in ("started", "name", "run id", "kind", "status", "algorithm", "mode", "seed", "pass@1", "reward"):
        wraps = col in ("name", "kind")
        table.add_column(col, overflow="fold", no_wrap=not wraps,
                         justify="right" if col in ("seed", "pass@1", "reward") else "left")
    pass1 = re.compile(r"^eval/.+/pass_at_1$")
    for run in found:
        kind = run.tags.get("kind") or "train"
        if run.tags.get("sweep_name") and kind == "train":
            kind = f"train ({run.tags['sweep_name']})"
        started = run.start_time.strftime("%m-%d %H:%M") if run.start_time is not None else "–"
        table.add_row(started, run.run_name, run.run_id[:12], kind, run.status, run.tags.get("algorithm", "–"),
                      run.tags.get("mode", "–"), run.tags.get("seed", "–"), fmt(_first_metric(run.metrics, pass1)),
                      fmt(run.metrics.get("rollout/reward_mean")))
    console = out()
    console.print(table)
    if not found:
        console.print("no runs yet")
