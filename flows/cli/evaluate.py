"""``aepo eval``: evaluate a checkpoint, a registered policy or the configured model (Pass@1/Pass@k with CIs,
per-question Parquet, an optional judge and a paired comparison with an earlier evaluation)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from rich.progress import Progress
from rich.table import Table

from flows.cli.environment import prepare_environment, start_prefect_api
from flows.cli.inputs import (
    RunsOpt,
    SetOpt,
    check_datasets,
    check_storage,
    check_tracking_store,
    load_checked_config,
    resolve_runs_dir,
    with_runs_dir,
)
from flows.cli.render import eval_table, fail, flow_progress, fmt, out, print_numerics, ui_hint, where_table
from tasks.progress import Progress as ProgressEvent

if TYPE_CHECKING:
    from aepo_core.config import ExperimentConfig
    from flows.evaluate import EvalResult


def _eval_progress(bar: Progress, task: Any, event: ProgressEvent) -> None:
    if event.stage == "evaluate":
        bar.update(task, advance=1, description=f"evaluated {event.name}")


def _checked_inputs(config: Path | None, sets: list[str] | None, checkpoint: str | None,
                    compare_to: str | None) -> ExperimentConfig | None:
    """The ``-c`` config (without overrides), after every check that needs nothing created: the config with the
    overrides, a local ``--compare-to`` and ``--checkpoint`` that exist; a mistake exits 2 here."""
    from infra.run.reading import may_exist

    base = load_checked_config(config, [], training=False) if config is not None else None
    if config is not None and sets:
        load_checked_config(config, sets, training=False)
    if compare_to is not None and not may_exist(compare_to):
        fail(f"--compare-to {compare_to}: no such file or directory")
    if checkpoint is not None and not may_exist(checkpoint):
        fail(f"checkpoint {checkpoint} does not exist")
    return base


def eval_(
    checkpoint: Annotated[str | None, typer.Option("--checkpoint", help="Checkpoint dir (step-NNNNNN) or a run's "
                                                   "checkpoint root (its newest), local or s3://… (the endpoint from "
                                                   "--config / --set storage.s3_endpoint_url), or a registered "
                                                   "policy models:/<name>/<version>, /latest or @best (the "
                                                   "registry of --set "
                                                   "tracking.tracking_uri, default the runs dir's); omit for the "
                                                   "configured model.")] = None,
    config: Annotated[Path | None, typer.Option("--config", "-c", help="Config YAML (default: the checkpoint's).")
                      ] = None,
    dataset: Annotated[list[str] | None, typer.Option("--dataset", "-d", metavar="NAME",
                                                      help="Dataset to evaluate (repeatable; default: eval.datasets)."
                                                      )] = None,
    set_: SetOpt = None,
    runs_dir: RunsOpt = None,
    run_name: Annotated[str | None, typer.Option("--run-name")] = None,
    compare_to: Annotated[str | None, typer.Option("--compare-to", help="A previous evaluation's per-question "
                                                   "Parquet (or its directory): paired Pass@1 difference.")] = None,
) -> None:
    """Evaluate a checkpoint: Pass@1/Pass@k with CIs, per-question Parquet, optional judge and paired comparison.

    \b
    Examples:
      aepo eval -c configs/tiny.yaml --checkpoint runs/checkpoints/tiny
      aepo eval --checkpoint models:/aepo-policy@best
      aepo eval -c configs/tiny.yaml --compare-to runs/eval/tiny/final/
    """
    base = _checked_inputs(config, set_, checkpoint, compare_to)
    runs = resolve_runs_dir(runs_dir, base)
    prepare_environment(runs)
    from flows.evaluate import evaluate
    from infra.run.policy_source import POLICY_ERRORS, locate_policy
    from infra.run.runtime import planned_numerics
    from tasks.retry import USER_ERRORS

    try:
        policy = locate_policy(base, checkpoint, set_, dataset, runs)
        check_datasets(policy.cfg, training=False)
    except POLICY_ERRORS as exc:
        fail(str(exc))
    check_storage(policy.cfg, runs)
    check_tracking_store(policy.cfg.tracking.tracking_uri, runs)
    print_numerics(planned_numerics(policy.cfg).describe())
    start_prefect_api()  # after every check: bad input exits without starting a server
    cfg = with_runs_dir(policy.cfg, runs)
    try:
        with flow_progress("evaluating", len(cfg.eval.datasets) or None, _eval_progress):
            result = evaluate(config=cfg, checkpoint=policy.reference, runs_dir=str(runs),
                              compare_to=compare_to, run_name=run_name)
    except USER_ERRORS as exc:  # the user's input (a bad row, a bad config), found by the flow: as before it
        fail(str(exc))
    except Exception as exc:
        fail(f"evaluation failed: {exc}", code=1)
    _print_result(result, compare_to, runs)


def _print_result(result: EvalResult, compare_to: str | None, runs: Path) -> None:
    console = out()
    console.print(eval_table(f"aepo eval: {result.run_name} (step {result.checkpoint_step})", result.summaries,
                             result.pass_k, result.judge if result.judge else None))
    if result.comparisons:
        cmp = Table(title=f"paired Pass@1 difference vs {compare_to}", title_justify="left")
        for col in ("dataset", "questions", "diff", "95% CI"):
            cmp.add_column(col)
        for ds, c in result.comparisons.items():
            cmp.add_row(ds, fmt(c.questions, 0), f"{c.diff:+.4f}", f"[{c.ci_low:.4f}, {c.ci_high:.4f}]")
        console.print(cmp)
    console.print(where_table([("MLflow run", f"{result.run_id}  ({result.tracking_uri})"),
                               ("per-question results", result.results_dir)]))
    console.print(escape(ui_hint(result.tracking_uri, runs)))
