"""The sweep flow: a grid of training runs over config overrides, compared in one table.

Each (cell, seed) is a child ``train`` flow run and a nested MLflow run under one parent run named after the
sweep; the sweep ends with a comparison table built from ``mlflow.search_runs`` over the children (a markdown
Prefect artifact, CSVs and a PNG, logged to the parent run and written to ``<runs_dir>/sweeps/<name>/``).

Where the children run:

- ``deployment=None`` (the default, no server needed): here, one after another, as subflows of this process.
- ``deployment="aepo-train/train"`` (CLI ``--deployment``): each child is submitted as a flow run of that
  deployment (``prefect.deployments.run_deployment``, named like its MLflow run, linked as a subflow), at most
  ``max_parallel`` in flight at once (on top of any concurrency limit of the work pool), and the sweep polls
  their states every 2 s. Workers of the deployment's pool run them, on this machine or others: the child's
  parameters carry its whole resolved config, with the parent's MLflow tracking URI written in, so every child
  logs under the one parent run; for workers on other machines that URI must be an ``mlflow server``
  (``tracking.tracking_uri: http://…``). A child that ends in any state but Completed (Failed, Crashed,
  Cancelled, or still unfinished ``child_timeout_s`` after its submission: then it is cancelled) is reported by
  name and state; the others go on, the comparison of the finished ones is written, and the sweep ends failed.
  A worker lost with its flow run (machine gone, both processes killed) leaves the flow run Running for ever:
  nothing is left to report it, and Prefect's server does not notice. The sweep does: a Running child whose
  flow-run heartbeats (``prefect.flow-run.heartbeat`` events, every ``PREFECT_FLOWS_HEARTBEAT_FREQUENCY`` s,
  180 by default) stop for ``child_lost_after_s`` is marked Crashed and reported as lost, and its MLflow run,
  left RUNNING, is ended KILLED. (A worker killed alone is different: the flow run lives in a session of its
  own, notices that its worker is gone and reports itself Crashed within seconds.)
  README "Scaling out" has the commands for a process work pool with N workers.
- ``shard="i/N"`` (CLI ``--shard i/N``) selects every N-th (cell, seed) from the i-th, under its own parent run
  ``<name>-shard<i>of<N>``: it was the way to spread a sweep before the work pool (``bench/compare_algorithms.py
  --workers N`` still uses it and merges the shards' stores) and now only narrows the run list; it combines with
  either way of running.

Re-running a sweep (same name) skips the children that already FINISHED: a child is found by its
``sweep_name`` tag (set when the child's run is created) and run name, anywhere in the experiment, and is reused
only if its ``config_hash`` tag equals the hash of the config it would run with now. A reused child is
re-parented: its ``mlflow.parentRunId`` tag is moved to the new parent run (the old parent is kept in the
``sweep_previous_parent_run_id`` tag), so the comparison, which selects the children by parent, and the MLflow
UI both show the whole sweep under the newest parent; the earlier parent's logged comparison is unchanged.

A scheduled sweep is a new sweep each time it fires (flow parameter ``dated``, which the scheduled deployments pass):
its parent run is named ``<name>-<UTC date-time of the firing>`` (tag ``sweep_date``), its comparison goes to
``<runs_dir>/sweeps/<name>/<date-time>/``, and every cell runs again, under it alone: nothing of an earlier firing is
reused, and its cells are never reused (re-parented) by a later sweep. Skipping finished cells by config hash alone
made the weekly schedule re-run nothing from its second week on. The alternative, skipping only cells whose config
and code version (commit, dirty diff) match, was not taken: it would make every release re-run every finished cell
of a sweep continued by hand (what ``ran_with`` keeps from happening across a release that adds a config field),
and a scheduled sweep of unchanged code would still measure nothing new. ``--resume`` continues the newest firing
(finished cells of that firing skipped).

The numerics are decided once per sweep (issue 49 §8): the parent run records the machine's facts (``system.*`` tags
and ``numerics.auto``, read back on ``--resume``) and every cell computes in them (the train flow's ``machine``
parameter, :func:`infra.numerics.numerics_for`): two arms never differ in numerics because of the load when each
started. A cell on a worker of another machine kind says so in one line, and refuses where the sweep chose bf16 and
bf16 is the slow path there.

``--resume`` (flow parameter ``resume``) continues a stopped sweep instead — Ctrl-C, SIGKILL, a lost worker, the
end of a working session: in the same parent run (the newest of the sweep's name), skipping the finished children
as above, and resuming each child that started and did not finish (same config) from its last checkpoint in its own
MLflow run (the train flow's resume). The final table equals an uninterrupted sweep's (``tests/flows/test_sweep.py``).
A sweep may also be continued a share at a time (``cells``, or ``bench.compare_algorithms --seeds N`` seed by seed):
the comparison logged to the parent covers every finished child of the sweep under it, not only the share that
invocation ran.

Sweep file (YAML; relative paths are relative to the sweep file)::

    name: algorithms              # parent MLflow run name; output directory <runs_dir>/sweeps/<name>/
    base: ../tiny.yaml            # the experiment config every cell starts from (default: built-in defaults)
    overrides:                    # dotted overrides applied to every cell (a mapping or a list of "k=v")
      train.steps: 4
    seeds: [0, 1, 2]              # every cell runs once per seed (sets `seed`); default: the base config's seed
    grid:                         # axes → levels → overrides; the cells are the cross product of the levels,
      algorithm:                  # named by joining the level names with "-" (one axis: the level name)
        aepo: {rollout.mode: aepo, algorithm.loss: aepo}
        grpo: {rollout.mode: independent, algorithm.loss: ppo_clip, algorithm.entropy_advantage: false}
    cells:                        # extra cells after the grid: name → overrides (e.g. ablations)
      aepo-no-premonitor: {rollout.mode: aepo, algorithm.loss: aepo, rollout.premonitor: false}
    runs_dir: runs                # optional; the flow's runs_dir parameter (or the CLI's --runs-dir) wins

A child run is named ``<name>-<cell>-s<seed>`` and tagged ``sweep_name``, ``sweep_cell`` (its MLflow params hold
the whole resolved config).  Every cell's config is validated before the first one runs, so a typo in the last
ablation fails the sweep at once with the cell and key in the message.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from uuid import UUID

import pandas as pd
from matplotlib.figure import Figure
from mlflow.exceptions import MlflowException
from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run

from aepo_core.config import ExperimentConfig
from aepo_core.config_keys import ConfigError
from aepo_core.cost import COST_PREFIX, TOTAL
from flows.common import artifact_key, flow_runs_dir, run_origin
from flows.sweep_spec import SweepRun, SweepSpec, load_sweep, parse_shard, shard_runs
from flows.train import train
from infra.numerics import DeviceFacts, auto_dtype, facts_for
from infra.plots import save_png
from infra.run.lock import Claims
from infra.run.resume import NothingToResumeError
from infra.tracking.run import Tracker
from tasks.progress import Progress, report

log = logging.getLogger(__name__)

TAG_SWEEP = "sweep_name"
TAG_CELL = "sweep_cell"
TAG_PREVIOUS_PARENT = "sweep_previous_parent_run_id"  # set on a child re-parented by a re-run of its sweep
TAG_DATE = "sweep_date"  # a dated sweep's (a scheduled firing's) UTC date-time, on its parent and its children
TAG_NUMERICS = "numerics.auto"  # on the parent: what `auto` chose for every cell (with the machine's system.* tags)
POLL_S = 2.0  # seconds between two reads of the children's states in a fan-out (one API call per child in flight)
HEARTBEAT_CHECK_S = 5.0  # seconds between two reads of a running child's newest heartbeat event
LOST_HEARTBEATS = 3  # default child_lost_after_s: this many heartbeat intervals (as Prefect's zombie automation)
HEARTBEAT_EVENT = "prefect.flow-run.heartbeat"
BUDGET_COLUMNS = ("generated_tokens", "tool_calls", "cpu_s")
"""What each run spent in all (``cost/total_<name>``, :mod:`aepo_core.cost`): arms are compared at their spend."""
RUN_COLUMNS = ["cell", "seed", "run_name", "run_id", "status", "dataset", "pass@1", "pass@1_ci_low",
               "pass@1_ci_high", "k", "pass@k", "tool_calls_per_question", "answered_rate", "reward_mean",
               "branch_samples", "max_branches_per_path", *BUDGET_COLUMNS]
_PASS1_RE = re.compile(r"^metrics\.eval/(?P<ds>.+)/pass_at_1$")


# ---------------------------------------------------------------------------------------------- comparison


def _metric(row: pd.Series, key: str) -> float:
    value = row.get(f"metrics.{key}")
    return float(value) if value is not None and not pd.isna(value) else math.nan


def comparison_frame(children: pd.DataFrame, spec: SweepSpec, whole_sweep: bool = False) -> pd.DataFrame:
    """One row per (child run, evaluation dataset) from a ``search_runs`` frame, in the sweep's order (its cells',
    then by seed).

    ``whole_sweep``: also the children outside ``spec``'s runs that carry its sweep name, their cell and seed read
    from their tags: a sweep continued a few cells or seeds at a time under one parent run (``cells``, a bench's
    ``--seeds N``) is compared whole, not as its last invocation's share."""
    by_name = {r.run_name: (r.cell, r.seed, r.config.eval.pass_k) for r in spec.runs}
    datasets = sorted({m.group("ds") for c in children.columns if (m := _PASS1_RE.match(c))})
    rows = []
    for _, child in children.iterrows():
        run = by_name.get(child["run_name"]) or (_tagged_run(child, spec) if whole_sweep else None)
        if run is None:
            continue
        cell, seed, pass_k = run
        k = int(child.get("params.eval.pass_k") or pass_k)
        common = {"cell": cell, "seed": seed, "run_name": child["run_name"], "run_id": child["run_id"],
                  "status": child["status"], "k": k, "reward_mean": _metric(child, "rollout/reward_mean"),
                  "branch_samples": _metric(child, "rollout/branch_samples"),
                  "max_branches_per_path": _metric(child, "rollout/max_branches_per_path"),
                  **{name: _metric(child, f"{COST_PREFIX}{TOTAL}{name}") for name in BUDGET_COLUMNS}}
        for ds in datasets or [""]:
            rows.append({**common, "dataset": ds, "pass@1": _metric(child, f"eval/{ds}/pass_at_1"),
                         "pass@1_ci_low": _metric(child, f"eval/{ds}/pass_at_1_ci_low"),
                         "pass@1_ci_high": _metric(child, f"eval/{ds}/pass_at_1_ci_high"),
                         "pass@k": _metric(child, f"eval/{ds}/pass_at_{k}"),
                         "tool_calls_per_question": _metric(child, f"eval/{ds}/tool_calls_per_question"),
                         "answered_rate": _metric(child, f"eval/{ds}/answered_rate")})
    frame = pd.DataFrame(rows, columns=RUN_COLUMNS)
    # Cells this spec does not name were run by earlier invocations: they come first, in the order they started.
    outside, first = set(frame["cell"]) - set(spec.cells), {}
    for _, child in children.iterrows():
        if (cell := child.get(f"tags.{TAG_CELL}")) in outside:
            started = str(child.get("start_time"))
            first[cell] = min(first.get(cell, started), started)
    rank = {c: i for i, c in enumerate([*sorted(first, key=lambda c: (first[c], c)), *spec.cells])}
    return frame.sort_values(["cell", "seed", "dataset"], key=lambda s: s.map(rank) if s.name == "cell" else s,
                             kind="stable").reset_index(drop=True)


