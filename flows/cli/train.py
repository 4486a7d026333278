"""``aepo train``: cold-start SFT if configured, RL steps and the final evaluation, tracked in MLflow."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from rich.progress import Progress

from flows.cli.environment import prepare_environment, start_prefect_api
from flows.cli.inputs import (
    ConfigOpt,
    RunsOpt,
    SetOpt,
    check_storage,
    check_tracking_store,
    exits,
    load_checked_config,
    resolve_runs_dir,
    with_runs_dir,
)
from flows.cli.render import eval_table, fail, flow_progress, out, print_numerics, ui_hint, where_table
from tasks.progress import Progress as ProgressEvent

if TYPE_CHECKING:
    from flows.train import TrainResult


def _train_progress(bar: Progress, task: Any, event: ProgressEvent) -> None:
    if event.stage == "start":
        bar.update(task, total=event.total, completed=event.done, description=f"{event.name}: training")
    elif event.stage == "rollout":
        bar.update(task, description=f"step {event.done}: update")
    elif event.stage == "update":
        bar.update(task, completed=event.done, description=f"step {event.done} done")
    elif event.stage == "evaluate":
        bar.update(task, description=f"evaluated {event.name} ({event.label})")


def train(
    config: ConfigOpt,
    set_: SetOpt = None,
    resume: Annotated[bool, typer.Option("--resume", help=(
        "Continue the newest MLflow run of this name (of those with this model and algorithm: else the newest) in "
        "the same run, from its last complete checkpoint, or from step 0 when it has none. No run of this name: "
        "exits 2, nothing started."))] = False,
    runs_dir: RunsOpt = None,
    run_name: Annotated[str | None, typer.Option("--run-name", help="Run name (default: the config's).")] = None,
    force_resume: Annotated[bool, typer.Option("--force-resume", help="Resume despite config changes.")] = False,
) -> None:
    """Train a policy (cold-start SFT if configured, RL steps, final evaluation), tracked in MLflow.

    \b
    Examples:
      aepo train -c configs/demo.yaml
      aepo train -c configs/tiny.yaml --set train.steps=4 --set checkpoint.every=1
      aepo train -c configs/tiny.yaml --resume
    """
    from infra.run.plan import check_plan, plan_run

    cfg = load_checked_config(config, set_)
    runs = resolve_runs_dir(runs_dir, cfg)
    check_tracking_store(cfg.tracking.tracking_uri, runs)
    cfg = with_runs_dir(cfg, runs)
    check_storage(cfg, runs, cfg.run_name_for(run_name))  # (before --resume's lookup: it names the bad location)
    # The run as the flow will plan it (runs dir, trainability, the run --resume continues): exits 2 before anything
    # is created, when the config cannot train, there is nothing to resume or another process trains it.
    plan = exits(plan_run)(cfg, str(runs), run_name, resume=resume, force_resume=force_resume)
    exits(check_plan)(plan)
    prepare_environment(plan.runs, rank=plan.ranks.rank)
    print_numerics(plan.numerics().describe())
    start_prefect_api()
    from flows.train import train as train_flow
    from tasks.retry import USER_ERRORS

    try:
        with flow_progress(f"{plan.name}: starting", cfg.train.steps, _train_progress):
            result = train_flow(config=plan.cfg, resume=resume, runs_dir=str(plan.runs), run_name=run_name,
                                force_resume=force_resume)
    except USER_ERRORS as exc:  # the user's input (a bad row, a bad config), found by the flow: as before it
        fail(str(exc))
    except Exception as exc:
        fail(f"training failed: {exc}", code=1)
    plan.ranks.finish()  # under a launcher: every rank ends together, the process group torn down
    _print_result(result, cfg.eval.pass_k, plan.runs)


def _print_result(result: TrainResult, pass_k: int, runs: Path) -> None:
    """The evaluations, the paired comparisons, the mechanisms that barely acted, where everything went."""
    from flows.train import comparison_lines

    console = out()
    console.print(eval_table(f"aepo train: {result.run_name} — evaluations ({result.steps} RL steps)",
                             result.final_eval, pass_k, stages=result.evals))
    for line in comparison_lines(result.comparisons):
        console.print(line)
    for note in result.idle_mechanisms:
        console.print(escape(f"next to nothing to act on: {note}"))
    console.print(where_table([
        ("MLflow run", f"{result.run_id}  ({result.tracking_uri})"),
        *([("registered policy", result.model_version)] if result.model_version else []),
        ("checkpoints", result.checkpoint_dir),
        ("trajectories", f"{result.trajectories}/trajectories  (nodes: {result.trajectories}/nodes)"),
        ("runs dir", result.runs_dir),
    ]))
    console.print(escape(ui_hint(result.tracking_uri, runs)))
