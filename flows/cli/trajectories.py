"""``aepo trajectories``: a run's stored rollout trees, per step or per question, and with ``--show`` one
question's tree or one trajectory's transcript."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from flows.cli.inputs import (
    FormatOpt,
    RunsOpt,
    TrackingOpt,
    check_experiment,
    reading_tracking_uri,
    resolve_runs_dir,
)
from flows.cli.render import OutputFormat, fail, print_records, transcript_out

if TYPE_CHECKING:
    from infra.run.stored_trajectories import TrajectoryStore


def _resolve_store_run(store: TrajectoryStore, run: str, uri: str | None, experiment: str) -> str:
    """A stored run id from a run id, a unique prefix of one, or an MLflow run name; exit 2 naming the stored runs
    when none matches."""
    from infra.run.stored_trajectories import stored_run_id

    found = stored_run_id(store, run, uri, experiment)
    if found is not None:
        return found
    stored = store.run_ids()
    listed = ", ".join(stored[:10]) + (" …" if len(stored) > 10 else "")
    fail(f"no stored trajectories for run {run!r} in {store.uri} (stored runs: {listed or 'none'})")


def _show(store: TrajectoryStore, run_id: str, step: int, value: str) -> None:
    """``--show``: one question's tree or one leaf's transcript at ``step``."""
    from flows.transcript import ShowError, render_show

    traj = store.read_trajectories(run_id, step=step)
    if traj.empty:
        fail(f"run {run_id} has no stored trajectories at step {step} (steps: {store.steps(run_id)})")
    try:
        view = render_show(run_id, step, value, traj, store.read_nodes(run_id, step=step))
    except ShowError as exc:
        fail(str(exc))
    transcript_out().print(view)


def trajectories(
    run: Annotated[str, typer.Argument(help="MLflow run id (or a unique prefix) or run name.")],
    step: Annotated[int | None, typer.Option("--step", help="Per-question detail of one step.")] = None,
    show: Annotated[str | None, typer.Option("--show", help="With --step: the transcript of <question> (its tree) "
                                             "or <question>/<leaf> (one trajectory, in full).")] = None,
    runs_dir: RunsOpt = None,
    store_uri: Annotated[str | None, typer.Option(
        "--store", help="Trajectory store: the directory holding trajectories/ and nodes/ (default: the runs dir; "
                        "s3://… works).")] = None,
    experiment: Annotated[str, typer.Option("--experiment", "-e", help="MLflow experiment a run name is looked up "
                                                                      "in.")] = "aepo",
    tracking_uri: TrackingOpt = None,
    output: FormatOpt = OutputFormat.table,
) -> None:
    """Summary of a run's stored rollout trees: per step, or per question with --step; with --show, a question's
    tree or one trajectory's transcript (segments, tool results, entropies, branch points, reward). A run name is
    resolved through MLflow (--tracking-uri, else the runs dir's SQLite store where there is one).

    \b
    Examples:
      aepo trajectories tiny
      aepo trajectories tiny --step 2 --format json
      aepo trajectories tiny --step 2 --show <question id>/0
    """
    from infra.run.stored_trajectories import StoreError, reading_store

    if show is not None and step is None:
        fail("--show needs --step N (the step whose tree to show)")
    if show is not None and output is not OutputFormat.table:
        fail(f"--format {output.value} does not apply to --show (a transcript, printed as text): the rows of a step "
             "are `aepo trajectories RUN --step N --format json`, the whole store is Parquet (runs/trajectories)")
    rdir = resolve_runs_dir(runs_dir)
    uri = reading_tracking_uri(rdir, tracking_uri, required=False)
    if uri is not None:
        check_experiment(uri, experiment)
    store = reading_store(rdir, store_uri)
    try:  # a damaged part (or a bad run id or step) is one line naming it, exit 2
        _summarize(store, _resolve_store_run(store, run, uri, experiment), step, show, output)
    except StoreError as exc:
        fail(str(exc))


def _summarize(store: TrajectoryStore, run_id: str, step: int | None, show: str | None, output: OutputFormat) -> None:
    if show is not None and step is not None:
        _show(store, run_id, step, show)
        return
    cols = ["step", "question_id", "leaf_id", "sample_kind", "reward", "status", "num_tool_calls", "tool_errors",
            "global_budget", "h_root"]
    traj = store.read_trajectories(run_id, step=step, columns=cols)
    nodes = store.read_nodes(run_id, step=step, columns=["step", "question_id", "branched"])
    if traj.empty:
        fail(f"run {run_id} has no stored trajectories{f' at step {step}' if step is not None else ''} "
             f"(steps: {store.steps(run_id)})")
    per_question = step is not None
    key = "question_id" if per_question else "step"
    title = (f"run {run_id} step {step}: per question" if per_question
             else f"run {run_id}: {traj['step'].nunique()} steps in {store.table_uri('trajectories')} (leaves) and "
                  f"{store.table_uri('nodes')} (nodes)")
    branches = nodes.groupby(key)["branched"].sum() if not nodes.empty else {}
    records = []
    for value, g in traj.groupby(key, sort=True):
        lead = ({"question": value, "m": int(g["global_budget"].iloc[0]), "H_root": float(g["h_root"].iloc[0])}
                if per_question else {"step": int(value), "questions": int(g["question_id"].nunique())})
        records.append({**lead, "leaves": len(g), "global": int((g["sample_kind"] == "global").sum()),
                        "branch": int((g["sample_kind"] == "branch").sum()),
                        "branch points": int(branches.get(value, 0)), "mean reward": float(g["reward"].mean()),
                        "tool calls/leaf": float(g["num_tool_calls"].mean()),
                        "tool errors": int(g["tool_errors"].sum()),
                        "statuses": ", ".join(f"{s}:{n}" for s, n in g["status"].value_counts().items())})
    print_records(title, records, output, right=[c for c in records[0] if c not in ("question", "statuses")],
                  fold=("statuses",))