def _tagged_run(child: pd.Series, spec: SweepSpec) -> tuple[str, int, int] | None:
    """(cell, seed, default Pass@k) of a child of ``spec``'s sweep from its tags; None for any other run."""
    cell, seed = child.get(f"tags.{TAG_CELL}"), child.get("tags.seed")
    if child.get(f"tags.{TAG_SWEEP}") != spec.name or not isinstance(cell, str) or not isinstance(seed, str):
        return None
    return cell, int(seed), spec.base.eval.pass_k


def summary_frame(runs: pd.DataFrame) -> pd.DataFrame:
    """Per (cell, dataset): runs, mean / std (over seeds) / min / max Pass@1, mean Pass@k, reward, tool calls, and
    the mean spend of a run (generated tokens, tool calls, CPU seconds)."""
    if runs.empty:
        return pd.DataFrame(columns=["cell", "dataset", "runs", "pass@1_mean", "pass@1_std", "pass@1_min",
                                     "pass@1_max", "pass@k_mean", "reward_mean", "tool_calls_per_question",
                                     *BUDGET_COLUMNS])
    g = runs.groupby(["cell", "dataset"], sort=False)
    out = g.agg(runs=("run_name", "count"), **{"pass@1_mean": ("pass@1", "mean"), "pass@1_std": ("pass@1", "std"),
                                               "pass@1_min": ("pass@1", "min"), "pass@1_max": ("pass@1", "max"),
                                               "pass@k_mean": ("pass@k", "mean")},
                reward_mean=("reward_mean", "mean"), tool_calls_per_question=("tool_calls_per_question", "mean"),
                **{name: (name, "mean") for name in BUDGET_COLUMNS})
    out["pass@1_std"] = out["pass@1_std"].fillna(0.0)
    return out.reset_index()


