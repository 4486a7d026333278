"""``aepo runs``: the newest MLflow runs of an experiment in a table (name, kind, status, algorithm, final Pass@1,
reward, spend)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Annotated

import typer

from flows.cli.inputs import FormatOpt, RunsOpt, TrackingOpt, check_experiment, reading_tracking_uri, resolve_runs_dir
from flows.cli.render import OutputFormat, as_count, err, fmt, print_records


def _first_metric(metrics: Mapping[str, float], pattern: re.Pattern[str]) -> tuple[str | None, float | None]:
    """The first metric whose name ``pattern`` matches, with the pattern's group (the dataset): (None, None) when
    none has a value."""
    for key, value in sorted(metrics.items()):
        found = pattern.match(str(key))
        if found and value is not None and not (isinstance(value, float) and math.isnan(value)):
            return found.group(1), float(value)
    return None, None


def _int_or_text(value: str | None) -> int | str | None:
    """A tag that holds a number (the seed) as a number."""
    return int(value) if value is not None and value.lstrip("-").isdigit() else value


def _cell(column: str, value: object) -> str:
    """A table cell: the start as month-day hour:minute (CSV and JSON keep the ISO time)."""
    if column == "started" and isinstance(value, str):
        return value[5:16].replace("T", " ")
    return fmt(value)


def runs(
    runs_dir: RunsOpt = None,
    experiment: Annotated[str, typer.Option("--experiment", "-e", help="MLflow experiment.")] = "aepo",
    limit: Annotated[int, typer.Option("--limit", "-n", help="Newest N runs.")] = 30,
    tracking_uri: TrackingOpt = None,
    output: FormatOpt = OutputFormat.table,
) -> None:
    """Table of MLflow runs: start, name, id, kind, status, algorithm, mode, seed, final Pass@1 and its dataset,
    reward, and what each training run spent (generated tokens, tool calls, CPU seconds).

    \b
    Examples:
      aepo runs -n 5
      aepo runs --format csv > runs.csv
    """
    rdir = resolve_runs_dir(runs_dir)
    uri = reading_tracking_uri(rdir, tracking_uri)
    assert uri is not None
    from infra.run.reading import newest_runs

    check_experiment(uri, experiment)
    found = newest_runs(uri, experiment, limit)
    pass1 = re.compile(r"^eval/(.+)/pass_at_1$")
    records = []
    for run in found:
        kind = run.tags.get("kind") or "train"
        if run.tags.get("sweep_name") and kind == "train":
            kind = f"train ({run.tags['sweep_name']})"
        dataset, final_pass1 = _first_metric(run.metrics, pass1)
        records.append({
            "started": run.start_time.isoformat(timespec="seconds") if run.start_time is not None else None,
            "name": run.run_name, "run id": run.run_id, "kind": kind, "status": run.status,
            "algorithm": run.tags.get("algorithm"), "mode": run.tags.get("mode"),
            "seed": _int_or_text(run.tags.get("seed")), "dataset": dataset, "pass@1": final_pass1,
            "reward": run.metrics.get("rollout/reward_mean"),
            # what the run spent in all (aepo_core.cost): compare runs at their budget, not only their steps
            "tokens": as_count(run.metrics.get("cost/total_generated_tokens")),
            "tool calls": as_count(run.metrics.get("cost/total_tool_calls")),
            "CPU s": run.metrics.get("cost/total_cpu_s"),
        })
    print_records(f"MLflow runs in {experiment!r} at {uri}", records, output, cell=_cell,
                  right=("seed", "pass@1", "reward", "tokens", "tool calls", "CPU s"), fold=("name", "kind"))
    if not found and output is OutputFormat.table:
        err().print("no runs yet")
