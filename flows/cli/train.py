"""``aepo train``: cold-start SFT if configured, RL steps and the final evaluation, tracked in MLflow."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from rich.progress import Progress

from aepo_core.config import ExperimentConfig
from aepo_core.config_keys import ConfigError
from flows.cli.environment import prepare_environment, start_prefect_api
from flows.cli.inputs import (
    ConfigOpt,
    RunsOpt,
    SetOpt,
    check_not_running,
    check_storage,
    check_tracking_store,
    load_checked_config,
    resolve_runs_dir,
    with_runs_dir,
)
from flows.cli.render import eval_table, fail, flow_progress, out, print_numerics, ui_hint, where_table
from tasks.progress import Progress as ProgressEvent

if TYPE_CHECKING:
    from infra.numerics import Numerics


def check_resume(cfg: ExperimentConfig, runs: Path, run_name: str) -> Numerics | None:
    """``--resume`` needs a run of that name in the tracking store (then it continues that run, from its newest
    complete checkpoint or, without one, from step 0): exits 2 when there is none, local and remote checkpoints
    alike, before anything is created, and when another process still trains it. Rank 0 alone asks (the others
    follow its choice). Returns the numerics the run recorded at its start (what the resume computes in)."""
    from infra.numerics import recorded_numerics
    from infra.ranks import Ranks
    from infra.run.resume import NothingToResumeError, nothing_to_resume, run_to_resume
    from infra.store import StoreError, TrajectoryStore
    from infra.tracking.client import resolve_tracking
    from infra.tracking.run import Tracker

    if not Ranks.current().is_main:
        return None
    uri, _ = resolve_tracking(cfg, runs)
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).is_file():
        fail(f"--resume: {nothing_to_resume(run_name, cfg.tracking.experiment, uri)}")  # not even a store yet
    try:
        run = run_to_resume(Tracker.from_config(cfg, runs), cfg, run_name)
    except NothingToResumeError as exc:
        fail(f"--resume: {exc}")
    check_not_running(runs, run_id=run.run_id)
    store = TrajectoryStore.from_config(cfg.storage, runs_dir=runs)
    try:  # a damaged part would stay in the run's trajectories, unread until someone analyses them
        store.check_parts(run.run_id)
    except StoreError as exc:
        fail(f"--resume: {exc}; move it away to resume (a step after the last checkpoint is then sampled again, an "
             "earlier one stays missing from the trajectories)")
    return recorded_numerics(cfg, run.params, run.tags, run.run_id)


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
    from infra.ranks import Ranks

    cfg = load_checked_config(config, set_)
    try:
        cfg.check_trainable(world_size=Ranks.current().world_size)  # the launcher's (torchrun sets WORLD_SIZE)
    except ConfigError as exc:
        fail(str(exc))
    runs = resolve_runs_dir(runs_dir, cfg)
    check_tracking_store(cfg.tracking.tracking_uri, runs)
    cfg = with_runs_dir(cfg, runs)
    check_storage(cfg, runs, cfg.run_name_for(run_name))
    recorded = check_resume(cfg, runs, cfg.run_name_for(run_name)) if resume else None
    prepare_environment(runs, rank=Ranks.current().rank)
    from infra.determinism import use_deterministic_algorithms

    use_deterministic_algorithms(cfg.train.deterministic)  # before the numerics probe initializes CUDA
    print_numerics(cfg, recorded)
    start_prefect_api()
    from flows.train import train as train_flow
    from tasks.retry import USER_ERRORS

    try:
        with flow_progress(f"{cfg.run_name_for(run_name)}: starting", cfg.train.steps,
                           _train_progress):
            result = train_flow(config=cfg, resume=resume, runs_dir=str(runs), run_name=run_name,
                                force_resume=force_resume)
    except USER_ERRORS as exc:  # the user's input (a bad row, a bad config), found by the flow: as before it
        fail(str(exc))
    except Exception as exc:
        fail(f"training failed: {exc}", code=1)
    Ranks.current().finish()  # under a launcher: every rank ends together, the process group torn down
    console = out()
    console.print(eval_table(f"aepo train: {result.run_name} — evaluations ({result.steps} RL steps)",
                             result.final_eval, cfg.eval.pass_k, stages=result.evals))
    for name, by_ds in result.comparisons.items():
        for ds, c in by_ds.items():
            console.print(f"{name.replace('_', ' ')} on {ds}: pass@1 {c['diff']:+.3f} [{c['ci_low']:+.3f}, "
                          f"{c['ci_high']:+.3f}] (paired over {c['questions']:.0f} questions)")
    console.print(where_table([
        ("MLflow run", f"{result.run_id}  ({result.tracking_uri})"),
        *([("registered policy", result.model_version)] if result.model_version else []),
        ("checkpoints", result.checkpoint_dir),
        ("trajectories", f"{result.trajectories}/trajectories  (nodes: {result.trajectories}/nodes)"),
        ("runs dir", result.runs_dir),
    ]))
    console.print(escape(ui_hint(result.tracking_uri, runs)))