def _fmt(x: Any, digits: int = 3) -> str:
    if isinstance(x, float):
        return "–" if math.isnan(x) else f"{x:.{digits}f}"
    return str(x)


def markdown_table(frame: pd.DataFrame, columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for _, row in frame.iterrows():
        lines.append("| " + " | ".join(_fmt(row[c]) for c in columns) + " |")
    return "\n".join(lines)


def _children(runs: pd.DataFrame) -> str:
    return (f"{runs['run_name'].nunique()} child runs ({runs['cell'].nunique()} cells × seeds "
            f"{sorted({int(s) for s in runs['seed']})})")


def comparison_markdown(spec: SweepSpec, parent_run_id: str, tracking_uri: str, runs: pd.DataFrame,
                        summary: pd.DataFrame) -> str:
    return "\n".join([
        f"# Sweep `{spec.name}`",
        "",
        f"- parent MLflow run `{parent_run_id}` at `{tracking_uri}`; {_children(runs)}"
        + ("" if set(runs["run_name"]) <= {r.run_name for r in spec.runs} else
           f" (this invocation's share: {len(spec.runs)} runs, {len(spec.cells)} cells × seeds {spec.seeds})")
        + f"; base config `{spec.base_source}`",
        "",
        "## Per cell (mean over seeds)",
        "",
        markdown_table(summary, list(summary.columns)),
        "",
        "## Per run",
        "",
        markdown_table(runs, ["cell", "seed", "status", "dataset", "pass@1", "pass@1_ci_low", "pass@1_ci_high",
                              "pass@k", "tool_calls_per_question", "reward_mean", *BUDGET_COLUMNS, "run_id"]),
    ])


def comparison_figure(runs: pd.DataFrame, title: str) -> Figure:
    """Per dataset, two panels: mean Pass@1 per cell (bars, ± std over seeds) with each seed's value as a dot; and
    each run's Pass@1 against the generated tokens it spent (a cell's colour in both)."""
    datasets = list(dict.fromkeys(runs["dataset"])) or [""]
    fig = Figure(figsize=(max(5.0, 1.1 * runs["cell"].nunique() + 2) + 5.0, 3.2 * len(datasets)))
    colours = {cell: f"C{i % 10}" for i, cell in enumerate(dict.fromkeys(runs["cell"]))}
    for i, ds in enumerate(datasets):
        _pass1_vs_tokens(fig.add_subplot(len(datasets), 2, 2 * i + 2), runs[runs["dataset"] == ds], colours)
        ax = fig.add_subplot(len(datasets), 2, 2 * i + 1)
        sub = runs[runs["dataset"] == ds]
        cells = list(dict.fromkeys(sub["cell"]))
        stats = sub.groupby("cell", sort=False)["pass@1"].agg(["mean", "std"]).reindex(cells).fillna(0.0)
        ax.bar(range(len(cells)), stats["mean"], yerr=stats["std"], capsize=4, color="#9ecae1", edgecolor="#3182bd")
        for j, cell in enumerate(cells):
            vals = sub[sub["cell"] == cell]["pass@1"].dropna()
            ax.scatter([j] * len(vals), vals, color="#08306b", s=14, zorder=3)
        ax.set_xticks(range(len(cells)), cells, rotation=20, ha="right")
        ax.set_ylabel("pass@1")
        ax.set_ylim(0, max(1e-3, float(sub["pass@1"].max(skipna=True) or 0)) * 1.15 + 0.01)
        ax.set_title(f"{title} — {ds}" if ds else title)
    fig.tight_layout()
    return fig


def _pass1_vs_tokens(ax: Any, runs: pd.DataFrame, colours: Mapping[str, str]) -> None:
    """Each run's final Pass@1 against its cumulative generated tokens, one colour per cell."""
    for cell, sub in runs.groupby("cell", sort=False):
        ax.scatter(sub["generated_tokens"], sub["pass@1"], color=colours[str(cell)], s=18, label=str(cell))
    ax.set_xlabel("generated tokens (the run's total)")
    ax.set_ylabel("pass@1")
    ax.set_title("pass@1 vs tokens spent")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="best")


