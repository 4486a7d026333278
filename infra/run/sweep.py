"""The sweep's bookkeeping in MLflow (:mod:`flows.sweep` orchestrates it): the parent run and what every cell starts
with, the children already finished (reused) or started (resumed), the parent a ``--resume`` continues, and the
comparison of the children (per-run and per-cell tables, markdown, CSVs and a PNG) logged to the parent.

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
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Self

import pandas as pd
from mlflow.exceptions import MlflowException

from aepo_core.config import ExperimentConfig
from aepo_core.config_keys import ConfigError
from aepo_core.cost import COST_PREFIX, TOTAL
from infra.numerics import DeviceFacts, auto_dtype, facts_for
from infra.plots import comparison_figure, save_png
from infra.run.resume import NothingToResumeError
from infra.run.sweep_spec import SweepRun, SweepSpec
from infra.tracking.client import RunOrigin, resolve_tracking
from infra.tracking.run import Tracker

log = logging.getLogger(__name__)

TAG_SWEEP = "sweep_name"
TAG_CELL = "sweep_cell"
TAG_PREVIOUS_PARENT = "sweep_previous_parent_run_id"  # set on a child re-parented by a re-run of its sweep
TAG_DATE = "sweep_date"  # a dated sweep's (a scheduled firing's) UTC date-time, on its parent and its children
TAG_NUMERICS = "numerics.auto"  # on the parent: what `auto` chose for every cell (with the machine's system.* tags)
BUDGET_COLUMNS = ("generated_tokens", "tool_calls", "cpu_s")
"""What each run spent in all (``cost/total_<name>``, :mod:`aepo_core.cost`): arms are compared at their spend."""


@dataclass(frozen=True)
class SweepRow:
    """One (child run, evaluation dataset) of a sweep: a row of ``runs.csv`` and a line of ``aepo sweep``; what the
    run spent in all (``cost/total_<name>``: generated tokens, tool calls, CPU seconds) beside its evaluation.
    :meth:`as_record` is its one serialized form (the CSV's columns, the flow result's records)."""

    cell: str
    seed: int
    run_name: str
    run_id: str
    status: str
    dataset: str
    pass1: float
    pass1_ci_low: float
    pass1_ci_high: float
    k: int
    pass_k: float
    tool_calls_per_question: float
    answered_rate: float
    reward_mean: float
    branch_samples: float
    max_branches_per_path: float
    generated_tokens: float
    tool_calls: float
    cpu_s: float

    @classmethod
    def columns(cls) -> list[str]:
        return [_COLUMN.get(f.name, f.name) for f in fields(cls)]

    def as_record(self) -> dict[str, object]:
        return {_COLUMN.get(name, name): value for name, value in asdict(self).items()}

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> SweepRow:
        return cls(**{f.name: record[_COLUMN.get(f.name, f.name)] for f in fields(cls)})


_COLUMN = {"pass1": "pass@1", "pass1_ci_low": "pass@1_ci_low", "pass1_ci_high": "pass@1_ci_high", "pass_k": "pass@k"}
"""The fields of :class:`SweepRow` whose column is named otherwise."""
RUN_COLUMNS = SweepRow.columns()
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
        spent = {name: _metric(child, f"{COST_PREFIX}{TOTAL}{name}") for name in BUDGET_COLUMNS}
        for ds in datasets or [""]:
            rows.append(SweepRow(
                cell, seed, child["run_name"], child["run_id"], child["status"], ds,
                _metric(child, f"eval/{ds}/pass_at_1"), _metric(child, f"eval/{ds}/pass_at_1_ci_low"),
                _metric(child, f"eval/{ds}/pass_at_1_ci_high"), k, _metric(child, f"eval/{ds}/pass_at_{k}"),
                _metric(child, f"eval/{ds}/tool_calls_per_question"), _metric(child, f"eval/{ds}/answered_rate"),
                _metric(child, "rollout/reward_mean"), _metric(child, "rollout/branch_samples"),
                _metric(child, "rollout/max_branches_per_path"), **spent).as_record())
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



# ------------------------------------------------------------------------------------------- the children


@dataclass(frozen=True)
class Launch:
    """What every cell of one sweep invocation starts with besides its config: the parent run, the firing's date
    (a dated sweep) and the machine facts the sweep's numerics were decided from; and where its comparison goes."""

    parent: str
    date: str | None
    machine: dict[str, Any]
    decided_on: str
    """The machine the numerics were decided on, in words (:meth:`DeviceFacts.describe`)."""
    auto: str
    """The dtype ``auto`` means in every cell (:func:`infra.numerics.auto_dtype`)."""
    out_dir: Path
    """``<runs_dir>/sweeps/<name>/`` (a dated sweep: ``…/<date-time>/``)."""

    def tags(self, spec: SweepSpec, run: SweepRun) -> dict[str, str]:
        return {TAG_SWEEP: spec.name, TAG_CELL: run.cell, **({TAG_DATE: self.date} if self.date else {})}


@dataclass(frozen=True)
class ChildFailure:
    """A child that did not complete: its run name and the final state (a Prefect state name, or why)."""

    run_name: str
    state: str


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


