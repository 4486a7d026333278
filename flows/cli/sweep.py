"""``aepo sweep``: a grid of training runs (cells × seeds) nested under one MLflow run, here one by one or as flow
runs of a deployment, then their comparison; ``--dry-run`` lists the runs and starts nothing."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich import box
from rich.markup import escape
from rich.progress import Progress
from rich.table import Table

from aepo_core.config_keys import ConfigError
from flows.cli.environment import prepare_environment, start_prefect_api
from flows.cli.inputs import (
    DEFAULT_RUNS_DIR,
    FormatOpt,
    RunsOpt,
    check_datasets,
    check_not_running,
    check_storage,
    check_tracking_store,
    healthy,
)
from flows.cli.render import (
    OutputFormat,
    as_count,
    err,
    fail,
    flow_progress,
    out,
    print_records,
    ui_hint,
    where_table,
)
from tasks.progress import Progress as ProgressEvent

if TYPE_CHECKING:
    from flows.sweep import SweepResult
    from infra.run.sweep_spec import SweepRun, SweepSpec


def _sweep_runs_dir(option: str | None, path: Path) -> Path:
    """--runs-dir / $AEPO_RUNS_DIR, else the sweep file's runs_dir (relative to the file), else ./runs."""
    if option:
        return Path(option).expanduser().resolve()
    from infra.run.sweep_spec import configured_runs_dir

    try:
        configured = configured_runs_dir(path)
    except ConfigError as exc:
        fail(str(exc))
    return configured or Path(DEFAULT_RUNS_DIR).resolve()


def _check_resume(config: Path, shard: str | None, set_: list[str] | None, only: list[str] | None,
                  runs: Path) -> None:
    """``--resume`` needs the sweep's parent run in the tracking store: exits 2 when there is none, before a server
    starts or a run is created."""
    from infra.run.resume import NothingToResumeError
    from infra.run.sweep import check_resumable
    from infra.run.sweep_spec import sweep_spec

    try:
        check_resumable(sweep_spec(str(config.resolve()), shard, list(set_ or []), only), runs)
    except NothingToResumeError as exc:
        fail(f"--resume: {exc}")


def _sweep_plan(spec: SweepSpec, selected: Sequence[SweepRun]) -> Table:
    """``aepo sweep --dry-run``: the runs a sweep would start, each with its cell's overrides;
    the ones every cell shares in the caption."""
    def joined(overrides: dict[str, Any]) -> str:
        return ", ".join(f"{k}={v}" for k, v in overrides.items()) or "–"

    table = Table(title=f"aepo sweep {spec.name}: {len(selected)} run(s), nothing started", title_justify="left",
                  caption=f"every cell (base {spec.base_source}): {joined(spec.overrides)}", caption_justify="left",
                  box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("cell", "seed", "run name", "cell overrides"):
        table.add_column(col, overflow="fold")
    for run in selected:
        own = {k: v for k, v in run.overrides.items()
               if k != "seed" and (k not in spec.overrides or k in spec.forced or spec.overrides[k] != v)}
        table.add_row(run.cell, str(run.seed), run.run_name, joined(own))
    return table


def sweep_cmd(
    config: Annotated[Path, typer.Option("--config", "-c", help="Sweep YAML (format: infra/run/sweep_spec.py).")],
    runs_dir: RunsOpt = None,
    shard: Annotated[str | None, typer.Option("--shard", help="Run only shard i/N of the (cell, seed) list (every "
                                              "N-th from the i-th); superseded by --deployment and a work pool.")
                     ] = None,
    deployment: Annotated[str | None, typer.Option(
        "--deployment", help="Submit each (cell, seed) as a flow run of this deployment (e.g. aepo-train/train) "
                             "to the Prefect server at $PREFECT_API_URL; default: run them here, one by one.")] = None,
    max_parallel: Annotated[int, typer.Option("--max-parallel", min=1, help="With --deployment: child flow runs "
                                              "in flight at once.")] = 4,
    child_timeout: Annotated[float | None, typer.Option(
        "--child-timeout", help="With --deployment: seconds after which an unfinished child is cancelled and "
                                "reported failed (default: wait).")] = None,
    child_lost_after: Annotated[float | None, typer.Option(
        "--child-lost-after", help="With --deployment: seconds without a heartbeat after which a running child "
                                   "counts as lost with its worker: marked Crashed and reported failed (default: "
                                   "3 × PREFECT_FLOWS_HEARTBEAT_FREQUENCY, 180 s unless set).")] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", "-s", metavar="KEY=VALUE",
                                                   help="Dotted override key=value for every cell, "
                                                   "applied after the cell's own (repeatable).")] = None,
    cells: Annotated[list[str] | None, typer.Option("--cells", metavar="CELL[,CELL…]",
                                                    help="Run only these cells (comma-separated or repeated), e.g. "
                                                         "--cells aepo,grpo.")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="List the runs (cell, seed, run name, overrides) and "
                                          "exit: nothing is started or created.")] = False,
    resume: Annotated[bool, typer.Option("--resume", help="Continue a stopped sweep in its own parent MLflow run: "
                                         "finished runs are skipped, a run that started resumes from its last "
                                         "checkpoint.")] = False,
    sequential: Annotated[bool, typer.Option("--sequential", help="Run the sweep file's `sequential:` design: seeds "
                                             "wave by wave, stopping (or dropping an arm) once its comparisons are "
                                             "decided.")] = False,
    output: FormatOpt = OutputFormat.table,
) -> None:
    """Run a grid of training runs (cells × seeds) nested under one MLflow run, then compare them.

    \b
    Examples:
      aepo sweep -c configs/sweeps/tiny.yaml --dry-run
      aepo sweep -c configs/sweeps/tiny.yaml --cells aepo,grpo --format csv > sweep.csv
      aepo sweep -c configs/sweeps/tiny.yaml --resume     # after Ctrl-C, a kill or the end of a session
      aepo sweep -c configs/sweeps/claims_powered.yaml --sequential
    """
    only = [c.strip() for item in cells for c in item.split(",") if c.strip()] if cells else None
    spec, selected = _load(config, set_, only, shard, sequential)
    if dry_run:
        out().print(_sweep_plan(spec, selected))
        return
    runs = _prepare(config, spec, selected, runs_dir, deployment is not None, resume, shard, set_, only)
    from flows.sweep import sweep

    start_prefect_api()  # after every check: bad input exits without starting a server
    result = _run_sweep(spec.name, len(selected), lambda: sweep(
        sweep_config=str(config.resolve()), runs_dir=str(runs), shard=shard, deployment=deployment,
        max_parallel=max_parallel, child_timeout_s=child_timeout, child_lost_after_s=child_lost_after,
        overrides=list(set_ or []) or None, cells=only, resume=resume, sequential=sequential))
    _print_result(result, output, runs)