# ---------------------------------------------------------------------------------------------- the flow


@dataclass(frozen=True)
class SweepResult:
    """A finished sweep: its parent MLflow run, the comparison files, and the tables as records."""

    name: str
    parent_run_id: str
    runs_dir: str
    out_dir: str
    tracking_uri: str
    markdown_artifact_id: str
    files: dict[str, str]
    runs: list[dict[str, Any]]
    summary: list[dict[str, Any]]
    started: list[str] = field(default_factory=list)
    """Run names of the children this invocation ran (or submitted)."""
    reused: list[str] = field(default_factory=list)
    """Run names of the children that had already FINISHED in MLflow and were not run again."""
    date: str | None = None
    """A dated sweep's (a scheduled firing's) UTC date-time: its parent run is ``<name>-<date>``."""


def sweep_spec(sweep_config: str | dict[str, Any], shard: str | None, overrides: Sequence[str] | None = None,
               cells: Sequence[str] | None = None) -> SweepSpec:
    """The sweep a flow run runs: the file's (or mapping's) with ``overrides`` on every cell, only ``cells`` (None:
    all), cut to one shard ``"i/N"`` (named ``…-shardIofN``)."""
    spec = load_sweep(sweep_config, overrides or (), cells)
    if shard is None:
        return spec
    i, n = parse_shard(shard)
    return replace(spec, name=f"{spec.name}-shard{i}of{n}", runs=shard_runs(spec.runs, shard))


def sweep_flow_run_name() -> str:
    """The name of an ``aepo-sweep`` flow run: its MLflow parent run's, the sweep's name (``aepo-sweep`` when the
    sweep file does not load: the flow itself then fails with the error)."""
    params = flow_run.parameters
    try:
        return sweep_spec(params["sweep_config"], params.get("shard"), params.get("overrides"),
                          params.get("cells")).name
    except (ConfigError, OSError):
        return "aepo-sweep"