def check_resumable(spec: SweepSpec, runs: Path) -> None:
    """``--resume`` needs the sweep's parent run in the tracking store (:func:`sweep_to_resume`): raises
    :class:`NothingToResumeError` when there is none, without creating a store where there is none yet."""
    uri, _ = resolve_tracking(spec.base, runs)
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).is_file():
        raise NothingToResumeError(f"nothing to resume: no tracking store at {uri} (drop --resume to start the sweep)")
    sweep_to_resume(Tracker.from_config(spec.base, runs, system_metrics=False), spec)


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
class SweepBook:
    """One sweep invocation's MLflow side: its runs dir, its tracker (the parent run once :meth:`start` has started
    it; as a context manager the book ends that run as :class:`Tracker` does) and the config each child runs with
    (:func:`child_config`)."""

    spec: SweepSpec
    runs: Path
    tracker: Tracker
    configs: dict[str, ExperimentConfig]

    @classmethod
    def open(cls, spec: SweepSpec, runs: Path) -> SweepBook:
        tracker = Tracker.from_config(spec.base, runs, system_metrics=False)
        return cls(spec, runs, tracker, {r.run_name: child_config(r.config, tracker) for r in spec.runs})

    @property
    def tracking_uri(self) -> str:
        return self.tracker.tracking_uri

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        self.tracker.__exit__(exc_type, *rest)

    def start(self, resume: bool, firing: str | None, deployment: str | None, origin: RunOrigin) -> Launch:
        """Start the parent run (``resume``: reopen the newest of the sweep's name, :func:`sweep_to_resume`) and
        decide the numerics of every cell: a resumed sweep's recorded facts, else this machine's. ``firing``: the
        date-time a new dated sweep is named after (None: not dated)."""
        spec, tracker = self.spec, self.tracker
        previous = sweep_to_resume(tracker, spec) if resume else None
        recorded = tracker.client.get_run(previous).data.tags if previous else {}
        date = recorded.get(TAG_DATE) if previous else firing
        facts = DeviceFacts.from_tags(recorded, recorded.get("system.numerics_source", "")) or facts_for(spec.base)
        parent = tracker.start(spec.base, run_name=f"{spec.name}-{date}" if date else spec.name, group=True,
                               resume_run_id=previous, origin=origin,
                               tags={"kind": "sweep", TAG_SWEEP: spec.name, "sweep_cells": len(spec.cells),
                                     "sweep_seeds": ",".join(map(str, spec.seeds)),
                                     "sweep_deployment": deployment or "in-process", **facts.tags(),
                                     TAG_NUMERICS: auto_dtype(facts), **({TAG_DATE: date} if date else {})})
        out_dir = self.runs / "sweeps" / spec.name / date if date else self.runs / "sweeps" / spec.name
        return Launch(parent, date, replace(facts, source=f"sweep {parent}").as_dict(), facts.describe(),
                      auto_dtype(facts), out_dir)

    def reuse_finished(self, launch: Launch) -> dict[str, FinishedChild]:
        """Log the sweep to the parent run, find the children that already FINISHED (:func:`finished_children`; a
        dated sweep's under its own parent only) and re-parent them under this one: the new parent run shows the
        whole sweep (see the module docstring; a resumed sweep's own children stay as they are)."""
        self.tracker.log_dict(self.spec.as_dict(), "sweep.json")
        done = finished_children(self.tracker, self.spec, self.configs,
                                 within=launch.parent if launch.date else None)
        for old in done.values():
            if old.parent_run_id != launch.parent:
                self.tracker.client.set_tag(old.run_id, "mlflow.parentRunId", launch.parent)
                self.tracker.client.set_tag(old.run_id, TAG_PREVIOUS_PARENT, old.parent_run_id)
        return done

    def started(self, launch: Launch) -> set[str]:
        """:func:`started_children` of the parent run: they resume from their last checkpoint."""
        return started_children(self.tracker, self.spec, self.configs, launch.parent)

    def end_abandoned(self, launch: Launch, failed: Sequence[ChildFailure]) -> dict[str, str]:
        """The MLflow run of a failed child that is still RUNNING belongs to a process that is gone (lost with its
        worker) or being stopped (cancelled after a timeout): end it KILLED, so that it does not stay RUNNING for
        ever and the comparison shows what became of it. Returns run name → the MLflow run ended."""
        names = {f.run_name for f in failed}
        if not names:
            return {}
        running = self.tracker.search_runs(filter_string=f"tags.mlflow.parentRunId = '{launch.parent}' AND "
                                                         "attributes.status = 'RUNNING'")
        ended = {}
        for _, child in running.iterrows():
            if child["run_name"] in names:
                self.tracker.client.set_terminated(child["run_id"], status="KILLED")
                ended[str(child["run_name"])] = str(child["run_id"])
        return ended

    def compare(self, launch: Launch) -> Comparison:
        """Tag the children with their cell, build the per-run and per-cell tables from MLflow over every child of the
        sweep under the parent (also those an earlier invocation ran: the parent shows the sweep as it stands), write
        them (CSV, markdown, PNG) to the launch's ``out_dir`` and log them to the parent run."""
        spec, tracker, parent, out_dir = self.spec, self.tracker, launch.parent, launch.out_dir
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
        return Comparison(per_run, summary, markdown, files)


@dataclass(frozen=True)
class Comparison:
    """A sweep's comparison as it stands: the per-run and per-cell tables, their markdown and the files written."""

    runs: pd.DataFrame
    summary: pd.DataFrame
    markdown: str
    files: dict[str, Path]