def _prepare(config: Path, spec: SweepSpec, selected: Sequence[SweepRun], runs_dir: str | None, fan_out: bool,
             resume: bool, shard: str | None, set_: list[str] | None, only: list[str] | None) -> Path:
    """The runs dir, its environment and every check before the sweep starts (the Prefect server with ``fan_out``,
    the stores, the sweep to ``resume``, no live process of the sweep); exits 2 on bad input."""
    runs = _sweep_runs_dir(runs_dir, config)
    if fan_out:
        _check_prefect_server()
    prepare_environment(runs)
    _check_stores(spec, selected, runs)
    if resume:
        _check_resume(config, shard, set_, only, runs)
    check_not_running(runs, sweep=spec.name)
    return runs


def _load(config: Path, set_: list[str] | None, only: list[str] | None, shard: str | None, sequential: bool
          ) -> tuple[SweepSpec, list[SweepRun]]:
    """The sweep file with ``--set`` and ``--cells``, and the runs of ``--shard``, every one's datasets at hand;
    exits 2 on a bad file (or ``--sequential`` without a design)."""
    if not config.is_file():
        fail(f"sweep file not found: {config}")
    from infra.run.sequential import sequential_design
    from infra.run.sweep_spec import load_sweep, shard_runs

    try:
        spec = load_sweep(config, list(set_ or []), only)
        if sequential:
            sequential_design(spec, shard)
        selected = shard_runs(spec.runs, shard)
        for run in selected:
            check_datasets(run.config)
    except ConfigError as exc:
        fail(str(exc))
    return spec, selected


def _check_stores(spec: SweepSpec, selected: Sequence[SweepRun], runs: Path) -> None:
    """The tracking store and every run's storage must be usable before anything starts."""
    check_tracking_store(spec.base.tracking.tracking_uri, runs)
    for run in selected:  # (cells may override the storage)
        check_storage(run.config, runs, run.config.run_name_for(None))


def _check_prefect_server() -> None:
    """``--deployment`` needs a Prefect server with workers at $PREFECT_API_URL."""
    api_url = os.environ.get("PREFECT_API_URL")
    if not api_url:
        fail("--deployment needs a Prefect server with workers: export PREFECT_API_URL=http://127.0.0.1:4200/api "
             "(docs/how-to/work-pool.md)")
    if not healthy(api_url):
        fail(f"--deployment: no Prefect server at PREFECT_API_URL={api_url}", code=1)


def _run_sweep(name: str, total: int, run: Callable[[], SweepResult]) -> SweepResult:
    """``run`` (the sweep flow), its ``total`` cells on a progress bar; exits 2 on the user's input, 1 on a failure."""
    from tasks.retry import USER_ERRORS

    def on_event(bar: Progress, task: Any, event: ProgressEvent) -> None:
        if event.stage == "cell":
            bar.update(task, completed=event.done, total=event.total, description=event.name)

    try:
        with flow_progress(f"sweep {name}", total, on_event) as progress:
            result = run()
            progress.update(progress.task_ids[0], completed=total, description=f"sweep {result.name} done")
    except USER_ERRORS as exc:  # the user's input (a bad row, a bad config), found by the flow: as before it
        fail(str(exc))
    except Exception as exc:
        fail(f"sweep failed: {exc}", code=1)
    return result


def _print_result(result: SweepResult, output: OutputFormat, runs: Path) -> None:
    """The per-run table in ``output``'s format; the reused runs, the files and the UI hint beside it."""
    records = [{"cell": r.cell, "seed": r.seed, "status": r.status, "dataset": r.dataset, "pass@1": r.pass1,
                "pass@1 CI low": r.pass1_ci_low, "pass@1 CI high": r.pass1_ci_high, "pass@k": r.pass_k,
                "tool calls/q": r.tool_calls_per_question, "reward": r.reward_mean,
                "tokens": as_count(r.generated_tokens), "CPU s": r.cpu_s}
               for r in result.rows()]
    print_records(f"aepo sweep: {result.name} (parent MLflow run {result.parent_run_id})", records, output,
                  right=("seed", "pass@1", "pass@1 CI low", "pass@1 CI high", "pass@k", "tool calls/q", "reward",
                         "tokens", "CPU s"))
    console = out() if output is OutputFormat.table else err()  # CSV and JSON keep stdout to the rows
    if result.reused:
        console.print(f"already FINISHED in MLflow, not run again: {', '.join(result.reused)}")
    for line in result.sequential:
        console.print(escape(line))
    console.print(where_table([(k, v) for k, v in result.files.items()]))
    console.print(escape(ui_hint(result.tracking_uri, runs)))