@flow(name="aepo-sweep", flow_run_name=sweep_flow_run_name, log_prints=True)
def sweep(sweep_config: str | dict[str, Any], runs_dir: str | None = None, shard: str | None = None,
          deployment: str | None = None, max_parallel: int = 4,
          child_timeout_s: float | None = None, child_lost_after_s: float | None = None,
          overrides: list[str] | None = None, cells: list[str] | None = None, resume: bool = False,
          dated: bool = False) -> SweepResult:
    """Run every (cell, seed) of the sweep — or of one shard ``"i/N"`` — as a nested training run, then compare
    them; returns the tables' paths. ``overrides`` (``"key=value"``) apply to every cell after its own;
    ``cells`` keeps only those cells.

    ``deployment`` (e.g. ``"aepo-train/train"``) submits each child as a flow run of that deployment, at most
    ``max_parallel`` in flight, and waits for them (a child still unfinished ``child_timeout_s`` after its
    submission is cancelled and reported failed; None: wait for ever). A Running child that sent heartbeats and
    then none for ``child_lost_after_s`` (None: 3 × this process's ``PREFECT_FLOWS_HEARTBEAT_FREQUENCY``, which
    the workers should share) is lost with its worker: marked Crashed and reported failed. None runs them here,
    one after another.
    Children that already FINISHED in MLflow with the same run name, sweep name and config are not run again.

    ``resume`` continues a stopped sweep (Ctrl-C, SIGKILL, a lost worker, the end of a working session) in its own
    parent MLflow run, the newest of this sweep's name: finished children are skipped as above, and a child that
    started and did not finish (same config) resumes from its last checkpoint in its own MLflow run.

    ``dated`` (what a schedule passes) makes this call a new sweep: a parent run of its own named after the firing's
    date-time, every cell run again (see the module docstring: why, and why not a code version in the hash)."""
    logger = get_run_logger()
    spec = sweep_spec(sweep_config, shard, overrides, cells)
    if max_parallel < 1:
        raise ConfigError(f"sweep max_parallel must be >= 1; got {max_parallel}")
    if child_timeout_s is not None and child_timeout_s <= 0:
        raise ConfigError(f"sweep child_timeout_s must be > 0 (or None); got {child_timeout_s}")
    if child_lost_after_s is not None and child_lost_after_s <= 0:
        raise ConfigError(f"sweep child_lost_after_s must be > 0 (or None); got {child_lost_after_s}")
    runs = flow_runs_dir(runs_dir, spec.runs_dir or spec.base.storage.runs_dir).resolve()
    runs.mkdir(parents=True, exist_ok=True)
    tracker = Tracker.from_config(spec.base, runs, system_metrics=False)
    configs = {r.run_name: child_config(r.config, tracker) for r in spec.runs}
    if deployment is not None:
        check_deployment(deployment, tracker.tracking_uri, logger)
    # One live process per sweep (infra.run.lock): a second invocation of this sweep fails here, before it
    # touches the parent run or starts a cell.
    with Claims(runs, sweep=spec.name):
        previous = sweep_to_resume(tracker, spec) if resume else None
        recorded = tracker.client.get_run(previous).data.tags if previous else {}
        date = recorded.get(TAG_DATE) if previous else (_firing_date() if dated else None)
        facts = DeviceFacts.from_tags(recorded, recorded.get("system.numerics_source", "")) or facts_for(spec.base)
        parent = tracker.start(spec.base, run_name=f"{spec.name}-{date}" if date else spec.name, group=True,
                               resume_run_id=previous, origin=run_origin(
                                   "flows/sweep.py:sweep", f"AEPO sweep {spec.name}: {len(spec.cells)} cells × "
                                   f"{len(spec.seeds)} seeds, one nested training run each."),
                               tags={"kind": "sweep", TAG_SWEEP: spec.name, "sweep_cells": len(spec.cells),
                                     "sweep_seeds": ",".join(map(str, spec.seeds)),
                                     "sweep_deployment": deployment or "in-process", **facts.tags(),
                                     TAG_NUMERICS: auto_dtype(facts), **({TAG_DATE: date} if date else {})})
        logger.info("sweep %s: numerics for every cell decided on %s (auto: %s)", spec.name, facts.describe(),
                    auto_dtype(facts))
        launch = _Launch(parent, date, replace(facts, source=f"sweep {parent}").as_dict())
        out_dir = runs / "sweeps" / spec.name / date if date else runs / "sweeps" / spec.name
        with tracker:
            tracker.log_dict(spec.as_dict(), "sweep.json")
            done = finished_children(tracker, spec, configs, within=parent if date else None)
            for name, old in done.items():  # re-parent: the new parent run shows the whole sweep (see the docstring)
                if old.parent_run_id != parent:  # (a resumed sweep's own children stay as they are)
                    tracker.client.set_tag(old.run_id, "mlflow.parentRunId", parent)
                    tracker.client.set_tag(old.run_id, TAG_PREVIOUS_PARENT, old.parent_run_id)
                logger.info("sweep run %s already FINISHED in MLflow (run %s): not run again", name, old.run_id)
            todo = [r for r in spec.runs if r.run_name not in done]
            started = started_children(tracker, spec, configs, parent) if resume else set()
            for name in sorted(started & {r.run_name for r in todo}):
                logger.info("sweep run %s started and did not finish: it resumes from its last checkpoint", name)
            if deployment is None:
                failed = _run_children(spec, todo, configs, runs, launch, started, logger)
            else:
                watch = _Watch(child_timeout_s, _lost_after(child_lost_after_s))
                failed = _fan_out(spec, todo, configs, runs, launch, deployment, max_parallel, watch, started, logger)
            _end_abandoned(tracker, parent, failed, logger)
            per_run, summary, markdown, files = _compare(spec, tracker, parent, out_dir)
            artifact_id = create_markdown_artifact(markdown=markdown, key=artifact_key("sweep", spec.name),
                                                   description=f"comparison of sweep {spec.name}")
            if failed:  # the parent run ends FAILED; the comparison of the runs that finished is written
                raise RuntimeError(f"sweep {spec.name}: {len(failed)} of {len(spec.runs)} runs failed: "
                                   f"{', '.join(f'{f.run_name} ({f.state})' for f in failed)} "
                                   f"(comparison written to {out_dir})")
        return SweepResult(spec.name, parent, str(runs), str(out_dir), tracker.tracking_uri, str(artifact_id),
                           {k: str(v) for k, v in files.items()}, per_run.to_dict(orient="records"),
                           summary.to_dict(orient="records"), [r.run_name for r in todo], sorted(done), date)


def _firing_date() -> str:
    """The UTC date-time a dated sweep is named after: its flow run's scheduled start (a schedule's firing time)."""
    start = flow_run.scheduled_start_time or datetime.now(timezone.utc)
    return start.astimezone(timezone.utc).strftime("%Y%m%dT%H%M%SZ")


@dataclass(frozen=True)
class _Launch:
    """What every cell of one sweep invocation starts with besides its config: the parent run, the firing's date
    (a dated sweep) and the machine facts the sweep's numerics were decided from."""

    parent: str
    date: str | None
    machine: dict[str, Any]

    def tags(self, spec: SweepSpec, run: SweepRun) -> dict[str, str]:
        return {TAG_SWEEP: spec.name, TAG_CELL: run.cell, **({TAG_DATE: self.date} if self.date else {})}


def child_config(cfg: ExperimentConfig, tracker: Tracker) -> ExperimentConfig:
    """The config a child runs with: its cell's config with the parent's tracking URI and artifact location
    written in, so a child started anywhere (a worker process, another machine) logs to the parent's MLflow."""
    tracking = cfg.tracking.model_copy(update={"tracking_uri": tracker.tracking_uri,
                                               "artifact_location": tracker.artifact_location})
    return cfg.model_copy(update={"tracking": tracking})


@dataclass(frozen=True)
class FinishedChild:
    """A child that already FINISHED in MLflow in an earlier invocation of the sweep."""

    run_id: str
    parent_run_id: str


def finished_children(tracker: Tracker, spec: SweepSpec, configs: Mapping[str, ExperimentConfig],
                      within: str | None = None) -> dict[str, FinishedChild]:
    """Run name → the newest FINISHED MLflow run of the experiment with that name, this sweep's ``sweep_name``
    tag and the config hash the child would run with now (a changed sweep file re-runs the cells it changes).

    ``within``: only the children of that parent run (a dated sweep reuses nothing of another firing). Without it,
    a dated sweep's children are none of another invocation's (they stay under their firing's parent)."""
    scope = f" AND tags.mlflow.parentRunId = '{within}'" if within else ""
    found = tracker.search_runs(filter_string=f"tags.{TAG_SWEEP} = '{spec.name}' AND attributes.status = 'FINISHED'"
                                              f"{scope}")
    out: dict[str, FinishedChild] = {}
    for _, row in found.iterrows():  # newest first (search_runs orders by start time, descending)
        name = row["run_name"]
        cfg = configs.get(name)
        if cfg is None or name in out or (within is None and _is_dated(row)):
            continue
        if not ran_with(tracker, row, cfg):
            log.info("sweep run %s (MLflow %s) FINISHED with another config: it runs again", name, row["run_id"])
            continue
        out[name] = FinishedChild(row["run_id"], str(row.get("tags.mlflow.parentRunId") or ""))
    return out


def _is_dated(row: Mapping[str, Any]) -> bool:
    """Whether a ``search_runs`` row is a dated sweep's run (its ``sweep_date`` tag set)."""
    value = row.get(f"tags.{TAG_DATE}")
    return isinstance(value, str) and bool(value)


def sweep_to_resume(tracker: Tracker, spec: SweepSpec) -> str:
    """The parent run ``resume`` continues: the newest sweep run of this name (a shard's name for a shard), dated
    (``<name>-<date>``, a scheduled firing) or not. Raises :class:`NothingToResumeError`: starting a new sweep
    instead would hide a wrong name, runs dir or tracking URI."""
    found = tracker.search_runs(filter_string=f"tags.kind = 'sweep' AND tags.{TAG_SWEEP} = '{spec.name}'")
    if not found.empty:
        dates = found[f"tags.{TAG_DATE}"] if f"tags.{TAG_DATE}" in found else pd.Series("", index=found.index)
        found = found[(found["run_name"] == spec.name) | (found["run_name"] == spec.name + "-" + dates.fillna(""))]
    if found.empty:
        raise NothingToResumeError(f"nothing to resume: no sweep named {spec.name!r} in experiment "
                                   f"{tracker.experiment!r} at {tracker.tracking_uri} (drop --resume to start it)")
    return str(found.iloc[0]["run_id"])  # newest first


def started_children(tracker: Tracker, spec: SweepSpec, configs: Mapping[str, ExperimentConfig], parent: str
                     ) -> set[str]:
    """Run names of ``parent``'s children that started with the config they would run with now and did not finish
    (RUNNING when their process was killed, FAILED, KILLED): they resume from their last checkpoint."""
    found = tracker.search_runs(filter_string=f"tags.mlflow.parentRunId = '{parent}' AND "
                                              "attributes.status != 'FINISHED'")
    return {str(row["run_name"]) for _, row in found.iterrows()
            if row["run_name"] in configs and ran_with(tracker, row, configs[row["run_name"]])}


def ran_with(tracker: Tracker, row: Mapping[str, Any], cfg: ExperimentConfig) -> bool:
    """Whether the MLflow run ``row`` (a ``search_runs`` row) ran with ``cfg``: its ``config_hash`` tag is cfg's, or
    the config it logged hashes to cfg's as today's code resolves it (:meth:`Tracker.logged_config`). The second
    keeps a sweep resumable across a release that adds a config field: the field changes every hash, and a finished
    cell would otherwise run again (a 20-minute demo cell, with its results already in MLflow)."""
    want = cfg.config_hash()
    if row.get("tags.config_hash") == want:
        return True
    try:
        return tracker.logged_config(str(row["run_id"])).config_hash() == want
    except (ConfigError, MlflowException, OSError) as exc:
        log.info("run %s: its logged config cannot be compared (%s)", row["run_id"], exc)
        return False


@dataclass(frozen=True)
class ChildFailure:
    """A child that did not complete: its run name and the final state (a Prefect state name, or why)."""

    run_name: str
    state: str


def _run_children(spec: SweepSpec, todo: Sequence[SweepRun], configs: Mapping[str, ExperimentConfig], runs: Path,
                  launch: _Launch, started: set[str], logger: Any) -> list[ChildFailure]:
    """Every (cell, seed) as a child ``train`` flow run nested under the parent (resumed when ``started``);
    returns the failed runs."""
    failed = []
    for i, run in enumerate(todo):
        report(logger, Progress("cell", done=i, total=len(todo), name=run.run_name),
               "sweep cell %d/%d: %s (%s)", i + 1, len(todo), run.run_name,
               ", ".join(f"{k}={v}" for k, v in run.overrides.items()))
        state = train(config=configs[run.run_name], runs_dir=str(runs), run_name=run.run_name,
                      parent_run_id=launch.parent, tags=launch.tags(spec, run), resume=run.run_name in started,
                      machine=launch.machine, return_state=True)
        if not state.is_completed():
            failed.append(ChildFailure(run.run_name, state.name or state.type.value))
            logger.error("sweep run %s ended %s: %s", run.run_name, state.type.value, state.message)
    return failed


def check_deployment(deployment: str, tracking_uri: str, logger: Any) -> None:
    """The deployment must exist on the Prefect API this flow talks to (a typo fails before any run starts)."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_deployment_by_name(deployment)
        except ObjectNotFound:
            raise ConfigError(f"sweep deployment {deployment!r} not found on the Prefect API at "
                              f"{client.api_url}: register it (`prefect deploy --name train`) or fix the name "
                              "('<flow name>/<deployment name>', e.g. 'aepo-train/train')") from None
    if not tracking_uri.startswith(("http://", "https://")):
        logger.warning("sweep children of %s log to %s: only workers that share this filesystem can write there; "
                       "set tracking.tracking_uri to an `mlflow server` (http://…) for workers on other machines",
                       deployment, tracking_uri)


@dataclass(frozen=True)
class _Watch:
    """When the fan-out gives up on a child: ``timeout_s`` after its submission, or ``lost_after_s`` after its
    last heartbeat (None: never)."""

    timeout_s: float | None
    lost_after_s: float | None


def _lost_after(child_lost_after_s: float | None) -> float | None:
    """``child_lost_after_s``, else 3 heartbeat intervals of this process's Prefect settings (None: heartbeats off)."""
    if child_lost_after_s is not None:
        return child_lost_after_s
    from prefect.settings import get_current_settings

    frequency = get_current_settings().flows.heartbeat_frequency
    return LOST_HEARTBEATS * frequency if frequency else None


@dataclass
class _Child:
    """A child in flight: its run, when it was submitted, and the newest heartbeat the sweep has seen of it."""

    run: SweepRun
    submitted: float
    heartbeat: tuple[UUID, datetime] | None = None  # (event id, occurred)
    seen_at: float = 0.0  # monotonic time that heartbeat was first seen (this machine's clock only)
    interval_s: float = 0.0  # the longest gap seen between two of its heartbeats
    checked_at: float = 0.0

    def silent_for(self, client: Any, flow_run_id: UUID, lost_after_s: float, now: float) -> float | None:
        """How long the child has been silent (no new heartbeat), if that makes it lost; else None.

        Only a child that has sent a heartbeat can be lost (with heartbeats off on its worker only the timeout
        applies), and never before two of its own heartbeat intervals: a worker that beats slower than this
        process's settings assume is not mistaken for a lost one."""
        if now - self.checked_at < HEARTBEAT_CHECK_S:
            return None
        self.checked_at = now
        try:
            event = _newest_heartbeat(client, flow_run_id)
        except Exception as exc:  # no verdict without the events API; the state poll goes on
            log.debug("reading the heartbeats of flow run %s failed: %s", flow_run_id, exc)
            return None
        if event is None:
            return None
        if self.heartbeat is None or event.id != self.heartbeat[0]:
            if self.heartbeat is not None:
                self.interval_s = max(self.interval_s, (event.occurred - self.heartbeat[1]).total_seconds())
            self.heartbeat, self.seen_at = (event.id, event.occurred), now
            return None
        limit = max(lost_after_s, 2 * self.interval_s)
        return limit if now - self.seen_at > limit else None


def _newest_heartbeat(client: Any, flow_run_id: UUID) -> Any:
    """The newest ``prefect.flow-run.heartbeat`` event of a flow run (None: none yet)."""
    from prefect.events.filters import EventFilter, EventNameFilter, EventOrder, EventResourceFilter

    page = client.read_events(EventFilter(event=EventNameFilter(name=[HEARTBEAT_EVENT]),
                                          resource=EventResourceFilter(id=[f"prefect.flow-run.{flow_run_id}"]),
                                          order=EventOrder.DESC), limit=1)
    return page.events[0] if page.events else None


def _fan_out(spec: SweepSpec, todo: Sequence[SweepRun], configs: Mapping[str, ExperimentConfig], runs: Path,
             launch: _Launch, deployment: str, max_parallel: int, watch: _Watch, started: set[str], logger: Any
             ) -> list[ChildFailure]:
    """Every (cell, seed) as a flow run of ``deployment`` (named like its MLflow run), at most ``max_parallel``
    submitted and unfinished at once; polls their states and returns the runs that did not complete (ended in
    another state, timed out, or lost: see :class:`_Watch`). If the sweep itself is stopped (an exception,
    Ctrl-C, SIGTERM), the children in flight are cancelled."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.states import Cancelling, Crashed

    pending = list(todo)
    parent = launch.parent
    invocation = flow_run.id
    in_flight: dict[UUID, _Child] = {}
    failed: list[ChildFailure] = []
    finished = 0
    with get_client(sync_client=True) as client:
        try:
            while pending or in_flight:
                while pending and len(in_flight) < max_parallel:
                    run = pending.pop(0)
                    resume = run.run_name in started
                    submitted = run_deployment(
                        deployment, timeout=0, flow_run_name=run.run_name, tags=["aepo-sweep", spec.name],
                        # one child flow run per child and sweep flow run: a retry of this flow run submits
                        # nothing twice, a resumed sweep (another flow run) submits afresh
                        idempotency_key=f"{parent}/{run.run_name}/{invocation}",
                        parameters={"config": configs[run.run_name].to_dict(), "runs_dir": str(runs),
                                    "run_name": run.run_name, "parent_run_id": parent, "overrides": [],
                                    "resume": resume, "tags": launch.tags(spec, run),
                                    "machine": launch.machine})
                    in_flight[submitted.id] = _Child(run, time.monotonic())
                    report(logger, Progress("cell", done=finished, total=len(todo), name=run.run_name),
                           "sweep run %s submitted to %s as flow run %s (%d in flight)", run.run_name, deployment,
                           submitted.id, len(in_flight))
                time.sleep(POLL_S)
                for flow_run_id_, child in list(in_flight.items()):
                    run, now = child.run, time.monotonic()
                    state = client.read_flow_run(flow_run_id_).state
                    silent = (child.silent_for(client, flow_run_id_, watch.lost_after_s, now)
                              if watch.lost_after_s is not None and state is not None and state.is_running()
                              else None)
                    if state is not None and state.is_final():
                        del in_flight[flow_run_id_]
                        finished += 1
                        if not state.is_completed():
                            failed.append(ChildFailure(run.run_name, state.name or state.type.value))
                            logger.error("sweep run %s (flow run %s) ended %s: %s", run.run_name, flow_run_id_,
                                         state.name, state.message)
                        else:
                            report(logger, Progress("cell", done=finished, total=len(todo), name=run.run_name),
                                   "sweep run %s completed (%d of %d ended)", run.run_name, finished, len(todo))
                    elif silent is not None:
                        del in_flight[flow_run_id_]
                        finished += 1
                        failed.append(ChildFailure(run.run_name, f"lost: no heartbeat for over {silent:g} s"))
                        logger.error("sweep run %s (flow run %s) sent no heartbeat for over %g s: its worker is "
                                     "gone; marked Crashed", run.run_name, flow_run_id_, silent)
                        client.set_flow_run_state(flow_run_id_, Crashed(
                            message=f"aepo sweep: no heartbeat for over {silent:g} s (worker lost)"), force=True)
                    elif watch.timeout_s is not None and now - child.submitted > watch.timeout_s:
                        del in_flight[flow_run_id_]
                        finished += 1
                        where = state.name if state is not None else "no state"
                        failed.append(ChildFailure(run.run_name, f"timed out after {watch.timeout_s:g} s in {where}"))
                        logger.error("sweep run %s (flow run %s) still %s after %g s: cancelled", run.run_name,
                                     flow_run_id_, where, watch.timeout_s)
                        client.set_flow_run_state(flow_run_id_, Cancelling(), force=True)
        except BaseException:
            for flow_run_id_, child in in_flight.items():
                logger.warning("sweep stopped: cancelling %s (flow run %s)", child.run.run_name, flow_run_id_)
                client.set_flow_run_state(flow_run_id_, Cancelling(), force=True)
            raise
    return failed


def _end_abandoned(tracker: Tracker, parent: str, failed: Sequence[ChildFailure], logger: Any) -> None:
    """The MLflow run of a failed child that is still RUNNING belongs to a process that is gone (lost with its
    worker) or being stopped (cancelled after a timeout): end it KILLED, so that it does not stay RUNNING for
    ever and the comparison shows what became of it."""
    names = {f.run_name for f in failed}
    if not names:
        return
    running = tracker.search_runs(filter_string=f"tags.mlflow.parentRunId = '{parent}' AND "
                                                "attributes.status = 'RUNNING'")
    for _, child in running.iterrows():
        if child["run_name"] in names:
            tracker.client.set_terminated(child["run_id"], status="KILLED")
            logger.warning("sweep run %s: its MLflow run %s was still RUNNING: ended KILLED", child["run_name"],
                           child["run_id"])


def _compare(spec: SweepSpec, tracker: Tracker, parent: str, out_dir: Path
             ) -> tuple[pd.DataFrame, pd.DataFrame, str, dict[str, Path]]:
    """Tag the children with their cell, build the per-run and per-cell tables from MLflow over every child of the
    sweep under ``parent`` (also those an earlier invocation ran: the parent shows the sweep as it stands), write
    them (CSV, markdown, PNG) to ``out_dir`` and log them to the parent run."""
    children = tracker.search_runs(filter_string=f"tags.mlflow.parentRunId = '{parent}'")
    cells = {r.run_name: r.cell for r in spec.runs}
    for _, child in children.iterrows():
        cell = cells.get(child["run_name"])
        if cell is not None:
            tracker.client.set_tag(child["run_id"], TAG_CELL, cell)
            tracker.client.set_tag(child["run_id"], TAG_SWEEP, spec.name)
    per_run = comparison_frame(children, spec, whole_sweep=True)
    summary = summary_frame(per_run)
    markdown = comparison_markdown(spec, parent, tracker.tracking_uri, per_run, summary)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {"runs_csv": out_dir / "comparison.csv", "summary_csv": out_dir / "summary.csv",
             "markdown": out_dir / "comparison.md", "plot": out_dir / "comparison.png"}
    per_run.to_csv(files["runs_csv"], index=False)
    summary.to_csv(files["summary_csv"], index=False)
    files["markdown"].write_text(markdown + "\n", encoding="utf-8")
    save_png(comparison_figure(per_run, spec.name), files["plot"])
    for path in files.values():
        tracker.log_artifact(path, "comparison")
    tracker.log_metrics({f"sweep/{row['cell']}/{row['dataset']}/pass@1_mean": row["pass@1_mean"]
                         for _, row in summary.iterrows()}, 0)
    return per_run, summary, markdown, files
